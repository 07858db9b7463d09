"""The TCPStore server's key space: the data, the queues and the parked requests, and every
command run on them. No sockets: :class:`~plugdist.store._tcp_server.StoreServer` parses frames,
calls :meth:`KeySpace.handle`, and sends what it returns; a parked request is answered later
through the ``answer`` callback, when a write creates its key (or fills its queue) or its
deadline passes (:meth:`KeySpace.expire`). A request waits on one missing key at a time, so a
WAIT on n keys costs one index entry, not n. Only the serving thread uses it.

Keys reserved for worlds' membership (:func:`plugdist.store._worldkeys.is_reserved`) refuse
every plain write: they change only through :class:`~plugdist.store._tcp_worlds.Worlds`, which
uses this key space's primitives (:meth:`KeySpace.put`, :meth:`KeySpace.append_entry`, ...).
"""

from __future__ import annotations

import heapq
import itertools
import struct
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from plugdist.errors import store_timeout
from plugdist.store import _wire as w
from plugdist.store._tcp_worlds import Worlds
from plugdist.store._wire import read_blob as _blob
from plugdist.store._worldkeys import RESERVED_NAMES, is_reserved

__all__ = ["KeySpace", "Sliced"]

_INIT_KEY_COUNT = 1  # num_keys counts the worker counter once someone joined (as torch does)
_MAX_TIMEOUT = 1e7  # seconds; longer ones are clamped (the deadline heap needs finite numbers)
# a request naming more keys than this is read this many keys a turn of the server's loop, so a
# request of 131,072 keys (about 60 ms of Python) does not hold every other client that long
SLICE_KEYS = 1024  # even: a MULTI_SET's slices hold whole pairs
_NAMED_MISSING = 16  # a timeout names at most this many missing keys


def _seconds(timeout: float) -> float:
    """A timeout from the wire: NaN is malformed; the rest is clamped to [0, ~115 days]."""
    if timeout != timeout:
        raise ValueError("timeout is NaN")
    return min(max(timeout, 0.0), _MAX_TIMEOUT)


class _Waiter:
    """One parked request of connection ``conn``."""

    __slots__ = ("conn", "op", "keys", "pos", "deadline", "timeout", "count", "done", "log")

    def __init__(self, conn: Any, op: w.Op, keys: list[bytes], timeout: float,
                 count: int = 0, log: bytes = b"") -> None:
        self.conn = conn
        self.op = op
        self.keys = keys
        self.pos = 0  # keys[:pos] were seen present; the waiter is indexed under keys[pos]
        self.timeout = timeout = _seconds(timeout)
        self.deadline = time.monotonic() + timeout
        self.count = count  # WAIT_WORKERS: clients wanted; LOG_READ: the first entry wanted
        self.log = log  # LOG_READ: the log's counter key
        self.done = False


class Sliced:
    """A request served a slice a turn: the server calls :meth:`step` once a turn of its loop
    until it returns the reply (bytes, or None when the request was parked, as
    :meth:`KeySpace.handle` does), serving the other clients in between."""

    __slots__ = ()
    must_finish = False  # True: finished even when its client leaves first

    def step(self) -> bytes | None | Sliced:
        """The next slice's work: the reply once done, else a :class:`Sliced` (``self`` or what
        follows it) to step at the next turn. Raises ValueError for a malformed body."""
        raise NotImplementedError

    def abandon(self) -> None:
        """Its client left before it was done: let go of what it holds, a slice a turn."""


class _KeysRead(Sliced):
    """A request of many keys (blobs), read ``SLICE_KEYS`` at a time. Each slice is looked at
    as it is read (``each``, whose falsy result stops the reading early: a CHECK whose key is
    missing, a MULTI_SET pair refused); ``finish(kept)`` makes the reply from the slices kept
    (``keep``)."""

    __slots__ = ("space", "buf", "pos", "end", "left", "keys", "each", "finish", "keep",
                 "must_finish")

    def __init__(self, space: KeySpace, buf: bytes, pos: int, end: int, n: int,
                 each: Callable[[list[bytes]], bool] | None,
                 finish: Callable[[list[bytes]], bytes | None | Sliced],
                 keep: bool = False, must_finish: bool = False) -> None:
        self.space, self.must_finish = space, must_finish
        self.buf, self.pos, self.end, self.left = buf, pos, end, n
        self.keys: list[bytes] = []  # the slices read, kept for ``finish`` when ``keep``
        self.each, self.finish, self.keep = each, finish, keep

    def step(self) -> bytes | None | Sliced:
        buf, pos, end, unpack = self.buf, self.pos, self.end, w.U32.unpack_from
        take = min(self.left, SLICE_KEYS)
        part = []
        for _ in range(take):
            if pos + 4 > end:
                raise ValueError("truncated blob length")
            (ln,) = unpack(buf, pos)
            pos += 4
            if pos + ln > end:
                raise ValueError("blob runs past the frame")
            part.append(buf[pos:pos + ln])
            pos += ln
        self.pos, self.left = pos, self.left - take
        if self.each is not None and not self.each(part):
            self.left = 0
        elif self.keep:
            self.keys.extend(part)
        if self.left:
            return self
        self.buf = b""
        return self.finish(self.keys)

    def abandon(self) -> None:
        self.space.discard(self.keys)


class _ValuesRead(Sliced):
    """A MULTI_GET of many keys whose every key was present: its values taken and packed
    ``SLICE_KEYS`` keys a turn, each slice's values at one instant. A key deleted before its
    slice is read sends the request back to waiting (with what is left of its timeout)."""

    __slots__ = ("space", "conn", "keys", "deadline", "done", "parts")

    def __init__(self, space: KeySpace, conn: Any, keys: list[bytes], deadline: float) -> None:
        self.space, self.conn, self.keys, self.deadline = space, conn, keys, deadline
        self.done = 0
        self.parts = [w.U32.pack(len(keys))]

    def step(self) -> bytes | None | Sliced:
        stop = self.done + SLICE_KEYS
        keys = self.keys[self.done:stop]
        values = [v for v in map(self.space.value, keys) if v is not None]
        if len(values) < len(keys):
            left = self.deadline - time.monotonic()
            return self.space.wait_again(self.conn, self.keys, left)
        pack = w.U32.pack
        self.parts.append(b"".join([b for v in values for b in (pack(len(v)), v)]))
        self.done = stop
        if stop < len(self.keys):
            return self
        self.space.discard(self.keys)
        return _ok(b"".join(self.parts))

    def abandon(self) -> None:
        self.space.discard(self.keys)


class _ValuesWritten(Sliced):
    """A MULTI_SET of many pairs, all checked: written ``SLICE_KEYS`` pairs a turn, in order,
    each slice at one instant. ``step`` until it returns the reply; the server finishes the
    writes of a client that left meanwhile (no MULTI_SET is left half written)."""

    __slots__ = ("space", "items", "done")
    must_finish = True

    def __init__(self, space: KeySpace, items: list[bytes]) -> None:
        self.space, self.items, self.done = space, items, 0

    def step(self) -> bytes | Sliced:
        items, stop = self.items, self.done + 2 * SLICE_KEYS
        self.space.put_all(dict(zip(items[self.done:stop:2], items[self.done + 1:stop:2],
                                    strict=True)))
        self.done = stop
        if stop < len(items):
            return self
        self.space.discard(items)
        return _OK_EMPTY


class KeySpace:
    """The data and the parked requests of one server. ``answer(conn, reply)`` sends a parked
    request's reply (after ``conn.waiter`` was cleared); ``max_value_bytes`` bounds a value (a
    SET, a MULTI_SET's, a COMPARE_SET's, what APPEND or QUEUE_PUSH may store);
    ``max_keys`` bounds the keys of one request (CHECK, WAIT, MULTI_GET, MULTI_SET);
    ``arm_will(conn)`` is called when ``conn`` leaves a will with a ttl
    (``conn.will_ttl``/``conn.will_deadline`` set), so the server can watch the deadline, which
    RENEW moves without calling it again. ``notice(event, **fields)`` logs a refusal (the server
    rate-limits it)."""

    def __init__(self, answer: Callable[[Any, bytes | Sliced], None], max_value_bytes: int,
                 arm_will: Callable[[Any], None] | None = None, *,
                 max_keys: int = 1 << 20,
                 notice: Callable[..., None] | None = None) -> None:
        self._answer = answer
        self._arm_will = arm_will
        self._max_value_bytes = max_value_bytes
        self._max_keys = max_keys
        self._notice = notice or (lambda event, **fields: None)
        self._data: dict[bytes, bytes] = {}
        self._queues: dict[bytes, deque[bytes]] = {}
        self._waiting: dict[bytes, list[_Waiter]] = {}
        self._poppers: dict[bytes, deque[_Waiter]] = {}
        self._worker_waiters: list[_Waiter] = []
        self._deadlines: list[tuple[float, int, _Waiter]] = []
        self._seq = itertools.count()
        self._joined = 0
        self._parked = 0
        self._removals = 0  # deletions and emptied queues so far: a key seen may be gone since
        self._garbage: deque[list[bytes]] = deque()  # big lists done with, freed a slice a turn
        self._handlers: dict[int, Callable[[Any, bytes, int, int], bytes | None | Sliced]] = {
            w.Op.SET: self._op_set, w.Op.GET: self._op_get, w.Op.ADD: self._op_add,
            w.Op.COMPARE_SET: self._op_compare_set, w.Op.WAIT: self._op_wait,
            w.Op.CHECK: self._op_check, w.Op.NUM_KEYS: self._op_num_keys,
            w.Op.DELETE_KEY: self._op_delete_key, w.Op.MULTI_GET: self._op_multi_get,
            w.Op.MULTI_SET: self._op_multi_set, w.Op.WAIT_WORKERS: self._op_wait_workers,
            w.Op.APPEND: self._op_append, w.Op.QUEUE_PUSH: self._op_queue_push,
            w.Op.QUEUE_POP: self._op_queue_pop, w.Op.QUEUE_LEN: self._op_queue_len,
            w.Op.WILL: self._op_will, w.Op.DELETE_PREFIX: self._op_delete_prefix,
            w.Op.LOG_READ: self._op_log_read, w.Op.RENEW: self._op_renew,
            w.Op.WILL_DROP: self._op_will_drop,
        }
        self.worlds = Worlds(self, self._notice)
        self._handlers.update({w.Op.CLAIM: self.worlds.op_claim, w.Op.JOIN: self.worlds.op_join,
                               w.Op.MEMBER: self.worlds.op_member,
                               w.Op.RECORD: self.worlds.op_record})

    def join(self) -> None:
        """A client joined (its handshake carried the join flag): count it for WAIT_WORKERS and
        num_keys, and answer the WAIT_WORKERS requests it satisfies."""
        self._joined += 1
        if self._worker_waiters:
            for waiter in [x for x in self._worker_waiters if self._joined >= x.count]:
                self._finish(waiter, _ok(w.I64.pack(self._joined)))

    def knows(self, op: int) -> bool:
        return op in self._handlers

    def handle(self, conn: Any, op: int, buf: bytes, pos: int,
               end: int) -> bytes | None | Sliced:
        """Run command ``op`` (one it :meth:`knows`) on its body ``buf[pos:end]``: the reply
        frame (empty for RENEW and WILL_DROP, which have none), or None when the request was
        parked (``conn.waiter`` is set until it is answered through ``answer``), or a
        :class:`Sliced` for a request of more than ``SLICE_KEYS`` keys. Raises ValueError (and
        the like) for a malformed body."""
        return self._handlers[op](conn, buf, pos, end)

    def _present(self, op: w.Op, key: bytes) -> bool:
        """Whether ``key`` satisfies a parked ``op``: GET/MULTI_GET want a value, WAIT a value or
        a non-empty queue, QUEUE_POP a non-empty queue."""
        if op == w.Op.WAIT:
            return key in self._data or bool(self._queues.get(key))
        if op == w.Op.QUEUE_POP:
            return bool(self._queues.get(key))
        return key in self._data

    def _first_missing(self, waiter: _Waiter, start: int) -> int:
        keys, op = waiter.keys, waiter.op
        for i in range(start, len(keys)):
            if not self._present(op, keys[i]):
                return i
        return len(keys)

    def _park(self, waiter: _Waiter) -> None:
        waiter.conn.waiter = waiter
        if waiter.op == w.Op.WAIT_WORKERS:
            self._worker_waiters.append(waiter)
        elif waiter.op == w.Op.QUEUE_POP:
            self._poppers.setdefault(waiter.keys[0], deque()).append(waiter)
        else:
            self._waiting.setdefault(waiter.keys[waiter.pos], []).append(waiter)
        self._parked += 1
        dl = self._deadlines
        if len(dl) > 1024 and len(dl) > 4 * self._parked:
            # answered waiters stay in the heap until their deadline; drop them in bulk so a
            # stream of short waits under a long timeout cannot grow it without bound
            dl[:] = [e for e in dl if not e[2].done]
            heapq.heapify(dl)
        heapq.heappush(dl, (waiter.deadline, next(self._seq), waiter))

    def forget(self, waiter: _Waiter) -> None:
        """Unpark ``waiter`` without answering it (its connection closed). Idempotent."""
        if not waiter.done:
            self._unpark(waiter)
            self.discard(waiter.keys)

    def _unpark(self, waiter: _Waiter) -> None:
        if waiter.done:
            return
        waiter.done = True
        self._parked -= 1
        if waiter.op == w.Op.WAIT_WORKERS:
            self._worker_waiters.remove(waiter)
            return
        if waiter.op == w.Op.QUEUE_POP:
            poppers = self._poppers.get(waiter.keys[0])
            if poppers is not None:
                try:
                    poppers.remove(waiter)
                except ValueError:
                    pass
                if not poppers:
                    del self._poppers[waiter.keys[0]]
            return
        key = waiter.keys[waiter.pos] if waiter.pos < len(waiter.keys) else None
        lst = self._waiting.get(key) if key is not None else None
        if lst is not None:
            try:
                lst.remove(waiter)
            except ValueError:
                pass
            if not lst:
                del self._waiting[key]  # type: ignore[arg-type]

    def _finish(self, waiter: _Waiter, reply: bytes | Sliced) -> None:
        self._unpark(waiter)
        if not isinstance(reply, Sliced):
            self.discard(waiter.keys)
        waiter.conn.waiter = None
        self._answer(waiter.conn, reply)

    def _key_created(self, key: bytes) -> None:
        waiters = self._waiting.pop(key, None)
        if not waiters:
            return
        for waiter in waiters:
            if waiter.done:
                continue
            nxt = self._first_missing(waiter, waiter.pos + 1)
            if nxt == len(waiter.keys):
                # every key was seen; one may have been deleted since: check them all once
                nxt = self._first_missing(waiter, 0)
            waiter.pos = nxt
            if nxt < len(waiter.keys):
                self._waiting.setdefault(waiter.keys[nxt], []).append(waiter)
            else:
                waiter.pos = len(waiter.keys)
                self._finish(waiter, self._ready_reply(waiter))

    def _ready_reply(self, waiter: _Waiter) -> bytes | Sliced:
        if waiter.op == w.Op.GET:
            return _ok(self._data[waiter.keys[0]])
        if waiter.op == w.Op.MULTI_GET:
            if len(waiter.keys) > SLICE_KEYS:
                return _ValuesRead(self, waiter.conn, waiter.keys, waiter.deadline)
            return _ok(w.pack_blobs([self._data[k] for k in waiter.keys]))
        if waiter.op == w.Op.LOG_READ:
            return self._log_entries(waiter.log, waiter.count)
        return _OK_EMPTY

    def _log_entries(self, log: bytes, start: int) -> bytes:
        """The entries ``log/start``, ``log/start+1``, ... up to the first missing one."""
        entries = []
        data = self._data
        n = start
        size = 0
        while size < self._max_value_bytes // 2:
            value = data.get(log + b"/" + str(n).encode())
            if value is None:
                break
            entries.append(value)
            size += len(value) + 4
            n += 1
        return _ok(w.pack_blobs(entries))

    def next_deadline(self) -> float | None:
        """The earliest deadline of a parked request (monotonic seconds), or None."""
        return self._deadlines[0][0] if self._deadlines else None

    def expire(self, now: float) -> None:
        """Answer, with a timeout reply, every parked request whose deadline passed."""
        dl = self._deadlines
        while dl and dl[0][0] <= now:
            _, _, waiter = heapq.heappop(dl)
            if waiter.done:
                continue
            if waiter.op == w.Op.WAIT_WORKERS:
                msg = (f"Timed out after {_whole_seconds(waiter.timeout)} seconds waiting for "
                       f"clients. {self._joined}/{waiter.count} clients joined.")
            elif waiter.op == w.Op.QUEUE_POP:
                msg = store_timeout("queue_pop", waiter.timeout,
                                    f"queue {_name(waiter.keys[0])!r} stayed empty")
            else:
                msg = store_timeout(waiter.op.name.lower(), waiter.timeout,
                                    f"missing keys {self._missing(waiter)}")
            self._finish(waiter, _reply(w.Status.TIMEOUT, msg.encode()))

    def _wait_for(self, conn: Any, op: w.Op, keys: list[bytes], timeout: float,
                  seen: int = 0) -> bytes | None | Sliced:
        """Answer, or park, a request for ``keys``, of which the first ``seen`` were seen
        present (a request read in slices looked at each as it read it)."""
        waiter = _Waiter(conn, op, keys, timeout)
        timeout = waiter.timeout
        waiter.pos = self._first_missing(waiter, seen)
        if waiter.pos == len(keys):
            reply = self._ready_reply(waiter)
            if not isinstance(reply, Sliced):
                self.discard(keys)
            return reply
        if timeout <= 0:
            reply = _reply(w.Status.TIMEOUT, f"{op.name.lower()} timeout (0s): missing keys "
                                             f"{self._missing(waiter)}".encode())
            self.discard(keys)
            return reply
        self._park(waiter)
        return None

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

    def wait_again(self, conn: Any, keys: list[bytes], timeout: float) -> bytes | None | Sliced:
        """A MULTI_GET being answered found a key deleted: wait for all its keys again, for
        ``timeout`` more seconds."""
        return self._wait_for(conn, w.Op.MULTI_GET, keys, max(timeout, 0.0))

    def _missing(self, waiter: _Waiter) -> str:
        """The names of ``waiter``'s missing keys, for its timeout's message: those among the
        ``SLICE_KEYS`` keys from the one it waits on, at most ``_NAMED_MISSING`` of them."""
        keys = waiter.keys[waiter.pos:waiter.pos + SLICE_KEYS]
        names = list(itertools.islice((_name(k) for k in keys
                                       if not self._present(waiter.op, k)), _NAMED_MISSING))
        if len(names) == _NAMED_MISSING or waiter.pos + len(keys) < len(waiter.keys):
            return f"{names} (the first named, of {len(waiter.keys)} keys asked)"
        return str(names)

    def _created_value(self, key: bytes) -> None:
        """A value now exists under ``key`` where none did."""
        if key in self._waiting:
            self._key_created(key)

    # ---- primitives (also the worlds' way to write their reserved keys) ----------------------

    def value(self, key: bytes) -> bytes | None:
        return self._data.get(key)

    def put(self, key: bytes, value: bytes) -> None:
        """Set ``key``, waking the requests waiting for it."""
        created = key not in self._data
        self._data[key] = value
        if created:
            self._created_value(key)

    def put_all(self, values: dict[bytes, bytes]) -> None:
        """Set every key of ``values``, then wake the requests waiting for them."""
        data, waiting = self._data, self._waiting
        created = [k for k in waiting if k in values and k not in data] if waiting else []
        data.update(values)
        for key in created:
            self._key_created(key)

    def add_to(self, key: bytes, amount: int) -> int | bytes:
        """Add ``amount`` to the counter ``key``: the sum, or an ERROR reply."""
        old = self._data.get(key)
        if old is None:
            total = amount
        else:
            try:
                total = int(old) + amount
            except ValueError:
                return _reply(w.Status.ERROR, (
                    f"add({_name(key)!r}) met a value that is not an integer ({old[:32]!r}): "
                    f"the key was written by set(); use a separate key for counters").encode())
        if not -(2**63) <= total < 2**63:
            return _reply(w.Status.ERROR, f"add({_name(key)!r}) overflows a 64-bit counter "
                                          f"({total})".encode())
        self._data[key] = str(total).encode()
        if old is None:
            self._created_value(key)
        return total

    def compare_set(self, key: bytes, expected: bytes, desired: bytes) -> bytes:
        """Compare-and-set (see ``Store.compare_set``): the value now held."""
        current = self._data.get(key)
        if current is None:
            if expected:
                return expected
            self._data[key] = desired
            self._created_value(key)
            return desired
        if current == expected:
            self._data[key] = desired
            return desired
        return current

    def delete(self, key: bytes) -> bool:
        had_value = self._data.pop(key, None) is not None
        had_queue = bool(self._queues.pop(key, None))
        self._removals += had_value or had_queue
        return had_value or had_queue

    def delete_prefix(self, prefix: bytes, reserved_too: bool) -> int:
        """Delete every key and queue starting with ``prefix`` (the reserved ones only with
        ``reserved_too``); how many."""
        doomed = [k for k in self._data if k.startswith(prefix)
                  and (reserved_too or not is_reserved(k))]
        for k in doomed:
            del self._data[k]
        queues = [k for k in self._queues if k.startswith(prefix)
                  and (reserved_too or not is_reserved(k))]
        for k in queues:
            del self._queues[k]
        self._removals += bool(doomed or queues)
        return len(set(doomed) | set(queues))

    def append_entry(self, log: bytes, value: bytes) -> int:
        """Append ``value`` to the numbered log ``log`` (its counter becomes n, the value lands
        at ``log/n``) and wake its readers; returns n. The server's own appends only."""
        self.execute_wills([(log, value)])
        return int(self._data[log])

    def _refused(self, conn: Any, op: str, key: bytes) -> bytes:
        """The reply to a plain write on a reserved key (and a rate-limited log line)."""
        self._notice("tcp_store_reserved_write_refused", peer=getattr(conn, "peer", "?"), op=op,
                     key=_name(key)[:200])
        return _reply(w.Status.ERROR, (
            f"{op}({_name(key)[:200]!r}) refused: this key belongs to a world's membership "
            f"(keys holding {RESERVED_NAMES}), which only the store and the world's members, "
            f"through checked operations, change; use other key names").encode())

    def _too_many(self, op: str, n: int) -> bytes | None:
        if n <= self._max_keys:
            return None
        return _reply(w.Status.ERROR, (
            f"{op} of {n} keys refused: this server takes at most {self._max_keys} keys per "
            f"request (TCPStoreLimits.max_keys_per_request); split it").encode())

    def _too_big(self, op: str, key: bytes, size: int) -> bytes | None:
        if size <= self._max_value_bytes:
            return None
        return _reply(w.Status.ERROR, (
            f"{op}({_name(key)[:200]!r}) refused: a value of {size} bytes exceeds this server's "
            f"limit of {self._max_value_bytes} (TCPStoreLimits.max_value_bytes); store large "
            f"data elsewhere and put its location in the store").encode())

    def refusal_ahead(self, conn: Any, op: int, buf: bytes | bytearray, pos: int,
                      end: int) -> bytes | None:
        """For a request of which only ``buf[pos:end]`` (its body's start) arrived: its ERROR
        reply when what arrived already decides it (too many keys, a value too big), ``b""``
        when it will not be refused for its size, None while the fields that tell are still to
        come. Lets the server answer and drop a huge frame without holding it."""
        if op == w.Op.CHECK or op == w.Op.MULTI_SET:
            if end - pos < 4:
                return None
            n = int(w.U32.unpack_from(buf, pos)[0])
            return self._too_many(w.Op(op).name.lower(), n // 2 if op == w.Op.MULTI_SET
                                  else n) or b""
        if op == w.Op.WAIT or op == w.Op.MULTI_GET:
            if end - pos < 12:
                return None
            return self._too_many(w.Op(op).name.lower(), int(w.U32.unpack_from(buf, pos + 8)[0])) \
                or b""
        if op in (w.Op.SET, w.Op.APPEND, w.Op.QUEUE_PUSH):
            if end - pos < 4:
                return None
            klen = int(w.U32.unpack_from(buf, pos)[0])
            if end - pos < 8 + klen:
                return None
            key = bytes(buf[pos + 4:pos + 4 + klen])
            vlen = int(w.U32.unpack_from(buf, pos + 4 + klen)[0])
            return self._too_big(w.Op(op).name.lower(), key, vlen) or b""
        return b""

    def _count(self, buf: bytes, pos: int, end: int) -> int:
        """The blob count at ``pos`` (a keyed request's n), read before its blobs are."""
        if pos + 4 > end:
            raise ValueError("truncated blob count")
        return int(w.U32.unpack_from(buf, pos)[0])

    # ---- commands: (conn, buf, body start, body end) -> reply frame or None when parked

    def _op_set(self, conn: Any, buf: bytes, pos: int, end: int) -> bytes:
        key, pos = _blob(buf, pos, end)
        value, _ = _blob(buf, pos, end)
        if is_reserved(key):
            return self._refused(conn, "set", key)
        refusal = self._too_big("set", key, len(value))
        if refusal:
            return refusal
        self.put(key, value)
        return _OK_EMPTY

    def _op_get(self, conn: Any, buf: bytes, pos: int, end: int) -> bytes | None | Sliced:
        timeout, kl = _F64_U32.unpack_from(buf, pos)
        if pos + 12 + kl != end:
            raise ValueError("key length does not match the frame")
        key = bytes(buf[pos + 12:end])
        value = self._data.get(key)
        if value is not None:
            return _ok(value)
        return self._wait_for(conn, w.Op.GET, [key], timeout)

    def _op_add(self, conn: Any, buf: bytes, pos: int, end: int) -> bytes:
        amount, kl = _I64_U32.unpack_from(buf, pos)
        if pos + 12 + kl != end:
            raise ValueError("key length does not match the frame")
        key = bytes(buf[pos + 12:end])
        if is_reserved(key):
            if amount:
                return self._refused(conn, "add", key)
            return self.read_counter(key)  # add(key, 0) reads a counter, creating nothing
        total = self.add_to(key, amount)
        return total if isinstance(total, bytes) else _ok(w.I64.pack(total))

    def read_counter(self, key: bytes) -> bytes:
        """The reply to ``add(key, 0)`` on a counter the caller may not create: its value, or 0
        while it does not exist."""
        old = self._data.get(key)
        try:
            return _ok(w.I64.pack(int(old) if old is not None else 0))
        except ValueError:
            return _reply(w.Status.ERROR, f"add({_name(key)!r}) met a value that is not an "
                                          f"integer".encode())

    def _op_will(self, conn: Any, buf: bytes, pos: int, end: int) -> bytes:
        key, pos = _blob(buf, pos, end)
        value, pos = _blob(buf, pos, end)
        ttl = 0.0
        if pos < end:
            (ttl,) = w.F64.unpack_from(buf, pos)
            ttl = _seconds(ttl)
        if is_reserved(key):
            return self._refused(conn, "hold_will", key)
        if getattr(conn, "identity", None) is not None:
            return _reply(w.Status.ERROR, b"hold_will refused: this connection holds a member "
                                          b"identity, whose will is the server's")
        conn.will = (key, value) if key else None
        self.arm(conn, ttl if key else 0.0)
        return _OK_EMPTY

    def arm(self, conn: Any, ttl: float) -> None:
        """Start the ttl of ``conn``'s will (none with ``ttl`` 0)."""
        conn.will_ttl = _seconds(ttl)
        if conn.will_ttl > 0:
            conn.will_deadline = time.monotonic() + conn.will_ttl
            if self._arm_will is not None:
                self._arm_will(conn)

    def _op_renew(self, conn: Any, buf: bytes, pos: int, end: int) -> bytes:
        if conn.will_ttl > 0:
            conn.will_deadline = time.monotonic() + conn.will_ttl
        return b""

    def _op_will_drop(self, conn: Any, buf: bytes, pos: int, end: int) -> bytes:
        conn.will = None
        conn.will_ttl = 0.0
        return b""

    def _op_log_read(self, conn: Any, buf: bytes, pos: int, end: int) -> bytes | None:
        timeout, start, kl = _F64_I64_U32.unpack_from(buf, pos)
        if pos + 20 + kl != end:
            raise ValueError("key length does not match the frame")
        if start < 1:
            raise ValueError(f"log entries are numbered from 1, got {start}")
        log = bytes(buf[pos + 20:end])
        first = log + b"/" + str(start).encode()
        if first in self._data:
            return self._log_entries(log, start)
        waiter = _Waiter(conn, w.Op.LOG_READ, [first], timeout, start, log)
        if waiter.timeout <= 0:
            return _reply(w.Status.TIMEOUT, f"log_read timeout (0s): missing keys "
                                            f"{[_name(first)]}".encode())
        self._park(waiter)
        return None

    def execute_wills(self, wills: list[tuple[bytes, bytes]]) -> None:
        """Connections with wills closed: append each value to the numbered log at its key (the
        counter ``key`` goes up by one to n, the value lands at ``key/n``), then wake every
        request waiting on them. All are written before anyone is woken, so the processes of a
        node that die together reach each waiter in one reply. A counter some client overwrote
        with set() is left alone."""
        created: list[bytes] = []
        for key, value in wills:
            old = self._data.get(key)
            try:
                n = (int(old) if old is not None else 0) + 1
            except ValueError:
                self._notice("tcp_store_will_unwritten", log=_name(key)[:200],
                             reason="its counter holds a value set() wrote, not a number")
                continue
            self._data[key] = str(n).encode()
            if old is None:
                created.append(key)
            entry = key + b"/" + str(n).encode()
            if entry not in self._data:
                created.append(entry)
            self._data[entry] = value
        for key in created:
            self._created_value(key)

    def _op_append(self, conn: Any, buf: bytes, pos: int, end: int) -> bytes:
        key, pos = _blob(buf, pos, end)
        tail, _ = _blob(buf, pos, end)
        if is_reserved(key):
            return self._refused(conn, "append", key)
        old = self._data.get(key)
        if len(old or b"") + len(tail) > self._max_value_bytes:
            return _reply(w.Status.ERROR, (
                f"append({_name(key)!r}) would grow the value past this server's limit of "
                f"{self._max_value_bytes} bytes (TCPStoreLimits.max_value_bytes)").encode())
        self._data[key] = tail if old is None else old + tail
        if old is None:
            self._created_value(key)
        return _OK_EMPTY

    def _op_compare_set(self, conn: Any, buf: bytes, pos: int, end: int) -> bytes:
        key, pos = _blob(buf, pos, end)
        expected, pos = _blob(buf, pos, end)
        desired, _ = _blob(buf, pos, end)
        if is_reserved(key):
            return self._refused(conn, "compare_set", key)
        refusal = self._too_big("compare_set", key, len(desired))
        if refusal:
            return refusal
        return _ok(self.compare_set(key, expected, desired))

    def _keyed(self, op: w.Op, buf: bytes, pos: int, end: int,
               each: Callable[[list[bytes]], bool] | None,
               finish: Callable[[list[bytes]], bytes | None | Sliced],
               keep: bool = False) -> bytes | None | Sliced:
        """A request whose body at ``pos`` is its keys (u32 n, n blobs): refused past
        ``max_keys``, answered at once up to ``SLICE_KEYS`` keys, else read in slices (see
        :class:`_KeysRead`)."""
        n = self._count(buf, pos, end)
        refusal = self._too_many(op.name.lower(), n)
        if refusal:
            return refusal
        if n > (end - pos - 4) // 4:
            raise ValueError(f"blob count {n} does not fit the frame")
        return _KeysRead(self, buf, pos + 4, end, n, each, finish, keep).step()

    def _awaited(self, conn: Any, op: w.Op, buf: bytes, pos: int,
                 end: int) -> bytes | None | Sliced:
        """WAIT or MULTI_GET: its keys looked at as they are read, until one is missing."""
        (timeout,) = w.F64.unpack_from(buf, pos)
        data, queues, removals = self._data, self._queues, self._removals
        seen, missing = [0], [False]

        def each(keys: list[bytes]) -> bool:
            if not missing[0]:
                for k in keys:
                    if not (k in data or op == w.Op.WAIT and bool(queues.get(k))):
                        missing[0] = True
                        break
                    seen[0] += 1
            return True

        def finish(keys: list[bytes]) -> bytes | None | Sliced:  # none removed: no second look
            return self._wait_for(conn, op, keys, timeout,
                                  seen[0] if self._removals == removals else 0)

        return self._keyed(op, buf, pos + 8, end, each, finish, keep=True)

    def _op_wait(self, conn: Any, buf: bytes, pos: int, end: int) -> bytes | None | Sliced:
        return self._awaited(conn, w.Op.WAIT, buf, pos, end)

    def _op_multi_get(self, conn: Any, buf: bytes, pos: int,
                      end: int) -> bytes | None | Sliced:
        return self._awaited(conn, w.Op.MULTI_GET, buf, pos, end)

    def _op_check(self, conn: Any, buf: bytes, pos: int, end: int) -> bytes | None | Sliced:
        """Whether every key is present; a CHECK read in slices looks at each slice as it is
        read (a key deleted meanwhile, in a slice already read, still counts as present)."""
        found = [True]

        def each(keys: list[bytes]) -> bool:
            data, queues = self._data, self._queues
            found[0] = all([k in data or bool(queues.get(k)) for k in keys])
            return found[0]

        return self._keyed(w.Op.CHECK, buf, pos, end, each,
                           lambda _: _ok(b"\x01" if found[0] else b"\x00"))

    def _op_num_keys(self, conn: Any, buf: bytes, pos: int, end: int) -> bytes:
        extra = _INIT_KEY_COUNT if self._joined else 0
        return _ok(w.I64.pack(len(self._data) + extra))

    def _op_delete_key(self, conn: Any, buf: bytes, pos: int, end: int) -> bytes:
        key, _ = _blob(buf, pos, end)
        if is_reserved(key):
            return self._refused(conn, "delete_key", key)
        return _ok(b"\x01" if self.delete(key) else b"\x00")

    def _op_delete_prefix(self, conn: Any, buf: bytes, pos: int, end: int) -> bytes:
        prefix, _ = _blob(buf, pos, end)
        if is_reserved(prefix):
            return self._refused(conn, "delete_prefix", prefix)
        # a plain client's prefix that spans a world (e.g. "") leaves that world's keys alone
        return _ok(w.I64.pack(self.delete_prefix(prefix, reserved_too=False)))

    def _op_multi_set(self, conn: Any, buf: bytes, pos: int,
                      end: int) -> bytes | None | Sliced:
        """All or nothing: every pair is checked as it is read (a slice at a time for many),
        and only then written: at one instant up to ``SLICE_KEYS`` pairs, else that many a
        turn, in order (see :class:`_ValuesWritten`)."""
        n = self._count(buf, pos, end)
        refusal = self._too_many("multi_set", n // 2)
        if refusal:
            return refusal
        if n % 2:
            raise ValueError("odd number of blobs")
        if n > (end - pos - 4) // 4:
            raise ValueError(f"blob count {n} does not fit the frame")
        refused: list[bytes] = []

        def each(items: list[bytes]) -> bool:  # slices hold whole pairs: SLICE_KEYS is even
            for i in range(0, len(items), 2):
                why = self._refused(conn, "multi_set", items[i]) if is_reserved(items[i]) \
                    else self._too_big("multi_set", items[i], len(items[i + 1]))
                if why:
                    refused.append(why)
                    return False
            return True

        def finish(items: list[bytes]) -> bytes | Sliced:
            if refused:
                return refused[0]
            if len(items) <= 2 * SLICE_KEYS:
                self.put_all(dict(zip(items[0::2], items[1::2], strict=True)))
                return _OK_EMPTY
            return _ValuesWritten(self, items).step()

        # a whole request is applied whole, even if its client leaves before it is
        return _KeysRead(self, buf, pos + 4, end, n, each, finish, keep=True,
                         must_finish=True).step()

    def _op_queue_push(self, conn: Any, buf: bytes, pos: int, end: int) -> bytes:
        key, pos = _blob(buf, pos, end)
        value, _ = _blob(buf, pos, end)
        if is_reserved(key):
            return self._refused(conn, "queue_push", key)
        refusal = self._too_big("queue_push", key, len(value))
        if refusal:
            return refusal
        poppers = self._poppers.get(key)
        if poppers:
            # a parked pop takes the value directly, oldest pop first
            self._finish(poppers[0], _ok(value))
            return _OK_EMPTY
        q = self._queues.get(key)
        if q is None:
            q = self._queues[key] = deque()
        q.append(value)
        if len(q) == 1 and key in self._waiting:
            self._key_created(key)
        return _OK_EMPTY

    def _op_queue_pop(self, conn: Any, buf: bytes, pos: int, end: int) -> bytes | None:
        timeout, block, kl = _F64_U8_U32.unpack_from(buf, pos)
        timeout = _seconds(timeout)
        if pos + 13 + kl != end:
            raise ValueError("key length does not match the frame")
        key = bytes(buf[pos + 13:end])
        if is_reserved(key):
            return self._refused(conn, "queue_pop", key)
        q = self._queues.get(key)
        if q:
            value = q.popleft()
            if not q:
                del self._queues[key]
                self._removals += 1
            return _ok(value)
        if not block:
            return _reply(w.Status.QUEUE_EMPTY, f"queue {_name(key)!r} is empty".encode())
        if timeout <= 0:
            return _reply(w.Status.TIMEOUT,
                          f"queue_pop timeout (0s): queue {_name(key)!r} is empty".encode())
        self._park(_Waiter(conn, w.Op.QUEUE_POP, [key], timeout))
        return None

    def _op_queue_len(self, conn: Any, buf: bytes, pos: int, end: int) -> bytes:
        key, _ = _blob(buf, pos, end)
        return _ok(w.I64.pack(len(self._queues.get(key, ()))))

    def _op_wait_workers(self, conn: Any, buf: bytes, pos: int, end: int) -> bytes | None:
        timeout, count = _F64_I64.unpack_from(buf, pos)
        timeout = _seconds(timeout)
        if self._joined >= count:
            return _ok(w.I64.pack(self._joined))
        if timeout <= 0:
            return _reply(w.Status.TIMEOUT, (f"Timed out after 0 seconds waiting for clients. "
                                             f"{self._joined}/{count} clients joined.").encode())
        self._park(_Waiter(conn, w.Op.WAIT_WORKERS, [], timeout, count))
        return None


_F64_U32 = struct.Struct("!dI")
_I64_U32 = struct.Struct("!qI")
_F64_I64 = struct.Struct("!dq")
_F64_U8_U32 = struct.Struct("!dBI")
_F64_I64_U32 = struct.Struct("!dqI")


def _whole_seconds(seconds: float) -> int:
    return max(int(seconds + 0.999), 0)


def _name(key: bytes) -> str:
    return key.decode(errors="replace")


def _reply(status: w.Status, body: bytes) -> bytes:
    return w.HEADER.pack(len(body), status) + body


def _ok(body: bytes) -> bytes:
    return w.HEADER.pack(len(body), 0) + body


_OK_EMPTY = _ok(b"")
