"""The death log: the world's event log, and what a member learns from it.

The log is the numbered log ``plugdist/live/deaths`` (``Store.read_log``). Its records are
JSON objects with a ``uid`` and a ``cause``: a death (``died``: a will ran; ``hung``,
``excluded``, ``reported``: declared by a member, once each; ``left``: a joiner gave up), a
``joining`` record (a process waits to be admitted, with its ``ticket``) or a ``decided``
record (an agreement's outcome was written, under ``key``). Members learn of all three from
the one wait they already hold on the log, without polling.

A record that cannot be read (a store that does not own membership holds whatever a client
wrote) is logged and skipped, never the end of the log. Entries the members no longer need are
deleted as epochs go by (:mod:`plugdist._resilience.cleanup`); a process that fell that far
behind skips to what is left.

Threading: :meth:`DeathLog._take` and :meth:`DeathLog._skip_trimmed` run on the monitor thread
(or in a test, on the caller's); they change the shared fields under the lock and notify
waiting agreements. :meth:`DeathLog.report` runs on any thread; it never raises for a store
that does not answer.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

from plugdist._log import lifecycle
from plugdist._resilience.state import MemberState
from plugdist.errors import DistError, DistTimeoutError
from plugdist.store import Store
from plugdist.store._worldkeys import DEATHS, joiner_uid

__all__ = ["DeathLog", "store_reader"]


def store_reader(store: Store) -> Any:
    """A wait on the death log through ``store.read_log``: (first entry wanted, seconds) ->
    entries; raises DistTimeoutError when none came."""
    return lambda start, wait: store.read_log(DEATHS, start, timedelta(seconds=wait))


class DeathLog(MemberState):
    """Reading the death log, and writing into it what this process saw fail."""

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

    def _count_joiners(self) -> None:
        """``joiners_waiting`` from the announced tickets not yet admitted (under the lock)."""
        self.joiners_waiting = sum(1 for t in self._join_tickets
                                   if t > self._join_done and joiner_uid(t) not in self.failed)

    def _count_waiting(self, asked: int, admitted: int) -> None:
        """``joiners_waiting`` from the store's join counters (tickets taken, tickets admitted
        or passed over), less the tickets whose joiner failed or gave up (the death log's)."""
        with self._lock:
            gone = sum(1 for t in self._join_tickets
                       if admitted < t <= asked and joiner_uid(t) in self.failed)
            self.joiners_waiting = max(asked - admitted - gone, 0)

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
        """Record the failures ``news`` (uid -> how) and abort the groups they affect."""
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
