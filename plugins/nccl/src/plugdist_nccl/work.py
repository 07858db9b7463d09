"""``NCCLWork``: a Work whose op runs on a CUDA stream.

Stream semantics (as torch.distributed's NCCL backend): the op was queued on the group's internal
stream after everything already queued on the caller's current stream. ``wait()`` makes the
caller's *current* stream wait for the op's CUDA event and returns without blocking the host, so
later work on that stream sees the result; work on another stream must wait for that stream
(``s.wait_stream(torch.cuda.current_stream())``). With ``NCCL_BLOCKING_WAIT=1`` (and for a
barrier) ``wait()`` blocks the host until the op finished, raising ``DistTimeoutError`` after the
timeout. ``is_completed()`` asks the CUDA event. The future (``get_future()``, ``then()``) is
completed by the group's watchdog thread once the event fired: callbacks run on that thread,
after the GPU finished, with the group's device current.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from plugdist.errors import DistTimeoutError
from plugdist.work import Work

__all__ = ["NCCLWork"]


class NCCLWork(Work):
    """Handle on an op queued on an NCCL stream. Thread-safe.

    ``tensors`` (inputs, outputs, temporaries) are referenced until the op finished, so the
    caching allocator cannot hand their memory to other work while NCCL still uses it.
    """

    def __init__(self, *, device: torch.device, blocking: bool, tensors: list[torch.Tensor],
                 flush: Callable[[], None], on_timeout: Callable[[NCCLWork], BaseException],
                 result: Any, **context: Any) -> None:
        super().__init__(**context)
        self.device = device
        self.blocking = blocking
        self.issued_at = time.monotonic()
        self._event: torch.cuda.Event | None = None
        self._tensors: list[torch.Tensor] | None = tensors
        self._flush = flush
        self._on_timeout = on_timeout
        self._value = result

    # -- for the process group and its watchdog ---------------------------------------------------
    def enqueued(self, event: torch.cuda.Event) -> None:
        """The op is on the stream; ``event`` fires when it finished."""
        self.issued_at = time.monotonic()
        self._event = event

    def gpu_done(self) -> bool:
        return self._event is not None and self._event.query()

    def finish(self) -> None:
        """Called by the watchdog when the event fired: release tensors, complete the future."""
        self._tensors = None
        if not self._future.done():
            self.set_result(self._value)

    def fail(self, exc: BaseException) -> None:
        self._tensors = None
        if not self._future.done():
            self.set_exception(exc)

    # -- the user-facing contract --------------------------------------------------------------
    def wait(self, timeout: timedelta | float | None = None) -> bool:
        """Order the caller's current stream after the op (host does not block), or, in blocking
        mode, block until the op finished. Raises the op's error, or DistTimeoutError."""
        self._flush()
        exc = self.exception()
        if exc is not None:
            raise exc
        if self._event is None:  # never queued and not failed: only a broken invariant gets here
            raise DistTimeoutError(f"{self._where()} was never queued on the GPU")
        if self.blocking:
            self._block(timeout)
        torch.cuda.current_stream(self.device).wait_event(self._event)
        exc = self.exception()
        if exc is not None:
            raise exc
        return True

    def _block(self, timeout: timedelta | float | None) -> None:
        seconds = self._seconds(timeout)
        deadline = time.monotonic() + (seconds if seconds is not None else float("inf"))
        pause = 1e-5
        while not self.gpu_done():
            exc = self.exception()
            if exc is not None:
                raise exc
            if time.monotonic() > deadline:
                raise self._on_timeout(self)
            time.sleep(pause)
            pause = min(pause * 2, 2e-3)

    def is_completed(self) -> bool:
        """True once the op finished on the GPU (or failed)."""
        self._flush()
        return self._future.done() or self.gpu_done()

    def is_success(self) -> bool:
        return self.is_completed() and self.exception() is None

    def get_future(self) -> torch.futures.Future:
        """Completed with the output tensors once the GPU finished (by the watchdog thread)."""
        self._flush()
        return self._future

    def result(self) -> Any:
        """The output tensors; blocks the host until the op finished on the GPU."""
        self.wait()
        Work.wait(self)
        return self._future.value()

