"""The watchdog: one thread per group that completes Works as their CUDA events fire, watches
for NCCL's asynchronous errors and, with ``NCCL_ASYNC_ERROR_HANDLING``, for ops that outlive the
group's timeout.

Ops of a group run in order on one stream, so only the oldest in-flight Work needs watching. The
thread sleeps on a condition while nothing is in flight and polls with a short back-off while
something is (a CUDA event cannot be waited on with a timeout).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

import torch

from .work import NCCLWork

__all__ = ["Watchdog"]

_MAX_PAUSE = 2e-3
_ERROR_CHECK_EVERY = 0.1  # seconds between ncclCommGetAsyncError calls


class Watchdog:
    """Tracks in-flight Works of one group. ``check_error()`` returns NCCL's asynchronous error
    or None; ``on_error(exc)`` / ``on_timeout(work)`` are called on the watchdog thread."""

    def __init__(self, name: str, device: torch.device, timeout_s: float | None,
                 check_error: Callable[[], BaseException | None],
                 on_error: Callable[[BaseException], None],
                 on_timeout: Callable[[NCCLWork], None]) -> None:
        self._inflight: collections.deque[NCCLWork] = collections.deque()
        self._cond = threading.Condition()
        self._stopped = False
        self._device = device
        self._timeout_s = timeout_s
        self._check_error = check_error
        self._on_error = on_error
        self._on_timeout = on_timeout
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def track(self, work: NCCLWork) -> None:
        with self._cond:
            self._inflight.append(work)
            self._cond.notify()

    def drain(self) -> list[NCCLWork]:
        """Remove and return every in-flight Work (to fail them after an abort)."""
        with self._cond:
            works = list(self._inflight)
            self._inflight.clear()
            return works

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        # callbacks chained on completed futures run here and may launch kernels
        torch.cuda.set_device(self._device)
        pause = 1e-5
        last_check = 0.0
        while True:
            with self._cond:
                while not self._inflight and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                head = self._inflight[0]
            now = time.monotonic()
            if now - last_check > _ERROR_CHECK_EVERY:
                last_check = now
                err = self._check_error()
                if err is not None:
                    self._on_error(err)
                    continue
            if head.gpu_done():
                with self._cond:
                    if self._inflight and self._inflight[0] is head:
                        self._inflight.popleft()
                head.finish()
                pause = 1e-5
                continue
            if self._timeout_s is not None and now - head.issued_at > self._timeout_s:
                self._on_timeout(head)
                continue
            time.sleep(pause)
            pause = min(pause * 2, _MAX_PAUSE)
