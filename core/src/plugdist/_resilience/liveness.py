"""Liveness: how the members learn that one of them died or hung, off the hot path, on one
monitor thread per process, at O(1) cost per member.

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

When the monitor learns of a failure it aborts (``ProcessGroup.abort``) every group it watches
that holds the failed member, so blocked ops are released with ``DistRankFailureError`` at once.

Threading and timeouts: the monitor (a daemon thread, ``plugdist-membership-<uid>``) waits on
the death log at most ``_PARKED_WAIT`` s where the will's cancel ends that wait, else at most
``_WAKE`` (heartbeats) or ``_QUIET_INTERVAL`` s (store liveness), so that a stop is heeded
within a second; it outlives a store that does not answer (logged once, retried each
``interval``). :meth:`Liveness._stop_liveness` blocks up to a second for the thread.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from plugdist._resilience.death_log import DeathLog, store_reader
from plugdist.errors import DistError, DistTimeoutError
from plugdist.store import PrefixStore, Store
from plugdist.store._worldkeys import (
    CURRENT,
    DEATHS,
    JOIN_COUNT,
    JOIN_DONE,
    TRIM,
    heartbeat_key,
    members_key,
)
from plugdist.store.api import Will

__all__ = ["Liveness", "hold_will", "plain_will"]

# seconds the monitor's wait on the death log lasts where the will's cancel ends it at once
# (a TCPStore will's read_log): the idle cost of a member is one parked request per this long
_PARKED_WAIT = 30.0
_WAKE = 0.2  # longest wait on the death log at a time: how soon ``stop`` is heeded
# seconds between the monitor's looks where the store serves liveness: with no heartbeats to
# write or read, it only re-reads the epoch record (a death wakes its wait at once anyway);
# short enough that stop()'s one-second join still finds the monitor done
_QUIET_INTERVAL = 0.5
_kept_wills: list[Any] = []  # wills of stopped members left to run at this process's exit


def hold_will(store: Store, key: str, value: str, ttl: float) -> Will:
    """``store.hold_will`` with a ttl, or without one for a store written before ttl existed."""
    try:
        return store.hold_will(key, value, ttl=ttl)
    except TypeError:
        return store.hold_will(key, value)


def plain_will(store: Store, uid: str, ttl: float) -> Will | None:
    """The will of member ``uid`` on a store that does not own membership; None where the
    store has no wills (heartbeats alone then)."""
    try:
        return hold_will(store, DEATHS, json.dumps({"uid": uid, "cause": "died"}), ttl)
    except NotImplementedError:
        return None


class Liveness(DeathLog):
    """The monitor thread: waits on the death log, beats and reads heartbeats where the store's
    wills do not cover hangs, and notices when the world moved on without this process."""

    def _prepare_monitor(self) -> None:
        """Choose how the monitor waits on the death log, once the will is held: a parked wait
        on the will's own connection where it has one, else the store's (a clone of it where it
        can be cloned, so that the wait does not hold up the caller's requests)."""
        will = self._will
        if will is not None and self.store_liveness is not None:
            will_reader = will.read_log
            # one parked wait at a time on the will's own connection; cancel() ends it
            self._reader = lambda start, wait: will_reader(start, wait)
            self._parked = True
            self._monitor_store = self.store  # for the rare look at the epoch record
        else:
            try:
                self._monitor_store = self.store.clone()
            except NotImplementedError:
                self._monitor_store = self.store
            self._reader = store_reader(self._monitor_store)

    def _start_monitor(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"plugdist-membership-{self.uid}",
                                        daemon=True)
        self._thread.start()

    def _stop_liveness(self, withdraw: bool) -> None:
        """Withdraw the will (or keep it, to run at this process's exit: ``withdraw`` False)
        and stop the monitor. Idempotent; blocks up to a second (see Membership.stop)."""
        self._stop.set()
        will, self._will = self._will, None
        if will is not None and withdraw:
            will.cancel()
        elif will is not None:
            _kept_wills.append(will)  # not collected (which could close it) before the exit
        thread, self._thread = self._thread, None
        # a monitor parked on the will's connection wakes only when the will is withdrawn: one
        # kept for the exit would hold this up for the join's whole second (the daemon thread
        # ends with the process)
        parked_for_good = self._parked and not withdraw
        if (thread is not None and thread is not threading.current_thread()
                and not parked_for_good):
            thread.join(1.0)
        mon, self._monitor_store = self._monitor_store, None
        if mon is not None and mon is not self.store:
            while isinstance(mon, PrefixStore):  # the clone is ours: close what it wraps
                mon = mon.underlying_store
            mon.close()

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
                    self._reader = store_reader(self.store)
                    every = max(self.interval, _QUIET_INTERVAL)
                    wake = min(every, _QUIET_INTERVAL)
                self._stop.wait(self.interval)
            except Exception as err:  # noqa: BLE001 - the monitor must outlive a bad read
                self._log.warning("membership_monitor_error", error=repr(err))
                self._stop.wait(self.interval)

    def _beat_and_check(self, store: Store) -> None:
        """The monitor's periodic look: beat, read the others' heartbeats (declaring one that
        stood still for ``hang_timeout`` hung), the joiners waiting, how far the death log was
        trimmed, and whether the world entered an epoch without this process."""
        with self._lock:
            others = [u for u in self.members if u != self.uid and u not in self.failed]
            epoch = self.epoch
        if self.store_liveness is None:
            if self.excluded_reason is None:
                self._writes.add(heartbeat_key(self.uid), 1)
        else:
            others = []  # the store's liveness covers hangs: nothing to beat or watch
        control = [CURRENT, JOIN_COUNT, JOIN_DONE, TRIM]
        keys = [heartbeat_key(u) for u in others] + control
        if not store.check(keys):
            # a member has not beaten yet, or its heartbeat went with the record of its death
            others, keys = [], control
            if not store.check(keys):
                return
        *beats, current, asked, admitted, trim = store.multi_get(keys)
        self._count_waiting(int(asked), int(admitted))
        self._skip_trimmed(int(json.loads(trim)["log"]))
        now = time.monotonic()
        for u, beat in zip(others, beats, strict=True):
            last = self._last_beat.get(u)
            if last is None or last[0] != beat:
                self._last_beat[u] = (bytes(beat), now)
            elif now - last[1] > self.hang_timeout:
                self._declare_hung(u, now - last[1])
        if int(current) > epoch and self.admitted:
            self._check_still_member(store, int(current))

    def _declare_hung(self, uid: str, silent: float) -> None:
        self._declare(uid, {"cause": "hung", "after": round(silent, 1)})

    def _check_still_member(self, store: Store, current: int) -> None:
        key = members_key(current)
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
