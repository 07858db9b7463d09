"""A process's view of the world's membership: the fields every part of it shares, the lock
that guards them, and the queries that read them.

Each process has a stable member id (``uid``): its rank at the first epoch (``"0"``, ``"1"``,
...) or ``"j<n>"`` for the n-th process that asked to join. An *epoch* is one membership of the
world: epoch 0 is the world ``init_process_group`` built; each shrink or grow makes the next.
``members`` are the uids of the current epoch in rank order.

Threading: the fields change on the monitor thread (what the death log says) and on the
caller's (agreement, entering an epoch); ``_lock`` (re-entrant) guards them, and ``_events``,
a condition on the same lock, is notified whenever the monitor learns something a waiting
caller may need. No query here touches the store or blocks, except :meth:`wait_for_failure`,
which waits on ``_events`` up to its timeout.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from plugdist._log import get_logger
from plugdist._resilience.policy import hang_timeout_setting, interval_setting
from plugdist._resilience.writes import MemberWrites, PlainWrites
from plugdist.errors import DistError, DistExcludedError, DistRankFailureError
from plugdist.store import Store
from plugdist.store.api import Will

if TYPE_CHECKING:
    from plugdist._group.process_group import ProcessGroup

__all__ = ["MemberState"]


class MemberState:
    """The shared fields of :class:`plugdist._resilience.membership.Membership` and the
    queries on them. Thread-safe."""

    def __init__(self, store: Store, uid: str, members: Sequence[str], epoch: int = 0,
                 interval: float | None = None, hang_timeout: float | None = None) -> None:
        self.store = store
        self.uid = uid
        self.members: list[str] = list(members)
        self.epoch = epoch
        self.hang_timeout = hang_timeout_setting(hang_timeout)
        self.interval = interval_setting(self.hang_timeout, interval)
        self.failed: dict[str, str] = {}  # uid -> why
        self.excluded_reason: str | None = None  # set when this process is out of the world
        self.admitted = uid in self.members  # a joiner is not, until the members admit it
        self._lock = threading.RLock()
        self._groups: list[tuple[weakref.ref[ProcessGroup], tuple[str, ...]]] = []
        self._seen_deaths = 0  # the death log's entries read so far
        self._last_beat: dict[str, tuple[bytes, float]] = {}
        self._grow_seq = 0
        # processes waiting to join, as of the monitor's last look (every ``interval``)
        self.joiners_waiting = 0
        self._will: Will | None = None
        # how this process writes the world's keys: the store's checked member operations, or
        # plain writes (set in start)
        self._writes: MemberWrites = PlainWrites(store, uid)
        # seconds within which the store's will notices a dead or stalled process; None: it
        # notices deaths only, and heartbeats catch hangs
        self.store_liveness: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._monitor_store: Store | None = None
        # how the monitor waits on the death log: (first entry wanted, seconds) -> entries
        self._reader: Any = None
        self._parked = False  # the reader's wait is long and the will's cancel ends it
        # notified when the monitor learns something agreement may be waiting for
        self._events = threading.Condition(self._lock)
        self._decided: dict[str, dict[str, Any]] = {}  # announced decisions, by key
        self._join_tickets: set[int] = set()  # tickets of processes announced as joining
        self._join_done = 0  # tickets up to this one were admitted or passed over
        self._log = get_logger(rank=self.rank_of(uid) if uid in self.members else -1)

    @property
    def protected(self) -> bool:
        """Whether the store owns this world's membership keys (no client can forge them)."""
        return bool(self._writes.protected)

    @property
    def writes(self) -> MemberWrites:
        """How this process writes the keys only a world's members may write: the store's
        checked member operations where it owns membership (keys relative to the world's
        root), else the store's plain ones."""
        return self._writes

    def rank_of(self, uid: str) -> int:
        """``uid``'s rank in the current epoch, or -1."""
        try:
            return self.members.index(uid)
        except ValueError:
            return -1

    @property
    def rank(self) -> int:
        return self.rank_of(self.uid)

    def failed_ranks(self, uids: Iterable[str] | None = None) -> list[int]:
        """Current-epoch ranks of the failed members among ``uids`` (default: everyone)."""
        with self._lock:
            pool = self.members if uids is None else uids
            return sorted(r for r in (self.rank_of(u) for u in pool if u in self.failed)
                          if r >= 0)

    def uids_of(self, ranks: Iterable[int]) -> tuple[str, ...]:
        return tuple(self.members[r] for r in ranks)

    def describe(self, dead: Sequence[str]) -> str:
        """Which ranks failed and how, and what to do."""
        parts = []
        for u in dead:
            r = self.rank_of(u)
            who = f"rank {r}" if r >= 0 else f"member {u}"
            parts.append(f"{who} {self.failed.get(u, 'failed')}")
        return (f"{'; '.join(parts)}. Call plugdist.shrink_group() on every survivor to continue "
                f"without {'it' if len(dead) == 1 else 'them'}")

    def first_failure(self, uids: Sequence[str]) -> DistError | None:
        """The error to raise when one of ``uids`` is known to have failed (or this process was
        excluded); None while they all live. Does not block."""
        with self._lock:
            dead = [u for u in uids if u in self.failed]
            if dead:
                return DistRankFailureError(f"[rank {self.rank}] {self.describe(dead)}",
                                            self.failed_ranks(dead))
            if self.excluded_reason is not None:
                return self._excluded_error()
            return None

    def wait_for_failure(self, uids: Sequence[str], timeout: float) -> DistError | None:
        """Block up to ``timeout`` seconds until one of ``uids`` is known to have failed:
        :meth:`first_failure`'s error then, else None. Wakes as soon as the monitor learns."""
        deadline = time.monotonic() + timeout
        with self._events:
            while True:
                err = self.first_failure(uids)
                left = deadline - time.monotonic()
                if err is not None or left <= 0:
                    return err
                self._events.wait(left)

    def _excluded_error(self) -> DistError:
        return DistExcludedError(f"[member {self.uid}] {self.excluded_reason}")

    def _abort_affected(self) -> None:
        """Abort the watched groups that hold a failed member, or all of them when this process
        is out of the world (see ``Membership.watch``)."""
        with self._lock:
            groups = [(r(), u) for r, u in self._groups]
            failed = dict(self.failed)
            excluded = self.excluded_reason
        for pg, uids in groups:
            if pg is None:
                continue
            if excluded is not None:
                pg.abort(excluded)
                continue
            dead = [u for u in uids if u in failed]
            if dead:
                ranks = tuple(self.failed_ranks(dead))
                pg.abort(self.describe(dead), ranks)
