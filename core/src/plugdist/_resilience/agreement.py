"""Agreement: the members of the next epoch, decided once, read the same by every survivor.

Shrink (``agree_shrink`` with no exclusions): each survivor appends its uid to the epoch's
arrival log; the first surviving member in rank order (the coordinator) reads that log with
parked waits until every member it does not know failed has arrived, writes the decision (one
compare-and-set; a member that sees the coordinator fail takes over), and announces it in the
death log. The others wait for that announcement: O(N) messages in all. With exclusions, the
first decision written wins, without waiting for anyone.

Grow (``agree_grow``): every member proposes the tickets waiting, in ticket order; the first
proposal written wins and the joiners are told their epoch (``plugdist/join/<n>/admitted``).

Entering (``enter``): the decision's members are recorded once per epoch (compare-and-set), so a
shrink and a grow agreed concurrently from one epoch cannot build two worlds under one number.

Blocking and threads: every call runs on the caller's thread and blocks for store round trips;
``agree_shrink`` and ``agree_grow`` up to their ``timeout`` (DistTimeoutError then, naming who
neither arrived nor failed). A waiting member is woken by the monitor thread (the announcement
or a death, through ``_events``), and re-reads the store every ``_DECISION_RECHECK`` s in case
the announcement was lost with its writer (``_POLL`` where no monitor delivers it).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from plugdist._log import get_logger
from plugdist._resilience.cleanup import forget_epochs, trim
from plugdist._resilience.death_log import DeathLog
from plugdist._resilience.writes import append_log
from plugdist.errors import DistRankFailureError, DistTimeoutError, timed_out
from plugdist.store import Store
from plugdist.store._worldkeys import (
    CURRENT,
    JOIN_COUNT,
    JOIN_DONE,
    admitted_key,
    arrived_key,
    decision_key,
    grow_key,
    joiner_uid,
    members_key,
    seen_key,
    ticket_key,
)

__all__ = ["Agreement", "Decision"]

_POLL = 0.05  # seconds between looks at the store while agreeing, where nothing wakes us
_COORDINATOR_SLICE = 0.25  # longest wait of the coordinator on the arrival log at a time
# longest wait of a non-coordinator for the decision between re-checks of the store, where the
# monitor's parked wait delivers the announcement (it re-checks in case that announcement was
# lost with a coordinator that died between its write and its announcement)
_DECISION_RECHECK = 2.0


class Decision:
    """What the members agreed for the next epoch."""

    def __init__(self, epoch: int, members: list[str], joined: list[str]) -> None:
        self.epoch, self.members, self.joined = epoch, members, joined


class Agreement(DeathLog):
    """The collectives that move the world from one epoch to the next."""

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
        decided = decision_key(e, retry)
        limit = timeout.total_seconds()
        deadline = time.monotonic() + limit
        if exclude is not None:
            record = {"excluded": [u for u in self.members if u in exclude]}
            record = json.loads(self._writes.compare_set(decided, b"", json.dumps(record)))
        else:
            arrivals = arrived_key(e, retry)
            append_log(self._writes, arrivals, self.uid)
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
        decided = grow_key(e, seq)
        if not store.check([decided]):
            done = store.add(JOIN_DONE, 0)
            count = store.add(JOIN_COUNT, 0)
            joiners = []
            for n in range(done + 1, count + 1):
                if not store.check([ticket_key(n)]):
                    break  # registered its ticket but not yet its liveness: next time
                uid = joiner_uid(n)
                with self._lock:
                    dead = uid in self.failed
                if not dead:
                    joiners.append((n, uid))
                done = n
            ours = json.dumps({"joiners": joiners, "done": done})
            if self._writes.compare_set(decided, b"", ours) == ours.encode() and joiners:
                # the joiners read the new epoch's members as soon as they are admitted
                self._writes.compare_set(members_key(e + 1), b"", json.dumps(
                    self.members + [uid for _, uid in joiners]))
        record = json.loads(store.get(decided))
        joiners = [(int(n), uid) for n, uid in record["joiners"]]
        done_now = store.add(JOIN_DONE, 0)
        if record["done"] > done_now:  # the same value from every member: one write wins
            self._writes.compare_set(JOIN_DONE, str(done_now), str(record["done"]))
        with self._lock:
            self._join_done = max(self._join_done, int(record["done"]))
            self._count_joiners()
        if not joiners:
            return None
        members = self.members + [uid for _, uid in joiners]
        for n, _ in joiners:
            self._writes.set(admitted_key(n), str(e + 1))
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
        recorded = writes.compare_set(members_key(decision.epoch), b"", mine)
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
        writes.set(seen_key(decision.epoch, self.uid), str(self._seen_deaths))
        if first:
            forget_epochs(writes, decision.epoch - 2)
            with self._lock:
                gone = set(self.failed)
            trim(store, writes, decision.epoch, self.members, self._join_done,
                 heartbeats=self.store_liveness is None, gone=gone)
        return decision
