"""The TCPStore server's key space: the data and the queues, the primitives every write goes
through (each wakes whoever waits on its key, :mod:`plugdist.store._server.waiters`), the
wills' log appends (gathered for a few milliseconds, :data:`GATHER_WILLS_S`), and the
refusals a command may answer with. No sockets and no parsing: the
commands (:mod:`plugdist.store._server.commands`) and the worlds
(:mod:`plugdist.store._server.worlds`) call it.

Keys reserved for worlds' membership (:func:`plugdist.store._worldkeys.is_reserved`) refuse
every plain write; they change only through the worlds, which use these primitives
(:meth:`KeySpace.put`, :meth:`KeySpace.append_entry`, ...). Only the serving thread uses it;
nothing here blocks.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from plugdist.store import _wire as w
from plugdist.store._server.replies import Reply, name, ok, reply, seconds, write_refused
from plugdist.store._server.sliced import SLICE_KEYS, Sliced
from plugdist.store._server.waiters import Waiters
from plugdist.store._worldkeys import RESERVED_NAMES, is_job_key, is_reserved

__all__ = ["KeySpace", "GATHER_WILLS_S"]

# how long the wills of connections that close together are gathered before they are written:
# the sockets of a process killed with its node close within microseconds of each other but
# reach the serving loop over a few turns; gathered, a node's deaths reach each reader of the
# death log in one reply (at 16,384 readers, a reply each per turn cost the server 0.4 s)
GATHER_WILLS_S = 0.005


class KeySpace:
    """The data of one server. ``answer(conn, reply)`` sends a parked request's reply (after
    ``conn.waiter`` was cleared); ``max_value_bytes`` bounds a value (a SET, a MULTI_SET's, a
    COMPARE_SET's, what APPEND or QUEUE_PUSH may store); ``max_keys`` bounds the keys of one
    request (CHECK, WAIT, MULTI_GET, MULTI_SET); ``max_reply_bytes`` a reply's body (a
    MULTI_GET's values together); ``arm_will(conn)`` is called when ``conn``
    leaves a will with a ttl (``conn.will_ttl``/``conn.will_deadline`` set), so the server can
    watch the deadline, which RENEW moves without calling it again. ``notice(event, **fields)``
    logs a refusal (the server rate-limits it)."""

    def __init__(self, answer: Callable[[Any, Reply | Sliced], None], max_value_bytes: int,
                 arm_will: Callable[[Any], None] | None = None, *,
                 max_keys: int = 1 << 20, max_reply_bytes: int = w.MAX_FRAME,
                 notice: Callable[..., None] | None = None) -> None:
        self._arm_will = arm_will
        self.max_value_bytes = max_value_bytes
        self.max_keys = max_keys
        self.max_reply_bytes = max_reply_bytes
        self.notice = notice or (lambda event, **fields: None)
        self.data: dict[bytes, bytes] = {}
        self.queues: dict[bytes, deque[bytes]] = {}
        self.removals = 0  # deletions and emptied queues so far: a key seen may be gone since
        self.dying: list[tuple[bytes, bytes]] = []  # wills of closed connections, unwritten
        self.dying_since = 0.0  # when the first of them closed (monotonic)
        self._garbage: deque[list[bytes]] = deque()  # big lists done with, freed a slice a turn
        self.waiters = Waiters(self, self.data, self.queues, answer, max_value_bytes)
        self._waiting = self.waiters.waiting  # the same dict: a write's check stays one lookup
        self._key_created = self.waiters.key_created

    # ---- big lists, freed a slice a turn -----------------------------------------------------

    def discard(self, items: list[bytes]) -> None:
        """``items`` (a request's keys or pairs) is no longer needed: free it a slice a turn
        (:meth:`tidy`), not all at once (freeing 262,144 blobs took 2 ms)."""
        if len(items) > SLICE_KEYS:
            self._garbage.append(items)

    @property
    def untidy(self) -> bool:
        """Whether :meth:`tidy` has work left."""
        return bool(self._garbage)

    def tidy(self) -> None:
        """Free ``SLICE_KEYS`` of the blobs :meth:`discard` was given; once a turn."""
        items = self._garbage[0]
        del items[-SLICE_KEYS:]
        if not items:
            self._garbage.popleft()

    def wait_again(self, conn: Any, keys: list[bytes], timeout: float) -> Reply | None | Sliced:
        """A MULTI_GET being answered found a key deleted: wait for all its keys again, for
        ``timeout`` more seconds."""
        return self.waiters.wait_for(conn, w.Op.MULTI_GET, keys, max(timeout, 0.0))

    # ---- primitives (also the worlds' way to write their reserved keys) ----------------------

    def created_value(self, key: bytes) -> None:
        """A value now exists under ``key`` where none did."""
        if key in self._waiting:
            self._key_created(key)

    def value(self, key: bytes) -> bytes | None:
        return self.data.get(key)

    def put(self, key: bytes, value: bytes) -> None:
        """Set ``key``, waking the requests waiting for it."""
        created = key not in self.data
        self.data[key] = value
        if created:
            self.created_value(key)

    def put_all(self, values: dict[bytes, bytes]) -> None:
        """Set every key of ``values``, then wake the requests waiting for them."""
        data, waiting = self.data, self._waiting
        created = [k for k in waiting if k in values and k not in data] if waiting else []
        data.update(values)
        for key in created:
            self._key_created(key)

    def add_to(self, key: bytes, amount: int) -> int | bytes:
        """Add ``amount`` to the counter ``key``: the sum, or an ERROR reply."""
        old = self.data.get(key)
        if old is None:
            total = amount
        else:
            try:
                total = int(old) + amount
            except ValueError:
                return reply(w.Status.ERROR, (
                    f"add({name(key)!r}) met a value that is not an integer ({old[:32]!r}): "
                    f"the key was written by set(); use a separate key for counters").encode())
        if not -(2**63) <= total < 2**63:
            return reply(w.Status.ERROR, f"add({name(key)!r}) overflows a 64-bit counter "
                                         f"({total})".encode())
        self.data[key] = str(total).encode()
        if old is None:
            self.created_value(key)
        return total

    def read_counter(self, key: bytes) -> bytes:
        """The reply to ``add(key, 0)`` on a counter the caller may not create: its value, or 0
        while it does not exist."""
        old = self.data.get(key)
        try:
            return ok(w.I64.pack(int(old) if old is not None else 0))
        except ValueError:
            return reply(w.Status.ERROR, f"add({name(key)!r}) met a value that is not an "
                                         f"integer".encode())

    def compare_set(self, key: bytes, expected: bytes, desired: bytes) -> bytes:
        """Compare-and-set (see ``Store.compare_set``): the value now held."""
        current = self.data.get(key)
        if current is None:
            if expected:
                return expected
            self.data[key] = desired
            self.created_value(key)
            return desired
        if current == expected:
            self.data[key] = desired
            return desired
        return current

    def delete(self, key: bytes) -> bool:
        had_value = self.data.pop(key, None) is not None
        had_queue = bool(self.queues.pop(key, None))
        self.removals += had_value or had_queue
        return had_value or had_queue

    def delete_prefix(self, prefix: bytes, reserved_too: bool, job_too: bool = True) -> int:
        """Delete every key and queue starting with ``prefix`` (the reserved ones only with
        ``reserved_too``, the job keys only with ``job_too``); how many."""
        def doomed_key(k: bytes) -> bool:
            return (k.startswith(prefix) and (reserved_too or not is_reserved(k))
                    and (job_too or not is_job_key(k)))

        doomed = [k for k in self.data if doomed_key(k)]
        for k in doomed:
            del self.data[k]
        queues = [k for k in self.queues if doomed_key(k)]
        for k in queues:
            del self.queues[k]
        self.removals += bool(doomed or queues)
        return len(set(doomed) | set(queues))

    def append_entry(self, log: bytes, value: bytes) -> int:
        """Append ``value`` to the numbered log ``log`` (its counter becomes n, the value lands
        at ``log/n``) and wake its readers; returns n, or 0 when the counter holds no number
        (nothing appended; logged). The server's own appends only."""
        self.execute_wills([(log, value)])
        try:
            return int(self.data.get(log, b"0"))
        except ValueError:
            return 0

    def execute_wills(self, wills: list[tuple[bytes, bytes]]) -> None:
        """Connections with wills closed: append each value to the numbered log at its key (the
        counter ``key`` goes up by one to n, the value lands at ``key/n``), then wake every
        request waiting on them. All are written before anyone is woken, so the processes of a
        node that die together reach each waiter in one reply. A counter some client overwrote
        with set() is left alone."""
        created: list[bytes] = []
        for key, value in wills:
            old = self.data.get(key)
            try:
                n = (int(old) if old is not None else 0) + 1
            except ValueError:
                self.notice("tcp_store_will_unwritten", log=name(key)[:200],
                            reason="its counter holds a value set() wrote, not a number")
                continue
            self.data[key] = str(n).encode()
            if old is None:
                created.append(key)
            entry = key + b"/" + str(n).encode()
            if entry not in self.data:
                created.append(entry)
            self.data[entry] = value
        for key in created:
            self.created_value(key)

    def will_died(self, will: tuple[bytes, bytes]) -> None:
        """A connection holding ``will`` closed: it is written within :data:`GATHER_WILLS_S`,
        with those of the connections that close meanwhile (see :meth:`execute_wills`)."""
        if not self.dying:
            self.dying_since = time.monotonic()
        self.dying.append(will)

    def wills_due(self, now: float) -> float:
        """Seconds until the gathered wills are written (0: now)."""
        return max(0.0, self.dying_since + GATHER_WILLS_S - now)

    def flush_wills(self) -> None:
        """Write the gathered wills now: when they are due, and before a world is made afresh
        (a death of the world before must not land in the new one's log)."""
        if self.dying:
            dying, self.dying = self.dying, []
            self.execute_wills(dying)

    def arm(self, conn: Any, ttl: float) -> None:
        """Start the ttl of ``conn``'s will (none with ``ttl`` 0)."""
        conn.will_ttl = seconds(ttl)
        if conn.will_ttl > 0:
            conn.will_deadline = time.monotonic() + conn.will_ttl
            if self._arm_will is not None:
                self._arm_will(conn)

    # ---- refusals ----------------------------------------------------------------------------

    def refused(self, conn: Any, op: str, key: bytes) -> bytes:
        """The reply to a plain write on a reserved key (and a rate-limited log line)."""
        return write_refused(
            self.notice, "tcp_store_reserved_write_refused", conn, op, key,
            f"this key belongs to a world's membership (keys holding {RESERVED_NAMES}), which "
            f"only the store and the world's members, through checked operations, change; use "
            f"other key names")

    def too_many(self, op: str, n: int) -> bytes | None:
        if n <= self.max_keys:
            return None
        return reply(w.Status.ERROR, (
            f"{op} of {n} keys refused: this server takes at most {self.max_keys} keys per "
            f"request (TCPStoreLimits.max_keys_per_request); split it").encode())

    def reply_too_big(self, op: str, n: int, size: int) -> bytes | None:
        """The refusal of a request of ``n`` keys whose reply body would be ``size`` bytes,
        when that is over ``max_reply_bytes`` (else None): found before the reply is packed."""
        if size <= self.max_reply_bytes:
            return None
        return reply(w.Status.ERROR, (
            f"{op} of {n} keys refused: its reply would be {size} bytes (or more), over this "
            f"server's limit of {self.max_reply_bytes} bytes per reply "
            f"(TCPStoreLimits.max_reply_bytes); ask for fewer keys at a time").encode())

    def too_big(self, op: str, key: bytes, size: int) -> bytes | None:
        if size <= self.max_value_bytes:
            return None
        return reply(w.Status.ERROR, (
            f"{op}({name(key)[:200]!r}) refused: a value of {size} bytes exceeds this server's "
            f"limit of {self.max_value_bytes} (TCPStoreLimits.max_value_bytes); store large "
            f"data elsewhere and put its location in the store").encode())
