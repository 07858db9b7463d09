"""The ``Store`` interface: a key-value store shared by every rank of a job.

Keys are ``str``; values are ``bytes`` (``str`` values are accepted and UTF-8 encoded). Every
method of the shipped stores is thread-safe. Methods that wait (``get``, ``wait``,
``multi_get``, a blocking ``queue_pop``) block the calling thread until the keys exist or the
timeout passes, then raise :class:`~plugdist.errors.DistTimeoutError` (its message contains
"timeout" and names the missing keys). ``add`` on a key written by ``set`` with a non-integer
value raises ``DistStoreError``.

``Store`` itself is a base class that may be subclassed partially, as torch's ``Store`` can: a
subclass overrides what it supports, and a method it did not override raises
``NotImplementedError`` ("Not implemented.") when called. ``append``, ``multi_get`` and
``multi_set`` have fallbacks built on ``compare_set``, ``get`` and ``set``.

Queues (``queue_push``/``queue_pop``/``queue_len``) live beside the keys: a key may hold a value
and a queue at once. ``check`` and ``wait`` see a key whose queue is not empty as present;
``get`` sees values only; ``num_keys`` counts values only.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Protocol

__all__ = ["Store", "Will", "MemberSession", "DEFAULT_STORE_TIMEOUT", "to_bytes", "to_seconds"]

DEFAULT_STORE_TIMEOUT = timedelta(seconds=300)


def to_bytes(value: bytes | bytearray | memoryview | str) -> bytes:
    """Store values are bytes; ``str`` is UTF-8 encoded."""
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"store values must be bytes or str, got {type(value).__name__}")


def to_seconds(timeout: timedelta | float | int) -> float:
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)



class Will(Protocol):
    """What :meth:`Store.hold_will` returns: a will the store executes unless ``cancel()`` is
    called first.

    ``liveness_timeout``: seconds within which the store executes the will of a process that
    died *or stalled* (its ttl and check), or None where the store notices only a dropped
    connection (membership then adds heartbeats). ``death_timeout``: how soon the will of a
    process that died runs (0 for a store that sees a dropped connection at once), or None for
    ``liveness_timeout``. ``read_log(start, timeout)``: :meth:`Store.read_log` of the will's own
    log ``key`` (one parked reader at a time; a store that has no cheaper way calls its own
    ``read_log``): blocks up to ``timeout`` seconds, then raises DistTimeoutError."""

    @property
    def liveness_timeout(self) -> float | None: ...
    @property
    def death_timeout(self) -> float | None: ...
    def cancel(self) -> None: ...
    def read_log(self, start: int, timeout: float, /) -> list[bytes]: ...


class MemberSession(Protocol):
    """What :meth:`Store.claim_member` and :meth:`Store.join_member` return: a member identity
    the store holds, and the writes it checks. Keys are relative to the world's root; each
    write raises DistStoreError when the store refuses it. ``protected``: the store owns the
    membership keys (only sessions may write them). ``start``/``ticket``: for a joiner, how far
    the death log ran when it took its ticket, and the ticket (0 and 0 for a rank). A session
    may also offer ``append_log(key, value) -> int`` (a numbered log's next entry in one
    request); membership uses it where it exists, an ``add`` and a ``set`` where not."""

    @property
    def will(self) -> Will: ...
    @property
    def uid(self) -> str: ...
    @property
    def start(self) -> int: ...
    @property
    def ticket(self) -> int: ...
    @property
    def protected(self) -> bool: ...

    def set(self, key: str, value: bytes | str) -> None: ...
    def add(self, key: str, amount: int) -> int: ...
    def compare_set(self, key: str, expected_value: bytes | str,
                    desired_value: bytes | str) -> bytes: ...
    def delete_key(self, key: str) -> bool: ...
    def delete_prefix(self, prefix: str) -> int: ...
    def record(self, record: bytes | str) -> bool: ...

class Store:
    """Base of every store. See the module docstring for the shared contract."""

    def __init__(self, timeout: timedelta = DEFAULT_STORE_TIMEOUT) -> None:
        self._timeout = timeout

    def _not_implemented(self, method: str) -> NotImplementedError:
        return NotImplementedError(
            f"{type(self).__name__}.{method}: Not implemented. This Store subclass does not "
            f"override {method}(); override it to support the call")

    @property
    def timeout(self) -> timedelta:
        """Default timeout of ``get``, ``wait`` and a blocking ``queue_pop``."""
        # a subclass may skip Store.__init__ (torch's allows it)
        return getattr(self, "_timeout", DEFAULT_STORE_TIMEOUT)

    def set_timeout(self, timeout: timedelta) -> None:
        """Change the default timeout of ``get``, ``wait`` and a blocking ``queue_pop``."""
        self._timeout = timeout

    # ---- the core operations: every store overrides these ----------------------------------

    def set(self, key: str, value: bytes | str) -> None:
        """Write ``value`` under ``key``, replacing any value; wakes waiters on ``key``."""
        raise self._not_implemented("set")

    def get(self, key: str) -> bytes:
        """The value of ``key``; blocks until it exists, up to the store's timeout."""
        raise self._not_implemented("get")

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the integer under ``key`` (created at 0); returns the
        sum."""
        raise self._not_implemented("add")

    def compare_set(self, key: str, expected_value: bytes | str,
                    desired_value: bytes | str) -> bytes:
        """Atomically set ``key`` to ``desired_value`` if its value equals ``expected_value``
        (or if the key is missing and ``expected_value`` is empty); returns the value now held.
        A missing key with a non-empty ``expected_value`` is left missing and ``expected_value``
        is returned."""
        raise self._not_implemented("compare_set")

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        """Block until every key in ``keys`` exists (a value, or a non-empty queue), or raise
        DistTimeoutError naming the missing ones."""
        raise self._not_implemented("wait")

    def check(self, keys: Sequence[str]) -> bool:
        """True when every key in ``keys`` exists right now. Does not block."""
        raise self._not_implemented("check")

    def num_keys(self) -> int:
        """Number of keys stored (as torch counts them: see each store)."""
        raise self._not_implemented("num_keys")

    def delete_key(self, key: str) -> bool:
        """Delete ``key`` (its value and its queue); True if it existed."""
        raise self._not_implemented("delete_key")

    # ---- the extended operations: fallbacks on the core ones --------------------------------

    def has_extended_api(self) -> bool:
        """True when ``append``, ``multi_get`` and ``multi_set`` are native (one request each)
        rather than the fallbacks of this base class."""
        return False

    def append(self, key: str, value: bytes | str) -> None:
        """Append ``value`` to the bytes under ``key`` (created if missing). The fallback retries
        ``compare_set`` until no other writer came in between; like torch's, it cannot tell a key
        that already holds exactly ``value`` from one it just created (it then appends nothing):
        override ``append`` where that matters. The shipped stores' ``append`` is native."""
        tail = to_bytes(value)
        expected = tail
        current = self.compare_set(key, b"", expected)
        while current != expected:
            expected = bytes(current) + tail
            current = self.compare_set(key, current, expected)

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """The values of ``keys``; blocks like ``get`` until all exist."""
        return [self.get(k) for k in keys]

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes | str]) -> None:
        """Set each key to the matching value."""
        if len(keys) != len(values):
            raise ValueError(f"multi_set got {len(keys)} keys but {len(values)} values")
        for k, v in zip(keys, values, strict=True):
            self.set(k, to_bytes(v))

    def queue_push(self, key: str, value: bytes | str) -> None:
        """Append ``value`` to the FIFO queue ``key``; wakes one blocked ``queue_pop`` and every
        ``wait`` on ``key``."""
        raise self._not_implemented("queue_push")

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """Remove and return the oldest value of queue ``key``. Blocking (the default): waits up
        to the store's timeout, then DistTimeoutError. ``block=False``: QueueEmptyError at once
        if the queue is empty. Each value goes to exactly one caller."""
        raise self._not_implemented("queue_pop")

    def queue_len(self, key: str) -> int:
        """Number of values in queue ``key`` (0 if it never existed)."""
        raise self._not_implemented("queue_len")

    def delete_prefix(self, prefix: str) -> int:
        """Optional: delete every key (value and queue) whose name starts with ``prefix``;
        returns how many. Used to forget the keys of finished epochs."""
        raise self._not_implemented("delete_prefix")

    def hold_will(self, key: str, value: bytes | str, ttl: float | None = None) -> Will:
        """Optional (liveness for resilient groups): leave a will that the store itself
        executes when this process's hold ends without the returned object's ``cancel()`` — the
        process died, or lost the store: ``value`` is appended to the numbered log ``key`` (the
        counter ``key`` becomes n, the value lands at ``f"{key}/{n}"``). A store that cannot
        notice a client's death raises NotImplementedError; membership then relies on
        heartbeats alone, which suits small worlds only (every member reads every other's).

        ``ttl`` (seconds): also execute the will when this process stops renewing it for that
        long (it was stopped, or hangs): the store's liveness then covers hangs too, at O(1)
        cost per member. A store may use a shorter ttl of its own; one without expiry ignores
        it (its will then has no ``liveness_timeout``). The renewal is the store's business (a
        thread of the store client), not the caller's.

        Returns a :class:`Will` (``cancel()``, ``liveness_timeout``, ``death_timeout``,
        ``read_log``). Where ``liveness_timeout`` is set, membership writes no heartbeats of its
        own and allows ``death_timeout`` (+1 s) for a transport's error to be confirmed; it
        waits on the death log through the will's ``read_log``."""
        raise self._not_implemented("hold_will")

    def claim_member(self, root: str, uid: str, world_size: int, ttl: float) -> MemberSession:
        """Optional (a world whose membership the store owns): hold the identity ``uid``, a
        rank of the first epoch of a world of ``world_size`` ranks whose membership keys live
        under the key prefix ``root``, with a will that the store writes itself (as
        :meth:`hold_will`, record ``{"uid": uid, "cause": "died"}`` in ``root`` +
        ``plugdist/live/deaths``). A store that owns membership refuses a plain write to any key
        :func:`plugdist.store._worldkeys.is_reserved` names, and a claim on an identity another
        live process holds, whose holder left, or of another world size (DistStoreError saying
        so). Returns a :class:`MemberSession`: its ``will`` (as :meth:`hold_will`'s), ``uid``,
        and the writes ``set``, ``add``, ``compare_set``, ``delete_key``, ``delete_prefix`` on
        keys relative to ``root``, and ``record(json)`` (append to the death log), each checked
        by the store. A store without it raises NotImplementedError: membership then writes its
        keys with plain writes, which any client of the store could forge."""
        raise self._not_implemented("claim_member")

    def join_member(self, root: str, ttl: float) -> MemberSession:
        """Optional, with :meth:`claim_member`: ask to join the world under ``root``; the store
        takes a ticket n, writes it, announces it in the death log and holds the identity
        ``j<n>`` for this process. The session has ``ticket`` and ``start`` (the death log's
        length before the announcement) besides what :meth:`claim_member`'s has."""
        raise self._not_implemented("join_member")

    def membership_exposure(self) -> str | None:
        """Optional: why any process that reaches this store could forge a world's membership
        in it (it does not own those keys, as :meth:`claim_member` does, and it is reachable
        beyond loopback without authentication), or None (it owns them, it is not exposed, or
        it cannot tell). Where it says so, resilient groups stay off unless turned on
        explicitly (``PLUGDIST_RESILIENCE=1``), with one warning naming why and the fix."""
        return None

    def keep_node_wills(self, directory: str) -> Any:
        """Optional (liveness at scale): renew, from this process, the wills (:meth:`hold_will`)
        of the processes it starts on its host, so the store serves one renewal per host
        rather than one per process. Returns a keeper with ``env`` (a dict of environment
        variables to give each started process: their wills then go through the keeper;
        ``directory``, an existing or creatable private directory, is where they reach it) and
        ``close()`` (idempotent; wills still held then run). The contract of the wills does
        not change: a process that dies or stops running has its will executed within its
        ``liveness_timeout``. ``plugdist-run``'s agent opens one on its rendezvous store where
        the store offers it. A store without it raises NotImplementedError: each process then
        renews its own will (a TCPStore's renewal is one small frame; see the resilience
        docs for why it offers no keeper)."""
        raise self._not_implemented("keep_node_wills")

    def read_log(self, key: str, start: int, timeout: timedelta | None = None) -> list[bytes]:
        """The entries ``f"{key}/{start}"``, ``f"{key}/{start + 1}"``, ... of the numbered log
        ``key`` (see :meth:`hold_will`), up to the first one missing; blocks until the first
        exists, up to ``timeout`` (default: the store's), then raises DistTimeoutError. A
        store that had to wait may return the first entry alone (etcd's comes with the event
        that woke it); the caller reads on from the next. A TCPStore answers with one parked
        request, however many entries; this fallback waits, then reads the counter and the
        entries one by one."""
        first = f"{key}/{start}"
        self.wait([first], timeout)
        total = self.add(key, 0)
        entries = [self.get(first)]
        for n in range(start + 1, total + 1):
            entry = f"{key}/{n}"
            if not self.check([entry]):
                break  # its writer has counted it but not written it yet
            entries.append(self.get(entry))
        return entries

    def clone(self) -> Store:
        """A new, independent handle on the same data (its own connections or file handle), for
        use from another thread without sharing this object's state."""
        raise self._not_implemented("clone")

    def close(self) -> None:
        """Release connections and files. Idempotent."""
