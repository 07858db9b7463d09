"""The watchdog: one thread per group that completes Works as their CUDA events fire, polls NCCL
for asynchronous errors, and bounds ops that outlive the group's timeout.

It tracks *launches*: a Work, or the lighter record of a synchronous op that has no Work
(:class:`~plugdist_nccl.work.Launch`). Ops of a group run in order, so only the oldest tracked
launch needs watching. A launch is tracked *before* its NCCL calls are made, so a host-side NCCL
call that never returns (e.g. ``ncclGroupEnd`` waiting for a peer) is bounded too. Tracking is
one deque append, with no lock unless the thread sleeps. The thread sleeps while nothing is
tracked and polls with a short back-off while something is (a CUDA event cannot be waited on
with a timeout); ops captured in CUDA graphs are polled through their
:class:`~plugdist_nccl.replays.ReplayWatch` every ``REPLAY_POLL`` seconds. The thread runs in
the relaxed capture mode, so its event queries never disturb a capture on another thread. It
survives anything its callbacks or the CUDA queries raise: the error is handed to ``on_error``,
so no future is left pending because the thread died.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Protocol

from .replays import LateReplay, ReplayWatch

__all__ = ["Watchdog", "Tracked", "REPLAY_POLL"]

_MAX_PAUSE = 2e-3
_ERROR_CHECK_EVERY = 0.1  # seconds between ncclCommGetAsyncError calls
REPLAY_POLL = 0.1  # seconds between looks at the replays of captured ops


class Tracked(Protocol):
    """What the watchdog needs of a launch (a Work, or a synchronous op's record)."""

    issued_at: float
    # someone may be waiting on its future (a Work): poll it with a short back-off. A
    # synchronous op's record is not: polling it less often keeps this thread off the GIL
    urgent: bool

    @property
    def launched(self) -> bool: ...

    def settled(self) -> bool: ...

    def gpu_done(self) -> bool: ...

    def finish(self) -> None: ...

    def finish_or_fail(self, exc: BaseException) -> None: ...


class Watchdog:
    """Tracks the in-flight Works of one group on a daemon thread.

    ``check_error()`` returns NCCL's asynchronous error or None; ``on_error(exc)``,
    ``on_timeout(launch)`` and ``on_late_replay(late)`` run on the watchdog thread and are
    expected to end the group (they call :meth:`stop`). ``op_timeout_s`` bounds an op once
    queued on the GPU (and each replay of a captured op), ``launch_timeout_s`` the host while it
    is being queued (None: unbounded). ``on_start`` runs first on the thread.
    """

    def __init__(self, name: str, *, on_start: Callable[[], None],
                 check_error: Callable[[], BaseException | None],
                 on_error: Callable[[BaseException], None],
                 on_timeout: Callable[[Tracked], None],
                 op_timeout_s: float | None, launch_timeout_s: float | None,
                 replays: ReplayWatch | None = None,
                 on_late_replay: Callable[[LateReplay], None] | None = None) -> None:
        self._inflight: collections.deque[Tracked] = collections.deque()
        self._cond = threading.Condition()
        self._idle = False  # the thread sleeps on _cond: a tracker must notify it
        self._stopped = False
        self._replays = replays
        self._on_late_replay = on_late_replay
        self._on_start = on_start
        self._check_error = check_error
        self._on_error = on_error
        self._on_timeout = on_timeout
        self._op_timeout_s = op_timeout_s
        self._launch_timeout_s = launch_timeout_s
        self._reported: Tracked | None = None  # the head already handed to on_timeout
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def stopped(self) -> bool:
        return self._stopped

    def track(self, launch: Tracked) -> None:
        """Watch ``launch`` (any thread). No lock unless the thread sleeps: it marks itself idle
        before it last looks at the deque, and this appends before it looks at the mark, so one
        of the two always sees the other."""
        self._inflight.append(launch)
        if self._idle:
            with self._cond:
                self._cond.notify()

    def pending(self) -> int:
        """How many tracked launches the thread has not settled yet."""
        return len(self._inflight)

    def watch_replays(self) -> None:
        """Captured ops now exist: wake the thread so that it starts polling their replays."""
        with self._cond:
            self._cond.notify()

    def drain(self) -> list[Tracked]:
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

    def _sleep_while_idle(self) -> bool:
        """Block until something is tracked, the next replay poll is due, or stop; False once
        stopped."""
        with self._cond:
            self._idle = True
            try:
                while not self._inflight and not self._stopped:
                    if self._replays is not None and len(self._replays):
                        self._cond.wait(REPLAY_POLL)
                        return not self._stopped
                    self._cond.wait()
            finally:
                self._idle = False
            return not self._stopped

    def _poll_replays(self, now: float) -> None:
        replays, limit = self._replays, self._op_timeout_s
        if replays is None or limit is None or self._on_late_replay is None:
            return
        for late in replays.late(now, limit):
            if self._stopped:
                return
            self._on_late_replay(late)

    def _run(self) -> None:
        try:
            self._on_start()  # callbacks chained on completed futures may launch kernels
        except BaseException as exc:  # noqa: BLE001 - reported like any other failure
            self._report(exc)
        pause = 1e-5
        last_check = last_replay_poll = time.monotonic()
        while True:
            if not self._inflight and not self._sleep_while_idle():
                return
            if self._stopped:
                return
            try:
                now = time.monotonic()
                watching_replays = self._replays is not None and len(self._replays) > 0
                if watching_replays and now - last_replay_poll > REPLAY_POLL:
                    last_replay_poll = now
                    self._poll_replays(now)
                if (self._inflight or watching_replays) and now - last_check > _ERROR_CHECK_EVERY:
                    last_check = now
                    err = self._check_error()
                    if err is not None and not self._stopped:
                        self._on_error(err)
                        continue
                if not self._inflight:
                    continue
                head = self._inflight[0]
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
            pause = min(pause * 2, _MAX_PAUSE) if head.urgent else _MAX_PAUSE

    def _report(self, exc: BaseException) -> None:
        """Hand ``exc`` to ``on_error``; if even that fails, fail the tracked Works here and stop,
        so nobody waits on a future this thread would never complete."""
        try:
            self._on_error(exc)
        except BaseException as second:  # noqa: BLE001 - last resort
            second.__context__ = exc
            for launch in self.drain():
                launch.finish_or_fail(second)
            self.stop(join=False)
