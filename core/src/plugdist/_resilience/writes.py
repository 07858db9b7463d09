"""The two ways a member writes the world's membership keys.

Where the store owns membership (``Store.claim_member`` / ``Store.join_member``: a TCPStore),
the session the store returns is the *checked* path: the server accepts each write only from a
current member of the world, so a stranger cannot forge a death or a decision. Elsewhere (etcd,
a FileStore, a third party's store) :class:`PlainWrites` writes them with the store's plain
operations, and the store's own access control is all that guards them. Both satisfy
:class:`MemberWrites`. Every call is one or two store round trips and blocks as long as the
store's operation does (its timeout); thread-safe as the store is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from plugdist.store import Store
from plugdist.store._worldkeys import DEATHS, declared_key
from plugdist.store.api import Will

__all__ = ["MemberWrites", "PlainWrites", "Identity", "append_log", "DECLARING_CAUSES"]

# the causes of a death-log record that one member writes about another: written only once
# across every member that declares it
DECLARING_CAUSES = ("excluded", "reported", "hung")


class MemberWrites(Protocol):
    """What membership needs of a write path."""

    @property
    def protected(self) -> bool:
        """True: the store checks every write against the world's members."""

    def set(self, key: str, value: bytes | str, /) -> Any: ...
    def add(self, key: str, amount: int, /) -> int: ...
    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str, /) -> bytes: ...
    def delete_key(self, key: str, /) -> Any: ...
    def delete_prefix(self, prefix: str, /) -> Any: ...
    def record(self, record: str, /) -> bool: ...


@dataclass
class Identity:
    """Who this process is to the world's store, once it holds its place: how it writes the
    world's keys and the will that records its death (None: the store has no wills), and
    ``log_start``: the death log's entries it need not read (a joiner's, from its ticket)."""

    writes: MemberWrites
    will: Will | None
    log_start: int = 0


class PlainWrites:
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
        if parsed.get("cause") in DECLARING_CAUSES:
            claim = declared_key(parsed['uid'])
            if self._store.compare_set(claim, b"", self._uid) != self._uid.encode():
                return False
        append_log(self._store, DEATHS, record)
        return True


def append_log(store: Any, key: str, value: str) -> int:
    """Append ``value`` to the numbered log ``key``, returning its number n: with a Store's
    plain writes, counted first, then written (a reader that finds the count ahead of the
    entry waits for the entry); a member session that appends in one request
    (``append_log``) does so."""
    append = getattr(store, "append_log", None)
    if append is not None:
        return int(append(key, value))
    n = int(store.add(key, 1))
    store.set(f"{key}/{n}", value)
    return n
