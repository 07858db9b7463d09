"""The NCCL plugin (plugdist-nccl).

Without a GPU (or without cupy/NCCL) only the first group runs: the package installs and imports,
says why it is unavailable, and refuses to build a group with that reason. With GPUs, the
conformance suite runs on world sizes 1..(number of GPUs), plus stream-ordering, a high-priority
stream, DDP on one rank and NCCL_BLOCKING_WAIT.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import _nccl_workers as workers
import plugdist as dist
import pytest
import torch
from plugdist._backend.reduce_op import ReduceOp
from plugdist._registry import BACKENDS, registry
from plugdist.testing import run_world
from plugdist.testing.checks import check_names, run_checks
from plugdist.testing.conformance import _gpu_shortfall
from plugdist.testing.harness import free_port
from plugdist_nccl import NCCLOptions, NCCLProcessGroup, availability, is_nccl_available
from plugdist_nccl.communicator import Communicator, CommunicatorClosed, exchange_unique_id
from plugdist_nccl.options import ErrorHandling, FailurePolicy, error_handling_from_env
from plugdist_nccl.watchdog import Watchdog
from plugdist_nccl.work import NCCLWork

AVAILABLE, REASON = NCCLProcessGroup.is_available()
needs_gpu = pytest.mark.skipif(not AVAILABLE, reason=f"nccl unavailable: {REASON}")
GPUS = torch.cuda.device_count() if AVAILABLE else 0
WORLD_TIMEOUT = 240.0
VENV_BIN = Path(sys.executable).parent


# -- runs everywhere ---------------------------------------------------------------------------
def test_package_imports_without_touching_cupy_or_the_gpu() -> None:
    code = ("import sys, plugdist_nccl; "
            "print('cupy' in sys.modules, plugdist_nccl.NCCLProcessGroup.backend_name)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "nccl"]


def test_entry_point_loads_the_class() -> None:
    assert registry.load(BACKENDS, "nccl") is NCCLProcessGroup
    caps = NCCLProcessGroup.static_capabilities()
    assert caps.device_types == ("cuda",)
    assert caps.refused_reduce_ops == {ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR}
    everyday = {ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX}
    assert everyday <= caps.reduce_ops
    assert all(caps.is_native(op, "cuda") for op in ("gather", "scatter", "all_to_all_single"))


def test_availability_matches_and_explains() -> None:
    ok, reason = availability()
    assert (ok, reason) == (AVAILABLE, REASON)
    assert is_nccl_available() is ok is dist.is_nccl_available()
    assert reason
    if not torch.cuda.is_available():
        assert not ok and "GPU" in reason


@pytest.mark.skipif(AVAILABLE, reason="checks the message shown when NCCL is unavailable")
def test_plugdist_info_says_why() -> None:
    out = subprocess.run([str(VENV_BIN / "plugdist"), "info"], capture_output=True, text=True,
                         check=True).stdout
    assert f"backend nccl: NOT available: {REASON}" in out
    assert "refused reductions (an error, not composed): BAND, BOR, BXOR" in out


@pytest.mark.skipif(AVAILABLE, reason="checks the refusal when NCCL is unavailable")
def test_init_process_group_refuses_with_the_reason() -> None:
    store = dist.HashStore()
    with pytest.raises(dist.DistError, match="nccl backend cannot run here") as info:
        dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    assert REASON in str(info.value)
    assert not dist.is_initialized()


def test_options() -> None:
    assert NCCLOptions.coerce(None) == NCCLOptions()

    class TorchLike:
        is_high_priority_stream = True

    assert NCCLOptions.coerce(TorchLike()).is_high_priority_stream
    with pytest.raises(TypeError, match="NCCLOptions"):
        NCCLOptions.coerce({"is_high_priority_stream": True})
    assert NCCLOptions(device_id="cuda:1").device() == torch.device("cuda", 1)
    assert NCCLOptions(device_id=2).device() == torch.device("cuda", 2)
    with pytest.raises(ValueError, match="CUDA device"):
        NCCLOptions(device_id="cpu").device()


def test_error_handling_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    monkeypatch.delenv("NCCL_ASYNC_ERROR_HANDLING", raising=False)
    assert error_handling_from_env() is ErrorHandling.SKIP_CLEANUP  # torch's default
    monkeypatch.setenv("NCCL_ASYNC_ERROR_HANDLING", "0")
    assert error_handling_from_env() is ErrorHandling.OFF
    monkeypatch.setenv("NCCL_ASYNC_ERROR_HANDLING", "1")
    assert error_handling_from_env() is ErrorHandling.TEAR_DOWN
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")  # the TORCH_ spelling wins
    assert error_handling_from_env() is ErrorHandling.CLEAN_UP
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "yes")
    with pytest.raises(ValueError, match="TORCH_NCCL_ASYNC_ERROR_HANDLING"):
        error_handling_from_env()


def test_failure_policy_follows_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Who times what out, and what a failure does, for every mode (defects 5 and 8)."""
    for name in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING",
                 "TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT"):
        monkeypatch.delenv(name, raising=False)
    default = FailurePolicy.from_env()
    assert default == FailurePolicy(False, ErrorHandling.SKIP_CLEANUP)
    # nothing set: a hung collective is timed out by the watchdog, which ends the process
    assert default.watchdog_op_timeout(30.0) == 30.0
    assert default.on_failure() == (False, True)
    # a barrier's (or wait(timeout=)) timeout aborts only under NCCL_BLOCKING_WAIT
    assert not default.wait_timeout_aborts()
    monkeypatch.setenv("NCCL_BLOCKING_WAIT", "1")
    blocking = FailurePolicy.from_env()
    assert blocking.blocking_wait and blocking.wait_timeout_aborts()
    assert blocking.watchdog_op_timeout(30.0) is None          # the waiter times ops out
    assert blocking.watchdog_launch_timeout(30.0) == 30.0      # nobody else can bound a launch
    assert blocking.on_failure() == (True, False)
    off = FailurePolicy(False, ErrorHandling.OFF)
    assert off.watchdog_op_timeout(30.0) is None and off.watchdog_launch_timeout(30.0) is None
    assert FailurePolicy(False, ErrorHandling.TEAR_DOWN).on_failure() == (True, True)
    assert FailurePolicy(False, ErrorHandling.CLEAN_UP).on_failure() == (True, False)


def _ranks(fns: list[Any]) -> list[Any]:
    """Run each ``fn()`` on its own thread; their results (or raised exceptions), in order."""
    out: list[Any] = [None] * len(fns)

    def body(i: int) -> None:
        try:
            out[i] = fns[i]()
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            out[i] = exc

    threads = [threading.Thread(target=body, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_unique_id_attempts_never_mix() -> None:
    """Defect 9, on a real store: a retry reads no stale id, and a rank that gave up makes the
    attempt fail everywhere (nobody enters ncclCommInitRank without it)."""
    store = dist.HashStore()
    ids = iter([b"A" * 128, b"B" * 128, b"C" * 128])
    short, long = timedelta(seconds=0.3), timedelta(seconds=20)

    def ex(rank: int, attempt: int, timeout: timedelta = long) -> Any:
        return exchange_unique_id(store, rank, 2, timeout, attempt, lambda: next(ids), "here:")

    assert _ranks([lambda: ex(0, 1), lambda: ex(1, 1)]) == [b"A" * 128] * 2
    # (say ncclCommInitRank failed) attempt 2: rank 1 arrives first and must wait for the new id
    late: list[Any] = []
    waiter = threading.Thread(target=lambda: late.append(ex(1, 2)))
    waiter.start()
    time.sleep(0.3)
    assert not late, "rank 1 took an id before rank 0 published attempt 2's"
    assert ex(0, 2) == b"B" * 128
    waiter.join(10)
    assert late == [b"B" * 128]
    # attempt 3: rank 1 gives up waiting for rank 0; rank 0, arriving later, fails at once
    with pytest.raises(dist.DistTimeoutError, match=r"attempt 3\): group ranks \[0\] did not"):
        ex(1, 3, short)
    started = time.monotonic()
    with pytest.raises(dist.DistTimeoutError, match="attempt 3"):
        ex(0, 3)
    assert time.monotonic() - started < 5, "rank 0 waited for an attempt already abandoned"
    assert next(ids) == b"C" * 128  # the abandoned attempt created no id


def test_unique_id_reaches_cupy_as_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Defect 1: cupy 14 takes and returns the unique id as 128 bytes (a tuple was cupy 13's).
    A stand-in with cupy 14's signature checks what create_communicator hands over; the device
    context is a no-op here (no GPU). Tests the plugin's plumbing, not cupy or NCCL."""
    import contextlib

    from plugdist_nccl import communicator

    made: list[tuple[int, Any, int]] = []

    class Cupy14Nccl:
        @staticmethod
        def get_unique_id() -> bytes:
            return bytes(range(128))  # bytes >= 0x80 included: no sign games

        class NcclCommunicator:
            def __init__(self, ndev: int, commId: bytes, rank: int) -> None:  # noqa: N803
                if not isinstance(commId, bytes):
                    raise TypeError(f"Argument 'commId' has incorrect type (expected bytes, got "
                                    f"{type(commId).__name__})")
                if len(commId) != 128:
                    raise ValueError(f"commId length {len(commId)} != 128.")
                made.append((ndev, commId, rank))

    monkeypatch.setattr(communicator, "load", lambda: Cupy14Nccl)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    store = dist.HashStore()
    comm = communicator.create_communicator(store, 0, 1, torch.device("cuda", 0),
                                            timedelta(seconds=5), 1, "here:")
    assert made == [(1, bytes(range(128)), 0)] and not comm.closed
    store.set("nccl/attempt2/unique_id", b"short")  # e.g. a peer on another plugdist-nccl
    with pytest.raises(dist.DistBackendError, match="5 bytes, not 128"):
        communicator.create_communicator(store, 0, 1, torch.device("cuda", 0),
                                         timedelta(seconds=5), 2, "here:")


class _CupyLikeComm:
    """Stands in for cupy's NcclCommunicator to test the guard's state machine (not NCCL): like
    cupy, abort() zeroes the handle and a call on a zeroed handle raises NCCL's
    INVALID_ARGUMENT; overlapping calls are recorded."""

    def __init__(self) -> None:
        self.handle = 1
        self.active = 0
        self.overlaps = 0
        self.calls: list[str] = []
        self.hold = 0.0

    def _enter(self, name: str) -> None:
        self.active += 1
        self.overlaps += self.active > 1
        self.calls.append(name)

    def check_async_error(self) -> None:
        self._enter("check")
        self.active -= 1
        if not self.handle:
            raise RuntimeError("NCCL_ERROR_INVALID_ARGUMENT: invalid argument")

    def all_reduce(self) -> None:
        self._enter("all_reduce")
        time.sleep(self.hold)
        self.active -= 1

    def abort(self) -> None:
        self._enter("abort")
        self.handle = 0
        self.active -= 1

    def destroy(self) -> None:
        self.abort()


def test_communicator_guard_orders_abort_and_calls() -> None:
    """Defect 4: the guard's state machine around a cupy-like communicator (not NCCL itself)."""
    raw = _CupyLikeComm()
    comm = Communicator(raw, abort_grace=timedelta(seconds=2))
    assert comm.check_async_error() is None
    raw.hold = 0.3
    user = threading.Thread(target=lambda: comm.use().__enter__().all_reduce())
    with comm.use() as r:  # a call in progress holds the lock ...
        assert r is raw
        checker: list[Any] = []
        t = threading.Thread(target=lambda: checker.append(comm.check_async_error()))
        t.start()
        t.join(1)
        assert checker == [None]  # ... and the watchdog's check neither blocks nor overlaps it
        aborter = threading.Thread(target=comm.abort)
        aborter.start()
        time.sleep(0.2)
        assert raw.handle == 1, "abort freed the communicator under a call in progress"
    aborter.join(5)
    assert raw.handle == 0 and raw.overlaps == 0, raw.calls
    assert comm.check_async_error() is None  # no spurious INVALID_ARGUMENT after the abort
    with pytest.raises(CommunicatorClosed, match="aborted"):
        with comm.use():
            pass
    comm.abort()
    comm.destroy()  # both idempotent
    assert raw.calls.count("abort") == 1
    del user


def test_communicator_abort_ends_a_stuck_call() -> None:
    """A call stuck inside NCCL past the grace period does not keep the abort from running
    (only ncclCommAbort can end such a call). State machine only, as above."""
    raw = _CupyLikeComm()
    comm = Communicator(raw, abort_grace=timedelta(seconds=0.2))
    inside, release = threading.Event(), threading.Event()

    def stuck() -> None:
        with comm.use():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=stuck)
    t.start()
    assert inside.wait(10)
    started = time.monotonic()
    comm.abort()
    assert 0.15 < time.monotonic() - started < 3
    assert raw.handle == 0
    release.set()
    t.join(5)


class _Event:
    """A CUDA event's query() for NCCLWork/Watchdog state-machine tests (no GPU involved)."""

    def __init__(self, fired: bool = False, error: BaseException | None = None) -> None:
        self.fired, self.error = fired, error

    def query(self) -> bool:
        if self.error is not None:
            raise self.error
        return self.fired

    def wait_on(self, stream: int) -> None:
        raise AssertionError("no stream to wait on in a state-machine test")

    def release(self) -> None:
        self.released = True


def _work(op: str = "all_reduce", value: Any = "out") -> NCCLWork:
    return NCCLWork(device=torch.device("cpu"), blocking=False, tensors=[], flush=lambda: None,
                    on_timeout=lambda w, s: dist.DistTimeoutError("timeout"), result=value, op=op,
                    rank=0, group="g", backend="nccl", timeout=timedelta(seconds=5))


def test_work_settles_once_and_completes_when_its_event_fired() -> None:
    """Defects 2 and 4, NCCLWork's state machine with a stand-in event (not a GPU)."""
    work = _work()
    assert not work.is_completed() and not work.launched
    event = _Event()
    work.enqueued(event)
    assert not work.is_completed() and not work.get_future().done()
    event.fired = True
    # no watchdog here: the first look at a fired event completes the future
    assert work.get_future().done() and work.get_future().value() == "out"
    assert work.is_completed() and work.is_success()
    work.fail(RuntimeError("late"))  # a second settlement is ignored, not a RuntimeError
    assert work.exception() is None
    # finish and fail racing from many threads: exactly one wins, nothing raises
    for _ in range(20):
        racer = _work()
        outcomes = _ranks([racer.finish, functools.partial(racer.fail, RuntimeError("x"))] * 4)
        assert outcomes == [None] * 8 and racer.get_future().done()


def _watchdog(**kw: Any) -> tuple[Watchdog, list[Any]]:
    seen: list[Any] = []
    box: list[Watchdog] = []

    def on_error(exc: BaseException) -> None:
        seen.append(("error", exc))
        for w in box[0].drain():
            w.finish_or_fail(dist.DistBackendError(f"group failed: {exc}"))
        box[0].stop()

    def on_timeout(work: NCCLWork) -> None:
        seen.append(("timeout", work.op))
        on_error(dist.DistTimeoutError("timed out"))

    args: dict[str, Any] = dict(on_start=lambda: None, check_error=lambda: None,
                                on_error=on_error, on_timeout=on_timeout, op_timeout_s=None,
                                launch_timeout_s=None)
    args.update(kw)
    box.append(Watchdog("test-watchdog", **args))
    return box[0], seen


def _until(cond: Any, seconds: float = 10) -> None:
    end = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.01)


def test_watchdog_completes_works_and_survives_a_sticky_cuda_error() -> None:
    """The watchdog's state machine with stand-in events (not NCCL): completion, then a
    query() that raises fails the pending works instead of killing the thread silently."""
    dog, seen = _watchdog()
    done, event = _work(value="a"), _Event()
    done.enqueued(event)
    dog.track(done)
    event.fired = True
    _until(lambda: done.get_future().done())
    sticky = _work(op="broken")
    sticky.enqueued(_Event(error=RuntimeError("CUDA error: an illegal memory access")))
    behind = _work(op="behind")
    behind.enqueued(_Event())
    dog.track(sticky)
    dog.track(behind)
    _until(lambda: behind.get_future().done())
    assert [kind for kind, _ in seen] == ["error"] and "illegal memory" in str(seen[0][1])
    for w in (sticky, behind):
        with pytest.raises(dist.DistBackendError, match="illegal memory"):
            w.wait()
    _until(lambda: dog.stopped)  # the handler stops it after failing the works


def test_watchdog_survives_its_own_handler_failing() -> None:
    def on_error(exc: BaseException) -> None:
        raise RuntimeError("handler broke")

    dog, _ = _watchdog(on_error=on_error)
    w = _work()
    w.enqueued(_Event(error=RuntimeError("sticky")))
    dog.track(w)
    _until(lambda: w.get_future().done())
    with pytest.raises(RuntimeError, match="handler broke"):
        w.get_future().wait()
    _until(lambda: dog.stopped)  # stopped after the works were failed


def test_watchdog_bounds_a_launch_and_stops_checking_once_broken() -> None:
    """A Work tracked but never queued (an NCCL call stuck on the host) meets the launch
    timeout; after the group failed, the communicator is not polled any more."""
    checks: list[float] = []

    def check() -> None:
        checks.append(time.monotonic())

    dog, seen = _watchdog(check_error=check, launch_timeout_s=0.3, op_timeout_s=None)
    queued = _work(op="queued")
    queued.enqueued(_Event())  # on the GPU, never fires: no op timeout in this mode
    dog.track(queued)
    _until(lambda: checks)  # the watchdog polls the communicator while healthy
    time.sleep(0.5)  # past the launch timeout: an op timeout would have fired by now
    assert seen == [], "an op timeout fired although op_timeout_s is None"
    for w in dog.drain():
        w.fail(RuntimeError("cleared"))
    stuck = _work(op="stuck-launch")
    dog.track(stuck)
    _until(lambda: stuck.get_future().done())
    assert seen[0] == ("timeout", "stuck-launch")
    n = len(checks)
    time.sleep(0.4)
    assert len(checks) == n and dog.stopped


def test_group_failure_settles_works_and_stops_polling_before_the_abort() -> None:
    """Defect 4, NCCLProcessGroup._abort's order on its real collaborators (Communicator,
    Watchdog, NCCLWork) around a cupy-like stand-in and stand-in events: not NCCL, not a GPU.
    The group object is made without __init__, which needs a GPU."""
    from plugdist._log import get_logger
    from plugdist_nccl.process_group import _P2P, NCCLProcessGroup

    raw = _CupyLikeComm()
    seen_at_abort: dict[str, Any] = {}
    pending = [_work(op=f"op{i}") for i in range(3)]
    held = _work(op="held-send")
    polls: list[float] = []

    def abort() -> None:
        seen_at_abort["settled"] = [w.get_future().done() for w in [*pending, held]]
        seen_at_abort["watchdog stopped"] = pg._watchdog.stopped  # type: ignore[union-attr]
        _CupyLikeComm.abort(raw)

    raw.abort = abort  # type: ignore[method-assign]
    comm = Communicator(raw)
    pg = NCCLProcessGroup.__new__(NCCLProcessGroup)
    pg._state, pg._broken, pg._log = threading.Lock(), None, get_logger()
    pg._p2p = [_P2P(True, torch.zeros(1), 1, held)]
    pg._comm = comm
    pg._watchdog = Watchdog("test-group", on_start=lambda: None,
                            check_error=lambda: polls.append(time.monotonic()) or
                            comm.check_async_error(),
                            on_error=lambda e: None, on_timeout=lambda w: None,
                            op_timeout_s=None, launch_timeout_s=None)
    finished = _work(op="done-on-gpu")
    finished.enqueued(_Event())
    for w in pending:
        w.enqueued(_Event())
        pg._watchdog.track(w)
    pg._watchdog.track(finished)
    _until(lambda: len(polls) > 0)
    finished._event = _Event(fired=True)  # its event fired; the others never will
    failure = dist.DistBackendError("peer died")
    pg._abort(failure)
    assert seen_at_abort == {"settled": [True] * 4, "watchdog stopped": True}
    for w in [*pending, held]:
        assert w.exception() is not None and "peer died" in str(w.exception())
    assert finished.get_future().value() == "out"  # finished on the GPU: not failed
    assert pg._broken is failure and comm.closed and raw.calls.count("abort") == 1
    n = len(polls)
    time.sleep(0.3)
    assert len(polls) == n, "the watchdog polled the communicator after the abort"
    pg._abort(dist.DistBackendError("again"))  # idempotent: the first failure stays
    assert pg._broken is failure


_EXIT_SCRIPT = """
import threading, time, sys
sys.path.insert(0, {tests!r})
from datetime import timedelta
from plugdist._log import get_logger
from plugdist.backend import GroupOptions
from plugdist_nccl import process_group as m
from plugdist_nccl.communicator import Communicator
from plugdist_nccl.watchdog import Watchdog
from test_nccl import _CupyLikeComm

raw = _CupyLikeComm()
pg = m.NCCLProcessGroup.__new__(m.NCCLProcessGroup)
m.BackendBase.__init__(pg, 0, 1, GroupOptions(group_name="exit-test"))
pg._state, pg._broken, pg._closed, pg._log = threading.Lock(), None, False, get_logger()
pg._p2p, pg._stream, pg._comm = [], None, Communicator(raw)
pg._watchdog = Watchdog("exit-test", on_start=lambda: None,
                        check_error=pg._comm.check_async_error, on_error=print,
                        on_timeout=print, op_timeout_s=None, launch_timeout_s=None)
def destroy():
    print("destroy; watchdog stopped:", pg._watchdog.stopped, flush=True)
    raw.handle = 0
raw.destroy = destroy
m._LIVE_GROUPS.add(pg)
m._register_exit_handler()
print("leaving without destroy_process_group", flush=True)
"""


def test_exit_without_destroy_stops_the_watchdog_then_frees_the_communicator() -> None:
    """The atexit hook of live groups, on a real interpreter exit: the watchdog stops before
    the communicator is destroyed (a cupy-like stand-in; not NCCL, not a GPU)."""
    code = _EXIT_SCRIPT.format(tests=str(Path(__file__).parent))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines == ["leaving without destroy_process_group",
                     "destroy; watchdog stopped: True"], out.stdout + out.stderr
    assert "destroy_process_group() was not called" in out.stdout + out.stderr


def test_dtype_views() -> None:
    from plugdist_nccl.dtypes import data_buffer, nccl_op, reduction_buffer

    assert data_buffer(torch.zeros(3, dtype=torch.int16)).count == 6      # raw bytes
    assert data_buffer(torch.zeros(3, dtype=torch.bfloat16)).count == 3   # ncclBfloat16
    assert reduction_buffer(torch.zeros(3, dtype=torch.complex64)).count == 6
    assert reduction_buffer(torch.zeros(3, dtype=torch.bool)).dtype == 1  # uint8
    assert nccl_op(ReduceOp.SUM, torch.bool) == nccl_op(ReduceOp.MAX, torch.bool)
    with pytest.raises(TypeError, match="int16"):
        reduction_buffer(torch.zeros(3, dtype=torch.int16))
    assert reduction_buffer(torch.zeros(3, dtype=torch.bfloat16)).dtype == 9  # ncclBfloat16


# -- needs GPUs --------------------------------------------------------------------------------
@needs_gpu
@pytest.mark.timeout(WORLD_TIMEOUT + 60)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8], ids=lambda n: f"world{n}")
def test_conformance_on_gpus(world_size: int) -> None:
    _ranks_or_skip(world_size)
    results = run_world(run_checks, world_size, backend="nccl", timeout=WORLD_TIMEOUT,
                        group_timeout=60.0)
    failures = [r[name] for r in results for name in check_names() if r.get(name)]
    assert not failures, "\n".join(failures)


@needs_gpu
@pytest.mark.parametrize("world_size", [1, 2], ids=lambda n: f"world{n}")
def test_results_ordered_for_another_stream_after_wait(world_size: int) -> None:
    _ranks_or_skip(world_size)
    results = run_world(workers.stream_ordering, world_size, backend="nccl", timeout=120,
                        group_timeout=60.0)
    assert results == [[]] * world_size, results


@needs_gpu
def test_high_priority_stream() -> None:
    [(priority, total)] = run_world(workers.high_priority, 1, backend="nccl", timeout=120)
    assert priority < 0 and total == 4.0


@needs_gpu
def test_ddp_on_cuda_one_rank() -> None:
    [diffs] = run_world(workers.ddp_one_rank, 1, backend="nccl", timeout=120)
    assert max(diffs) < 1e-6, diffs


def _ranks_or_skip(world_size: int) -> None:
    """Skip, with the reason, where this machine cannot run ``world_size`` NCCL ranks."""
    short = _gpu_shortfall("nccl", world_size)
    if short:
        pytest.skip(short)


def _two_ranks() -> None:
    _ranks_or_skip(2)


@needs_gpu
@pytest.mark.timeout(150)
def test_ddp_on_cuda_two_ranks() -> None:
    _two_ranks()
    results = run_world(workers.ddp_two_ranks, 2, backend="nccl", timeout=120,
                        group_timeout=60.0)
    assert results == [[], []], results


@needs_gpu
@pytest.mark.timeout(150)
def test_p2p_eager_versus_held_back() -> None:
    _two_ranks()
    results = run_world(workers.p2p_eager_versus_held, 2, backend="nccl", timeout=120,
                        group_timeout=60.0)
    assert results == [[], []], results


@needs_gpu
@pytest.mark.timeout(240)
def test_plugdist_nccl_inside_torch() -> None:
    """torch.distributed alone over plugdist_nccl matches torch's NCCL (ops, DDP, FSDP2), and
    the device-map forms mixing plugdist and torch backends serve cpu and cuda tensors."""
    _two_ranks()
    ports = [free_port() for _ in range(4)]
    results = run_world(workers.torch_over_plugdist_nccl, 2, timeout=200, args=(ports,))
    assert results == [[], []], results


@needs_gpu
@pytest.mark.timeout(120)
def test_blocking_wait_raises_timeout() -> None:
    _two_ranks()
    results = run_world(workers.blocking_wait_timeout, 2, backend="nccl", timeout=90,
                        group_timeout=3.0, env={"NCCL_BLOCKING_WAIT": "1"}, expect_errors=True)
    assert results[0].value is not None and results[0].value.startswith("timeout:"), results[0]
    assert "NCCL_BLOCKING_WAIT" in results[0].value and "was aborted" in results[0].value
    assert " Timed out waiting 3000ms for " in results[0].value, results[0].value


@needs_gpu
@pytest.mark.timeout(120)
def test_barrier_timeout_without_blocking_wait_leaves_the_communicator() -> None:
    _two_ranks()
    results = run_world(workers.barrier_timeout, 2, backend="nccl", timeout=90,
                        group_timeout=3.0, env={"NCCL_ASYNC_ERROR_HANDLING": "0"},
                        expect_errors=True)
    assert results[0].value is not None and results[0].value.startswith("timeout:"), results[0]
    assert "was not aborted" in results[0].value, results[0].value


def test_gpu_sharing_is_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    from plugdist.testing.checks import RANKS_PER_GPU_ENV, gpu_shortfall

    monkeypatch.delenv(RANKS_PER_GPU_ENV, raising=False)
    assert gpu_shortfall("gloo", ("cpu", "cuda"), 64) is None
    over = GPUS + 1
    assert "needs one GPU per rank" in (gpu_shortfall("nccl", ("cuda",), over) or "")
    monkeypatch.setenv(RANKS_PER_GPU_ENV, "2")
    assert (gpu_shortfall("nccl", ("cuda",), over) is None) == (GPUS > 0)
    assert "2 ranks each" in (gpu_shortfall("nccl", ("cuda",), 2 * GPUS + 1) or "")
    monkeypatch.setenv(RANKS_PER_GPU_ENV, "zero")
    with pytest.raises(ValueError, match=RANKS_PER_GPU_ENV):
        gpu_shortfall("nccl", ("cuda",), 1)


def test_gpu_tests_skip_with_the_reason() -> None:
    ok, reason = NCCLProcessGroup.is_available()  # asked again, not the module's answer
    [skips] = needs_gpu.args
    assert skips is (not ok)
    if not skips:
        pytest.skip("GPU present: the GPU tests run")
    assert reason and REASON
    assert needs_gpu.kwargs["reason"] == f"nccl unavailable: {reason}"


# -- the lean route and CUDA graphs --------------------------------------------------------------
@needs_gpu
@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size", [1, 2], ids=lambda n: f"world{n}")
def test_synchronous_ops_run_on_the_callers_stream(world_size: int) -> None:
    _ranks_or_skip(world_size)
    results = run_world(workers.sync_ops_on_caller_stream, world_size, backend="nccl",
                        timeout=120, group_timeout=60.0)
    assert results == [[]] * world_size, results


@needs_gpu
@pytest.mark.timeout(120)
def test_a_synchronous_op_whose_peer_never_comes_is_timed_out() -> None:
    _two_ranks()
    results = run_world(workers.sync_op_timeout, 2, backend="nccl", timeout=90,
                        group_timeout=3.0, env={"NCCL_ASYNC_ERROR_HANDLING": "2"},
                        expect_errors=True)
    assert results[0].value is not None and results[0].value.startswith("error:"), results[0]
    assert "all_reduce" in results[0].value and "3000ms" in results[0].value, results[0].value


@needs_gpu
@pytest.mark.timeout(200)
@pytest.mark.parametrize("world_size", [1, 2], ids=lambda n: f"world{n}")
def test_every_capturable_op_replays_in_a_cuda_graph(world_size: int) -> None:
    _ranks_or_skip(world_size)
    results = run_world(workers.graph_capture, world_size, backend="nccl", timeout=170,
                        group_timeout=60.0)
    assert results == [[]] * world_size, results


@needs_gpu
@pytest.mark.timeout(200)
@pytest.mark.parametrize("world_size", [1, 2], ids=lambda n: f"world{n}")
@pytest.mark.parametrize("through", ["plugdist", "bridge"])
def test_a_captured_training_step_replays_as_eager(world_size: int, through: str) -> None:
    _ranks_or_skip(world_size)
    results = run_world(workers.graph_training_step, world_size, backend="nccl", timeout=170,
                        group_timeout=60.0, args=(through,))
    assert results == [[]] * world_size, results


@needs_gpu
@pytest.mark.timeout(150)
def test_a_stuck_replay_is_named_after_the_group_timeout() -> None:
    _two_ranks()
    results = run_world(workers.graph_replay_hang, 2, backend="nccl", timeout=120,
                        group_timeout=3.0, expect_errors=True)
    stuck = results[0]
    assert stuck.exitcode == 6, stuck
    assert "captured in a CUDA graph, replay 2" in stuck.stderr_tail, stuck.stderr_tail
    assert "Timed out waiting 3000ms" in stuck.stderr_tail, stuck.stderr_tail
    assert results[1].value == "slept", results[1]


# -- the lean route's watchdog feed and the replay watch, without a GPU -------------------------
class _Launch:
    """What the watchdog tracks for a synchronous op (stand-in: no CUDA event)."""

    urgent = False

    def __init__(self) -> None:
        self.issued_at, self.launched, self.done, self._settled = time.monotonic(), True, \
            False, False

    def settled(self) -> bool:
        return self._settled

    def gpu_done(self) -> bool:
        return self.done

    def finish(self) -> None:
        self._settled = True

    def finish_or_fail(self, exc: BaseException) -> None:
        self._settled = True


def test_watchdog_feed_without_a_lock_loses_no_launch() -> None:
    """track() appends without a lock unless the thread sleeps: launches fed by two threads
    while the watchdog keeps falling idle and waking are all settled, none stranded."""
    dog, seen = _watchdog()
    launches = [_Launch() for _ in range(4000)]
    for launch in launches:
        launch.done = True

    def feed(part: list[_Launch]) -> None:
        for i, launch in enumerate(part):
            dog.track(launch)
            if i % 97 == 0:
                time.sleep(0.003)  # long enough for the thread to go idle in between

    _ranks([functools.partial(feed, launches[:2000]), functools.partial(feed, launches[2000:])])
    _until(lambda: all(launch.settled() for launch in launches))
    assert dog.pending() == 0 and seen == []
    dog.stop()


def test_replay_watch_names_a_stuck_replay_once_and_never_a_moving_one() -> None:
    """The replay watch's verdict on the counters the GPU copies (no GPU: the rows given)."""
    from plugdist_nccl.replays import ReplayWatch

    watch = ReplayWatch.__new__(ReplayWatch)
    watch._ops, watch._pending, watch._reported = ["all_reduce", "broadcast"], {}, set()
    watch._lock = threading.Lock()
    # slot 0 finished every replay; slot 1's third replay began at t=0 and never ended
    assert watch._judge([3, 3], [3, 2], now=0.0, limit=1.0) == []
    assert watch._judge([3, 3], [3, 2], now=0.9, limit=1.0) == []
    late = watch._judge([4, 3], [4, 2], now=1.5, limit=1.0)
    assert [(x.op, x.replay) for x in late] == [("broadcast", 3)]
    assert watch._judge([5, 3], [5, 2], now=9.0, limit=1.0) == []  # reported once
    # a host far ahead of the GPU: always a replay in flight, but each poll sees it move on
    moving = ReplayWatch.__new__(ReplayWatch)
    moving._ops, moving._pending, moving._reported = ["all_reduce"], {}, set()
    for step in range(10):
        assert moving._judge([step + 1], [step], now=float(step), limit=1.0) == []
