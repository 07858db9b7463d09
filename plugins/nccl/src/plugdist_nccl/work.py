"""``NCCLWork``: a Work whose op runs on a CUDA stream.

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
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Protocol

import torch
from plugdist.errors import DistTimeoutError
from plugdist.work import Work

__all__ = ["NCCLWork", "GpuEvent"]


class GpuEvent(Protocol):
    """What a Work needs of its CUDA event."""

    def query(self) -> bool: ...


class NCCLWork(Work):
    """Handle on an op queued (or being queued) on an NCCL stream. Thread-safe.

    ``tensors`` (inputs, outputs, temporaries) are referenced until the op finished, so the
    caching allocator cannot hand their memory to other work while NCCL still uses it. The
    future is settled at most once (:meth:`finish` or :meth:`fail`, whichever comes first).
    """

    def __init__(self, *, device: torch.device, blocking: bool, tensors: list[torch.Tensor],
                 flush: Callable[[], None],
                 on_timeout: Callable[[NCCLWork, float], BaseException],
                 result: Any, **context: Any) -> None:
        super().__init__(**context)
        self.device = device
        self.blocking = blocking
        self.issued_at = time.monotonic()
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

    def enqueued(self, event: GpuEvent) -> None:
        """The op is on the stream; ``event`` fires when it finished."""
        self.issued_at = time.monotonic()
        self._event = event

    def gpu_done(self) -> bool:
        """Whether the op's event fired (may raise a CUDA error)."""
        return self._event is not None and self._event.query()

    def settled(self) -> bool:
        return self._settled

    def finish(self) -> None:
        """The event fired: release the tensors and complete the future (unless it already was
        settled). Callbacks chained on the future run here."""
        if self._settle():
            self.set_result(self._value)

    def fail(self, exc: BaseException) -> None:
        """Fail the future with ``exc`` (unless it already was settled)."""
        if self._settle():
            self.set_exception(exc)

    def finish_or_fail(self, exc: BaseException) -> None:
        """After a failure or shutdown: finish if the GPU finished the op, else fail (``exc``)."""
        try:
            done = self.gpu_done()
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
        try:
            if not self._settled and self.gpu_done():
                self.finish()
        except Exception:  # noqa: BLE001 - reported by the watchdog
            pass
        return self._settled

    # -- the user-facing contract --------------------------------------------------------------
    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """Order the caller's current stream after the op (the host does not block); with
        ``timeout``, in blocking mode, or for a barrier, block the host until the op finished.
        Raises the op's error, or DistTimeoutError."""
        self._flush()
        exc = self.exception()
        if exc is not None:
            raise exc
        if self.blocking or timeout is not None:
            self._block(timeout)
        if self._event is None:  # never queued and not failed: only a broken invariant gets here
            raise DistTimeoutError(f"{self._where()} was never queued on the GPU")
        torch.cuda.current_stream(self.device).wait_event(self._event)  # type: ignore[arg-type]
        exc = self.exception()
        if exc is not None:
            raise exc
        return True

    def _block(self, timeout: timedelta | float | None) -> None:
        seconds = self._seconds(timeout)
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
        return self._poll() or self._future.done()

    def is_success(self) -> bool:
        return self.is_completed() and self.exception() is None

    def get_future(self) -> torch.futures.Future:
        """Completed with the output tensors once the GPU finished (by whoever sees it first)."""
        self._flush()
        self._poll()
        return self._future

    def result(self) -> Any:
        """The output tensors; blocks the host until the op finished on the GPU."""
        self._flush()
        self._block(None)
        return self._future.value()
