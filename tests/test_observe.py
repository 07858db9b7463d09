"""Observability: torch.profiler events and flight-recorder dumps that torch's analyzer reads.

A 2-rank world per backend (gloo, mpi under mpiexec, the send/recv-only toy) runs every op under
``torch.profiler`` and through the torch bridge; real hangs (one rank skips a collective) and
real mismatches (different sizes) on 2 and 3 ranks over gloo and mpi are dumped and read by
torch's own ``fr_trace`` in a subprocess; a healthy run's dump reports nothing; lifecycle events
come out as JSON.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _observe_workers as w
import pytest
import torch
from plugdist import GroupOptions, ProcessGroup, ReduceOp, Work, dump_flight_recorder
from plugdist._backend.work import completed_work
from plugdist._observability.flight_recorder import recorder
from plugdist.backend import BackendBase
from plugdist.testing import run_world
from plugdist.testing.pytest_plugin import available_backends

BACKENDS = [b for b in ("gloo", "mpi", "toy") if b in available_backends()]
FR_BACKENDS = [b for b in ("gloo", "mpi") if b in available_backends()]
HANG_TIMEOUT = 2.0  # the hanging group's; the world's stays long enough for a loaded machine


def _fr_env(tmp_path: Path, detail: bool = False) -> dict[str, str]:
    env = {"TORCH_FR_BUFFER_SIZE": "200",
           "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "fr" / "rank_"),
           "PLUGDIST_FR_POLL_S": "0.2"}
    if detail:
        env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        env["PLUGDIST_FLIGHT_RECORDER_DIR"] = str(tmp_path / "plugdist_fr")
    return env


def fr_trace(directory: Path) -> str:
    """torch's analyzer on ``directory``, as a user runs it; its report (it logs to stderr)."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace",
                           str(directory)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


# -- profiler ------------------------------------------------------------------------------------
@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_op_is_one_profiler_event_with_shapes(backend: str) -> None:
    results = run_world(w.profiled_ops, 2, backend=backend, timeout=150)
    for rank, res in enumerate(results):
        names = [name for name, _, _ in res["events"]]
        assert names == [f"plugdist:{backend}:{op}" for op in res["issued"]], (rank, names)
        shapes = {name.rsplit(":", 1)[1]: (s, d) for name, s, d in res["events"]}
        assert shapes["all_reduce"][0] == [[6]]  # the last, async, one
        assert shapes["all_gather_into_tensor"] == ([[4, 2], [8, 2]], ["float", "float"])
        assert shapes["reduce_scatter_tensor"][0] == [[8, 2], [4, 2]]
        assert shapes["all_to_all"][0] == [[3]] * 4
        assert shapes["barrier"] == ([], [])
        assert shapes["send" if rank == 0 else "recv"][0] == [[5]]
        assert [(n, s) for n, s, _ in res["bridged"]] == [
            (f"plugdist:{backend}:all_reduce", [[3, 5]]),
            (f"plugdist:{backend}:broadcast", [[3, 5]]),
            (f"plugdist:{backend}:all_reduce", [[3, 5]])], rank
    # rank 1 joined the async all_reduce 0.3 s late: rank 0's event spans until completion
    assert results[0]["late_span_us"] > 200_000, results[0]["late_span_us"]


# -- flight recorder: torch's analyzer on real dumps ---------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", FR_BACKENDS)
@pytest.mark.parametrize("ws", [2, 3])
def test_fr_trace_names_the_rank_that_skipped_a_collective(backend: str, ws: int,
                                                           tmp_path: Path) -> None:
    culprit = ws - 1
    results = run_world(w.hang, ws, backend=backend, env=_fr_env(tmp_path), timeout=100,
                        args=(culprit, 30.0, HANG_TIMEOUT))
    for rank, res in enumerate(results):
        assert res["dumped"], rank  # the culprit too: asked through the store
        assert (res["error"] is None) == (rank == culprit), (rank, res)
    report = fr_trace(tmp_path / "fr")
    assert "Not all ranks joining collective, sequence number: 5" in report, report
    assert f"missing ranks: {{{culprit}}}" in report, report
    # mpi is not among the analyzer's prefixes (see plugdist._observability.flight_recorder)
    prefix = "gloo"
    assert f"collective: {prefix}:all_reduce" in report, report
    assert f"group info: 1:plugdist:{backend}" in report, report
    assert "collective state: started" in report, report
    assert re.search(r"\nhang at .*_observe_workers.py", report), report  # the waiting thread's


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", FR_BACKENDS)
@pytest.mark.parametrize("ws", [2, 3])
def test_fr_trace_names_the_rank_with_other_sizes(backend: str, ws: int, tmp_path: Path) -> None:
    """gloo aborts the process on a size mismatch, so there the DETAIL check stops the op first
    (and every rank dumps); MPI runs it, and the ranks dump on request."""
    culprit = ws - 1
    detail = backend == "gloo"
    results = run_world(w.mismatch, ws, backend=backend, env=_fr_env(tmp_path, detail),
                        timeout=100, args=(culprit, 30.0))
    for rank, res in enumerate(results):
        assert res["dumped"], rank
        assert res["error"] == ("CollectiveMismatchError" if detail else None), (rank, res)
    report = fr_trace(tmp_path / "fr")
    assert "Collective sequence number: 4 has errors" in report, report
    assert "SIZE_OR_SYNTAX_MISMATCH" in report, report
    named = set(map(int, re.findall(r"Culprit rank (\d+)", report)))
    # the analyzer compares every rank with the first dump it reads: the culprit is named, or
    # (when it read the culprit's first) every other rank is
    assert named in ({culprit}, set(range(ws)) - {culprit}), report
    assert "'[[32]]'" in report and "'[[16]]'" in report, report


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", FR_BACKENDS)
def test_fr_trace_finds_nothing_in_a_healthy_run(backend: str, tmp_path: Path) -> None:
    ws = 3
    env = {**_fr_env(tmp_path), "PLUGDIST_FR_STACK_DEPTH": "4"}
    results = run_world(w.clean, ws, backend=backend, env=env, timeout=100)
    for rank, res in enumerate(results):
        assert res["path"] == str(tmp_path / "fr" / f"rank_{rank}")
        assert res["signal_dump"], rank  # SIGUSR1 dumped too
    report = fr_trace(tmp_path / "fr")
    for bad in ("Not all ranks", "has errors", "mismatch", "Culprit", "cannot decide"):
        assert bad not in report, report
    dump = pickle.loads((tmp_path / "fr" / "rank_1").read_bytes())
    assert dump["version"] == "2.10"
    assert dump["pg_config"]["0"] == {"name": "0", "desc": f"plugdist:{backend}",
                                      "backend": backend, "ranks": "[0, 1, 2]"}
    assert dump["pg_status"]["0"]["last_completed_collective"] == 6
    ops = [(e["profiling_name"], e["collective_seq_id"], e["p2p_seq_id"], e["state"])
           for e in dump["entries"]]
    assert ops == [("gloo:all_reduce", i, 0, "completed") for i in range(1, 5)] + [
        ("gloo:broadcast", 5, 0, "completed"), ("gloo:barrier", 6, 0, "completed")], ops
    first = dump["entries"][0]
    assert first["input_sizes"] == [[16]] and first["input_dtypes"] == ["float32"]
    assert any(f["name"] == "_warm" for f in first["frames"]), first["frames"]


# -- lifecycle events ----------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_lifecycle_events_are_json_lines(tmp_path: Path) -> None:
    script = ("import plugdist as dist, torch\n"
              f"dist.init_process_group('gloo', init_method='file://{tmp_path}/rdzv', rank=0, "
              "world_size=1, torch_world=False)\n"
              "dist.new_group([0])\n"
              "dist.destroy_process_group()\n")
    env = {**os.environ, "PLUGDIST_LOG_LEVEL": "INFO", "PLUGDIST_LOG_FORMAT": "json"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr
    events: list[dict[str, Any]] = [json.loads(line) for line in proc.stderr.splitlines()
                                    if line.startswith("{")]
    built = [e for e in events if e["event"] == "group_built"]
    assert [(e["rank"], e["group"], e["backend"], e["group_rank"]) for e in built] == [
        (0, "0", "gloo", 0), (0, "1", "gloo", 0)], events
    destroyed = [e for e in events if e["event"] == "group_destroyed"]
    assert {e["group"] for e in destroyed} == {"0", "1"}, events
    assert all(e["level"] == "info" and "timestamp" in e for e in built + destroyed)


# -- the recorder's entries, in-process ----------------------------------------------------------
class _Echo(BackendBase):
    """One rank, ops done at once: enough to read the entries the core records."""

    backend_name = "echo"

    def native_all_reduce(self, *, tensor: torch.Tensor, op: ReduceOp) -> Work:
        return completed_work([tensor])

    def native_all_gather_into_tensor(self, *, output: torch.Tensor,
                                      tensor: torch.Tensor) -> Work:
        output.copy_(tensor)
        return completed_work([output])


class _Nccl(_Echo):
    backend_name = "nccl"


@pytest.fixture
def recording(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "10")
    monkeypatch.setenv("PLUGDIST_FR_DUMP_SIGNAL", "OFF")
    recorder.reset()
    yield
    recorder.reset()


def test_entries_speak_torchs_terms(recording: None, tmp_path: Path) -> None:
    echo = ProcessGroup(_Echo(0, 1, GroupOptions(group_name="e", global_ranks=(0,))))
    nccl = ProcessGroup(_Nccl(0, 1, GroupOptions(group_name="n", global_ranks=(0,))))
    for pg in (echo, nccl):
        recorder.add_group(pg, None, (0,), 0)
    t = torch.ones(3, dtype=torch.float64)
    echo.run_blocking("all_reduce", t, ReduceOp.SUM)
    echo.all_gather_into_tensor(torch.empty(3, dtype=torch.float64), t).wait()
    nccl.all_reduce(t).wait()
    dump = pickle.loads(Path(dump_flight_recorder(tmp_path / "d")).read_bytes())
    entries = [(e["profiling_name"], e["process_group"], e["collective_seq_id"], e["state"],
                e["input_sizes"], e["output_dtypes"], e["backend"]) for e in dump["entries"]]
    assert entries == [
        ("gloo:all_reduce", ("e", "plugdist:echo"), 1, "completed", [[3]], ["float64"], "echo"),
        ("gloo:_all_gather_base", ("e", "plugdist:echo"), 2, "completed", [[3]], ["float64"],
         "echo"),
        ("nccl:all_reduce", ("n", "plugdist:nccl"), 1, "completed", [[3]], ["float64"],
         "nccl")]
    assert dump["pg_status"]["e"] == {"last_enqueued_collective": 2,
                                      "last_started_collective": 2,
                                      "last_completed_collective": 2}


def test_nothing_is_recorded_when_nobody_watches(tmp_path: Path) -> None:
    recorder.reset()
    pg = ProcessGroup(_Echo(0, 1, GroupOptions(group_name="quiet", global_ranks=(0,))))
    pg.run_blocking("all_reduce", torch.ones(2), ReduceOp.SUM)
    assert not recorder.on
    assert pickle.loads(Path(dump_flight_recorder(tmp_path / "d")).read_bytes())["entries"] == []
