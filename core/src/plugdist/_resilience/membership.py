"""Membership: who is in the world, who has failed, who waits to join, and the epoch record the
survivors agree on. Knows nothing of any backend; everything goes through the world's store.

:class:`Membership` ties the parts: its fields and queries (:mod:`.state`), the death log
(:mod:`.death_log`), liveness (:mod:`.liveness`), agreement (:mod:`.agreement`, which cleans up
through :mod:`.cleanup`). A process that asks to join gets its Membership from
:mod:`.joining`; a group's store that gives up on a dead member is :mod:`.guarded_store`.

Store keys (under the world's store; names in :mod:`plugdist.store._worldkeys`):
``plugdist/live/deaths[/n]``, ``plugdist/live/hb/<uid>`` (heartbeats only),
``plugdist/live/declared/<uid>``, ``plugdist/live/trim``, ``plugdist/epoch/current``,
``plugdist/epoch/forgotten``, ``plugdist/epoch/<e>/...`` (agreement, and how far each member had
read the death log when it entered; removed two epochs later), ``plugdist/join/...``.

Who writes them: where the store owns membership (``Store.claim_member``: a TCPStore), this
process holds its identity with the store, which writes its death itself, takes join tickets
itself, and checks every other write against the world's current members; a stranger, or a
stray process of another job, cannot write any of them. Elsewhere membership writes them with
the store's plain operations (:mod:`.writes`).

Thread-safe; one per world. :meth:`Membership.start` blocks for a few store round trips and
starts the monitor thread; :meth:`Membership.stop` blocks up to a second.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

from plugdist._resilience.agreement import Agreement
from plugdist._resilience.liveness import Liveness, plain_will
from plugdist._resilience.writes import Identity, PlainWrites
from plugdist.errors import DistStoreError
from plugdist.store._worldkeys import (
    CURRENT,
    JOIN_COUNT,
    JOIN_DONE,
    NO_TRIM,
    TRIM,
    heartbeat_key,
)

if TYPE_CHECKING:
    from plugdist._group.process_group import ProcessGroup

__all__ = ["Membership"]


class Membership(Agreement, Liveness):
    """This process's view of the world's membership. Thread-safe; one per world.

    ``members`` are the uids of the current epoch in rank order. Start with :meth:`start`
    (leaves the will, starts the monitor), stop with :meth:`stop` (withdraws the will: a
    clean exit is not a failure)."""

    def start(self, only_with_store_liveness: bool = False,
              identity: Identity | None = None) -> bool:
        """Hold this member's identity and will (with a ttl of ``hang_timeout``) and start the
        monitor. Blocks for a few store round trips. ``only_with_store_liveness``: where the
        store's wills do not expire (no will, or one without ``liveness_timeout``), start
        nothing and return False instead of falling back to heartbeats. ``identity``: the one
        this process already holds (a joiner's, from its ticket:
        :mod:`plugdist._resilience.joining`). True when started. Raises DistStoreError when the
        store refuses the identity (another job's process reaching this store, see
        ``Store.claim_member``)."""
        held = identity or self._claim()
        self._writes, self._will, self._seen_deaths = held.writes, held.will, held.log_start
        self.store_liveness = self._will.liveness_timeout if self._will is not None else None
        if only_with_store_liveness and self.store_liveness is None:
            if self._will is not None:
                self._will.cancel()
                self._will = None
            return False
        self._prepare_monitor()
        if not self._writes.protected:
            if self.store_liveness is None:
                self.store.add(heartbeat_key(self.uid), 1)
            for counter in (JOIN_COUNT, JOIN_DONE):  # read together (multi_get)
                self.store.add(counter, 0)
            self.store.compare_set(TRIM, b"", NO_TRIM)
            self.store.compare_set(CURRENT, b"", b"0")
        self._start_monitor()
        return True

    def _claim(self) -> Identity:
        """A member of the first epoch: its identity held by the store where the store owns
        membership, else plain writes and a plain will."""
        try:
            session = self.store.claim_member("", self.uid, len(self.members),
                                              self.hang_timeout)
            return Identity(session, session.will)
        except NotImplementedError:
            return Identity(PlainWrites(self.store, self.uid),
                            plain_will(self.store, self.uid, self.hang_timeout))
        except DistStoreError as err:
            raise DistStoreError(f"[rank {self.uid}, op init_process_group] the world's "
                                 f"store refused this process: {err}") from None

    def stop(self, withdraw: bool = True) -> None:
        """Withdraw the will and stop the monitor. Idempotent; blocks up to a second while the
        monitor ends. ``withdraw=False`` (a process ending on an error) keeps the will: it runs
        when this process's connection to the store closes, as for a crash; a monitor parked
        on that connection is then left to end with the process, not waited for."""
        self._stop_liveness(withdraw)

    def watch(self, pg: ProcessGroup, uids: Sequence[str]) -> None:
        """Abort ``pg`` as soon as one of ``uids`` (its members, in group-rank order) fails."""
        pg.abort_signal.monitored = True
        # a transport error waits as long as the store takes to confirm a death
        death = self._will.death_timeout if self._will is not None else None
        if death is None:
            death = self.store_liveness
        if death is not None:
            pg.abort_signal.confirm_grace = max(pg.abort_signal.confirm_grace, death + 1.0)
        with self._lock:
            self._groups = [(r, u) for r, u in self._groups if r() is not None]
            self._groups.append((weakref.ref(pg), tuple(uids)))
        self._abort_affected()

    def enter_admitted(self, epoch: int, members: Sequence[str], ticket: int) -> None:
        """A joiner's entry into the epoch that admitted it, with ``members``; the grow that
        admitted it decided every join ticket up to its own, ``ticket``."""
        with self._lock:
            self.members, self.epoch, self.admitted = list(members), epoch, True
            self._join_done = ticket
