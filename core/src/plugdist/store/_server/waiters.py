"""The parked requests of one server's key space: GET, WAIT, MULTI_GET, QUEUE_POP, LOG_READ and
WAIT_WORKERS that could not be answered at once wait here until a write creates their key (or
fills their queue, or a client joins) or their deadline passes (:meth:`Waiters.expire`).

A request waits on one missing key at a time, so a WAIT on n keys costs one index entry, not n.
Only the serving thread uses it; nothing here blocks: an answer goes out through the ``answer``
callback (the server's, which sends it or steps it a slice a turn).
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from plugdist.errors import store_timeout
from plugdist.store import _wire as w
from plugdist.store._server.quota import ENTRY_OVERHEAD
from plugdist.store._server.replies import (
    OK_EMPTY,
    Reply,
    name,
    ok,
    ok_value,
    ok_values,
    reply,
    seconds,
    whole_seconds,
)
from plugdist.store._server.sliced import SLICE_KEYS, Sliced, Space, ValuesRead

__all__ = ["Waiter", "Waiters"]

_NAMED_MISSING = 16  # a timeout names at most this many missing keys


class Waiter:
    """One parked request of connection ``conn``."""

    __slots__ = ("conn", "op", "keys", "pos", "deadline", "timeout", "count", "done", "log",
                 "held")

    def __init__(self, conn: Any, op: w.Op, keys: list[bytes], timeout: float,
                 count: int = 0, log: bytes = b"") -> None:
        self.conn = conn
        self.op = op
        self.keys = keys
        self.pos = 0  # keys[:pos] were seen present; the waiter is indexed under keys[pos]
        self.timeout = timeout = seconds(timeout)
        self.deadline = time.monotonic() + timeout
        self.count = count  # WAIT_WORKERS: clients wanted; LOG_READ: the first entry wanted
        self.log = log  # LOG_READ: the log's counter key
        self.done = False
        self.held = 0  # bytes counted in the strangers' parked bytes (see Waiters.hold)


class Waiters:
    """The parked requests over ``data`` and ``queues`` (the key space's own dicts, read, never
    written here). ``answer(conn, reply)`` sends a parked request's reply (after
    ``conn.waiter`` was cleared); ``space`` is what a reply made in slices reads from;
    ``max_value_bytes`` bounds a LOG_READ's reply."""

    def __init__(self, space: Space, data: dict[bytes, bytes], queues: dict[bytes, deque[bytes]],
                 answer: Callable[[Any, Reply | Sliced], None], max_value_bytes: int) -> None:
        self._space = space
        self._data = data
        self._queues = queues
        self._answer = answer
        self._max_value_bytes = max_value_bytes
        self.waiting: dict[bytes, list[Waiter]] = {}  # by the key each waits on now
        self.poppers: dict[bytes, deque[Waiter]] = {}  # QUEUE_POPs by queue, oldest first
        self.worker_waiters: list[Waiter] = []
        self.deadlines: list[tuple[float, int, Waiter]] = []
        self._seq = itertools.count()
        self.joined = 0  # clients whose handshake carried the join flag
        self.parked = 0
        # the strangers' quota (the server sets it): (conn, bytes) -> whether it may park that
        # much, and the bytes given back when a counted request is answered or forgotten
        self.hold: Callable[[Any, int], bool] = lambda conn, size: True
        self.release: Callable[[int], None] = lambda size: None

    def join(self) -> None:
        """A client joined: count it, and answer the WAIT_WORKERS requests it satisfies."""
        self.joined += 1
        if self.worker_waiters:
            for waiter in [x for x in self.worker_waiters if self.joined >= x.count]:
                self.finish(waiter, ok(w.I64.pack(self.joined)))

    def _present(self, op: w.Op, key: bytes) -> bool:
        """Whether ``key`` satisfies a parked ``op``: GET/MULTI_GET want a value, WAIT a value or
        a non-empty queue, QUEUE_POP a non-empty queue."""
        if op == w.Op.WAIT:
            return key in self._data or bool(self._queues.get(key))
        if op == w.Op.QUEUE_POP:
            return bool(self._queues.get(key))
        return key in self._data

    def _first_missing(self, waiter: Waiter, start: int) -> int:
        keys, op = waiter.keys, waiter.op
        for i in range(start, len(keys)):
            if not self._present(op, keys[i]):
                return i
        return len(keys)

    def park(self, waiter: Waiter) -> Reply | None:
        """Park ``waiter`` (None), or refuse it (the ERROR reply) when it would hold more than
        the strangers' quota allows a connection not known to be the job's."""
        if waiter.conn.job_refusal != "":  # not known to be the job's: its bytes count
            size = sum(map(len, waiter.keys)) + ENTRY_OVERHEAD * len(waiter.keys) \
                + len(waiter.log)
            if not self.hold(waiter.conn, size):
                return reply(w.Status.ERROR, (
                    f"{waiter.op.name.lower()} refused: it would park {size} bytes of keys, "
                    f"and the parked requests of processes that are not the job's hold at most "
                    f"TCPStoreLimits.max_stranger_bytes together ({waiter.conn.job_refusal})"
                ).encode())
            if waiter.conn.job_refusal != "":  # not found to be the job's when asked
                waiter.held = size
        waiter.conn.waiter = waiter
        if waiter.op == w.Op.WAIT_WORKERS:
            self.worker_waiters.append(waiter)
        elif waiter.op == w.Op.QUEUE_POP:
            self.poppers.setdefault(waiter.keys[0], deque()).append(waiter)
        else:
            self.waiting.setdefault(waiter.keys[waiter.pos], []).append(waiter)
        self.parked += 1
        dl = self.deadlines
        if len(dl) > 1024 and len(dl) > 4 * self.parked:
            # answered waiters stay in the heap until their deadline; drop them in bulk so a
            # stream of short waits under a long timeout cannot grow it without bound
            dl[:] = [e for e in dl if not e[2].done]
            heapq.heapify(dl)
        heapq.heappush(dl, (waiter.deadline, next(self._seq), waiter))
        return None

    def forget(self, waiter: Waiter) -> None:
        """Unpark ``waiter`` without answering it (its connection closed). Idempotent."""
        if not waiter.done:
            self._unpark(waiter)
            self._space.discard(waiter.keys)

    def _unpark(self, waiter: Waiter) -> None:
        if waiter.done:
            return
        waiter.done = True
        self.parked -= 1
        if waiter.held:
            self.release(waiter.held)
            waiter.held = 0
        if waiter.op == w.Op.WAIT_WORKERS:
            self.worker_waiters.remove(waiter)
            return
        if waiter.op == w.Op.QUEUE_POP:
            poppers = self.poppers.get(waiter.keys[0])
            if poppers is not None:
                try:
                    poppers.remove(waiter)
                except ValueError:
                    pass
                if not poppers:
                    del self.poppers[waiter.keys[0]]
            return
        key = waiter.keys[waiter.pos] if waiter.pos < len(waiter.keys) else None
        lst = self.waiting.get(key) if key is not None else None
        if lst is not None:
            try:
                lst.remove(waiter)
            except ValueError:
                pass
            if not lst:
                del self.waiting[key]  # type: ignore[arg-type]

    def finish(self, waiter: Waiter, answer: Reply | Sliced) -> None:
        """Answer ``waiter`` with ``answer`` (a reply frame, or one made in slices)."""
        self._unpark(waiter)
        if not isinstance(answer, Sliced):
            self._space.discard(waiter.keys)
        waiter.conn.waiter = None
        self._answer(waiter.conn, answer)

    def key_created(self, key: bytes) -> None:
        """A value (or a queue's first item) now exists under ``key``: move its waiters on."""
        waiters = self.waiting.pop(key, None)
        if not waiters:
            return
        logs_read: dict[tuple[bytes, int], Reply | Sliced] = {}  # a log's readers share a reply
        for waiter in waiters:
            if waiter.done:
                continue
            nxt = self._first_missing(waiter, waiter.pos + 1)
            if nxt == len(waiter.keys):
                # every key was seen; one may have been deleted since: check them all once
                nxt = self._first_missing(waiter, 0)
            waiter.pos = nxt
            if nxt < len(waiter.keys):
                self.waiting.setdefault(waiter.keys[nxt], []).append(waiter)
            else:
                waiter.pos = len(waiter.keys)
                if waiter.op == w.Op.LOG_READ:
                    read = (waiter.log, waiter.count)
                    answer = logs_read.get(read)
                    if answer is None:
                        answer = logs_read[read] = self._ready_reply(waiter)
                else:
                    answer = self._ready_reply(waiter)
                self.finish(waiter, answer)

    def _ready_reply(self, waiter: Waiter) -> Reply | Sliced:
        if waiter.op == w.Op.GET:
            return ok_value(self._data[waiter.keys[0]])
        if waiter.op == w.Op.MULTI_GET:
            if len(waiter.keys) > SLICE_KEYS:
                return ValuesRead(self._space, waiter.conn, waiter.keys, waiter.deadline)
            values = [self._data[k] for k in waiter.keys]
            return self._space.reply_too_big(
                "multi_get", len(values), 4 + 4 * len(values) + sum(map(len, values))) \
                or ok_values(values)
        if waiter.op == w.Op.LOG_READ:
            return self.log_entries(waiter.log, waiter.count)
        return OK_EMPTY

    def log_entries(self, log: bytes, start: int) -> bytes:
        """The entries ``log/start``, ``log/start+1``, ... up to the first missing one, at most
        ``LOG_READ_ENTRIES`` of them and about half ``max_value_bytes`` (the client reads on)."""
        entries: list[bytes] = []
        data = self._data
        n = start
        size = 0
        while size < self._max_value_bytes // 2 and len(entries) < w.LOG_READ_ENTRIES:
            value = data.get(log + b"/" + str(n).encode())
            if value is None:
                break
            entries.append(value)
            size += len(value) + 4
            n += 1
        return ok(w.pack_blobs(entries))

    def next_deadline(self) -> float | None:
        """The earliest deadline of a parked request (monotonic seconds), or None."""
        return self.deadlines[0][0] if self.deadlines else None

    def expire(self, now: float) -> None:
        """Answer, with a timeout reply, every parked request whose deadline passed."""
        dl = self.deadlines
        while dl and dl[0][0] <= now:
            _, _, waiter = heapq.heappop(dl)
            if waiter.done:
                continue
            if waiter.op == w.Op.WAIT_WORKERS:
                msg = (f"Timed out after {whole_seconds(waiter.timeout)} seconds waiting for "
                       f"clients. {self.joined}/{waiter.count} clients joined.")
            elif waiter.op == w.Op.QUEUE_POP:
                msg = store_timeout("queue_pop", waiter.timeout,
                                    f"queue {name(waiter.keys[0])!r} stayed empty")
            else:
                msg = store_timeout(waiter.op.name.lower(), waiter.timeout,
                                    f"missing keys {self._missing(waiter)}")
            self.finish(waiter, reply(w.Status.TIMEOUT, msg.encode()))

    def wait_for(self, conn: Any, op: w.Op, keys: list[bytes], timeout: float,
                 seen: int = 0) -> Reply | None | Sliced:
        """Answer, or park, a request for ``keys``, of which the first ``seen`` were seen
        present (a request read in slices looked at each as it read it)."""
        waiter = Waiter(conn, op, keys, timeout)
        timeout = waiter.timeout
        waiter.pos = self._first_missing(waiter, seen)
        if waiter.pos == len(keys):
            answer = self._ready_reply(waiter)
            if not isinstance(answer, Sliced):
                self._space.discard(keys)
            return answer
        if timeout <= 0:
            answer = reply(w.Status.TIMEOUT, f"{op.name.lower()} timeout (0s): missing keys "
                                             f"{self._missing(waiter)}".encode())
            self._space.discard(keys)
            return answer
        return self.park(waiter)

    def _missing(self, waiter: Waiter) -> str:
        """The names of ``waiter``'s missing keys, for its timeout's message: those among the
        ``SLICE_KEYS`` keys from the one it waits on, at most ``_NAMED_MISSING`` of them."""
        keys = waiter.keys[waiter.pos:waiter.pos + SLICE_KEYS]
        names = list(itertools.islice((name(k) for k in keys
                                       if not self._present(waiter.op, k)), _NAMED_MISSING))
        if len(names) == _NAMED_MISSING or waiter.pos + len(keys) < len(waiter.keys):
            return f"{names} (the first named, of {len(waiter.keys)} keys asked)"
        return str(names)
