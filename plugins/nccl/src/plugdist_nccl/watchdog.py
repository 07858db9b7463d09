"""The watchdog: one thread per group that completes Works as their CUDA events fire, polls NCCL
for asynchronous errors, and bounds ops that outlive the group's timeout.

Ops of a group run in order on one stream, so only the oldest tracked Work needs watching. A Work
is tracked *before* its NCCL calls are made, so a host-side NCCL call that never returns (e.g.
``ncclGroupEnd`` waiting for a peer) is bounded too. The thread sleeps on a condition while
nothing is tracked and polls with a short back-off while something is (a CUDA event cannot be
waited on with a timeout). It survives anything its callbacks or the CUDA queries raise: the error
is handed to ``on_error``, so no future is left pending because the thread died.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

from .work import NCCLWork

__all__ = ["Watchdog"]

_MAX_PAUSE = 2e-3
_ERROR_CHECK_EVERY = 0.1  # seconds between ncclCommGetAsyncError calls


class Watchdog:
    """Tracks the in-flight Works of one group on a daemon thread.

    ``check_error()`` returns NCCL's asynchronous error or None; ``on_error(exc)`` and
    ``on_timeout(work)`` run on the watchdog thread and are expected to end the group (they
    call :meth:`stop`). ``op_timeout_s`` bounds an op once queued on the GPU, ``launch_timeout_s``
    the host while it is being queued (None: unbounded). ``on_start`` runs first on the thread.
    """

    def __init__(self, name: str, *, on_start: Callable[[], None],
                 check_error: Callable[[], BaseException | None],
                 on_error: Callable[[BaseException], None],
                 on_timeout: Callable[[NCCLWork], None],
                 op_timeout_s: float | None, launch_timeout_s: float | None) -> None:
        self._inflight: collections.deque[NCCLWork] = collections.deque()
        self._cond = threading.Condition()
        self._stopped = False
        self._on_start = on_start
        self._check_error = check_error
        self._on_error = on_error
        self._on_timeout = on_timeout
        self._op_timeout_s = op_timeout_s
        self._launch_timeout_s = launch_timeout_s
        self._reported: NCCLWork | None = None  # the head already handed to on_timeout
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def stopped(self) -> bool:
        return self._stopped

    def track(self, work: NCCLWork) -> None:
        with self._cond:
            self._inflight.append(work)
            self._cond.notify()

    def drain(self) -> list[NCCLWork]:
        """Remove and return every tracked Work (to settle them after a failure or shutdown)."""
        with self._cond:
            works = list(self._inflight)
            self._inflight.clear()
            return works

    def stop(self, join: bool = True) -> None:
        """End the thread: no more completions, error checks or timeouts. Idempotent; from
        another thread it also waits (up to 5 s) for the thread to end."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if join and threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        try:
            self._on_start()  # callbacks chained on completed futures may launch kernels
        except BaseException as exc:  # noqa: BLE001 - reported like any other failure
            self._report(exc)
        pause = 1e-5
        last_check = time.monotonic()
        while True:
            with self._cond:
                while not self._inflight and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                head = self._inflight[0]
            try:
                now = time.monotonic()
                if now - last_check > _ERROR_CHECK_EVERY:
                    last_check = now
                    err = self._check_error()
                    if err is not None and not self._stopped:
                        self._on_error(err)
                        continue
                if head.settled() or head.gpu_done():
                    with self._cond:
                        if self._inflight and self._inflight[0] is head:
                            self._inflight.popleft()
                    head.finish()
                    pause = 1e-5
                    continue
                limit = self._op_timeout_s if head.launched else self._launch_timeout_s
                if limit is not None and head is not self._reported \
                        and now - head.issued_at > limit:
                    self._reported = head
                    self._on_timeout(head)
                    continue
            except BaseException as exc:  # noqa: BLE001 - e.g. a sticky CUDA error in query()
                self._report(exc)
                continue
            time.sleep(pause)
            pause = min(pause * 2, _MAX_PAUSE)

    def _report(self, exc: BaseException) -> None:
        """Hand ``exc`` to ``on_error``; if even that fails, fail the tracked Works here and stop,
        so nobody waits on a future this thread would never complete."""
        try:
            self._on_error(exc)
        except BaseException as second:  # noqa: BLE001 - last resort
            second.__context__ = exc
            for work in self.drain():
                work.fail(second)
            self.stop(join=False)
