"""Observability: torch.profiler events and flight-recorder dumps that torch's analyzer reads.

A 2-rank world per backend (gloo, mpi under mpiexec, the send/recv-only toy) runs every op under
``torch.profiler`` and through the torch bridge; real hangs (one rank skips a collective) and
real mismatches (different sizes) on 2 and 3 ranks over gloo and mpi are dumped and read by
torch's own ``fr_trace`` in a subprocess — the hangs with no recorder setting at all (it is on by
default; only the dump folder is given); a healthy run's dump reports nothing; the watcher waits
on the store without polling it; lifecycle events come out as JSON.
"""

from __future__ import annotations

import inspect
import json
import os
import pickle
import re
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _observe_workers as w
import pytest
import torch
from plugdist import GroupOptions, ProcessGroup, ReduceOp, Work, dump_flight_recorder
from plugdist._backend.work import completed_work
from plugdist._observability.flight_recorder import recorder
from plugdist._observability.fr_watch import ask_key
from plugdist._observability.observe import SHORT_OPS
from plugdist.backend import BackendBase
from plugdist.errors import DistError, DistTimeoutError
from plugdist.store import HashStore
from plugdist.testing import run_world, wait_for
from plugdist.testing.pytest_plugin import available_backends

BACKENDS = [b for b in ("gloo", "mpi", "toy") if b in available_backends()]
FR_BACKENDS = [b for b in ("gloo", "mpi") if b in available_backends()]
# the line of the op that hangs in _observe_workers.hang
_HUNG_LINE = next(i for i, line in enumerate(
    inspect.getsource(w).splitlines(), 1) if "dist.all_reduce(torch.ones(16, device" in line)
HANG_TIMEOUT = 2.0  # the hanging group's; the world's stays long enough for a loaded machine


def _fr_env(tmp_path: Path, detail: bool = False) -> dict[str, str]:
    env = {"TORCH_FR_BUFFER_SIZE": "200",
           "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "fr" / "rank_")}
    if detail:
        env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        env["PLUGDIST_FLIGHT_RECORDER_DIR"] = str(tmp_path / "plugdist_fr")
    return env


def eventually(cond: Any, timeout: float = 10.0) -> bool:
    return wait_for(cond, timeout)


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
def _no_recorder_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks started from here see no setting of the recorder (only where dumps go)."""
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_DISTRIBUTED_DEBUG", "PLUGDIST_DEBUG",
                 "PLUGDIST_FR_STACK_DEPTH", "PLUGDIST_FR_DUMP_SIGNAL"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", [*FR_BACKENDS, "toy", "nccl"])
@pytest.mark.parametrize("ws", [2, 3])
def test_fr_trace_names_the_rank_that_skipped_a_collective(backend: str, ws: int,
                                                           tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    """A real hang, dumped with the recorder's defaults: no rerun with a setting needed."""
    if backend == "nccl":
        if "nccl" not in available_backends() or torch.cuda.device_count() < ws:
            pytest.skip(f"nccl needs a GPU per rank: {ws} ranks, "
                        f"{torch.cuda.device_count()} GPU(s) here")
    culprit = ws - 1
    _no_recorder_settings(monkeypatch)
    env = {"TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "fr" / "rank_")}
    results = run_world(w.hang, ws, backend=backend, env=env, timeout=100,
                        args=(culprit, 30.0, HANG_TIMEOUT))
    for rank, res in enumerate(results):
        assert res["dumped"], rank  # the culprit too: asked through the store
        assert (res["error"] is None) == (rank == culprit), (rank, res)
    report = fr_trace(tmp_path / "fr")
    assert "Not all ranks joining collective, sequence number: 5" in report, report
    assert f"missing ranks: {{{culprit}}}" in report, report
    # mpi is not among the analyzer's prefixes (see plugdist._observability.flight_recorder)
    prefix = "nccl" if backend == "nccl" else "gloo"
    assert f"collective: {prefix}:all_reduce" in report, report
    assert f"group info: 1:plugdist:{backend}" in report, report
    assert "collective state: started" in report, report
    # the issuing thread's stack where it waited: at the op's line, not where it went on to
    assert re.search(rf"\n\s*hang at .*_observe_workers.py:{_HUNG_LINE}\n", report), report


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


def test_recording_is_on_by_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE", raising=False)
    monkeypatch.setenv("PLUGDIST_FR_DUMP_SIGNAL", "OFF")
    recorder.reset()
    try:
        pg = ProcessGroup(_Echo(0, 1, GroupOptions(group_name="loud", global_ranks=(0,))))
        recorder.add_group(pg, None, (0,), 0)
        assert recorder.on and recorder.capacity == 2000
        pg.run_blocking("all_reduce", torch.ones(2), ReduceOp.SUM)
        pg.run_blocking("all_reduce", torch.ones(2, 3, dtype=torch.int64), ReduceOp.SUM)
        dump = pickle.loads(Path(dump_flight_recorder(tmp_path / "d")).read_bytes())
        assert [(e["collective_seq_id"], e["state"], e["input_sizes"], e["input_dtypes"])
                for e in dump["entries"]] == [(1, "completed", [[2]], ["float32"]),
                                              (2, "completed", [[2, 3]], ["int64"])]
    finally:
        recorder.reset()


def test_the_ring_keeps_no_tensor_alive(recording: None) -> None:
    """An entry holds its tensors' shape and dtype, never the tensors: a dropped tensor's
    memory is freed while its entry stays."""
    pg = ProcessGroup(_Echo(0, 1, GroupOptions(group_name="mem", global_ranks=(0,))))
    recorder.add_group(pg, None, (0,), 0)
    t = torch.ones(1000)
    gone = weakref.ref(t)
    pg.run_blocking("all_reduce", t, ReduceOp.SUM)
    pg.all_gather_into_tensor(torch.empty(1000), t).wait()
    del t
    assert gone() is None
    assert len(recorder.snapshot()["entries"]) == 2


def test_nothing_is_recorded_with_a_buffer_of_zero(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "0")
    recorder.reset()
    try:
        pg = ProcessGroup(_Echo(0, 1, GroupOptions(group_name="quiet", global_ranks=(0,))))
        recorder.add_group(pg, None, (0,), 0)
        pg.run_blocking("all_reduce", torch.ones(2), ReduceOp.SUM)
        assert not recorder.on
        dump = pickle.loads(Path(dump_flight_recorder(tmp_path / "d")).read_bytes())
        assert dump["entries"] == []
    finally:
        recorder.reset()


class _Held(BackendBase):
    """One rank whose blocking all_reduce waits until the test lets it go."""

    backend_name = "held"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.entered = threading.Event()
        self.release = threading.Event()

    def native_all_reduce(self, *, tensor: torch.Tensor, op: ReduceOp) -> Work:
        raise NotImplementedError

    def native_all_reduce_blocking(self, *, tensor: torch.Tensor, op: ReduceOp) -> None:
        self.entered.set()
        assert self.release.wait(30)


def _issue_held_all_reduce(pg: ProcessGroup) -> None:
    pg.run_blocking("all_reduce", torch.ones(4), ReduceOp.SUM)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("timed", [False, True])
def test_an_op_in_flight_is_dumped_with_its_threads_stack(
        recording: None, monkeypatch: pytest.MonkeyPatch, timed: bool) -> None:
    """The short route keeps no thread id: a dump finds the thread blocked in the op (its
    stack, its id). A completed op is untimed unless TORCH_NCCL_ENABLE_TIMING asks."""
    if timed:
        monkeypatch.setenv("TORCH_NCCL_ENABLE_TIMING", "1")
    backend = _Held(0, 1, GroupOptions(group_name="held", global_ranks=(0,)))
    pg = ProcessGroup(backend)
    recorder.add_group(pg, None, (0,), 0)
    issuer = threading.Thread(target=_issue_held_all_reduce, args=(pg,))
    issuer.start()
    try:
        assert backend.entered.wait(30)
        (live,) = recorder.snapshot()["entries"]
        assert live["state"] == "started" and live["input_sizes"] == [[4]], live
        assert live["thread_id"] == str(issuer.ident), live
        assert "_issue_held_all_reduce" in [f["name"] for f in live["frames"]], live["frames"]
    finally:
        backend.release.set()
        issuer.join(30)
    (done,) = recorder.snapshot()["entries"]
    assert done["state"] == "completed" and done["retired"], done
    if timed:
        assert done["duration_ms"] is not None and done["duration_ms"] > 0, done
        assert done["time_discovered_completed_ns"] >= done["time_created_ns"], done
    else:
        assert done["duration_ms"] is None and done["time_discovered_completed_ns"] is None


class _Later(BackendBase):
    """One rank whose async all_reduce stays pending until the test completes its Work."""

    backend_name = "later"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.pending: list[Work] = []

    def native_all_reduce(self, *, tensor: torch.Tensor, op: ReduceOp) -> Work:
        work = self.work("all_reduce")
        self.pending.append(work)
        return work


@pytest.mark.parametrize("outcome", ["result", "error"])
def test_an_async_op_is_recorded_by_the_short_route_until_its_work_completes(
        recording: None, outcome: str) -> None:
    """An async op of one tensor (the recorder alone on): its entry is written at the call,
    with the issuing thread, and completed (untimed) or failed through its Work."""
    backend = _Later(0, 1, GroupOptions(group_name="later", global_ranks=(0,)))
    pg = ProcessGroup(backend)
    recorder.add_group(pg, None, (0,), 0)
    work = pg.all_reduce(torch.ones(5))
    (live,) = recorder.snapshot()["entries"]
    assert (live["state"], live["input_sizes"], live["error"]) == ("started", [[5]], None), live
    assert live["thread_id"] == str(threading.get_ident()), live
    if outcome == "result":
        backend.pending[0].set_result([torch.ones(5)])
        work.wait()
    else:
        backend.pending[0].set_exception(RuntimeError("the wire broke"))
        with pytest.raises(DistError, match="the wire broke"):
            work.wait()
    (done,) = recorder.snapshot()["entries"]
    if outcome == "result":
        assert (done["state"], done["duration_ms"], done["error"]) == ("completed", None, None)
    else:
        assert done["state"] == "started" and "the wire broke" in done["error"], done


def test_an_async_op_done_after_its_ring_slot_was_reused_leaves_that_slot_alone(
        recording: None) -> None:
    backend = _Later(0, 1, GroupOptions(group_name="wrap", global_ranks=(0,)))
    pg = ProcessGroup(backend)
    recorder.add_group(pg, None, (0,), 0)
    first = pg.all_reduce(torch.ones(5))
    for _ in range(recorder.capacity - 1):
        pg.all_reduce(torch.ones(2))
        backend.pending[-1].set_result([torch.ones(2)])
    newest = pg.all_reduce(torch.ones(3))  # takes the first op's slot, and stays pending
    backend.pending[0].set_result([torch.ones(5)])
    assert first.wait()
    entries = recorder.snapshot()["entries"]
    assert [e["collective_seq_id"] for e in entries] == list(range(2, recorder.capacity + 2))
    assert entries[-1]["input_sizes"] == [[3]] and entries[-1]["state"] == "started", entries
    assert all(e["state"] == "completed" for e in entries[:-1]), entries
    backend.pending[-1].set_result([torch.ones(3)])
    assert newest.wait() and recorder.snapshot()["entries"][-1]["state"] == "completed"


@pytest.mark.parametrize("outcome", ["result", "error"])
def test_on_completion_calls_each_observer_once_even_past_one_that_raises(outcome: str) -> None:
    """Work.on_completion (the base Work's, through its future): called on completion with
    the op's error or None, at once when already done; an observer that raises is logged
    and does not stop the others."""
    seen: list[Any] = []

    def broken(error: BaseException | None) -> None:
        raise RuntimeError("an observer's bug")

    work = Work(op="all_reduce", rank=0, group="g", backend="echo")
    work.on_completion(broken)
    work.on_completion(seen.append)
    assert seen == []
    if outcome == "result":
        work.set_result([torch.ones(1)])
        assert seen == [None]
    else:
        work.set_exception(DistTimeoutError("slow"))
        assert len(seen) == 1 and isinstance(seen[0], DistTimeoutError), seen
        assert "rank 0" in str(seen[0]) and "all_reduce" in str(seen[0])
    work.on_completion(seen.append)
    assert len(seen) == 2 and type(seen[1]) is type(seen[0]), seen  # at once, the same outcome


def test_a_work_done_at_birth_calls_an_observer_at_once_without_a_future() -> None:
    seen: list[Any] = []
    work = completed_work([torch.ones(1)], op="all_reduce", rank=0, group="g", backend="echo")
    work.on_completion(seen.append)
    assert seen == [None] and work.lazy_future is None


def test_one_tensor_ops_sit_where_the_short_route_reads_them() -> None:
    """run_blocking's short route reads a one-tensor collective's tensor as its first
    argument."""
    for op in SHORT_OPS:
        names = list(inspect.signature(getattr(ProcessGroup, op)).parameters)[1:]
        assert names.index("tensor") == 0, (op, names)


class _Counting(HashStore):
    """A real in-process store that counts the requests it serves."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def wait(self, keys: Any, timeout: Any = None) -> None:
        self.calls.append("wait")
        super().wait(keys, timeout)

    def check(self, keys: Any) -> bool:
        self.calls.append("check")
        return super().check(keys)

    def get(self, key: str) -> bytes:
        self.calls.append("get")
        return super().get(key)

    def add(self, key: str, amount: int) -> int:
        self.calls.append("add")
        return super().add(key, amount)


@pytest.mark.timeout(60)
def test_the_watcher_waits_on_the_store_and_wakes_on_a_request(
        recording: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Idle, the watcher holds one wait on the store (no polling); a peer's request (the
    multi_set that asks) wakes it, and it dumps; destroying the group ends it."""
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", str(tmp_path / "rank_"))
    store = _Counting()
    pg = ProcessGroup(_Echo(0, 1, GroupOptions(group_name="w", global_ranks=(0,))))
    recorder.add_group(pg, store, (0,), 0)
    assert eventually(lambda: "wait" in store.calls)
    time.sleep(2.5)  # a second-by-second poll would show here
    assert store.calls == ["add", "wait"], store.calls
    store.multi_set([ask_key(0, 1)], [b"a peer's op failed"])  # what a peer's request writes
    assert eventually(lambda: (tmp_path / "rank_0").exists(), timeout=20)
    assert eventually(lambda: store.calls.count("wait") == 2)
    recorder.remove_group(pg)
    assert recorder.watch._thread is None
    assert not any(t.name == "plugdist-flight-recorder" and t.is_alive()
                   for t in threading.enumerate())
