"""``NCCLProcessGroup``: every plugdist op as NCCL calls on one communicator and one CUDA stream.

One communicator per group (sub-groups have their own), built at the group's first op on that
op's device, or when the group is created if ``NCCLOptions.device_id`` names the device. Every op
is queued on the group's stream after the caller's current stream and returns an
:class:`~plugdist_nccl.work.NCCLWork`; gather, scatter and all_to_all are grouped send/recv.

Point-to-point ops are held back and queued together (one NCCL group call) when this process next
waits on, queries or chains any of them, or issues another op on the group: a ring of
``isend``/``irecv`` then cannot deadlock. ``NCCLOptions(eager_p2p=True)`` hands each to NCCL at
once instead, as torch does (see the README for what each choice can deadlock on).

Synchronous ops (``async_op=False``: the core's lean route, ``native_<op>_blocking``) run on
the caller's current stream, as torch's NCCL backend does for them: no stream hand-over and one
event per op, for the watchdog, from a pool, through raw handles (:mod:`plugdist_nccl.cuda`).
Ops returning a Work run on the group's stream after the caller's.

CUDA graphs: an op issued while the caller's stream is being captured is captured (NCCL
supports it) and covered at each replay by the watchdog through a
:class:`~plugdist_nccl.replays.ReplayWatch`; nothing in the capture queries or synchronizes an
event. The first op of a group (which builds the communicator) and a barrier (which blocks the
host) cannot be captured and say so.

Locks: ``_lock`` orders the ops of the group (every NCCL call is made under it, so all ranks see
the same order); the communicator has its own lock (see :class:`Communicator`); ``_state`` guards
the failure state and the held-back ops. A failure (``_abort``) never takes ``_lock``: the thread
holding it may be stuck inside an NCCL call that only the abort can end.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar

import torch
from plugdist.backend import BackendBase, GroupOptions, ReduceOp, Work, get_logger
from plugdist.errors import DistBackendError, DistError, DistTimeoutError, timed_out, where
from plugdist.store import Store

from ._nccl import availability, load, version
from .communicator import Communicator, CommunicatorClosed, create_communicator
from .cuda import EventPool, current_stream, relax_capture_mode, runtime, stream_capturing
from .dtypes import (
    DATA_CODES,
    REDUCE_CODES,
    Buffer,
    check_reducible,
    data_buffer,
    nccl_op,
    reduce_code,
    reduction_buffer,
)
from .options import ASYNC_ERROR_HANDLING_ENV, FailurePolicy, NCCLOptions
from .replays import LateReplay, ReplayWatch
from .watchdog import Tracked, Watchdog
from .work import Launch, NCCLWork, RawEvent

__all__ = ["NCCLProcessGroup"]

_BITWISE = frozenset({ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR})
Issue = Callable[[Any, int], None]  # (communicator, stream handle) -> queue NCCL calls
_DEVICE_TO_DEVICE = 3  # cudaMemcpyDeviceToDevice


@dataclass
class _P2P:
    send: bool
    tensor: torch.Tensor
    peer: int
    work: NCCLWork


class NCCLProcessGroup(BackendBase):
    """A group of processes, one GPU each, talking through NCCL.

    Construction is cheap and local unless ``NCCLOptions.device_id`` is given (then collective,
    as the first op otherwise is: every member must reach it, bounded by ``options.timeout``).
    Ops never block the host (except a barrier's wait, the first op, ``wait(timeout=...)`` and
    waits under ``NCCL_BLOCKING_WAIT``). Thread-safe: ops may be issued from several threads; all
    ranks must issue them in the same order. Groups not shut down (``destroy_process_group``)
    are freed at interpreter exit: watchdog first, then the communicator.
    """

    backend_name: ClassVar[str] = "nccl"
    plugin_api = (2, 0)  # written for plugdist's plugin API 2.x
    device_types: ClassVar[tuple[str, ...]] = ("cuda",)
    lean_device_types: ClassVar[tuple[str, ...]] = ("cuda",)
    default_for: ClassVar[tuple[str, ...]] = ("cuda",)
    # AVG is native from NCCL 2.10 (capabilities() drops it on older NCCL: the core divides)
    native_reduce_ops: ClassVar[frozenset[ReduceOp]] = frozenset(
        {ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX})
    refused_reduce_ops: ClassVar[frozenset[ReduceOp]] = _BITWISE

    def __init__(self, store: Store, rank: int, size: int,
                 options: GroupOptions | None = None) -> None:
        super().__init__(rank, size, options)
        here = where(rank=rank, group=self.group_name, backend=self.backend_name)
        ok, reason = self.is_available()
        if not ok:
            raise DistBackendError(f"{here} the nccl backend cannot run here: {reason}")
        try:
            self.nccl_options = NCCLOptions.coerce(self.options.backend_options)
        except TypeError as exc:
            raise TypeError(f"{here} {exc}") from None
        self._store = store
        self._log = get_logger(rank=rank, group=self.group_name)
        self._nccl = load()
        self._version = version()
        self._policy = FailurePolicy.from_env()
        self._blocking = self._policy.blocking_wait
        if self._blocking and any(os.environ.get(n, "").strip() for n in ASYNC_ERROR_HANDLING_ENV):
            self._log.warning("NCCL_BLOCKING_WAIT and NCCL_ASYNC_ERROR_HANDLING are both set; "
                              "blocking wait wins: waiters time ops out, the watchdog will not "
                              "end the process")
        self._lock = threading.RLock()
        self._state = threading.Lock()
        self._comm: Communicator | None = None
        self._comm_attempts = 0
        self._device: torch.device | None = None
        self._stream: torch.cuda.Stream | None = None
        self._stream_ptr = 0  # its raw handle
        self._events = EventPool()
        self._caller_done = 0  # a raw event re-recorded by each op on the group's stream
        self._replays: ReplayWatch | None = None
        self._unwatched_captures = False
        # the device index the lean route serves: set once the communicator exists, -1 while
        # it does not or the group is broken or closed (one comparison instead of four)
        self._lean_index = -1
        self._watchdog: Watchdog | None = None
        self._p2p: list[_P2P] = []
        self._broken: BaseException | None = None
        self._closed = False
        _LIVE_GROUPS.add(self)
        _register_exit_handler()
        device = self.nccl_options.device()
        if device is not None:
            with self._lock:
                self._ensure_comm("init", device)

    # -- plugin metadata ------------------------------------------------------------------------
    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """Whether a GPU, cupy >= 14 and NCCL >= 2.18.1 are usable here, and why not. Never
        raises."""
        return availability()

    @property
    def device(self) -> torch.device | None:
        """The GPU of this group's communicator (None before the first op)."""
        return self._device

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The internal stream this group's ops run on (None before the first op)."""
        return self._stream

    def shutdown(self, drain: timedelta = timedelta(seconds=10)) -> None:
        """Fail held-back point-to-point ops, stop the watchdog, then free the communicator
        (``ncclCommDestroy`` once the stream drained within ``drain``, else ``ncclCommAbort``).
        Idempotent."""
        with self._state:
            if self._closed:
                return
            self._closed = True
            self._lean_index = -1
            pending, self._p2p = self._p2p, []
        _LIVE_GROUPS.discard(self)
        closed = DistBackendError(f"{self.where('shutdown')} the group was shut down before "
                                  f"this op was queued")
        for p in pending:
            p.work.fail(closed)
        comm, watchdog = self._comm, self._watchdog
        drained = self._broken is None and self._drain_stream(drain)
        if watchdog is not None:  # before the communicator goes: it polls it
            watchdog.stop()
            for w in watchdog.drain():
                w.finish_or_fail(closed)
        if comm is not None:
            try:
                comm.destroy() if drained else comm.abort()
            except Exception as exc:  # noqa: BLE001 - best effort, the group is going anyway
                self._log.debug("freeing the communicator failed", error=str(exc))
        if drained:
            self._events.destroy()
        self._log.debug("nccl group shut down", drained=drained)

    def _drain_stream(self, limit: timedelta) -> bool:
        """Whether the group's stream and the synchronous ops still tracked (queued on callers'
        streams) finished within ``limit``."""
        stream = self._stream
        if stream is None:
            return True
        watchdog = self._watchdog
        end = time.monotonic() + limit.total_seconds()
        while watchdog is not None and watchdog.pending() and not watchdog.stopped:
            if time.monotonic() > end:
                return False
            time.sleep(1e-3)
        try:
            event = torch.cuda.Event()
            event.record(stream)
            while not event.query():
                if time.monotonic() > end:
                    return False
                time.sleep(1e-3)
        except Exception as exc:  # noqa: BLE001 - a broken CUDA context: abort instead
            self._log.debug("draining the stream failed", error=str(exc))
            return False
        return True

    # -- the communicator and the stream --------------------------------------------------------
    def _check_usable(self, op: str, device: torch.device) -> None:
        if self._broken is not None:
            raise DistBackendError(f"{self.where(op)} this group's NCCL communicator was aborted "
                                   f"after an earlier failure ({self._broken}); create a new "
                                   f"group") from self._broken
        if self._closed:
            raise DistBackendError(f"{self.where(op)} this group was shut down; create a new one")
        if self._device is not None and device != self._device:
            raise ValueError(f"{self.where(op)} tensor is on {device}, but this group's NCCL "
                             f"communicator lives on {self._device}; use one GPU per process "
                             f"(torch.cuda.set_device) for every op of a group")

    def _ensure_stream(self, op: str, device: torch.device) -> torch.cuda.Stream:
        """The group's stream, made on ``device`` at the first op. Caller holds the lock."""
        if self._stream is None:
            self._refuse_capture(op, device)
            priority = -1 if self.nccl_options.is_high_priority_stream else 0
            self._stream = torch.cuda.Stream(device=device, priority=priority)
            self._stream_ptr = self._stream.cuda_stream
            with torch.cuda.device(device):
                self._caller_done = self._events.take()
            self._device = device
        return self._stream

    def _refuse_capture(self, op: str, device: torch.device) -> None:
        """Before the group's first op: building the communicator cannot be captured."""
        if stream_capturing(current_stream(device.index)):
            raise DistBackendError(
                f"{self.where(op)} this is the group's first op, which builds its NCCL "
                f"communicator: that cannot happen while a CUDA graph is being captured. Run "
                f"one op of this group before capturing (a warm-up, as torch's docs advise), "
                f"or create the group with NCCLOptions(device_id=...)")

    def _after_caller(self) -> int:
        """Order the group's stream after the caller's current stream (what ``wait_stream``
        does, with one event reused: a stream waits for the event as recorded when it is told
        to); returns the caller's stream. Caller holds the lock; the stream exists."""
        caller = current_stream(self._device_index())
        rt = runtime()
        rt.eventRecord(self._caller_done, caller)
        rt.streamWaitEvent(self._stream_ptr, self._caller_done, 0)
        return caller

    def _device_index(self) -> int:
        device = self._device
        assert device is not None and device.index is not None  # set with the stream
        return device.index

    def _ensure_comm(self, op: str, device: torch.device) -> Communicator:
        """The communicator, built on ``device`` at the first op. Caller holds the lock."""
        self._check_usable(op, device)
        if self._comm is not None:
            return self._comm
        self._refuse_capture(op, device)
        self._ensure_stream(op, device)
        self._comm_attempts += 1  # a retry after a failed build uses fresh store keys
        comm = create_communicator(self._store, self.group_rank, self.group_size, device,
                                   self.timeout, self._comm_attempts, self.where(op))
        seconds = self.timeout.total_seconds()
        self._replays = ReplayWatch(device)

        def on_start() -> None:
            torch.cuda.set_device(device)
            relax_capture_mode()  # its event queries must not disturb a user's capture

        self._watchdog = Watchdog(
            f"plugdist-nccl-{self.group_name}-r{self.group_rank}",
            on_start=on_start, check_error=comm.check_async_error,
            on_error=self._watchdog_error, on_timeout=self._watchdog_timeout,
            op_timeout_s=self._policy.watchdog_op_timeout(seconds),
            launch_timeout_s=self._policy.watchdog_launch_timeout(seconds),
            replays=self._replays, on_late_replay=self._late_replay)
        self._comm = comm
        if device.index is not None and not self._blocking:  # blocking waits need a Work
            self._lean_index = device.index
        self._log.debug("nccl communicator created", device=str(device), size=self.group_size,
                        high_priority=self.nccl_options.is_high_priority_stream)
        return comm

    def _device_of(self, t: torch.Tensor | None) -> torch.device:
        if t is not None:
            return t.device if t.device.index is not None else \
                torch.device("cuda", torch.cuda.current_device())
        if self._device is not None:
            return self._device
        return torch.device("cuda", torch.cuda.current_device())

    # -- issuing --------------------------------------------------------------------------------
    def _new_work(self, op: str, device: torch.device, tensors: list[torch.Tensor], result: Any,
                  blocking: bool = False) -> NCCLWork:
        return NCCLWork(device=device, blocking=blocking or self._blocking, tensors=tensors,
                        flush=self._flush, on_timeout=self._wait_timeout, result=result, op=op,
                        rank=self.group_rank, group=self.group_name, backend=self.backend_name,
                        timeout=self.timeout)

    def _issue(self, op: str, sample: torch.Tensor | None, issue: Issue, keep: list[torch.Tensor],
               result: Any, blocking: bool = False, torch_kernels: bool = False) -> NCCLWork:
        """Queue ``issue`` on the group's stream after the caller's current stream; return its
        Work. ``keep``: every tensor the op touches (held until it finished);
        ``torch_kernels``: ``issue`` also runs torch ops (on the group's stream)."""
        device = self._device_of(sample)
        with self._lock:
            self._flush_locked()
            comm = self._ensure_comm(op, device)
            work = self._new_work(op, device, keep, result, blocking)
            self._launch(op, comm, [work], issue, torch_kernels)
        return work

    def _launch(self, op: str, comm: Communicator, works: list[NCCLWork], issue: Issue,
                torch_kernels: bool = False) -> None:
        """Run ``issue`` on the group's stream (caller holds the lock), then record one event
        for ``works``; an NCCL error fails them and is raised as DistBackendError.

        The works are tracked before the NCCL calls: a call that blocks the host (``ncclGroupEnd``
        waiting for a peer to connect) is then bounded by the watchdog's launch timeout. While
        the caller's stream is being captured, the op is captured instead: not tracked, its
        replays watched."""
        watchdog, stream = self._watchdog, self._stream
        if watchdog is None or stream is None:
            raise DistBackendError(f"{self.where(op)} no communicator (internal error)")
        ptr = self._stream_ptr
        captured = stream_capturing(self._after_caller())
        slot = self._replay_slot(op) if captured else None
        if not captured:
            now = time.monotonic()
            for w in works:
                w.issued_at = now
                watchdog.track(w)
        try:
            with comm.lock:
                raw = comm.raw
                if raw is None:
                    raise comm.closed_error()
                if torch_kernels or slot is not None:
                    with _current_stream(stream, works[0].device):
                        self._watched(slot, ptr, lambda: issue(raw, ptr))
                else:
                    issue(raw, ptr)
                handle = self._events.take()
                runtime().eventRecord(handle, ptr)
        except Exception as exc:
            err = self._translate(op, exc)
            for w in works:
                w.fail(err)
            raise err from exc
        event = RawEvent(handle, self._events)
        for w in works:
            w.enqueued(event, captured)

    # -- the lean route: synchronous ops on the caller's stream ---------------------------------
    def _direct(self, op: str, tensor: torch.Tensor, issue: Issue) -> Any:
        """A synchronous op, queued on the caller's current stream: None once queued (the
        caller's stream sees the result), NotImplemented to take the Work path (the group's
        first op, another device, held-back sends, a broken or closed group, blocking wait).
        One pooled event per op, for the watchdog; captured instead while the stream is being
        captured."""
        index = tensor.get_device()
        if index != self._lean_index or self._p2p:
            return NotImplemented
        comm, watchdog, device = self._comm, self._watchdog, self._device
        assert comm is not None and watchdog is not None and device is not None  # set before
        stream = current_stream(index)
        if stream_capturing(stream):
            return self._direct_captured(op, comm, stream, issue)
        launch = Launch(op, self.where, device, self._events)
        with comm.lock:
            watchdog.track(launch)  # under the lock: tracked in the order NCCL gets the ops
            raw = comm.raw
            if raw is None:
                launch.abandon()
                raise self._translate(op, comm.closed_error())
            event = self._events.take()
            try:
                issue(raw, stream)
                runtime().eventRecord(event, stream)
            except Exception as exc:
                launch.abandon()
                self._events.give(event)
                raise self._translate(op, exc) from exc
            launch.enqueued(event)
        return None

    def _direct_captured(self, op: str, comm: Communicator, stream: int, issue: Issue) -> Any:
        slot = self._replay_slot(op)
        with comm.lock:
            raw = comm.raw
            if raw is None:
                raise self._translate(op, comm.closed_error())
            try:
                self._watched(slot, stream, lambda: issue(raw, stream))
            except Exception as exc:
                raise self._translate(op, exc) from exc
        return None

    def _replay_slot(self, op: str) -> int | None:
        """A replay-watch slot for ``op``, being captured now (None: all taken, warned once)."""
        replays, watchdog = self._replays, self._watchdog
        assert replays is not None and watchdog is not None  # made with the communicator
        slot = replays.claim(op)
        if slot is None:
            if not self._unwatched_captures:
                self._unwatched_captures = True
                self._log.warning("nccl: more ops captured in CUDA graphs than the watchdog "
                                  "can follow; later captured ops are not bounded by the group "
                                  "timeout when replayed", watched=len(replays))
        elif slot == 0:
            watchdog.watch_replays()
        return slot

    def _watched(self, slot: int | None, stream: int, issue: Callable[[], None]) -> None:
        """``issue()`` between the replay watch's two marks (``stream`` is torch's current)."""
        replays = self._replays
        if slot is None or replays is None:
            issue()
            return
        replays.before(slot, stream)
        issue()
        replays.after(slot, stream)

    def native_all_reduce_blocking(self, *, tensor: torch.Tensor, op: ReduceOp) -> Any:
        codes = REDUCE_CODES.get(tensor.dtype)
        if codes is None:  # a dtype NCCL cannot reduce: the Work route raises the error
            return NotImplemented
        dtype, per = codes
        count, red, ptr = tensor.numel() * per, reduce_code(op, tensor.dtype), tensor.data_ptr()
        if not count:
            return None
        return self._direct("all_reduce", tensor,
                            lambda c, s: c.allReduce(ptr, ptr, count, dtype, red, s))

    def native_broadcast_blocking(self, *, tensor: torch.Tensor, src: int) -> Any:
        codes = DATA_CODES.get(tensor.dtype)
        if codes is None:
            return NotImplemented
        count, ptr = tensor.numel() * codes[1], tensor.data_ptr()
        if not count:
            return None
        return self._direct("broadcast", tensor,
                            lambda c, s: c.broadcast(ptr, ptr, count, codes[0], src, s))

    def native_reduce_blocking(self, *, tensor: torch.Tensor, dst: int, op: ReduceOp) -> Any:
        codes = REDUCE_CODES.get(tensor.dtype)
        if codes is None:  # a dtype NCCL cannot reduce: the Work route raises the error
            return NotImplemented
        dtype, per = codes
        count, red, ptr = tensor.numel() * per, reduce_code(op, tensor.dtype), tensor.data_ptr()
        if not count:
            return None
        return self._direct("reduce", tensor,
                            lambda c, s: c.reduce(ptr, ptr, count, dtype, red, dst, s))

    def native_all_gather_into_tensor_blocking(self, *, output: torch.Tensor,
                                               tensor: torch.Tensor) -> Any:
        codes = DATA_CODES.get(tensor.dtype)
        if codes is None:
            return NotImplemented
        count, inp, out = tensor.numel() * codes[1], tensor.data_ptr(), output.data_ptr()
        if not count:
            return None
        return self._direct("all_gather_into_tensor", tensor,
                            lambda c, s: c.allGather(inp, out, count, codes[0], s))

    def native_reduce_scatter_tensor_blocking(self, *, output: torch.Tensor, input: torch.Tensor,
                                              op: ReduceOp) -> Any:
        codes = REDUCE_CODES.get(output.dtype)
        if codes is None:  # a dtype NCCL cannot reduce: the Work route raises the error
            return NotImplemented
        dtype, per = codes
        count, red = output.numel() * per, reduce_code(op, output.dtype)
        inp, out = input.data_ptr(), output.data_ptr()
        if not count:
            return None
        return self._direct("reduce_scatter_tensor", output,
                            lambda c, s: c.reduceScatter(inp, out, count, dtype, red, s))

    def native_all_to_all_single_blocking(self, *, output: torch.Tensor,
                                          input: torch.Tensor) -> Any:
        codes = DATA_CODES.get(input.dtype)
        if codes is None:
            return NotImplemented
        n, me, nccl = self.group_size, self.group_rank, self._nccl
        count = input.numel() * codes[1] // n  # per rank
        step = input.numel() * input.element_size() // n  # bytes per rank
        inp, out, dtype = input.data_ptr(), output.data_ptr(), codes[0]
        if not count:
            return None

        def issue(c: Any, s: int) -> None:
            runtime().memcpyAsync(out + me * step, inp + me * step, step, _DEVICE_TO_DEVICE, s)
            if n == 1:
                return
            nccl.groupStart()
            try:
                for peer in range(n):
                    if peer != me:
                        c.send(inp + peer * step, count, dtype, peer, s)
                        c.recv(out + peer * step, count, dtype, peer, s)
            finally:
                nccl.groupEnd()

        return self._direct("all_to_all_single", input, issue)

    def _flush(self) -> None:
        if self._p2p:
            with self._lock:
                self._flush_locked()

    def _flush_locked(self) -> None:
        """Queue every held-back send/recv as one NCCL group call. Caller holds the lock."""
        with self._state:
            pending, self._p2p = self._p2p, []
        if not pending:
            return
        works = [p.work for p in pending]
        try:
            comm = self._ensure_comm(pending[0].work.op, pending[0].work.device)
        except Exception as exc:
            for w in works:
                w.fail(exc)
            raise
        nccl = self._nccl

        def issue(comm: Any, stream: int) -> None:
            nccl.groupStart()
            try:
                for p in pending:
                    _p2p_call(comm, p.send, data_buffer(p.tensor), p.peer, stream)
            finally:
                nccl.groupEnd()

        self._launch("send/recv", comm, works, issue)

    def _hold_p2p(self, op: str, send: bool, tensor: torch.Tensor, peer: int) -> NCCLWork:
        device = self._device_of(tensor)
        with self._lock:
            self._check_usable(op, device)
            self._ensure_stream(op, device)
            # ordered after the caller's stream now, though NCCL gets the op at the flush
            self._after_caller()
            work = self._new_work(op, device, [tensor], [tensor])
            if tensor.numel() == 0:
                work.finish()  # nothing to move: done, and nothing to order after
                return work
            with self._state:
                self._p2p.append(_P2P(send, tensor, peer, work))
            if self.nccl_options.eager_p2p:
                self._flush_locked()
        return work

    # -- failures ------------------------------------------------------------------------------
    def _translate(self, op: str, exc: BaseException) -> DistError:
        if isinstance(exc, CommunicatorClosed):
            return DistBackendError(f"{self.where(op)} {exc} after an earlier failure "
                                    f"({self._broken}); create a new group")
        if isinstance(exc, DistError):
            return exc
        msg = str(exc).strip() or type(exc).__name__
        err = DistBackendError(f"{self.where(op)} NCCL failed on {self._device}: {msg} "
                               f"(NCCL {'.'.join(map(str, self._version))})")
        err.__cause__ = exc
        return err

    def native_abort(self) -> None:
        """Resilient groups aborted the group (a member failed): fail what is pending and abort
        the communicator (``ncclCommAbort`` frees a kernel stuck waiting for the dead peer), on
        a thread of its own, since the abort can take a while. Not yet run on a GPU here."""
        err = self.abort_signal.error(self.where("abort"))
        threading.Thread(target=self._abort, args=(err,), daemon=True,
                         name=f"plugdist-nccl-abort-{self.group_name}").start()

    def _abort(self, exc: BaseException) -> None:
        """Mark the group broken, settle every pending Work (``exc`` for those the GPU did not
        finish), stop the watchdog, then abort the communicator. Any thread; never takes
        ``_lock`` (its holder may be stuck in an NCCL call that only the abort ends)."""
        self._lean_index = -1
        with self._state:
            if self._broken is None:
                self._broken = exc
            pending, self._p2p = self._p2p, []
        watchdog = self._watchdog
        works = [p.work for p in pending] + (watchdog.drain() if watchdog is not None else [])
        for w in works:
            w.finish_or_fail(exc)
        if watchdog is not None:
            watchdog.stop()  # no more polling of a communicator being aborted
        comm = self._comm
        if comm is not None:
            try:
                comm.abort()
            except Exception as err:  # noqa: BLE001 - already failing
                self._log.debug("ncclCommAbort failed", error=str(err))

    def _timeout_error(self, work: Any, seconds: float, tail: str) -> DistTimeoutError:
        """``work`` outlived ``seconds``; ``tail`` says what happens about it."""
        what = "the op to finish on" if work.launched else "NCCL to queue the op on"
        return DistTimeoutError(f"{timed_out(work.where(), seconds, f'{what} {work.device}')}"
                                f"{tail}")

    def _wait_timeout(self, work: NCCLWork, seconds: float) -> BaseException:
        """A host-blocking wait ran out. Under NCCL_BLOCKING_WAIT the communicator is aborted
        (its state is unknown now); otherwise it is left to the watchdog's error handling.
        Returns the error for the waiter to raise."""
        self._log.error("nccl wait timed out", op=work.op, seconds=seconds)
        if self._policy.wait_timeout_aborts():
            err = self._timeout_error(
                work, seconds, " (NCCL_BLOCKING_WAIT); the NCCL communicator was aborted. A peer "
                "may have died, be stuck, or be running a different op; this group cannot be "
                "used any more")
            self._abort(err)
            return err
        handling = int(self._policy.handling)
        then = (f"the watchdog (NCCL_ASYNC_ERROR_HANDLING={handling}) acts when it outlives the "
                f"group timeout") if self._policy.watchdog_op_timeout(seconds) is not None else \
            "nothing else times it out (NCCL_ASYNC_ERROR_HANDLING=0)"
        return self._timeout_error(
            work, seconds, f"; the NCCL communicator was not aborted (NCCL_BLOCKING_WAIT is not "
            f"set): the op may still finish, and {then}. A peer may have died, be stuck, or be "
            f"running a different op")

    def _watchdog_timeout(self, work: Tracked) -> None:
        abort, end = self._policy.on_failure()
        what = "aborts the NCCL communicator" if abort else "does not abort the communicator"
        then = " and ends the process" if end else "; this group cannot be used any more"
        seconds = self.timeout.total_seconds()
        self._fail_async(self._timeout_error(
            work, seconds, f"; the watchdog ({self._policy_name()}) {what}{then}. A peer may "
            f"have died, be stuck, or be running a different op"))

    def _late_replay(self, late: LateReplay) -> None:
        """A replay of a captured op outlived the group timeout (watchdog thread)."""
        abort, end = self._policy.on_failure()
        what = "aborts the NCCL communicator" if abort else "does not abort the communicator"
        then = " and ends the process" if end else "; this group cannot be used any more"
        seconds = self.timeout.total_seconds()
        here = f"{self.where(late.op)} (captured in a CUDA graph, replay {late.replay})"
        self._fail_async(DistTimeoutError(
            f"{timed_out(here, seconds, f'the op to finish on {self._device}')}; the watchdog "
            f"({self._policy_name()}) {what}{then}. A peer may have died, be stuck, or not be "
            f"replaying the same graph"))

    def _watchdog_error(self, exc: BaseException) -> None:
        err = DistBackendError(f"{self.where('watchdog')} NCCL reported an asynchronous error on "
                               f"{self._device}: {type(exc).__name__}: {exc}")
        err.__cause__ = exc
        self._fail_async(err)

    def _policy_name(self) -> str:
        if self._policy.blocking_wait:
            return "NCCL_BLOCKING_WAIT"
        return f"NCCL_ASYNC_ERROR_HANDLING={int(self._policy.handling)}"

    def _fail_async(self, err: DistError) -> None:
        """A failure the watchdog found: abort and/or end the process, as the policy says."""
        abort, end = self._policy.on_failure()
        self._log.error("nccl group failed", error=str(err), handling=self._policy_name())
        if abort:
            self._abort(err)
        if end:
            _end_process(err)

    # -- validation ----------------------------------------------------------------------------
    def _check_reduction(self, op: str, tensor: torch.Tensor) -> None:
        """What NCCL adds to the core's checks of a reduction: a dtype it can reduce (the core
        refuses the bitwise reductions itself: ``refused_reduce_ops``)."""
        try:
            check_reducible(tensor.dtype)
        except TypeError as exc:
            raise TypeError(f"{self.where(op)} {exc}") from None

    # -- native hooks ---------------------------------------------------------------------------
    def native_all_reduce(self, *, tensor: torch.Tensor, op: ReduceOp) -> Work:
        self._check_reduction("all_reduce", tensor)
        if tensor.numel() == 0:
            return self._issue("all_reduce", tensor, _nothing, [tensor], [tensor])
        buf, red = reduction_buffer(tensor), nccl_op(op, tensor.dtype)
        return self._issue("all_reduce", tensor,
                           lambda c, s: c.allReduce(buf.ptr, buf.ptr, buf.count, buf.dtype, red, s),
                           [tensor], [tensor])

    def native_broadcast(self, *, tensor: torch.Tensor, src: int) -> Work:
        buf = data_buffer(tensor)
        return self._issue("broadcast", tensor, _if_any(
            buf, lambda c, s: c.broadcast(buf.ptr, buf.ptr, buf.count, buf.dtype, src, s)),
            [tensor], [tensor])

    def native_reduce(self, *, tensor: torch.Tensor, dst: int, op: ReduceOp) -> Work:
        self._check_reduction("reduce", tensor)
        buf, red = reduction_buffer(tensor), nccl_op(op, tensor.dtype)
        # NCCL writes recvbuff on the root only: elsewhere the input stays as it was
        return self._issue("reduce", tensor, _if_any(
            buf, lambda c, s: c.reduce(buf.ptr, buf.ptr, buf.count, buf.dtype, red, dst, s)),
            [tensor], [tensor])

    def native_all_gather_into_tensor(self, *, output: torch.Tensor, tensor: torch.Tensor) -> Work:
        inp, out = data_buffer(tensor), data_buffer(output)
        return self._issue("all_gather_into_tensor", tensor, _if_any(
            inp, lambda c, s: c.allGather(inp.ptr, out.ptr, inp.count, inp.dtype, s)),
            [tensor, output], [output])

    def native_all_gather(self, *, output_tensors: list[torch.Tensor],
                          tensor: torch.Tensor) -> Work:
        flat = self._scratch(tensor, (self.group_size * tensor.numel(),))
        inp, out = data_buffer(tensor), data_buffer(flat)

        def issue(c: Any, s: int) -> None:
            if inp.count:
                c.allGather(inp.ptr, out.ptr, inp.count, inp.dtype, s)
            parts = flat.chunk(self.group_size) if flat.numel() else []
            for dst, part in zip(output_tensors, parts, strict=False):
                dst.view(-1).copy_(part)  # on the group's stream, after the gather

        return self._issue("all_gather", tensor, issue, [tensor, flat, *output_tensors],
                           output_tensors, torch_kernels=True)

    def native_reduce_scatter_tensor(self, *, output: torch.Tensor, input: torch.Tensor,
                                     op: ReduceOp) -> Work:
        self._check_reduction("reduce_scatter_tensor", output)
        out, inp = reduction_buffer(output), reduction_buffer(input)
        red = nccl_op(op, output.dtype)
        return self._issue("reduce_scatter_tensor", output, _if_any(
            out, lambda c, s: c.reduceScatter(inp.ptr, out.ptr, out.count, out.dtype, red, s)),
            [output, input], [output])

    def native_reduce_scatter(self, *, output: torch.Tensor, input_list: list[torch.Tensor],
                              op: ReduceOp) -> Work:
        self._check_reduction("reduce_scatter", output)
        flat = self._scratch(output, (self.group_size * output.numel(),))
        out = reduction_buffer(output)
        red = nccl_op(op, output.dtype)

        def issue(c: Any, s: int) -> None:
            if out.count:
                torch.cat([t.reshape(-1) for t in input_list], out=flat)
                inp = reduction_buffer(flat)
                c.reduceScatter(inp.ptr, out.ptr, out.count, out.dtype, red, s)

        return self._issue("reduce_scatter", output, issue, [output, flat, *input_list], [output],
                           torch_kernels=True)

    def native_all_to_all_single(self, *, output: torch.Tensor, input: torch.Tensor,
                                 output_split_sizes: list[int],
                                 input_split_sizes: list[int]) -> Work:
        outs = _rows(output, output_split_sizes)
        ins = _rows(input, input_split_sizes)
        return self._exchange("all_to_all_single", input, ins, outs, [output, input], [output])

    def native_all_to_all(self, *, output_tensors: list[torch.Tensor],
                          input_tensors: list[torch.Tensor]) -> Work:
        return self._exchange("all_to_all", input_tensors[0], list(input_tensors),
                              list(output_tensors), [*output_tensors, *input_tensors],
                              output_tensors)

    def native_gather(self, *, tensor: torch.Tensor, gather_list: list[torch.Tensor] | None,
                      dst: int) -> Work:
        n, me = self.group_size, self.group_rank
        if me == dst and gather_list is not None:
            sends: list[torch.Tensor | None] = [None] * n
            sends[me] = tensor
            return self._exchange("gather", tensor, sends, list(gather_list),
                                  [tensor, *gather_list], gather_list)
        sends = [tensor if r == dst else None for r in range(n)]
        return self._exchange("gather", tensor, sends, [None] * n, [tensor], [])

    def native_scatter(self, *, tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None,
                       src: int) -> Work:
        n, me = self.group_size, self.group_rank
        recvs: list[torch.Tensor | None] = [tensor if r == src else None for r in range(n)]
        if me == src and scatter_list is not None:
            return self._exchange("scatter", tensor, list(scatter_list), recvs,
                                  [tensor, *scatter_list], [tensor])
        return self._exchange("scatter", tensor, [None] * n, recvs, [tensor], [tensor])

    def native_barrier(self) -> Work:
        # wait() blocks the host until every rank arrived; bounded by the group timeout, which
        # aborts the communicator only under NCCL_BLOCKING_WAIT
        device = self._device_of(None)
        if stream_capturing(current_stream(device.index)):
            raise DistBackendError(
                f"{self.where('barrier')} a barrier cannot be captured in a CUDA graph: it "
                f"blocks the host until every rank arrived, which a captured op never does "
                f"(it runs at replay). Call it outside the capture; inside, an all_reduce "
                f"orders the ranks' streams")
        flag = torch.zeros(1, dtype=torch.float32, device=device)
        buf = data_buffer(flag)
        return self._issue("barrier", flag,
                           lambda c, s: c.allReduce(buf.ptr, buf.ptr, 1, buf.dtype, 0, s),
                           [flag], [], blocking=True)

    def native_send(self, *, tensor: torch.Tensor, dst: int, tag: int) -> Work:
        return self._hold_p2p("send", True, tensor, dst)

    def native_recv(self, *, tensor: torch.Tensor, src: int | None, tag: int) -> Work:
        if src is None:  # the core refuses this first: NCCL has no receive from any source
            raise ValueError(f"{self.where('recv')} NCCL cannot receive from any source")
        work = self._hold_p2p("recv", False, tensor, src)
        work.set_source_rank(src)
        return work

    # -- helpers -------------------------------------------------------------------------------
    def _scratch(self, like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """A temporary for an op, allocated for the group's stream once it exists; during a
        capture, from the capture's own memory (on the capturing stream)."""
        stream = self._stream
        if stream is not None and not stream_capturing(current_stream(self._device_index())):
            with torch.cuda.stream(stream):
                return torch.empty(shape, dtype=like.dtype, device=like.device)
        return torch.empty(shape, dtype=like.dtype, device=like.device)

    def _exchange(self, op: str, sample: torch.Tensor, sends: list[torch.Tensor | None],
                  recvs: list[torch.Tensor | None], keep: list[torch.Tensor],
                  result: Any) -> NCCLWork:
        """Send ``sends[r]`` to and receive ``recvs[r]`` from every rank r (None: nothing) as one
        NCCL group call; this rank's own slot is a copy on the stream."""
        me, nccl = self.group_rank, self._nccl

        def issue(c: Any, s: int) -> None:
            mine_in, mine_out = sends[me], recvs[me]
            if mine_in is not None and mine_out is not None and mine_in.numel():
                mine_out.view(-1).copy_(mine_in.reshape(-1))
            nccl.groupStart()
            try:
                for peer in range(self.group_size):
                    if peer == me:
                        continue
                    out, inp = recvs[peer], sends[peer]
                    if inp is not None and inp.numel():
                        _p2p_call(c, True, data_buffer(inp), peer, s)
                    if out is not None and out.numel():
                        _p2p_call(c, False, data_buffer(out), peer, s)
            finally:
                nccl.groupEnd()

        return self._issue(op, sample, issue, keep, result, torch_kernels=True)


def _p2p_call(comm: Any, send: bool, buf: Buffer, peer: int, stream: int) -> None:
    if send:
        comm.send(buf.ptr, buf.count, buf.dtype, peer, stream)
    else:
        comm.recv(buf.ptr, buf.count, buf.dtype, peer, stream)


def _nothing(_comm: Any, _stream: int) -> None:
    """An empty tensor: nothing to send, but the Work still follows the stream."""


def _if_any(buf: Buffer, issue: Issue) -> Issue:
    return issue if buf.count else _nothing


def _rows(t: torch.Tensor, splits: list[int]) -> list[torch.Tensor | None]:
    if t.dim() == 0:
        return [t.view(1)]
    return list(t.split(splits, dim=0))


@contextmanager
def _current_stream(stream: torch.cuda.Stream, device: torch.device) -> Iterator[None]:
    """``stream`` as the current stream of ``device`` (its own) for the block, so torch's
    kernels on tensors of ``device`` go to it. What ``torch.cuda.stream(stream)`` does for them,
    without resolving the current device through ``torch.cuda.is_available()`` on each use
    (tens of microseconds per op)."""
    previous = torch.cuda.current_stream(device)
    torch.cuda.set_stream(stream)
    try:
        yield
    finally:
        torch.cuda.set_stream(previous)


def _end_process(err: BaseException) -> None:
    """NCCL_ASYNC_ERROR_HANDLING: CUDA work may have run on corrupt data; continuing user code is
    unsafe, so the process ends (as torch.distributed's NCCL backend does)."""
    sys.stderr.write(f"plugdist-nccl: ending the process: {err}\n")
    sys.stderr.flush()
    os._exit(6)


# -- interpreter exit without destroy_process_group ---------------------------------------------
# cupy frees a communicator (ncclCommDestroy) when the object is collected during interpreter
# teardown, while the group's daemon watchdog thread may still be polling it. So at exit, before
# teardown, every group still alive is shut down here: its watchdog stopped first, then its
# communicator destroyed (or aborted when its stream does not drain in time: a dead peer must not
# hang the exit). torch's NCCL backend warns in the same situation.
_LIVE_GROUPS: weakref.WeakSet[NCCLProcessGroup] = weakref.WeakSet()
_EXIT_HANDLER = threading.Lock()
_exit_registered = False
EXIT_DRAIN = timedelta(seconds=2)


def _register_exit_handler() -> None:
    global _exit_registered
    with _EXIT_HANDLER:
        if not _exit_registered:
            atexit.register(_shutdown_at_exit)
            _exit_registered = True


def _shutdown_at_exit() -> None:
    groups = list(_LIVE_GROUPS)
    if not groups:
        return
    if any(g._comm is not None for g in groups):
        groups[0]._log.warning("plugdist-nccl: destroy_process_group() was not called before "
                               "exit; freeing NCCL communicators now", groups=len(groups))
    for group in groups:
        try:
            group.shutdown(drain=EXIT_DRAIN)
        except Exception:  # noqa: BLE001 - one group's failure must not keep others alive
            pass


