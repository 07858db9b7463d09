"""Joining: a new process asks to be admitted into a running world
(``init_process_group(join=True)``), and waits until the members admit it at their next
``grow_group``.

A :class:`Joiner` takes a ticket n (its member id is ``j<n>``): where the store owns
membership, the store takes it and announces it itself (``Store.join_member``); elsewhere the
joiner counts it, writes it (with where it starts reading the death log: a trim keeps what
comes after) and announces it in the death log, so that the members learn of it from the wait
they already hold. Then it starts liveness (so the members see it die) and waits for
``plugdist/join/<n>/admitted``.

Blocking: :meth:`Joiner.join` blocks up to its timeout (DistTimeoutError), or until the world
closes (:class:`WorldClosedError`: every member left), re-checking about once a second. A joiner
that gives up (the timeout, any error) says so in the death log before it withdraws its will,
so that no later grow admits it: a will withdrawn in silence left its ticket looking alive, and
a grow that admitted such a ticket built a group that waited for it in vain.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta

from plugdist._resilience.agreement import Decision
from plugdist._resilience.liveness import plain_will
from plugdist._resilience.membership import Membership
from plugdist._resilience.policy import hang_timeout_setting
from plugdist._resilience.writes import Identity, PlainWrites
from plugdist.errors import DistError, DistTimeoutError, WorldClosedError, timed_out
from plugdist.store import Store
from plugdist.store._worldkeys import (
    CLOSED,
    CURRENT,
    DEATHS,
    JOIN_COUNT,
    epoch_key,
    join_admitted,
    join_ticket,
)

__all__ = ["Joiner", "request_join"]


class Joiner:
    """One process's request to join the world on ``store``: its ticket, the identity it holds
    with it, and its membership once started. Used once, from one thread."""

    def __init__(self, store: Store, interval: float | None = None) -> None:
        self.store = store
        self.interval = interval
        self.hang_timeout = hang_timeout_setting()
        self.ticket = 0
        self.uid = ""
        self.epoch = 0  # the epoch current when it took its ticket
        self.identity: Identity | None = None

    def join(self, timeout: timedelta) -> tuple[Membership, Decision]:
        """Take a ticket, start liveness, and block until the members admit this process
        (bounded by ``timeout``). Returns its membership, entered into the admitting epoch, and
        that epoch's decision."""
        identity = self._take_ticket()
        me = Membership(self.store, self.uid, [], self.epoch, interval=self.interval,
                        hang_timeout=self.hang_timeout)
        me.start(identity=identity)
        try:
            epoch, members = self._await_admission(timeout)
        except BaseException as err:
            try:
                identity.writes.record(json.dumps({
                    "uid": self.uid, "cause": "left",
                    "how": f"it gave up joining: {type(err).__name__}"}))
            except DistError:
                pass  # a store that is gone: nobody is left to admit it either
            me.stop()
            raise
        me.enter_admitted(epoch, members, self.ticket)
        return me, Decision(epoch, members, [self.uid])

    def _take_ticket(self) -> Identity:
        """The ticket, identity and will, and the announcement in the death log (by the store
        itself where it owns membership). A joiner reads the death log from where it ran at its
        ticket: it cares only about deaths from then on."""
        store = self.store
        try:
            session = store.join_member("", self.hang_timeout)
        except NotImplementedError:
            session = None
        if session is not None:
            self.uid, self.ticket = session.uid, session.ticket
            self.epoch = int(store.get(CURRENT))
            self.identity = Identity(session, session.will, session.start)
            return self.identity
        self.ticket = store.add(JOIN_COUNT, 1)
        self.uid = f"j{self.ticket}"
        writes = PlainWrites(store, self.uid)
        self.epoch = int(store.compare_set(CURRENT, b"", b"0") or 0)
        will = plain_will(store, self.uid, self.hang_timeout)
        start = store.add(DEATHS, 0)
        self.identity = Identity(writes, will, start)
        # where this joiner started reading the death log: a trim keeps what comes after
        store.set(join_ticket(self.ticket), json.dumps({"uid": self.uid, "start": start}))
        # the members learn of it from the wait they hold on the log, not by polling
        writes.record(json.dumps({"uid": self.uid, "cause": "joining", "ticket": self.ticket}))
        return self.identity

    def _await_admission(self, timeout: timedelta) -> tuple[int, list[str]]:
        """The epoch that admitted this process and its members."""
        store, admitted = self.store, join_admitted(self.ticket)
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
                        f"left) before admitting member {self.uid}; there is nothing to join") \
                        from None
                if time.monotonic() >= deadline and not store.check([admitted]):
                    here = f"[member {self.uid}, op init_process_group(join=True)]"
                    raise DistTimeoutError(
                        f"{timed_out(here, timeout.total_seconds(), 'admission')}: the running "
                        f"ranks admit joiners when they call plugdist.grow_group()") from None
        epoch = int(store.get(admitted))
        members_key = epoch_key(epoch, "members")
        store.wait([members_key], timeout)
        return epoch, json.loads(store.get(members_key))


def request_join(store: Store, timeout: timedelta,
                 interval: float | None = None) -> tuple[Membership, Decision]:
    """For a new process: :meth:`Joiner.join` (take a ticket, start liveness, block until
    admitted, at most ``timeout``)."""
    return Joiner(store, interval).join(timeout)
