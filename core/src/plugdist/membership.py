"""Membership: who is in the world, who has failed, who waits to join, and the epoch record the
survivors agree on. Knows nothing of any backend; everything goes through the world's store.

Each process has a stable member id (``uid``): its rank at the first epoch (``"0"``, ``"1"``,
...) or ``"j<n>"`` for the n-th process that asked to join. An *epoch* is one membership of the
world: epoch 0 is the world ``init_process_group`` built; each shrink or grow makes the next,
whose members (uids, in rank order) are written once, by compare-and-set, so every survivor
reads the same list.

Liveness, off the hot path, on one monitor thread per process:

* **Death**: a will left with the store (``Store.hold_will``) appends this member's uid to the
  death log the moment its process dies (the store sees the connection drop). Stores that
  cannot (a FileStore) rely on heartbeats alone.
* **Hang**: every member bumps a heartbeat counter each ``interval``; a member whose counter
  has not moved for ``hang_timeout`` is declared failed by the first member to notice, in the
  same death log. Not where the store's liveness sees a stalled process too (the will's
  ``liveness_timeout``, e.g. an etcd lease the process stops renewing): then no heartbeats,
  and the monitor looks at the store every half second instead of each ``interval``.

When the monitor learns of a failure it aborts (``ProcessGroup.abort``) every group it watches
that holds the failed member, so blocked ops are released with ``DistRankFailureError`` at once.

Store keys (under the world's store): ``plugdist/live/deaths[/n]``, ``plugdist/live/hb/<uid>``,
``plugdist/epoch/current``, ``plugdist/epoch/<e>/...`` (agreement; removed two epochs later),
``plugdist/join/...``.
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

from .errors import DistError, DistExcludedError, DistRankFailureError, DistTimeoutError, timed_out
from .log import get_logger, lifecycle
from .store import PrefixStore, Store

if TYPE_CHECKING:
    from .process_group import ProcessGroup

__all__ = ["Membership", "Decision", "WorldClosedError", "GuardedPrefixStore", "request_join",
           "group_prefix", "INTERVAL_ENV", "HANG_TIMEOUT_ENV", "RESILIENCE_ENV",
           "enabled"]

RESILIENCE_ENV = "PLUGDIST_RESILIENCE"
INTERVAL_ENV = "PLUGDIST_HEARTBEAT_INTERVAL"
HANG_TIMEOUT_ENV = "PLUGDIST_HEARTBEAT_TIMEOUT"

DEATHS = "plugdist/live/deaths"
_HB = "plugdist/live/hb"
CURRENT = "plugdist/epoch/current"
CLOSED = "plugdist/closed"  # set when every member of the last epoch left
_JOIN = "plugdist/join"
_POLL = 0.05  # seconds between looks at the store while agreeing
_WAKE = 0.2  # longest wait on the death log at a time: how soon ``stop`` is heeded
_STORE_GRACE = 10.0  # seconds a guarded wait rides out a store that does not answer
# seconds between the monitor's looks where the store serves liveness: with no heartbeats to
# write or read, it only re-reads the epoch record (a death wakes its wait at once anyway);
# short enough that stop()'s one-second join still finds the monitor done
_QUIET_INTERVAL = 0.5


def enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether worlds get a membership: with ``PLUGDIST_RESILIENCE=1`` (``plugdist-run
    --replace-failed`` sets it for its workers), read from ``env`` (default: this process's
    environment). Off by default in this version: see docs/resilience.md."""
    value = (os.environ if env is None else env).get(RESILIENCE_ENV, "0")
    return value.strip().lower() in ("1", "true", "yes", "on")


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


def _epoch_key(epoch: int, tail: str) -> str:
    return f"plugdist/epoch/{epoch}/{tail}"


class WorldClosedError(DistError):
    """A process asked to join a world whose members had all left."""


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
        # seconds within which the store's will notices a dead or stalled process; None: it
        # notices deaths only, and heartbeats catch hangs
        self.store_liveness: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._monitor_store: Store | None = None
        self._log = get_logger(rank=self.rank_of(uid) if uid in self.members else -1)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Leave the will and start beating. Blocks for a few store round trips."""
        try:
            self._will = self.store.hold_will(DEATHS, json.dumps({"uid": self.uid,
                                                                   "cause": "died"}))
        except NotImplementedError:
            self._will = None  # heartbeats alone
        self.store_liveness = getattr(self._will, "liveness_timeout", None)
        try:
            self._monitor_store = self.store.clone()
        except NotImplementedError:
            self._monitor_store = self.store
        # a member of the first epoch reads the whole log (a peer may have died before this
        # process started looking); a joiner cares only about deaths from now on
        self._seen_deaths = 0 if self.admitted else self.store.add(DEATHS, 0)
        if self.store_liveness is None:
            self.store.add(f"{_HB}/{self.uid}", 1)
        for counter in (f"{_JOIN}/count", f"{_JOIN}/done"):  # read together (multi_get)
            self.store.add(counter, 0)
        self._thread = threading.Thread(target=self._run, name=f"plugdist-membership-{self.uid}",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Withdraw the will and stop the monitor. Idempotent; blocks up to a second."""
        self._stop.set()
        will, self._will = self._will, None
        if will is not None:
            will.cancel()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(1.0)
        mon, self._monitor_store = self._monitor_store, None
        if mon is not None and mon is not self.store:
            while isinstance(mon, PrefixStore):  # the clone is ours: close what it wraps
                mon = mon.underlying_store
            mon.close()

    # -- queries -----------------------------------------------------------------------------
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
        if self.store_liveness is not None:  # a transport error waits for the store to confirm
            pg.abort_signal.confirm_grace = max(pg.abort_signal.confirm_grace,
                                                self.store_liveness + 1.0)
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
        next_beat = 0.0
        # where the store's liveness covers hangs there are no heartbeats: the periodic look
        # only re-reads the epoch record, so it comes less often
        quiet = self.store_liveness is not None
        every = max(self.interval, _QUIET_INTERVAL) if quiet else self.interval
        wake = min(every, _QUIET_INTERVAL if quiet else _WAKE)
        while not self._stop.is_set():
            try:
                try:
                    store.wait([f"{DEATHS}/{self._seen_deaths + 1}"], timedelta(seconds=wake))
                    died = True
                except DistTimeoutError:
                    died = False  # every entry of the log is written with or before its count
                if self._stop.is_set():
                    return
                if died:
                    self._read_deaths(store)
                if time.monotonic() >= next_beat:
                    self._beat_and_check(store)
                    next_beat = time.monotonic() + every
                unreachable_since = None
            except DistError as err:
                now = time.monotonic()
                if unreachable_since is None:
                    unreachable_since = now
                    self._log.warning("membership_store_unreachable", error=str(err))
                self._stop.wait(self.interval)
            except Exception as err:  # noqa: BLE001 - the monitor must outlive a bad read
                self._log.warning("membership_monitor_error", error=repr(err))
                self._stop.wait(self.interval)

    def _read_deaths(self, store: Store) -> None:
        total = store.add(DEATHS, 0)
        news: dict[str, str] = {}
        while self._seen_deaths < total:
            self._seen_deaths += 1
            record = json.loads(store.get(f"{DEATHS}/{self._seen_deaths}"))
            news[record["uid"]] = self._how(record)
        if news:
            self._learn(news)

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
        return f"failed ({record.get('how', 'reported by a backend')})"

    def _learn(self, news: dict[str, str]) -> None:
        with self._lock:
            fresh = {u: why for u, why in news.items() if u not in self.failed}
            self.failed.update(fresh)
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
            store.add(f"{_HB}/{self.uid}", 1)
        else:
            others = []  # the store's liveness covers hangs: nothing to beat or watch
        keys = [f"{_HB}/{u}" for u in others] + [CURRENT, f"{_JOIN}/count", f"{_JOIN}/done"]
        if not store.check(keys):
            return
        *beats, current, asked, admitted = store.multi_get(keys)
        self.joiners_waiting = int(asked) - int(admitted)
        now = time.monotonic()
        for u, beat in zip(others, beats, strict=True):
            last = self._last_beat.get(u)
            if last is None or last[0] != beat:
                self._last_beat[u] = (bytes(beat), now)
            elif now - last[1] > self.hang_timeout:
                self._declare_hung(store, u, now - last[1])
        if int(current) > epoch and self.admitted:
            self._check_still_member(store, int(current))

    def _declare_hung(self, store: Store, uid: str, silent: float) -> None:
        self._declare(store, uid, {"cause": "hung", "after": round(silent, 1)})

    def _declare(self, store: Store, uid: str, record: dict[str, Any]) -> None:
        """Write ``uid`` into the death log, once across every member that declares it."""
        claim = f"plugdist/live/declared/{uid}"
        if store.compare_set(claim, b"", self.uid.encode()) != self.uid.encode():
            return
        n = store.add(DEATHS, 1)
        store.set(f"{DEATHS}/{n}", json.dumps({"uid": uid, **record}))

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
                self._declare(self.store, u, {"cause": "reported", "how": how})
            except DistError as err:  # the store's host may be what died
                self._log.warning("membership_report_unwritten", uid=u, error=str(err))

    def _check_still_member(self, store: Store, current: int) -> None:
        try:
            members = json.loads(store.get(_epoch_key(current, "members")))
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
        store.set(_epoch_key(e, f"shrink/arrived/{self.uid}"), b"1")
        decided = _epoch_key(e, "next" if retry == 0 else f"next/{retry}")
        limit = timeout.total_seconds()
        deadline = time.monotonic() + limit
        while not store.check([decided]):
            if exclude is not None:
                proposal = [u for u in self.members if u not in exclude]
            else:
                with self._lock:
                    alive = [u for u in self.members if u not in self.failed]
                pending = [u for u in alive
                           if not store.check([_epoch_key(e, f"shrink/arrived/{u}")])]
                proposal = alive if not pending else []
                if pending and time.monotonic() > deadline:
                    ranks = [self.rank_of(u) for u in pending]
                    here = f"[rank {self.rank}, op shrink_group]"
                    raise DistTimeoutError(
                        f"{timed_out(here, limit, 'the survivors')}: ranks {ranks} neither "
                        f"called it nor failed; every surviving rank must call shrink_group")
            if proposal:
                store.compare_set(decided, b"", json.dumps({"members": proposal}))
                break
            time.sleep(_POLL)
        members = json.loads(store.get(decided))["members"]
        with self._lock:
            left_alive = [u for u in self.members if u not in members and u not in self.failed]
        for uid in left_alive:  # told through the death log, so they learn it at once
            self._declare(store, uid, {"cause": "excluded", "epoch": e + 1})
        if self.uid not in members:
            with self._lock:
                self.excluded_reason = (f"this process was excluded from the world by "
                                        f"shrink_group at epoch {e + 1}")
            raise self._excluded_error()
        return Decision(e + 1, members, [])

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
            store.compare_set(decided, b"", json.dumps({"joiners": joiners, "done": done}))
        record = json.loads(store.get(decided))
        joiners = [(int(n), uid) for n, uid in record["joiners"]]
        done_now = store.add(f"{_JOIN}/done", 0)
        if record["done"] > done_now:  # the same value from every member: one write wins
            store.compare_set(f"{_JOIN}/done", str(done_now), str(record["done"]))
        if not joiners:
            return None
        members = self.members + [uid for _, uid in joiners]
        for n, _ in joiners:
            store.set(f"{_JOIN}/{n}/admitted", str(e + 1))
        return Decision(e + 1, members, [uid for _, uid in joiners])

    def enter(self, decision: Decision) -> Decision:
        """Make ``decision`` the current epoch here; record it for everyone (idempotent) and
        forget the agreement keys of the epoch before last. Returns the decision in force: the
        first recorded for that epoch. A shrink and a grow agreed concurrently from the same
        epoch (a member failed while the others admitted a joiner) both propose the next one;
        every process follows the one recorded first, so no two of them build different
        worlds under one epoch. Raises DistExcludedError when that one leaves this process out."""
        store = self.store
        mine = json.dumps(decision.members)
        recorded = store.compare_set(_epoch_key(decision.epoch, "members"), b"", mine)
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
        with self._lock:
            self.members = list(decision.members)
            self.epoch = decision.epoch
            self._grow_seq = 0
            self._last_beat.clear()
        current = int(store.compare_set(CURRENT, b"", str(decision.epoch)) or 0)
        if current < decision.epoch:
            store.compare_set(CURRENT, str(current), str(decision.epoch))
        self._log = get_logger(rank=self.rank)
        _forget_epoch(store, decision.epoch - 2)
        return decision


def _forget_epoch(store: Store, epoch: int) -> None:
    if epoch < 0:
        return
    try:
        store.delete_prefix(f"plugdist/epoch/{epoch}/")
        store.delete_prefix(group_prefix(epoch, ""))
    except (DistError, NotImplementedError):
        pass  # a store that cannot delete by prefix keeps them: a few keys per epoch


def request_join(store: Store, timeout: timedelta,
                 interval: float | None = None) -> tuple[Membership, Decision]:
    """For a new process: take a ticket, start liveness (so the members see it die), and block
    until the members admit it at their next ``grow_group`` (bounded by ``timeout``)."""
    n = store.add(f"{_JOIN}/count", 1)
    uid = f"j{n}"
    current = int(store.compare_set(CURRENT, b"", b"0") or 0)
    me = Membership(store, uid, [], current, interval=interval)
    me.start()
    try:
        store.set(f"{_JOIN}/{n}", uid)
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
                if time.monotonic() >= deadline:
                    here = f"[member {uid}, op init_process_group(join=True)]"
                    raise DistTimeoutError(
                        f"{timed_out(here, timeout.total_seconds(), 'admission')}: the running "
                        f"ranks admit joiners when they call plugdist.grow_group()") from None
        epoch = int(store.get(f"{_JOIN}/{n}/admitted"))
        members = json.loads(_wait_get(store, _epoch_key(epoch, "members"), timeout))
    except BaseException:
        me.stop()
        raise
    decision = Decision(epoch, members, [uid])
    with me._lock:
        me.members, me.epoch, me.admitted = list(members), epoch, True
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
            m = self._membership
            dead = [u for u in self._uids if u in m.failed]
            if dead:
                raise DistRankFailureError(f"[rank {m.rank}] {m.describe(dead)}",
                                           m.failed_ranks(dead))
            if m.excluded_reason is not None:
                raise m._excluded_error()

    def get(self, key: str) -> bytes:
        self._until_present(self._ks([key]), None)
        return super().get(key)

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        self._until_present(self._ks(keys), timeout)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        self._until_present(self._ks(keys), None)
        return super().multi_get(keys)
