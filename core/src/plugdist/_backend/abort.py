"""``AbortSignal``: how a group's ops learn that the group was aborted.

Every :class:`~plugdist._group.process_group.ProcessGroup` owns one signal; its Works hold it. When
membership learns that a member failed, it fires the signal of every group that member belongs
to: ops issued later fail at once, and a thread blocked waiting on an op is released within
:data:`SLICE` seconds, with the signal's error, however long the group's timeout is. This is
what lets a survivor stop waiting for a peer the transport has not yet noticed is gone.

Backends that block in a native wait they cannot interrupt use :func:`wait_sliced`; backends
that see a failure themselves (a closed socket) keep raising their own error, which
:meth:`AbortSignal.explain` replaces with the rank failure once membership confirms it.
Thread-safe.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from plugdist.errors import DistRankFailureError

__all__ = ["AbortSignal", "SLICE", "wait_sliced"]

SLICE = 0.05  # seconds: how often a blocked wait looks at its group's signal
# how long a transport error waits for membership to name the failed rank before it is raised
# as it is. A killed process's TCPStore connection drops at once, but on a loaded machine the
# store's host and the monitor threads may not run for a second or more (the chaos soak saw
# survivors raise "lost its connection" at 1 s): waiting costs only on the error path, where a
# transport error that is no death is raised that much later. A store that notices deaths
# later says so (Store.hold_will's liveness_timeout)
_CONFIRM_GRACE = 5.0
_EXPLAINED = "_plugdist_explained"  # set on an error explain() returned as it was


class AbortSignal:
    """Fired once, with the reason, when the group is aborted. ``monitored`` says whether a
    membership watches the group (only then is a transport error worth a second look);
    ``confirm_grace`` how long such an error waits for the membership to name the failure
    (membership raises it where its store takes longer to notice a death); ``closing``, set
    by :meth:`close` when the group is shut down, ends that wait: the shutdown failed the op."""

    __slots__ = ("reason", "ranks", "monitored", "confirm_grace", "closing", "_event",
                 "_futures", "_lock")

    def __init__(self) -> None:
        self.reason: str | None = None
        self.ranks: tuple[int, ...] = ()
        self.monitored = False
        self.confirm_grace = _CONFIRM_GRACE
        self.closing = False
        self._event = threading.Event()
        # Works whose future someone holds (DDP, comm hooks, ``then``): fired, they fail too
        self._futures: weakref.WeakSet[Any] = weakref.WeakSet()
        self._lock = threading.Lock()

    @property
    def fired(self) -> bool:
        return self.reason is not None

    def fire(self, reason: str, ranks: tuple[int, ...] = ()) -> None:
        """Abort: ``reason`` says what happened (e.g. "rank 2 died"), ``ranks`` the failed
        global ranks. A later call with more failed ranks updates both (errors raised from then
        on name every failure known); one without is ignored."""
        if self.reason is None or not set(ranks) <= set(self.ranks):
            self.ranks = tuple(sorted(set(self.ranks) | set(ranks)))
            self.reason = reason
            self._event.set()
            with self._lock:
                holders = list(self._futures)
            for work in holders:
                work.abort_future()

    def watch_future(self, work: Any) -> None:
        """Fail ``work``'s future (``work.abort_future()``) when fired: a future's waiter
        (torch's DDP, in C++) cannot be released any other way. Only while monitored."""
        if not self.monitored:
            return
        with self._lock:
            self._futures.add(work)
        if self.reason is not None:
            work.abort_future()

    def error(self, here: str) -> DistRankFailureError:
        """The error for an op at ``here`` (a :func:`~plugdist.errors.where` string)."""
        return DistRankFailureError(f"{here} aborted: {self.reason}", self.ranks)

    def check(self, here: Callable[[], str]) -> None:
        """Raise the abort error if fired (``here`` is formatted only then)."""
        if self.reason is not None:
            raise self.error(here())

    def wait(self, seconds: float) -> bool:
        """Block until fired or ``seconds`` passed; True if fired."""
        return self._event.wait(seconds)

    def close(self) -> None:
        """The group is being shut down: errors of its ops are raised as they are from now
        on (waits in :meth:`explain` end within ``SLICE``). Any thread; idempotent."""
        self.closing = True

    def explain(self, exc: BaseException, here: str) -> BaseException:
        """For an op's error ``exc``: the rank-failure error when the group is (or within
        ``confirm_grace`` seconds becomes) aborted for a failure, else ``exc`` itself — at
        once once the group is closing (:meth:`close`)."""
        if isinstance(exc, DistRankFailureError) or not self.monitored:
            return exc
        # an error explained before (when its Work failed) waited its grace then: a wait on
        # that Work only looks again
        grace = 0.0 if getattr(exc, _EXPLAINED, False) else self.confirm_grace
        deadline = time.monotonic() + grace
        while self.reason is None:
            left = deadline - time.monotonic()
            if self.closing or left <= 0:
                with contextlib.suppress(AttributeError):  # an exception without a __dict__
                    setattr(exc, _EXPLAINED, True)
                return exc
            self._event.wait(min(left, SLICE))
        err = self.error(here)
        err.__cause__ = exc
        return err


def wait_sliced(wait_once: Callable[[float | None], bool], seconds: float | None,
                signal: AbortSignal | None) -> bool:
    """Call ``wait_once(s)`` (block up to ``s`` seconds, True once done) until it returns True
    (then True), ``seconds`` passed (None: no limit; then False), or ``signal`` fired (then
    the caller checks the signal). Without a monitored signal: one call for the whole time."""
    if signal is None or not signal.monitored:
        return wait_once(seconds)
    deadline = None if seconds is None else time.monotonic() + seconds
    while True:
        if signal.fired:
            return False
        step = SLICE if deadline is None else min(SLICE, deadline - time.monotonic())
        if step <= 0:
            return False
        if wait_once(step):
            return True
