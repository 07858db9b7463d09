"""Membership: who is in the world, who has failed, who waits to join, and the epoch record the
survivors agree on. Knows nothing of any backend; everything goes through the world's store.

Each process has a stable member id (``uid``): its rank at the first epoch (``"0"``, ``"1"``,
...) or ``"j<n>"`` for the n-th process that asked to join. An *epoch* is one membership of the
world: epoch 0 is the world ``init_process_group`` built; each shrink or grow makes the next,
whose members (uids, in rank order) are written once, by compare-and-set, so every survivor
reads the same list.

Liveness, off the hot path, on one monitor thread per process, at O(1) cost per member:

* **Death and hang, decided by the store**: a will left with the store (``Store.hold_will``
  with ``ttl=hang_timeout``) appends this member's uid to the death log the moment its process
  dies (the store sees the connection drop) or stops renewing it for the ttl (a stopped or hung
  process; a TCPStore client renews with one 5-byte frame a quarter ttl, an etcd lease is
  renewed by its own thread). No member reads another's heartbeat. The monitor parks one wait
  on the death log (on the will's own connection where the store offers ``read_log`` there),
  so a death wakes every member with one message each, and an idle world costs nothing more.
* **Fallback for small worlds**: a store whose will has no ttl (``liveness_timeout`` None) or
  that has no wills (a FileStore, a HashStore, a third party's): every member bumps a heartbeat
  counter each ``interval`` and reads every other member's; a member whose counter has not
  moved for ``hang_timeout`` is declared failed by the first member to notice, in the same
  death log. That is N^2 reads per interval: fine for tens of members, not for thousands.

The death log is the world's event log: besides deaths it carries ``joining`` records (a
process waits to be admitted) and ``decided`` records (an agreement's outcome is written), so
members learn of both from the wait they already hold, without polling.

When the monitor learns of a failure it aborts (``ProcessGroup.abort``) every group it watches
that holds the failed member, so blocked ops are released with ``DistRankFailureError`` at once.

Agreement (``agree_shrink`` with no exclusions): each survivor appends its uid to the epoch's
arrival log; the first surviving member in rank order (the coordinator) reads that log with
parked waits until every member it does not know failed has arrived, writes the decision
(one compare-and-set; a member that sees the coordinator fail takes over), and announces it in
the death log. The others wait for that announcement: O(N) messages in all.

Store keys (under the world's store; names in :mod:`plugdist.store._worldkeys`):
``plugdist/live/deaths[/n]``, ``plugdist/live/hb/<uid>`` (fallback only),
``plugdist/live/declared/<uid>``, ``plugdist/live/trim``, ``plugdist/epoch/current``,
``plugdist/epoch/forgotten``, ``plugdist/epoch/<e>/...`` (agreement, and how far each member had
read the death log when it entered; removed two epochs later), ``plugdist/join/...``.

Who writes them: where the store owns membership (``Store.claim_member``: a TCPStore), this
process holds its identity with the store, which writes its death itself, takes join tickets
itself, and checks every other write (``_writes``, the member session) against the world's
current members; a stranger, or a stray process of another job, cannot write any of them.
Elsewhere (etcd, a FileStore, a third party's store) membership writes them with the store's
plain operations (:class:`_PlainWrites`): the store's own access control is all that guards
them. A death-log record that cannot be read is logged and skipped, never the end of the log.

What the members no longer need is deleted as epochs go by (``Membership._trim``, by the first
rank of each new epoch): the death log's entries that every member had read when it entered the
previous epoch and that came before every waiting joiner's start, the claims and heartbeats of
the members those entries record as failed, and the join tickets decided before the last trim.
A process that is no longer a member may find its next entry gone: it skips to what is left.
"""

from __future__ import annotations

import json
import os
import threading
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from plugdist._log import get_logger, lifecycle
from plugdist.errors import (
    DistError,
    DistExcludedError,
    DistRankFailureError,
    DistStoreError,
    DistTimeoutError,
    WorldClosedError,
    timed_out,
)
from plugdist.store import PrefixStore, Store
from plugdist.store._worldkeys import CLOSED, CURRENT, DEATHS, epoch_key
from plugdist.store._worldkeys import DECLARED as _DECLARED
from plugdist.store._worldkeys import FORGOTTEN as _FORGOTTEN
from plugdist.store._worldkeys import HEARTBEATS as _HB
from plugdist.store._worldkeys import JOIN as _JOIN
from plugdist.store._worldkeys import NO_TRIM as _NO_TRIM
from plugdist.store._worldkeys import TRIM as _TRIM

if TYPE_CHECKING:
    from plugdist._group.process_group import ProcessGroup

__all__ = ["Membership", "Decision", "WorldClosedError", "GuardedPrefixStore", "request_join",
           "group_prefix", "INTERVAL_ENV", "HANG_TIMEOUT_ENV", "RESILIENCE_ENV",
           "resilience_mode", "off_hint"]

RESILIENCE_ENV = "PLUGDIST_RESILIENCE"
INTERVAL_ENV = "PLUGDIST_HEARTBEAT_INTERVAL"
HANG_TIMEOUT_ENV = "PLUGDIST_HEARTBEAT_TIMEOUT"

_POLL = 0.05  # seconds between looks at the store while agreeing, where nothing wakes us
_kept_wills: list[Any] = []  # wills of stopped members left to run at this process's exit
_COORDINATOR_SLICE = 0.25  # longest wait of the coordinator on the arrival log at a time
# longest wait of a non-coordinator for the decision between re-checks of the store, where the
# monitor's parked wait delivers the announcement (it re-checks in case that announcement was
# lost with a coordinator that died between its write and its announcement)
_DECISION_RECHECK = 2.0
# seconds the monitor's wait on the death log lasts where the will's cancel ends it at once
# (a TCPStore will's read_log): the idle cost of a member is one parked request per this long
_PARKED_WAIT = 30.0
_WAKE = 0.2  # longest wait on the death log at a time: how soon ``stop`` is heeded
_STORE_GRACE = 10.0  # seconds a guarded wait rides out a store that does not answer
# seconds between the monitor's looks where the store serves liveness: with no heartbeats to
# write or read, it only re-reads the epoch record (a death wakes its wait at once anyway);
# short enough that stop()'s one-second join still finds the monitor done
_QUIET_INTERVAL = 0.5


def resilience_mode(env: Mapping[str, str] | None = None) -> str:
    """How ``PLUGDIST_RESILIENCE`` (read from ``env``, default this process's environment) sets
    resilient groups: ``"auto"`` (unset, the default: on where the world's store holds wills
    that expire, a TCPStore or etcd), ``"on"`` (``1``: on for any store, with heartbeats where
    its wills cannot expire) or ``"off"`` (``0``)."""
    value = (os.environ if env is None else env).get(RESILIENCE_ENV, "").strip().lower()
    if value in ("", "auto"):
        return "auto"
    if value in ("1", "true", "yes", "on"):
        return "on"
    if value in ("0", "false", "no", "off"):
        return "off"
    raise ValueError(f"{RESILIENCE_ENV}={value!r}: use 1 (on for every store), 0 (off) or leave "
                     f"it unset (on where the store's wills expire: TCPStore, etcd)")


def off_hint(what: str) -> str:
    """The error's text when ``what`` needs resilient groups and this process has none."""
    return (f"{what} needs resilient groups, which are off in this process: they are on by "
            f"default where the world's store holds wills that expire (TCPStore, etcd) unless "
            f"{RESILIENCE_ENV}=0; {RESILIENCE_ENV}=1 before init_process_group turns them on "
            f"for any store; and they need a world of more than one rank")


def _env_seconds(name: str, default: float) -> float:
    text = os.environ.get(name)
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"{name}={text!r} must be positive")
    return value


def group_prefix(epoch: int, name: str) -> str:
    """Where the groups of ``epoch`` keep their keys in the world's store."""
    return f"plugdist/group/{name}" if epoch == 0 else f"plugdist/egroup/{epoch}/{name}"


_epoch_key = epoch_key


class Decision:
    """What the members agreed for the next epoch."""

    def __init__(self, epoch: int, members: list[str], joined: list[str]) -> None:
        self.epoch, self.members, self.joined = epoch, members, joined


class Membership:
    """This process's view of the world's membership. Thread-safe; one per world.

    ``members`` are the uids of the current epoch in rank order. Start with :meth:`start`
    (leaves the will, starts the monitor), stop with :meth:`stop` (withdraws the will: a
    clean exit is not a failure)."""

    def __init__(self, store: Store, uid: str, members: Sequence[str], epoch: int = 0,
                 interval: float | None = None, hang_timeout: float | None = None) -> None:
        self.store = store
        self.uid = uid
        self.members: list[str] = list(members)
        self.epoch = epoch
        self.hang_timeout = hang_timeout or _env_seconds(HANG_TIMEOUT_ENV, 10.0)
        # deaths wake the monitor at once (the death log is waited on); the interval paces only
        # heartbeats, ten per hang timeout
        self.interval = interval or _env_seconds(INTERVAL_ENV,
                                                 min(1.0, max(0.05, self.hang_timeout / 10)))
        self.failed: dict[str, str] = {}  # uid -> why
        self.excluded_reason: str | None = None  # set when this process is out of the world
        self.admitted = uid in self.members  # a joiner is not, until the members admit it
        self._lock = threading.RLock()
        self._groups: list[tuple[weakref.ref[ProcessGroup], tuple[str, ...]]] = []
        self._seen_deaths = 0
        self._last_beat: dict[str, tuple[bytes, float]] = {}
        self._grow_seq = 0
        # processes waiting to join, as of the monitor's last look (every ``interval``)
        self.joiners_waiting = 0
        self._will: Any = None
        # how this process writes the world's keys: the store's checked member operations, or
        # plain writes (set in start)
        self._writes: Any = _PlainWrites(store, uid)
        self.ticket = 0  # a joiner's ticket (set in start)
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

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, only_with_store_liveness: bool = False, joining: bool = False) -> bool:
        """Hold this member's identity and will (with a ttl of ``hang_timeout``) and start the
        monitor. Blocks for a few store round trips. ``only_with_store_liveness``: where the
        store's wills do not expire (no will, or one without ``liveness_timeout``), start
        nothing and return False instead of falling back to heartbeats. ``joining``: this
        process asks to join (its uid, ``j<ticket>``, comes from the ticket it takes here).
        True when started. Raises DistStoreError when the store refuses the identity (another
        job's process reaching this store, see ``Store.claim_member``)."""
        if joining:
            self._take_ticket()
        else:
            try:
                self._writes = self.store.claim_member("", self.uid, len(self.members),
                                                       self.hang_timeout)
                self._will = self._writes.will
            except NotImplementedError:
                self._will = self._plain_will()
            except DistStoreError as err:
                raise DistStoreError(f"[rank {self.uid}, op init_process_group] the world's "
                                     f"store refused this process: {err}") from None
        self.store_liveness = getattr(self._will, "liveness_timeout", None)
        if only_with_store_liveness and self.store_liveness is None:
            if self._will is not None:
                self._will.cancel()
                self._will = None
            return False
        will_reader = getattr(self._will, "read_log", None)
        if will_reader is not None and self.store_liveness is not None:
            # one parked wait at a time on the will's own connection; cancel() ends it
            self._reader = lambda start, wait: will_reader(start, wait)
            self._parked = True
            self._monitor_store = self.store  # for the rare look at the epoch record
        else:
            try:
                self._monitor_store = self.store.clone()
            except NotImplementedError:
                self._monitor_store = self.store
            self._reader = _store_reader(self._monitor_store)
        if not self._writes.protected:
            if self.store_liveness is None:
                self.store.add(f"{_HB}/{self.uid}", 1)
            for counter in (f"{_JOIN}/count", f"{_JOIN}/done"):  # read together (multi_get)
                self.store.add(counter, 0)
            self.store.compare_set(_TRIM, b"", _NO_TRIM)
            self.store.compare_set(CURRENT, b"", b"0")
        self._thread = threading.Thread(target=self._run, name=f"plugdist-membership-{self.uid}",
                                        daemon=True)
        self._thread.start()
        return True

    def _plain_will(self) -> Any:
        """The will of a store that does not own membership (heartbeats alone without one)."""
        try:
            return _hold_will(self.store, DEATHS, json.dumps({"uid": self.uid, "cause": "died"}),
                              self.hang_timeout)
        except NotImplementedError:
            return None

    def _take_ticket(self) -> None:
        """A joiner's start: its ticket, identity and will, and its announcement in the death
        log (by the store itself where it owns membership). A joiner reads the death log from
        where it ran at its ticket: it cares only about deaths from then on."""
        store = self.store
        try:
            session = store.join_member("", self.hang_timeout)
        except NotImplementedError:
            session = None
        if session is not None:
            self._writes, self._will = session, session.will
            self.uid, self.ticket, self._seen_deaths = session.uid, session.ticket, session.start
            self.epoch = int(store.get(CURRENT))
            return
        self.ticket = store.add(f"{_JOIN}/count", 1)
        self.uid = f"j{self.ticket}"
        self._writes = _PlainWrites(store, self.uid)
        self.epoch = int(store.compare_set(CURRENT, b"", b"0") or 0)
        self._will = self._plain_will()
        self._seen_deaths = store.add(DEATHS, 0)
        # where this joiner started reading the death log: a trim keeps what comes after
        store.set(f"{_JOIN}/{self.ticket}", json.dumps({"uid": self.uid,
                                                         "start": self._seen_deaths}))
        # the members learn of it from the wait they hold on the log, not by polling
        self._writes.record(json.dumps({"uid": self.uid, "cause": "joining",
                                        "ticket": self.ticket}))

    def stop(self, withdraw: bool = True) -> None:
        """Withdraw the will and stop the monitor. Idempotent; blocks up to a second.
        ``withdraw=False`` (a process ending on an error) keeps the will: it runs when this
        process's connection to the store closes, as for a crash."""
        self._stop.set()
        will, self._will = self._will, None
        if will is not None and withdraw:
            will.cancel()
        elif will is not None:
            _kept_wills.append(will)  # not collected (which could close it) before the exit
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(1.0)
        mon, self._monitor_store = self._monitor_store, None
        if mon is not None and mon is not self.store:
            while isinstance(mon, PrefixStore):  # the clone is ours: close what it wraps
                mon = mon.underlying_store
            mon.close()

    # -- queries -----------------------------------------------------------------------------
    @property
    def protected(self) -> bool:
        """Whether the store owns this world's membership keys (no client can forge them)."""
        return bool(self._writes.protected)

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

    # -- groups ------------------------------------------------------------------------------
    def watch(self, pg: ProcessGroup, uids: Sequence[str]) -> None:
        """Abort ``pg`` as soon as one of ``uids`` (its members, in group-rank order) fails."""
        pg.abort_signal.monitored = True
        # a transport error waits as long as the store takes to confirm a death
        death = getattr(self._will, "death_timeout", self.store_liveness)
        if death is not None:
            pg.abort_signal.confirm_grace = max(pg.abort_signal.confirm_grace, death + 1.0)
        with self._lock:
            self._groups = [(r, u) for r, u in self._groups if r() is not None]
            self._groups.append((weakref.ref(pg), tuple(uids)))
        self._abort_affected()

    def _abort_affected(self) -> None:
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

    def describe(self, dead: Sequence[str]) -> str:
        """Which ranks failed and how, and what to do."""
        parts = []
        for u in dead:
            r = self.rank_of(u)
            who = f"rank {r}" if r >= 0 else f"member {u}"
            parts.append(f"{who} {self.failed.get(u, 'failed')}")
        return (f"{'; '.join(parts)}. Call plugdist.shrink_group() on every survivor to continue "
                f"without {'it' if len(dead) == 1 else 'them'}")

    # -- the monitor -------------------------------------------------------------------------
    def _run(self) -> None:
        store = self._monitor_store
        assert store is not None
        unreachable_since: float | None = None
        # where the store's liveness covers hangs there are no heartbeats: the periodic look
        # only re-reads the epoch record, so it comes less often; where the wait is parked on
        # the will's connection, a death or an announcement wakes it and the look is rare
        quiet = self.store_liveness is not None
        if self._parked:
            every = wake = _PARKED_WAIT
        else:
            every = max(self.interval, _QUIET_INTERVAL) if quiet else self.interval
            wake = min(every, _QUIET_INTERVAL if quiet else _WAKE)
        next_beat = time.monotonic() + every if self._parked else 0.0
        while not self._stop.is_set():
            try:
                try:
                    entries = self._reader(self._seen_deaths + 1, wake)
                except DistTimeoutError:
                    entries = []
                if self._stop.is_set():
                    return
                if entries:
                    self._take(entries)
                if time.monotonic() >= next_beat:
                    self._beat_and_check(store)
                    next_beat = time.monotonic() + every
                unreachable_since = None
            except DistError as err:
                if self._stop.is_set():
                    return
                now = time.monotonic()
                if unreachable_since is None:
                    unreachable_since = now
                    self._log.warning("membership_store_unreachable", error=str(err))
                if self._parked:
                    # the will's connection is gone (the store dropped it, or its host died):
                    # read the log through the store itself from now on
                    self._parked = False
                    self._reader = _store_reader(self.store)
                    every = max(self.interval, _QUIET_INTERVAL)
                    wake = min(every, _QUIET_INTERVAL)
                self._stop.wait(self.interval)
            except Exception as err:  # noqa: BLE001 - the monitor must outlive a bad read
                self._log.warning("membership_monitor_error", error=repr(err))
                self._stop.wait(self.interval)

    def _take(self, entries: list[bytes]) -> None:
        """Act on new entries of the death log: deaths, joiners' and decisions'
        announcements."""
        news: dict[str, str] = {}
        for raw in entries:
            self._seen_deaths += 1
            try:
                record = json.loads(raw)
                cause = record.get("cause")
                if cause == "joining":
                    ticket = int(record["ticket"])
                    with self._lock:
                        self._join_tickets.add(ticket)
                        self._count_joiners()
                elif cause == "decided":
                    key = str(record["key"])
                    with self._events:
                        self._decided[key] = record
                        self._events.notify_all()
                else:
                    news[str(record["uid"])] = self._how(record)
            except (ValueError, TypeError, KeyError, AttributeError) as err:
                # a store that does not own membership can hold anything a client wrote
                self._log.warning("death_log_record_skipped", entry=self._seen_deaths,
                                  record=bytes(raw[:200]), error=repr(err))
        if news:
            self._learn(news)

    def _read_deaths(self, store: Store) -> None:
        """Read, without waiting, what the death log holds beyond what this member has seen."""
        try:
            entries = store.read_log(DEATHS, self._seen_deaths + 1, timedelta(0))
        except DistTimeoutError:
            return
        self._take(entries)

    def _count_joiners(self) -> None:
        """``joiners_waiting`` from the announced tickets not yet admitted (under the lock)."""
        self.joiners_waiting = sum(1 for t in self._join_tickets
                                   if t > self._join_done and f"j{t}" not in self.failed)

    def _how(self, record: dict[str, Any]) -> str:
        """How a member failed, from its death-log record."""
        cause = record.get("cause", "died")
        if cause == "died" and self.store_liveness is None:
            return "died (its process exited or was killed: the store saw its connection drop)"
        if cause == "died":
            return (f"died (its process exited, was killed, or stopped running for about "
                    f"{self.store_liveness:.3g} s: the store's liveness for it expired)")
        if cause == "excluded":
            return f"was excluded from the world by shrink_group at epoch {record['epoch']}"
        if cause == "hung":
            return f"hung (no heartbeat for {record.get('after', '?')} s)"
        if cause == "left":
            return f"left ({record.get('how', 'it gave up')})"
        return f"failed ({record.get('how', 'reported by a backend')})"

    def _learn(self, news: dict[str, str]) -> None:
        with self._lock:
            fresh = {u: why for u, why in news.items() if u not in self.failed}
            self.failed.update(fresh)
            self._count_joiners()  # a joiner that died or gave up no longer waits
            self._events.notify_all()  # an agreement may wait on one of them
            if self.uid in fresh and self.excluded_reason is None:
                why = fresh[self.uid]
                if not why.startswith("was excluded"):
                    why = f"was declared failed by the others: {why}"
                self.excluded_reason = (f"this process (member {self.uid}) {why}; it is no "
                                        f"longer in the world (a process can come back only "
                                        f"as a new one, with join=True)")
        if fresh:
            lifecycle("rank_failure", group="world", group_rank=self.rank, backend="",
                      level="warning", epoch=self.epoch, failed_ranks=self.failed_ranks(fresh),
                      how={u: fresh[u] for u in sorted(fresh)})
            self._abort_affected()

    def _beat_and_check(self, store: Store) -> None:
        with self._lock:
            others = [u for u in self.members if u != self.uid and u not in self.failed]
            epoch = self.epoch
        if self.store_liveness is None:
            if self.excluded_reason is None:
                self._writes.add(f"{_HB}/{self.uid}", 1)
        else:
            others = []  # the store's liveness covers hangs: nothing to beat or watch
        control = [CURRENT, f"{_JOIN}/count", f"{_JOIN}/done", _TRIM]
        keys = [f"{_HB}/{u}" for u in others] + control
        if not store.check(keys):
            # a member has not beaten yet, or its heartbeat went with the record of its death
            others, keys = [], control
            if not store.check(keys):
                return
        *beats, current, asked, admitted, trim = store.multi_get(keys)
        self.joiners_waiting = int(asked) - int(admitted)
        self._skip_trimmed(int(json.loads(trim)["log"]))
        now = time.monotonic()
        for u, beat in zip(others, beats, strict=True):
            last = self._last_beat.get(u)
            if last is None or last[0] != beat:
                self._last_beat[u] = (bytes(beat), now)
            elif now - last[1] > self.hang_timeout:
                self._declare_hung(store, u, now - last[1])
        if int(current) > epoch and self.admitted:
            self._check_still_member(store, int(current))

    def _skip_trimmed(self, trimmed: int) -> None:
        """Go on past death-log entries that were deleted before this process read them (on the
        monitor thread). Only a process that is no longer a member, or a joiner not yet admitted,
        can be that far behind: a trim never passes what a member had read."""
        if trimmed <= self._seen_deaths:
            return
        member = self.admitted and self.excluded_reason is None
        (self._log.warning if member else self._log.info)(
            "death_log_entries_skipped", seen=self._seen_deaths, trimmed=trimmed)
        self._seen_deaths = trimmed

    def _declare_hung(self, store: Store, uid: str, silent: float) -> None:
        self._declare(uid, {"cause": "hung", "after": round(silent, 1)})

    def _declare(self, uid: str, record: dict[str, Any]) -> None:
        """Write ``uid`` into the death log, once across every member that declares it."""
        self._writes.record(json.dumps({"uid": uid, **record}))

    def report(self, ranks: Iterable[int], how: str) -> None:
        """A backend's transport saw these current-epoch ranks fail (an MPI error, a closed
        connection): act on it here at once (abort the groups holding them) and write it into
        the death log for the other members. ``how`` says what the transport saw. Ranks already
        known to have failed, or outside the current epoch, are ignored. Never raises for a
        store that does not answer (the local view is updated all the same)."""
        with self._lock:
            fresh = [self.members[r] for r in ranks
                     if 0 <= r < len(self.members) and self.members[r] not in self.failed
                     and self.members[r] != self.uid]
        if not fresh:
            return
        self._learn({u: self._how({"cause": "reported", "how": how}) for u in fresh})
        for u in fresh:
            try:
                self._declare(u, {"cause": "reported", "how": how})
            except DistError as err:  # the store's host may be what died
                self._log.warning("membership_report_unwritten", uid=u, error=str(err))

    def _check_still_member(self, store: Store, current: int) -> None:
        key = _epoch_key(current, "members")
        try:  # the new epoch's rank 0 writes its members: never wait for it here
            if not store.check([key]):
                return
            members = json.loads(store.get(key))
        except DistError:
            return
        if self.uid not in members and self.excluded_reason is None:
            with self._lock:
                self.excluded_reason = (f"this process (rank {self.rank} at epoch {self.epoch}) "
                                        f"was excluded from the world by shrink_group at epoch "
                                        f"{current}; its groups are gone (a process can come "
                                        f"back only as a new one, with join=True)")
            self._abort_affected()

    # -- agreement ---------------------------------------------------------------------------
    def _excluded_error(self) -> DistError:
        return DistExcludedError(f"[member {self.uid}] {self.excluded_reason}")

    def agree_shrink(self, exclude: Sequence[str] | None, timeout: timedelta,
                     retry: int = 0) -> Decision:
        """Collective of the survivors of the current epoch: the members of the next one.

        ``exclude`` None: every member that is not known to have failed must call this; the
        next epoch holds those that did (a member failing meanwhile is left out). Given: the
        members minus ``exclude``, without waiting for anyone. The first decision written wins,
        so all survivors read the same one. ``retry`` > 0: agree again within the same epoch
        (a backend's native shrink failed before the epoch was entered; every survivor passes
        the same ``retry``). Blocks up to ``timeout``; raises DistTimeoutError naming the members
        that neither arrived nor failed, or DistRankFailureError when this process is
        excluded."""
        if self.excluded_reason is not None:
            raise self._excluded_error()
        store, e = self.store, self.epoch
        if exclude is not None and self.uid in exclude:
            raise DistRankFailureError(f"[rank {self.rank}] shrink_group: this rank is in "
                                       f"ranks_to_exclude; only the ranks that stay call it")
        decided = _epoch_key(e, "next" if retry == 0 else f"next/{retry}")
        limit = timeout.total_seconds()
        deadline = time.monotonic() + limit
        if exclude is not None:
            record = {"excluded": [u for u in self.members if u in exclude]}
            record = json.loads(self._writes.compare_set(decided, b"", json.dumps(record)))
        else:
            arrivals = _epoch_key(e, f"shrink/{retry}/arrived")
            _append_log(self._writes, arrivals, self.uid)
            record = self._await_decision(store, decided, arrivals, deadline, limit)
        members = self._members_after(record)
        with self._lock:
            left_alive = [u for u in self.members if u not in members and u not in self.failed]
        for uid in left_alive:  # told through the death log, so they learn it at once
            self._declare(uid, {"cause": "excluded", "epoch": e + 1})
        if self.uid not in members:
            with self._lock:
                self.excluded_reason = (f"this process was excluded from the world by "
                                        f"shrink_group at epoch {e + 1}")
            raise self._excluded_error()
        return Decision(e + 1, members, [])

    def _members_after(self, record: dict[str, Any]) -> list[str]:
        """The next epoch's members from a decision record (the members it excludes)."""
        if "members" in record:
            return list(record["members"])
        excluded = set(record["excluded"])
        return [u for u in self.members if u not in excluded]

    def _await_decision(self, store: Store, decided: str, arrivals: str, deadline: float,
                        limit: float) -> dict[str, Any]:
        """Wait for the decision ``decided`` of a shrink without exclusions; decide it when this
        member is the first survivor in rank order (the coordinator), which reads the arrival
        log with parked waits until every member it does not know failed has arrived. Raises
        DistTimeoutError at ``deadline`` naming the members that neither arrived nor failed."""
        arrived: set[str] = set()
        next_entry = 1
        recheck_at = 0.0
        while True:
            with self._lock:
                known = self._decided.get(decided)
                alive = [u for u in self.members if u not in self.failed]
            if known is not None:
                return known
            now = time.monotonic()
            if not alive or alive[0] == self.uid:
                try:
                    entries = store.read_log(arrivals, next_entry, timedelta(
                        seconds=max(0.0, min(_COORDINATOR_SLICE, deadline - now))))
                except DistTimeoutError:
                    entries = []
                next_entry += len(entries)
                arrived.update(entry.decode() for entry in entries)
                with self._lock:
                    alive = [u for u in self.members if u not in self.failed]
                pending = [u for u in alive if u not in arrived]
                if not pending:
                    ours = json.dumps({"excluded": [u for u in self.members if u not in alive]})
                    won = self._writes.compare_set(decided, b"", ours)
                    if won == ours.encode():  # tell everyone, through the wait they hold
                        self._writes.record(json.dumps(
                            {"uid": self.uid, "cause": "decided", "key": decided,
                             **json.loads(ours)}))
                    return dict(json.loads(won))
                if time.monotonic() >= deadline:
                    raise self._shrink_timeout(pending, limit)
                continue
            if now >= recheck_at:
                if store.check([decided]):
                    return dict(json.loads(store.get(decided)))
                delivered = self._parked and self._thread is not None
                recheck_at = now + (_DECISION_RECHECK if delivered else _POLL)
            if now >= deadline:
                try:
                    arrived.update(e.decode() for e in store.read_log(arrivals, 1,
                                                                      timedelta(0)))
                except DistTimeoutError:
                    pass
                raise self._shrink_timeout([u for u in alive if u not in arrived], limit)
            with self._events:
                self._events.wait(max(0.0, min(recheck_at, deadline) - now))

    def _shrink_timeout(self, pending: list[str], limit: float) -> DistTimeoutError:
        ranks = [self.rank_of(u) for u in pending]
        here = f"[rank {self.rank}, op shrink_group]"
        return DistTimeoutError(f"{timed_out(here, limit, 'the survivors')}: ranks {ranks} "
                                f"neither called it nor failed; every surviving rank must call "
                                f"shrink_group")

    def agree_grow(self, timeout: timedelta) -> Decision | None:
        """Collective of the current members: admit the processes waiting to join (in ticket
        order), or None when nobody waits. Every member must call it, in the same order."""
        if self.excluded_reason is not None:
            raise self._excluded_error()
        store, e = self.store, self.epoch
        seq, self._grow_seq = self._grow_seq, self._grow_seq + 1
        decided = _epoch_key(e, f"grow/{seq}")
        if not store.check([decided]):
            done = store.add(f"{_JOIN}/done", 0)
            count = store.add(f"{_JOIN}/count", 0)
            joiners = []
            for n in range(done + 1, count + 1):
                if not store.check([f"{_JOIN}/{n}"]):
                    break  # registered its ticket but not yet its liveness: next time
                uid = f"j{n}"
                with self._lock:
                    dead = uid in self.failed
                if not dead:
                    joiners.append((n, uid))
                done = n
            ours = json.dumps({"joiners": joiners, "done": done})
            if self._writes.compare_set(decided, b"", ours) == ours.encode() and joiners:
                # the joiners read the new epoch's members as soon as they are admitted
                self._writes.compare_set(_epoch_key(e + 1, "members"), b"", json.dumps(
                    self.members + [uid for _, uid in joiners]))
        record = json.loads(store.get(decided))
        joiners = [(int(n), uid) for n, uid in record["joiners"]]
        done_now = store.add(f"{_JOIN}/done", 0)
        if record["done"] > done_now:  # the same value from every member: one write wins
            self._writes.compare_set(f"{_JOIN}/done", str(done_now), str(record["done"]))
        with self._lock:
            self._join_done = max(self._join_done, int(record["done"]))
            self._count_joiners()
        if not joiners:
            return None
        members = self.members + [uid for _, uid in joiners]
        for n, _ in joiners:
            self._writes.set(f"{_JOIN}/{n}/admitted", str(e + 1))
        return Decision(e + 1, members, [uid for _, uid in joiners])

    def enter(self, decision: Decision) -> Decision:
        """Make ``decision`` the current epoch here; record it for everyone (idempotent) and
        forget the agreement keys of the epoch before last (the new epoch's rank 0 alone).
        Returns the decision in force: the first recorded for that epoch. A shrink and a grow
        agreed concurrently from the same epoch (a member failed while the others admitted a
        joiner) both propose the next one; every process follows the one recorded first (one
        compare-and-set each: O(N) messages for the epoch), so no two of them build different
        worlds under one epoch. Raises DistExcludedError when that one leaves this process out."""
        store, writes = self.store, self._writes
        mine = json.dumps(decision.members)
        recorded = writes.compare_set(_epoch_key(decision.epoch, "members"), b"", mine)
        if recorded and recorded != mine.encode():
            members = json.loads(recorded)
            self._log.warning("epoch_decided_elsewhere", epoch=decision.epoch,
                              ours=decision.members, recorded=members)
            decision = Decision(decision.epoch, members,
                                [u for u in decision.joined if u in members])
            if self.uid not in members:
                with self._lock:
                    self.excluded_reason = (f"this process is not in epoch {decision.epoch}, "
                                            f"which the others entered first")
                raise self._excluded_error()
        first = bool(decision.members) and decision.members[0] == self.uid
        with self._lock:
            self.members = list(decision.members)
            self.epoch = decision.epoch
            self._grow_seq = 0
            self._last_beat.clear()
        current = int(writes.compare_set(CURRENT, b"", str(decision.epoch)) or 0)
        if current < decision.epoch:
            writes.compare_set(CURRENT, str(current), str(decision.epoch))
        self._log = get_logger(rank=self.rank)
        # how far this member had read the death log: the next epoch's first rank trims up to
        # what every member of its epoch had read when it entered this one
        writes.set(_epoch_key(decision.epoch, f"seen/{self.uid}"), str(self._seen_deaths))
        if first:
            _forget_epochs(writes, decision.epoch - 2)
            self._trim(store, decision.epoch)
        return decision

    def _trim(self, store: Store, epoch: int) -> None:
        """Delete what no member or waiting joiner can need any more (the first rank of
        ``epoch``, on entering it): the death log's entries up to the lowest of how far each
        member of ``epoch`` had read it on entering the epoch before and where each waiting
        joiner started reading it; the claims and heartbeats of the members those entries
        record as failed; the join tickets the last trim found decided. Skipped, for a later
        epoch to do, while a member of ``epoch`` had not entered the one before (a joiner
        admitted into it) or a joiner has taken a number but not yet written its ticket.
        Concurrent trims (first ranks of two epochs) delete the same keys at worst."""
        try:
            raw = store.get(_TRIM)
            state = json.loads(raw)
            if state["epoch"] >= epoch:
                return
            marks = [_epoch_key(epoch - 1, f"seen/{u}") for u in self.members]
            if not store.check(marks):
                return
            floor = min(int(v) for v in store.multi_get(marks))
            # read after the members' marks: a joiner that takes a ticket now starts past them
            count = store.add(f"{_JOIN}/count", 0)
            tickets = [f"{_JOIN}/{n}" for n in range(state["done"] + 1, count + 1)]
            if tickets:
                if not store.check(tickets):
                    return
                floor = min(floor, *(json.loads(t)["start"] for t in store.multi_get(tickets)))
            trimmed = max(state["log"], floor)
            writes = self._writes
            if floor > state["log"]:
                self._forget_failed(store, state["log"] + 1, floor)
                for n in range(state["log"] + 1, floor + 1):
                    writes.delete_key(f"{DEATHS}/{n}")
            for n in range(state["tickets"] + 1, state["done"] + 1):
                writes.delete_key(f"{_JOIN}/{n}")
                writes.delete_key(f"{_JOIN}/{n}/admitted")
            # the grows this member took part in admitted their joiners into this epoch at
            # the latest: the next trim, from a later epoch, finds them entered or gone
            done = max(state["done"], self._join_done)
            writes.compare_set(_TRIM, raw, json.dumps({
                "epoch": epoch, "log": trimmed, "tickets": state["done"], "done": done}))
        except (DistError, NotImplementedError, ValueError, KeyError):
            pass  # the next epoch's trim deletes it all

    def _forget_failed(self, store: Store, first: int, last: int) -> None:
        """Delete the claims and heartbeats of the members that death-log entries ``first`` to
        ``last`` record as failed (every member knows it from those entries)."""
        try:
            entries = store.read_log(DEATHS, first, timedelta(0))[:last - first + 1]
        except DistTimeoutError:
            return  # deleted meanwhile by another epoch's trim
        if self._writes.protected:
            return  # the store keeps no claims, and its liveness needs no heartbeats
        for raw in entries:
            try:
                record = json.loads(raw)
                cause, uid = record.get("cause"), str(record["uid"])
            except (ValueError, TypeError, KeyError, AttributeError):
                continue  # skipped when it was read
            if cause in ("hung", "excluded", "reported"):
                store.delete_key(f"{_DECLARED}/{uid}")
            if cause not in ("joining", "decided") and self.store_liveness is None:
                store.delete_key(f"{_HB}/{uid}")


class _PlainWrites:
    """Membership's writes through a store's plain operations: for a store that does not own
    membership (no ``claim_member``), where any client of the store could write them too."""

    protected = False

    def __init__(self, store: Store, uid: str) -> None:
        self._store = store
        self._uid = uid
        self.set, self.add, self.compare_set = store.set, store.add, store.compare_set
        self.delete_key, self.delete_prefix = store.delete_key, store.delete_prefix

    def record(self, record: str) -> bool:
        """Append ``record`` to the death log; one that declares a member failed only once
        across every member that declares it (a claim first). False when another's came first."""
        parsed = json.loads(record)
        if parsed.get("cause") in ("excluded", "reported", "hung"):
            claim = f"{_DECLARED}/{parsed['uid']}"
            if self._store.compare_set(claim, b"", self._uid) != self._uid.encode():
                return False
        _append_log(self._store, DEATHS, record)
        return True


def _append_log(store: Any, key: str, value: str) -> None:
    """Append ``value`` to the numbered log ``key`` (counted first, then written: a reader
    that finds the count ahead of the entry waits for the entry)."""
    n = store.add(key, 1)
    store.set(f"{key}/{n}", value)


def _hold_will(store: Store, key: str, value: str, ttl: float) -> Any:
    """``store.hold_will`` with a ttl, or without one for a store written before ttl existed."""
    try:
        return store.hold_will(key, value, ttl=ttl)
    except TypeError:
        return store.hold_will(key, value)


def _store_reader(store: Store) -> Any:
    """The monitor's wait on the death log through the store's ``read_log``."""
    return lambda start, wait: store.read_log(DEATHS, start, timedelta(seconds=wait))


def _forget_epochs(store: Any, last: int) -> None:
    """Drop the keys of every epoch up to ``last`` not dropped yet (the first rank of an epoch
    that died before entering it left the epoch before last behind)."""
    if last < 0:
        return
    try:
        done = int(store.compare_set(_FORGOTTEN, b"", b"-1"))
        for epoch in range(done + 1, last + 1):
            store.delete_prefix(f"plugdist/epoch/{epoch}/")
            store.delete_prefix(group_prefix(epoch, ""))
        if last > done:
            store.compare_set(_FORGOTTEN, str(done), str(last))
    except (DistError, NotImplementedError):
        pass  # a store that cannot delete by prefix keeps them: a few keys per epoch


def request_join(store: Store, timeout: timedelta,
                 interval: float | None = None) -> tuple[Membership, Decision]:
    """For a new process: take a ticket, start liveness (so the members see it die), and block
    until the members admit it at their next ``grow_group`` (bounded by ``timeout``). A joiner
    that gives up (the timeout, any error) says so in the death log before it withdraws its
    will, so that no later grow admits it: a will withdrawn in silence left its ticket looking
    alive, and a grow that admitted such a ticket built a group that waited for it in vain."""
    me = Membership(store, "", [], 0, interval=interval)
    me.start(joining=True)
    n, uid = me.ticket, me.uid
    try:
        admitted = f"{_JOIN}/{n}/admitted"
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            try:
                store.wait([admitted], timedelta(seconds=min(1.0, max(
                    0.0, deadline - time.monotonic()))))
                break
            except DistTimeoutError:
                if store.check([CLOSED]) and not store.check([admitted]):
                    raise WorldClosedError(
                        f"init_process_group(join=True): the world finished (every member "
                        f"left) before admitting member {uid}; there is nothing to join") \
                        from None
                if time.monotonic() >= deadline and not store.check([admitted]):
                    here = f"[member {uid}, op init_process_group(join=True)]"
                    raise DistTimeoutError(
                        f"{timed_out(here, timeout.total_seconds(), 'admission')}: the running "
                        f"ranks admit joiners when they call plugdist.grow_group()") from None
        epoch = int(store.get(f"{_JOIN}/{n}/admitted"))
        members = json.loads(_wait_get(store, _epoch_key(epoch, "members"), timeout))
    except BaseException as err:
        try:
            me._writes.record(json.dumps({
                "uid": uid, "cause": "left", "how": f"it gave up joining: {type(err).__name__}"}))
        except DistError:
            pass  # a store that is gone: nobody is left to admit it either
        me.stop()
        raise
    decision = Decision(epoch, members, [uid])
    with me._lock:
        me.members, me.epoch, me.admitted = list(members), epoch, True
        me._join_done = n  # the grow that admitted it decided every ticket up to its own
    return me, decision


def _wait_get(store: Store, key: str, timeout: timedelta) -> bytes:
    store.wait([key], timeout)
    return store.get(key)


class GuardedPrefixStore(PrefixStore):
    """A PrefixStore whose blocking reads (``get``, ``wait``, ``multi_get``) give up with
    ``DistRankFailureError`` as soon as one of ``uids`` is known to have failed, instead of
    waiting out the timeout for a key a dead member will never write. Used while a group is
    built, so that a member dying mid-build fails the build in about a second."""

    def __init__(self, prefix: str, store: Store, membership: Membership,
                 uids: Sequence[str]) -> None:
        super().__init__(prefix, store)
        self._membership = membership
        self._uids = tuple(uids)

    def _until_present(self, keys: list[str], timeout: timedelta | None) -> None:
        limit = (timeout if timeout is not None else self.timeout).total_seconds()
        deadline = time.monotonic() + limit
        unavailable_since: float | None = None
        while True:
            left = deadline - time.monotonic()
            try:
                self.underlying_store.wait(keys, timedelta(seconds=max(0.0, min(0.2, left))))
                return
            except DistTimeoutError:
                unavailable_since = None
                if time.monotonic() >= deadline:
                    raise
            except DistError:
                # a replicated store (etcd) electing a leader answers no one for a moment; a
                # store that stays away is an error after _STORE_GRACE
                now = time.monotonic()
                unavailable_since = unavailable_since or now
                if now - unavailable_since > _STORE_GRACE or now >= deadline:
                    raise
                time.sleep(0.05)
            failure = self._membership.first_failure(self._uids)
            if failure is not None:
                raise failure

    def get(self, key: str) -> bytes:
        self._until_present(self._ks([key]), None)
        return super().get(key)

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        self._until_present(self._ks(keys), timeout)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        self._until_present(self._ks(keys), None)
        return super().multi_get(keys)
