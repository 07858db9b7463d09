"""``NCCLWork``: a Work whose op runs on a CUDA stream; ``Launch``: what the watchdog follows of
a synchronous op, which has no Work.

Stream semantics (as torch.distributed's NCCL backend): the op was queued on the group's internal
stream after everything already queued on the caller's current stream. ``wait()`` makes the
caller's *current* stream wait for the op's CUDA event and returns without blocking the host, so
later work on that stream sees the result; work on another stream must wait for that stream
(``s.wait_stream(torch.cuda.current_stream())``). ``wait(timeout=...)``, a barrier, and every wait
under ``NCCL_BLOCKING_WAIT=1`` block the host until the op finished, raising DistTimeoutError
after the timeout. ``is_completed()`` asks the CUDA event. The future (``get_future()``,
``then()``) is completed as soon as anyone sees the event fired: the group's watchdog thread, or a
caller of ``is_completed()``, ``get_future()`` or a blocking ``wait()``; callbacks run on that
thread, after the GPU finished.

An op captured in a CUDA graph runs at each replay, not now: its Work only orders streams inside
the capture (``wait()``, never blocking the host); asking whether it completed, its future or
its result raises, and the watchdog covers its replays instead (see :mod:`plugdist_nccl.replays`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

import torch
from plugdist.backend import Work
from plugdist.errors import DistBackendError, DistTimeoutError

from .cuda import EventPool, current_stream, event_done, runtime

__all__ = ["NCCLWork", "GpuEvent", "RawEvent", "Launch"]


class GpuEvent(Protocol):
    """What a Work needs of its CUDA event."""

    def query(self) -> bool: ...

    def wait_on(self, stream: int) -> None: ...

    def release(self) -> None: ...


class RawEvent:
    """A pooled CUDA event recorded after an op (shared by the Works of one launch). Released
    to its pool once, when the first of them finished: a Work whose op finished never waits
    on its event again, and waiting on an event re-recorded for a later op could only wait
    longer, never too little."""

    __slots__ = ("handle", "_pool")

    def __init__(self, handle: int, pool: EventPool) -> None:
        self.handle = handle
        self._pool: EventPool | None = pool

    def query(self) -> bool:
        return event_done(self.handle)

    def wait_on(self, stream: int) -> None:
        runtime().streamWaitEvent(stream, self.handle, 0)

    def release(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.give(self.handle)


class Launch:
    """A synchronous op queued on the caller's stream (no Work, no future): the watchdog's
    record of it. ``event`` is 0 until the op's NCCL calls returned and its event was
    recorded; the pooled event goes back to the pool when the watchdog settles the launch."""

    __slots__ = ("op", "_where_in", "device", "issued_at", "event", "_pool", "_settled")
    urgent = False  # no future: the watchdog polls it at its slowest pace

    def __init__(self, op: str, where: Callable[[str], str], device: torch.device,
                 pool: EventPool) -> None:
        self.op = op
        self._where_in = where  # the group's ``where``
        self.device = device
        self.issued_at = time.monotonic()
        self.event = 0
        self._pool = pool
        self._settled = False

    @property
    def launched(self) -> bool:
        return self.event != 0

    def enqueued(self, event: int) -> None:
        self.issued_at = time.monotonic()
        self.event = event

    def settled(self) -> bool:
        return self._settled

    def gpu_done(self) -> bool:
        return self.event != 0 and event_done(self.event)

    def finish(self) -> None:
        if not self._settled:
            self._settled = True
            if self.event:
                self._pool.give(self.event)

    def finish_or_fail(self, exc: BaseException) -> None:
        self.finish()  # nobody waits on a launch: the group reports its failure

    def abandon(self) -> None:
        """The NCCL calls failed: nothing to watch (the event, if taken, was not recorded)."""
        self._settled = True

    def where(self) -> str:
        return self._where_in(self.op)


class NCCLWork(Work):
    """Handle on an op queued (or being queued) on an NCCL stream. Thread-safe.

    ``tensors`` (inputs, outputs, temporaries) are referenced until the op finished, so the
    caching allocator cannot hand their memory to other work while NCCL still uses it. The
    future is settled at most once (:meth:`finish` or :meth:`fail`, whichever comes first).
    """

    urgent = True  # its future may have waiters: the watchdog polls it with a short back-off

    def __init__(self, *, device: torch.device, blocking: bool, tensors: list[torch.Tensor],
                 flush: Callable[[], None],
                 on_timeout: Callable[[NCCLWork, float], BaseException],
                 result: Any, **context: Any) -> None:
        super().__init__(**context)
        self.device = device
        self.blocking = blocking
        self.issued_at = time.monotonic()
        self.captured = False
        self._finished = False
        self._event: GpuEvent | None = None
        self._tensors: list[torch.Tensor] | None = tensors
        self._flush = flush
        self._on_timeout = on_timeout
        self._value = result
        self._settle_lock = threading.Lock()
        self._settled = False

    # -- for the process group and its watchdog ---------------------------------------------------
    @property
    def launched(self) -> bool:
        """Whether the op's NCCL calls returned and its event was recorded."""
        return self._event is not None

    def enqueued(self, event: GpuEvent, captured: bool = False) -> None:
        """The op is on the stream; ``event`` fires when it finished. ``captured``: it was
        captured into a CUDA graph (it runs at replays; nobody may query the event)."""
        self.issued_at = time.monotonic()
        self.captured = captured
        self._event = event

    def gpu_done(self) -> bool:
        """Whether the op's event fired (may raise a CUDA error)."""
        if self.captured:
            raise self._captured_error("its completion")
        return self._event is not None and self._event.query()

    def settled(self) -> bool:
        return self._settled

    def finish(self) -> None:
        """The event fired: release the tensors and complete the future (unless it already was
        settled). Callbacks chained on the future run here."""
        if self._settle():
            self._finished = True
            event = self._event
            if event is not None and not self.captured:
                event.release()
            self.set_result(self._value)

    def fail(self, exc: BaseException) -> None:
        """Fail the future with ``exc`` (unless it already was settled)."""
        if self._settle():
            self.set_exception(exc)

    def finish_or_fail(self, exc: BaseException) -> None:
        """After a failure or shutdown: finish if the GPU finished the op, else fail (``exc``)."""
        try:
            done = not self.captured and self.gpu_done()
        except Exception:  # noqa: BLE001 - a broken CUDA context: the op did not finish for us
            done = False
        self.finish() if done else self.fail(exc)

    def _settle(self) -> bool:
        with self._settle_lock:
            if self._settled:
                return False
            self._settled = True
        self._tensors = None
        return True

    def _poll(self) -> bool:
        """Complete the future now if the event fired; True once settled. A CUDA error from the
        event is left to the watchdog, which fails the group's works with it."""
        if self.captured:
            raise self._captured_error("whether it completed")
        try:
            if not self._settled and self.gpu_done():
                self.finish()
        except Exception:  # noqa: BLE001 - reported by the watchdog
            pass
        return self._settled

    def _captured_error(self, what: str) -> DistBackendError:
        return DistBackendError(
            f"{self.where()} was captured in a CUDA graph: it runs at each replay of the "
            f"graph, so {what} cannot be asked of this Work; wait() inside the capture orders "
            f"your stream after it, and the group's watchdog bounds each replay by the group "
            f"timeout")

    # -- the user-facing contract --------------------------------------------------------------
    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """Order the caller's current stream after the op (the host does not block); with
        ``timeout``, in blocking mode, or for a barrier, block the host until the op finished
        (not for an op captured in a CUDA graph: that only orders the stream). Raises the op's
        error, or DistTimeoutError."""
        self._flush()
        exc = self.exception()
        if exc is not None:
            raise exc
        if (self.blocking or timeout is not None) and not self.captured:
            self._block(timeout)
        if self._finished:
            return True  # done on the GPU: nothing left to order after
        event = self._event
        if event is None:  # never queued and not failed: only a broken invariant gets here
            raise DistTimeoutError(f"{self.where()} was never queued on the GPU")
        event.wait_on(current_stream(self.device.index))
        exc = self.exception()
        if exc is not None:
            raise exc
        return True

    def synchronize(self) -> None:
        """Order the caller's current stream after the op, as ``wait()`` does (which blocks
        the host too in blocking mode or for a barrier)."""
        self.wait()

    def _block(self, timeout: timedelta | float | None) -> None:
        seconds = self.timeout_seconds(timeout)
        deadline = time.monotonic() + (seconds if seconds is not None else float("inf"))
        pause = 1e-5
        while not self._poll():
            if time.monotonic() > deadline:
                raise self._on_timeout(self, seconds or 0.0)
            time.sleep(pause)
            pause = min(pause * 2, 2e-3)
        exc = self.exception()
        if exc is not None:
            raise exc

    def is_completed(self) -> bool:
        """True once the op finished on the GPU (or failed); completes the future then."""
        self._flush()
        return self._poll() or self.future.done()

    def exception(self) -> BaseException | None:
        if self.captured and not self._settled:
            return None  # a captured op fails only at a replay, which the watchdog reports
        return super().exception()

    def is_success(self) -> bool:
        return self.is_completed() and self.exception() is None

    def get_future(self) -> torch.futures.Future:
        """Completed with the output tensors once the GPU finished (by whoever sees it first)."""
        self._flush()
        if self.captured:
            raise self._captured_error("a future")
        self._poll()
        return self.future

    def result(self) -> Any:
        """The output tensors; blocks the host until the op finished on the GPU."""
        self._flush()
        if self.captured:
            raise self._captured_error("its result")
        self._block(None)
        return self.future.value()
