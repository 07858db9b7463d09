"""What the members no longer need, deleted as epochs go by, so that the store's keys stay
bounded however many shrinks and grows a world goes through.

On entering an epoch, its first rank (alone) drops the agreement keys and group keys of the
epoch before last (:func:`forget_epochs`) and trims (:func:`trim`): the death log's entries
that every member had read when it entered the previous epoch and that came before every
waiting joiner's start, the claims and heartbeats of the members those entries record as
failed (:func:`forget_failed`), and the join tickets decided before the last trim. A process
that is no longer a member may find its next entry gone: it skips to what is left
(``DeathLog._skip_trimmed``).

Best effort: a few store round trips on the caller's thread, each bounded by the store's
timeout; any store error leaves the rest for the next epoch's trim. Concurrent trims (first
ranks of two epochs) delete the same keys at worst.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from datetime import timedelta

from plugdist._resilience.writes import MemberWrites
from plugdist.errors import DistError, DistTimeoutError
from plugdist.store import Store
from plugdist.store._worldkeys import (
    DEATHS,
    FORGOTTEN,
    JOIN_COUNT,
    TRIM,
    admitted_key,
    death_key,
    declared_key,
    epoch_prefix,
    group_prefix,
    heartbeat_key,
    joiner_uid,
    seen_key,
    ticket_key,
)

__all__ = ["trim", "forget_failed", "forget_epochs"]

_KEYS_AT_ONCE = 1024  # join tickets read per request (a store's per-request key limit is higher)


def trim(store: Store, writes: MemberWrites, epoch: int, members: Sequence[str],
         join_done: int, heartbeats: bool, gone: Collection[str] = ()) -> None:
    """Delete what no member or waiting joiner can need any more (the first rank of
    ``epoch``, whose ``members`` are given, on entering it): the death log's entries up to the
    lowest of how far each member had read it on entering the epoch before and where each
    waiting joiner started reading it; the claims and (``heartbeats``: the world beats) the
    heartbeats of the members those entries record as failed; the join tickets the last trim
    found decided. ``join_done``: the tickets up to this one were decided by the grows this
    member took part in; ``gone``: members and joiners known to have failed (a joiner among
    them no longer waits). Skipped, for a later epoch to do, while a member had not entered the
    epoch before (a joiner admitted into it) or a joiner has taken a number but not yet written
    its ticket. Where the store owns membership (``writes.protected``) the trim record alone is
    written: the store checks it and deletes the entries and tickets itself."""
    try:
        raw = store.get(TRIM)
        state = json.loads(raw)
        if state["epoch"] >= epoch:
            return
        marks = [seen_key(epoch - 1, u) for u in members]
        if not store.check(marks):
            return
        floor = min(int(v) for v in store.multi_get(marks))
        # read after the members' marks: a joiner that takes a ticket now starts past them
        count = store.add(JOIN_COUNT, 0)
        waiting = [ticket_key(n) for n in range(state["done"] + 1, count + 1)
                   if joiner_uid(n) not in gone]
        for at in range(0, len(waiting), _KEYS_AT_ONCE):
            tickets = waiting[at:at + _KEYS_AT_ONCE]
            if not store.check(tickets):
                return
            floor = min(floor, *(json.loads(t)["start"] for t in store.multi_get(tickets)))
        trimmed = max(state["log"], floor)
        if floor > state["log"]:
            forget_failed(store, writes, state["log"] + 1, floor, heartbeats)
            if not writes.protected:
                for n in range(state["log"] + 1, floor + 1):
                    writes.delete_key(death_key(n))
        if not writes.protected:
            for n in range(state["tickets"] + 1, state["done"] + 1):
                writes.delete_key(ticket_key(n))
                writes.delete_key(admitted_key(n))
        # the grows this member took part in admitted their joiners into this epoch at
        # the latest: the next trim, from a later epoch, finds them entered or gone
        done = max(state["done"], join_done)
        writes.compare_set(TRIM, raw, json.dumps({
            "epoch": epoch, "log": trimmed, "tickets": state["done"], "done": done}))
    except (DistError, NotImplementedError, ValueError, KeyError):
        pass  # the next epoch's trim deletes it all


def forget_failed(store: Store, writes: MemberWrites, first: int, last: int,
                  heartbeats: bool) -> None:
    """Delete the claims and (``heartbeats``) heartbeats of the members that death-log entries
    ``first`` to ``last`` record as failed (every member knows it from those entries). Nothing
    where the store owns membership: it keeps no claims, and its liveness needs no heartbeats."""
    try:
        entries = store.read_log(DEATHS, first, timedelta(0))[:last - first + 1]
    except DistTimeoutError:
        return  # deleted meanwhile by another epoch's trim
    if writes.protected:
        return
    for raw in entries:
        try:
            record = json.loads(raw)
            cause, uid = record.get("cause"), str(record["uid"])
        except (ValueError, TypeError, KeyError, AttributeError):
            continue  # skipped when it was read
        if cause in ("hung", "excluded", "reported"):
            store.delete_key(declared_key(uid))
        if cause not in ("joining", "decided") and heartbeats:
            store.delete_key(heartbeat_key(uid))


def forget_epochs(writes: MemberWrites, last: int) -> None:
    """Drop the keys of every epoch up to ``last`` not dropped yet (the first rank of an epoch
    that died before entering it left the epoch before last behind)."""
    if last < 0:
        return
    try:
        done = int(writes.compare_set(FORGOTTEN, b"", b"-1"))
        for epoch in range(done + 1, last + 1):
            writes.delete_prefix(epoch_prefix(epoch))
            writes.delete_prefix(group_prefix(epoch, ""))
        if last > done:
            writes.compare_set(FORGOTTEN, str(done), str(last))
    except (DistError, NotImplementedError):
        pass  # a store that cannot delete by prefix keeps them: a few keys per epoch
