"""The debug plugin (plugdist-debug) against real worlds on every installed backend.

One 3-rank world per backend plants mismatches and a stuck rank and checks what every rank
reports; one world per backend runs the whole conformance suite with every group wrapped; one
gloo world switches levels at runtime and reads DDP's log lines. Fast unit tests cover the
fingerprint comparison, ``plugdist debug analyze`` and the core's warning when DETAIL has no
plugin to serve it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import _debug_workers as w
import pytest
import torch
from plugdist import DebugLevel
from plugdist._tools.cli import main as plugdist_cli
from plugdist._world import groups
from plugdist.testing import run_world
from plugdist.testing.pytest_plugin import available_backends
from plugdist_debug.analyze import run as analyze_dir
from plugdist_debug.fingerprint import Fingerprint, TensorSpec, differences, spec_of

BACKENDS = [b for b in ("gloo", "mpi", "toy") if b in available_backends()]


def _env(tmp_path: Path, level: str = "DETAIL") -> dict[str, str]:
    return {"TORCH_DISTRIBUTED_DEBUG": level, "PLUGDIST_FLIGHT_RECORDER_DIR": str(tmp_path / "fr")}


# -- mismatches, stuck ranks, flight recorder, analyze --------------------------------------------
@pytest.fixture(scope="module", params=BACKENDS)
def planted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
            ) -> tuple[str, Path, list[dict[str, Any]]]:
    tmp = tmp_path_factory.mktemp(f"debug-{request.param}")
    analysis = tmp / "analysis"
    results = run_world(w.mismatches_and_stuck, 3, backend=request.param, args=(str(analysis),),
                        env=_env(tmp), group_timeout=60, timeout=150)
    return request.param, tmp, results


EXPECTED_DIFFERENCES = {
    "op": ["op: all_reduce on ranks 0,2 vs reduce on rank 1",
           "root: none on ranks 0,2 vs 0 on rank 1"],
    "shape": ["tensor shape: [10] on ranks 0,2 vs [20] on rank 1"],
    "dtype": ["tensor dtype: float32 on ranks 0,2 vs int64 on rank 1"],
    "reduce_op": ["reduce_op: SUM on ranks 0,2 vs MAX on rank 1"],
    "root": ["root: 0 on ranks 0,2 vs 1 on rank 1"],
}


@pytest.mark.timeout(200)
def test_mismatches_are_reported_on_every_rank(planted: tuple[str, Path, list[dict]]) -> None:
    backend, _tmp, results = planted
    for rank, res in enumerate(results):
        assert res["wrapped"], f"rank {rank}: the world group is not wrapped under DETAIL"
        for case, want in EXPECTED_DIFFERENCES.items():
            err = res[case]
            assert err["type"] == "CollectiveMismatchError" and err["is_dist_error"], (rank, err)
            assert err["differences"] == want, (backend, rank, case, err["message"])
            msg = err["message"]
            assert f"[rank {rank}, group '0', backend '{backend}'" in msg, msg
            for line in want:
                assert line in msg, msg
            for r in range(3):   # every rank's fingerprint is shown
                assert re.search(rf"^  rank {r}: #\d+ ", msg, re.M), msg
            assert "nothing was sent" in msg and "dumped to" in msg, msg
        assert res["op_left_tensor_alone"], f"rank {rank}: the mismatched collective ran anyway"
        assert res["async"]["type"] == "CollectiveMismatchError", res["async"]
        assert "tensor shape: [2] on ranks 0,2 vs [4] on rank 1" in res["async"]["differences"]
        assert res["splits"]["type"] == "CollectiveMismatchError", res["splits"]
        assert ("split sizes: rank 1 sends 2 elements to rank 0, but rank 0 expects 1 from rank 1"
                in res["splits"]["differences"]), res["splits"]
        assert res["after"] == {"sum": [9.0, 9.0], "objects": [{"r": 0}, {"r": 1}, {"r": 2}],
                                "ring": float((rank - 1) % 3)}, res["after"]


@pytest.mark.timeout(200)
def test_stuck_rank_is_named_within_the_timeout(planted: tuple[str, Path, list[dict]]) -> None:
    backend, _tmp, results = planted
    for rank in (0, 2):
        err, took = results[rank]["stuck"], results[rank]["stuck_after_s"]
        assert err["type"] == "DistTimeoutError", (rank, err)
        msg = err["message"]
        assert f"[rank {rank}, group '1', backend '{backend}', op all_reduce]" in msg, msg
        assert "all_reduce #2: group rank 1" in msg, msg  # numbered as the flight recorder
        assert "group rank 1 (global [1]) never reached it" in msg, msg
        assert "] Rank 1 failed to pass monitoredBarrier in " in msg, msg  # torch's DETAIL words
        assert w.STUCK_TIMEOUT <= took < w.STUCK_TIMEOUT + 10, took
    late = results[1]["late"]
    assert late["type"] == "DistTimeoutError", late
    assert "ranks 0,2 gave up waiting" in late["message"], late
    assert results[1]["late_after_s"] < 5, results[1]["late_after_s"]


@pytest.mark.timeout(200)
def test_flight_recorder_dumps_and_analyze(planted: tuple[str, Path, list[dict]],
                                           capsys: pytest.CaptureFixture[str]) -> None:
    backend, tmp, results = planted
    auto = tmp / "fr"
    for rank in range(3):
        doc = json.loads((auto / f"rank_{rank}.json").read_text())
        assert doc["rank"] == rank and doc["world_size"] == 3 and doc["version"] == 1
        entries = doc["groups"]["0"]["entries"]
        first = next(e for e in entries if e["seq"] == 1)
        assert first["state"] == "failed" and "CollectiveMismatchError" in first["error"], first
        assert first["op"] == ("reduce" if rank == 1 else "all_reduce") and first["sizes"] == [[10]]
        done = [e for e in entries if e["state"] == "completed"]
        assert done and all(e["time_completed"] >= e["time_started"] >= e["time_scheduled"]
                            for e in done)
        assert any(e["op"] == "send" and e["p2p_seq"] for e in entries), "p2p not recorded"
    if results[1]["signal_dump"] is not None:   # None: another handler owned SIGUSR2 there
        assert results[1]["signal_dump"] == "signal SIGUSR2", results[1]["signal_dump"]
    elif backend != "mpi":
        pytest.fail("SIGUSR2 handler was not installed")

    code = plugdist_cli(["debug", "analyze", str(tmp / "analysis")])
    report = capsys.readouterr().out
    assert code == 1, report
    assert "read 3 dump(s)" in report, report
    assert re.search(r"group '1': rank 1 is behind: issued 1 collective\(s\), its last was "
                     r"all_reduce #1; ranks 0,2 issued 2, and wait at all_reduce #2",
                     report), report
    assert "group '1': all_reduce #2 failed" not in report, "reported twice"
    assert ("group '0': ranks diverge at collective #1: op: all_reduce on ranks 0,2 vs reduce "
            "on rank 1") in report, report
    text, code = analyze_dir(tmp / "analysis", as_json=True)
    kinds = {(f["kind"], f["group"]) for f in json.loads(text)["findings"]}
    assert {("behind", "1"), ("mismatch", "0")} <= kinds, kinds


# -- no false positives ---------------------------------------------------------------------------
@pytest.mark.timeout(280)
@pytest.mark.parametrize("backend", BACKENDS)
def test_conformance_suite_passes_under_detail(backend: str, tmp_path: Path) -> None:
    results = run_world(w.conformance_under_detail, 3, backend=backend, env=_env(tmp_path),
                        group_timeout=60, timeout=240)
    failures = [msg for r in results for msg in r["results"].values() if msg]
    assert not failures, "\n".join(failures)
    for rank, r in enumerate(results):
        assert r["wrapped"], f"rank {rank}: not wrapped"
        assert r["checked"] > 200, f"rank {rank}: only {r['checked']} collectives were checked"
    assert not (tmp_path / "fr").exists(), "a dump was written, so something failed a check"


# -- levels at runtime and DDP logging ------------------------------------------------------------
def _events(lines: list[str], event: str) -> list[str]:
    return [line for line in lines if f"event='{event}'" in line]


@pytest.mark.timeout(200)
def test_runtime_levels_and_ddp_logging(tmp_path: Path) -> None:
    env = {"TORCH_DISTRIBUTED_DEBUG": "OFF", "PLUGDIST_DDP_LOG_EVERY": "2",
           "PLUGDIST_FLIGHT_RECORDER_DIR": str(tmp_path / "fr")}
    results = run_world(w.levels_and_ddp, 2, backend="gloo", env=env, timeout=150)
    for rank, r in enumerate(results):
        assert r["start_level"] == "OFF" and not r["world_wrapped"]
        assert r["detail_group_wrapped"] and not r["off_group_wrapped"]
        assert r["off_sum"] == [2.0, 2.0]
        assert r["detail_mismatch"]["differences"] == [
            "tensor shape: [3] on rank 0 vs [4] on rank 1"], r["detail_mismatch"]
        assert r["from_env"] == "INFO" and r["from_torch_env"] == "DETAIL"
        # unused parameters are named at INFO (by the core's reducer)
        assert "dead.weight" in r["unused_error"]["message"], r["unused_error"]
        lines = r["log_lines"]
        built = _events(lines, "ddp_constructed")
        assert len(built) == 3, lines        # the INFO model, the unused one, the DETAIL one
        for line in built:
            for field in ("bucket_cap_bytes=", "bucket_sizes=", "parameter_dtypes=",
                          "find_unused_parameters=", "world_size=2", "backend_name='gloo'"):
                assert field in line, (field, line)
            assert line.count(f"rank={rank}") >= 1 and "group=" in line, line
        assert "bucket_cap_bytes=1048576" in built[0], built[0]
        stats = _events(lines, "ddp_runtime_stats")
        # only the DETAIL model's iterations 2 and 4 (PLUGDIST_DDP_LOG_EVERY=2)
        assert [re.findall(r"iteration=(\d+)", s) for s in stats] == [["2"], ["4"]], stats
        for line in stats:
            for field in ("forward_compute_time=", "backward_compute_time=",
                          "backward_comm_time=", "backward_compute_comm_overlap_time=",
                          "avg_backward_comm_time="):
                assert field in line, (field, line)
            assert f"rank={rank}" in line
        assert all(line.count("\n") == 0 for line in lines)


# -- unit tests (no world) ------------------------------------------------------------------------
def test_fingerprint_differences_name_fields_and_ranks() -> None:
    a = Fingerprint(5, "all_reduce", "SUM", None, (spec_of("tensor", torch.ones(10)),))
    b = Fingerprint(5, "all_reduce", "SUM", None, (spec_of("tensor", torch.ones(20)),))
    assert differences([a, b, a]) == ["tensor shape: [10] on ranks 0,2 vs [20] on rank 1"]
    assert differences([a, a]) == []
    assert Fingerprint.decode(b.encode()) == b
    weird = Fingerprint(5, "all_reduce", "SUM", None, (spec_of("tensor", [1.0]),))
    assert "tensor dtype: float32 on rank 0 vs list on rank 1" in differences([a, weird])
    rows = (TensorSpec("input", (None,), "float32", "cpu"),)
    s0 = Fingerprint(1, "all_to_all_single", tensors=rows, sends=(1, 1), recvs=(1, 1))
    s1 = Fingerprint(1, "all_to_all_single", tensors=rows, sends=(2, 0), recvs=(1, 1))
    assert differences([s0, s1]) == [
        "split sizes: rank 1 sends 2 elements to rank 0, but rank 0 expects 1 from rank 1",
        "split sizes: rank 1 sends 0 elements to rank 1, but rank 1 expects 1 from rank 1"]


def test_analyze_reports_missing_and_incomplete(tmp_path: Path) -> None:
    def dump(rank: int, issued: int, states: list[str]) -> None:
        entries = [{"id": i, "op": "all_reduce", "seq": i, "p2p_seq": None, "peer": None,
                    "sizes": [[4]], "dtypes": ["float32"], "state": s, "time_scheduled": 1.0,
                    "time_started": 1.0, "time_completed": None, "error": None,
                    "fingerprint": {"seq": i, "op": "all_reduce", "reduce_op": "SUM",
                                    "tensors": [["tensor", [4], "float32", "cpu"]]}}
                   for i, s in enumerate(states, start=1)]
        doc = {"version": 1, "rank": rank, "world_size": 3, "reason": "test",
               "groups": {"0": {"global_ranks": [0, 1, 2], "collectives_issued": issued,
                                "entries": entries}}}
        (tmp_path / f"rank_{rank}.json").write_text(json.dumps(doc))

    dump(0, 2, ["completed", "started"])
    dump(1, 2, ["completed", "started"])
    text, code = analyze_dir(tmp_path)
    assert code == 1
    assert "no dump from rank 2" in text, text
    assert "all_reduce #2 never completed: started on ranks 0,1" in text, text
    empty = tmp_path / "empty"
    empty.mkdir()
    assert analyze_dir(empty)[1] == 2


def test_core_warns_once_when_detail_has_no_plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    from plugdist._registry import registry

    assert registry.has_hook("plugdist_wrap_backend"), "plugdist-debug is not registered"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        groups._warn_if_detail_unserved(DebugLevel.DETAIL)     # served: silent
    monkeypatch.setattr(groups, "_warned_no_debug_plugin", False)
    monkeypatch.setattr(registry, "has_hook", lambda name: False)
    with pytest.warns(RuntimeWarning, match="pip install plugdist-debug"):
        groups._warn_if_detail_unserved(DebugLevel.DETAIL)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        groups._warn_if_detail_unserved(DebugLevel.DETAIL)     # once only
        groups._warn_if_detail_unserved(DebugLevel.INFO)


# -- a report reaches every rank before any rank raises ------------------------------------------
@pytest.mark.timeout(150)
def test_mismatch_report_reaches_the_peer_of_a_rank_that_exits_at_once(tmp_path: Path) -> None:
    """Rank 0 serves the store and exits right after raising; rank 1 still gets the report, not a
    lost connection. Three 2-rank worlds at once, beside a process spinning on a core."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        dirs = [tmp_path / f"world{i}" for i in range(3)]
        for d in dirs:
            d.mkdir()
        with ThreadPoolExecutor(len(dirs)) as pool:
            list(pool.map(lambda d: run_world(
                w.mismatch_then_exit, 2, backend="gloo", args=(str(d),), env=_env(d),
                group_timeout=60, timeout=120, expect_errors=True), dirs))
    finally:
        spinner.kill()
        spinner.wait()
    for d in dirs:
        for rank in (0, 1):
            path = d / f"rank{rank}.json"
            assert path.exists(), f"{d.name} rank {rank} wrote no outcome"
            outcome = json.loads(path.read_text())
            assert outcome["type"] == "CollectiveMismatchError", f"{d.name} rank {rank}: {outcome}"
            assert "op: all_reduce on rank 0 vs reduce on rank 1" in outcome["differences"], outcome


@pytest.mark.timeout(120)
def test_detail_errors_number_collectives_as_the_flight_recorder(tmp_path: Path) -> None:
    """One numbering: the DETAIL error's #N is the core flight recorder's collective_seq_id
    (torch's dump format, which torchfrtrace reads: from 1) and the debug recorder's seq."""
    env = {**_env(tmp_path), "TORCH_FR_BUFFER_SIZE": "100"}
    results = run_world(w.numbering_matches_flight_recorder, 2, backend="gloo", env=env,
                        group_timeout=30, timeout=90)
    for rank, res in enumerate(results):
        err = res["error"]
        assert err["type"] == "CollectiveMismatchError", (rank, err)
        assert "collective #2 does not match" in err["message"], err["message"]
        mine = "reduce" if rank == 1 else "all_reduce"
        assert [c[:2] for c in res["core"][:2]] == [(1, "all_reduce"), (2, mine)], res["core"]
        assert res["core"][0][2] == "completed", res["core"]
        assert [d[:2] for d in res["debug"][:2]] == [(1, "all_reduce"), (2, mine)], res["debug"]
        assert res["debug"][1][2] == "failed", res["debug"]
