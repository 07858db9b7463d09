"""The TCPStore server's commands: each request's body parsed and run on the key space
(:mod:`plugdist.store._server.keyspace`), parked with the waiters when it must wait, or read
a slice a turn when it names many keys (:mod:`plugdist.store._server.sliced`). The worlds'
commands (CLAIM, JOIN, MEMBER, RECORD) are :mod:`plugdist.store._server.worlds`'s, in the same
table.

Only the serving thread uses it; nothing here blocks. :meth:`Commands.handle` is on the hot path
of every request: one table lookup, then the command.
"""

from __future__ import annotations

import struct
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from plugdist.store import _wire as w
from plugdist.store._server.jobkeys import JobKeys
from plugdist.store._server.keyspace import KeySpace
from plugdist.store._server.quota import ENTRY_OVERHEAD, QUEUE_OVERHEAD, StrangerQuota
from plugdist.store._server.replies import OK_EMPTY, Reply, name, ok, ok_value, reply, seconds
from plugdist.store._server.sliced import SLICE_KEYS, KeysRead, Sliced, ValuesWritten
from plugdist.store._server.waiters import Waiter
from plugdist.store._server.worlds import Worlds
from plugdist.store._wire import read_blob as _blob
from plugdist.store._worldkeys import is_job_key, is_reserved

__all__ = ["Commands"]

_INIT_KEY_COUNT = 1  # num_keys counts the worker counter once someone joined (as torch does)
_F64_U32 = struct.Struct("!dI")
_I64_U32 = struct.Struct("!qI")
_F64_I64 = struct.Struct("!dq")
_F64_U8_U32 = struct.Struct("!dBI")
_F64_I64_U32 = struct.Struct("!dqI")

Handler = Callable[[Any, bytes, int, int], "Reply | None | Sliced"]


class Commands:
    """Every command of one server, by op code, over the key space ``keys``, its ``worlds``,
    the launchers' ``job_keys`` and the strangers' ``quota``."""

    def __init__(self, keys: KeySpace, worlds: Worlds, job_keys: JobKeys,
                 quota: StrangerQuota) -> None:
        self._keys = keys
        self._job_keys = job_keys
        self._charge = quota.charge
        self.stranger_refusal = quota.request_refusal
        self._data = keys.data
        self._queues = keys.queues
        self._waiters = keys.waiters
        self.served = 0  # requests handled so far (read by StoreServer.stats)
        self.handlers: dict[int, Handler] = {
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
            w.Op.CLAIM: self._trusting(worlds.op_claim),
            w.Op.JOIN: self._trusting(worlds.op_join),
            w.Op.MEMBER: worlds.op_member, w.Op.RECORD: worlds.op_record,
            w.Op.VOUCH: self._trusting(worlds.op_vouch),
        }
        self.trust: Callable[[Any], None] = lambda conn: None  # the server's guests set it

    def knows(self, op: int) -> bool:
        return op in self.handlers

    def handle(self, conn: Any, op: int, buf: bytes, pos: int,
               end: int) -> Reply | None | Sliced:
        """Run command ``op`` (one it :meth:`knows`) on its body ``buf[pos:end]``: the reply
        frame (empty for RENEW and WILL_DROP, which have none), or None when the request was
        parked (``conn.waiter`` is set until it is answered through ``answer``), or a
        :class:`Sliced` for a request of more than ``SLICE_KEYS`` keys. Raises ValueError (and
        the like) for a malformed body."""
        self.served += 1
        return self.handlers[op](conn, buf, pos, end)

    def refusal_ahead(self, conn: Any, op: int, buf: bytes | bytearray, pos: int,
                      end: int) -> bytes | None:
        """For a request of which only ``buf[pos:end]`` (its body's start) arrived: its ERROR
        reply when what arrived already decides it (too many keys, a value too big), ``b""``
        when it will not be refused for its size, None while the fields that tell are still to
        come. Lets the server answer and drop a huge frame without holding it."""
        keys = self._keys
        if op == w.Op.CHECK or op == w.Op.MULTI_SET:
            if end - pos < 4:
                return None
            n = int(w.U32.unpack_from(buf, pos)[0])
            return keys.too_many(w.Op(op).name.lower(), n // 2 if op == w.Op.MULTI_SET
                                 else n) or b""
        if op == w.Op.WAIT or op == w.Op.MULTI_GET:
            if end - pos < 12:
                return None
            return keys.too_many(w.Op(op).name.lower(), int(w.U32.unpack_from(buf, pos + 8)[0])) \
                or b""
        if op in (w.Op.SET, w.Op.APPEND, w.Op.QUEUE_PUSH):
            if end - pos < 4:
                return None
            klen = int(w.U32.unpack_from(buf, pos)[0])
            if end - pos < 8 + klen:
                return None
            key = bytes(buf[pos + 4:pos + 4 + klen])
            vlen = int(w.U32.unpack_from(buf, pos + 4 + klen)[0])
            return keys.too_big(w.Op(op).name.lower(), key, vlen) or b""
        return b""

    @staticmethod
    def _count(buf: bytes, pos: int, end: int) -> int:
        """The blob count at ``pos`` (a keyed request's n), read before its blobs are."""
        if pos + 4 > end:
            raise ValueError("truncated blob count")
        return int(w.U32.unpack_from(buf, pos)[0])

    # ---- commands: (conn, buf, body start, body end) -> reply frame or None when parked

    def _trusting(self, handler: Callable[[Any, bytes, int, int], bytes]) -> Handler:
        """CLAIM, JOIN or VOUCH (the worlds'), after which a connection that holds an identity,
        or vouched with a live one's credential (answered OK), is trusted: no longer a
        guest."""
        def run(conn: Any, buf: bytes, pos: int, end: int) -> bytes:
            answer = handler(conn, buf, pos, end)
            if not conn.trusted and (conn.identity is not None or answer == OK_EMPTY):
                self.trust(conn)
            return answer
        return run

    def _guard(self, conn: Any, op: str, key: bytes) -> bytes | None:
        """The refusal of a plain write ``op`` on ``key``: a world's reserved key, or a job key
        from a connection without the job's credential; None for every other key."""
        if b"plugdist/" not in key:
            return None
        if is_reserved(key):
            return self._keys.refused(conn, op, key)
        if is_job_key(key):
            return self._job_keys.refusal(conn, op, key)
        return None

    def _op_set(self, conn: Any, buf: bytes, pos: int, end: int) -> bytes:
        key, pos = _blob(buf, pos, end)
        value, _ = _blob(buf, pos, end)
        refusal = self._guard(conn, "set", key)
        if refusal:
            return refusal
        refusal = self._keys.too_big("set", key, len(value)) \
            or self._charge(conn, "set", key, ENTRY_OVERHEAD + len(key) + len(value))
        if refusal:
            return refusal
        self._keys.put(key, value)
        return OK_EMPTY

    def _op_get(self, conn: Any, buf: bytes, pos: int, end: int) -> Reply | None | Sliced:
        timeout, kl = _F64_U32.unpack_from(buf, pos)
        if pos + 12 + kl != end:
            raise ValueError("key length does not match the frame")
        key = bytes(buf[pos + 12:end])
        value = self._data.get(key)
        if value is not None:
            return ok_value(value)
        return self._waiters.wait_for(conn, w.Op.GET, [key], timeout)

    def _op_add(self, conn: Any, buf: bytes, pos: int, end: int) -> bytes:
        amount, kl = _I64_U32.unpack_from(buf, pos)
        if pos + 12 + kl != end:
            raise ValueError("key length does not match the frame")
        key = bytes(buf[pos + 12:end])
        if b"plugdist/" in key:
            if is_reserved(key):
                if amount:
                    return self._keys.refused(conn, "add", key)
                return self._keys.read_counter(key)  # add(key, 0) reads, creating nothing
            if is_job_key(key):
                refusal = self._job_keys.refusal(conn, "add", key) if amount else None
                if refusal:
                    return refusal
        if key not in self._data:
            refusal = self._charge(conn, "add", key, ENTRY_OVERHEAD + len(key) + 20)
            if refusal:
                return refusal
        total = self._keys.add_to(key, amount)
        return total if isinstance(total, bytes) else ok(w.I64.pack(total))

    def _op_will(self, conn: Any, buf: bytes, pos: int, end: int) -> bytes:
        key, pos = _blob(buf, pos, end)
        value, pos = _blob(buf, pos, end)
        ttl = 0.0
        if pos < end:
            (ttl,) = w.F64.unpack_from(buf, pos)
            ttl = seconds(ttl)
        refusal = self._guard(conn, "hold_will", key) \
            or self._charge(conn, "hold_will", key, ENTRY_OVERHEAD + len(key) + len(value))
        if refusal:
            return refusal
        if getattr(conn, "identity", None) is not None:
            return reply(w.Status.ERROR, b"hold_will refused: this connection holds a member "
                                         b"identity, whose will is the server's")
        conn.will = (key, value) if key else None
        self._keys.arm(conn, ttl if key else 0.0)
        return OK_EMPTY

    def _op_renew(self, conn: Any, buf: bytes, pos: int, end: int) -> bytes:
        if conn.will_ttl > 0:
            conn.will_deadline = time.monotonic() + conn.will_ttl
        return b""

    def _op_will_drop(self, conn: Any, buf: bytes, pos: int, end: int) -> bytes:
        conn.will = None
        conn.will_ttl = 0.0
        return b""

    def _op_log_read(self, conn: Any, buf: bytes, pos: int, end: int) -> Reply | None:
        timeout, start, kl = _F64_I64_U32.unpack_from(buf, pos)
        if pos + 20 + kl != end:
            raise ValueError("key length does not match the frame")
        if start < 1:
            raise ValueError(f"log entries are numbered from 1, got {start}")
        log = bytes(buf[pos + 20:end])
        first = log + b"/" + str(start).encode()
        if first in self._data:
            return self._waiters.log_entries(log, start)
        waiter = Waiter(conn, w.Op.LOG_READ, [first], timeout, start, log)
        if waiter.timeout <= 0:
            return reply(w.Status.TIMEOUT, f"log_read timeout (0s): missing keys "
                                           f"{[name(first)]}".encode())
        return self._waiters.park(waiter)

    def _op_append(self, conn: Any, buf: bytes, pos: int, end: int) -> bytes:
        key, pos = _blob(buf, pos, end)
        tail, _ = _blob(buf, pos, end)
        refusal = self._guard(conn, "append", key)
        if refusal:
            return refusal
        old = self._data.get(key)
        if len(old or b"") + len(tail) > self._keys.max_value_bytes:
            return reply(w.Status.ERROR, (
                f"append({name(key)!r}) would grow the value past this server's limit of "
                f"{self._keys.max_value_bytes} bytes (TCPStoreLimits.max_value_bytes)").encode())
        refusal = self._charge(conn, "append", key,
                               len(tail) + (ENTRY_OVERHEAD + len(key) if old is None else 0))
        if refusal:
            return refusal
        self._data[key] = tail if old is None else old + tail
        if old is None:
            self._keys.created_value(key)
        return OK_EMPTY

    def _op_compare_set(self, conn: Any, buf: bytes, pos: int, end: int) -> Reply:
        key, pos = _blob(buf, pos, end)
        expected, pos = _blob(buf, pos, end)
        desired, _ = _blob(buf, pos, end)
        refusal = self._guard(conn, "compare_set", key)
        if refusal:
            return refusal
        refusal = self._keys.too_big("compare_set", key, len(desired)) \
            or self._charge(conn, "compare_set", key,
                              ENTRY_OVERHEAD + len(key) + len(desired))
        if refusal:
            return refusal
        return ok_value(self._keys.compare_set(key, expected, desired))

    def _keyed(self, conn: Any, op: w.Op, buf: bytes, pos: int, end: int,
               each: Callable[[list[bytes]], bool] | None,
               finish: Callable[[list[bytes]], Reply | None | Sliced],
               keep: bool = False) -> Reply | None | Sliced:
        """A request whose body at ``pos`` is its keys (u32 n, n blobs): refused past
        ``max_keys``, answered at once up to ``SLICE_KEYS`` keys, else read in slices (see
        :class:`~plugdist.store._server.sliced.KeysRead`)."""
        n = self._count(buf, pos, end)
        refusal = self._keys.too_many(op.name.lower(), n) \
            or self.stranger_refusal(conn, op.name.lower(), end - pos, n)
        if refusal:
            return refusal
        if n > (end - pos - 4) // 4:
            raise ValueError(f"blob count {n} does not fit the frame")
        return KeysRead(self._keys, buf, pos + 4, end, n, each, finish, keep).step()

    def _awaited(self, conn: Any, op: w.Op, buf: bytes, pos: int,
                 end: int) -> Reply | None | Sliced:
        """WAIT or MULTI_GET: its keys looked at as they are read, until one is missing."""
        (timeout,) = w.F64.unpack_from(buf, pos)
        data, queues, removals = self._data, self._queues, self._keys.removals
        seen, missing = [0], [False]

        def each(keys: list[bytes]) -> bool:
            if not missing[0]:
                for k in keys:
                    if not (k in data or op == w.Op.WAIT and bool(queues.get(k))):
                        missing[0] = True
                        break
                    seen[0] += 1
            return True

        def finish(keys: list[bytes]) -> Reply | None | Sliced:  # none removed: no second look
            return self._waiters.wait_for(conn, op, keys, timeout,
                                          seen[0] if self._keys.removals == removals else 0)

        return self._keyed(conn, op, buf, pos + 8, end, each, finish, keep=True)

    def _op_wait(self, conn: Any, buf: bytes, pos: int, end: int) -> Reply | None | Sliced:
        return self._awaited(conn, w.Op.WAIT, buf, pos, end)

    def _op_multi_get(self, conn: Any, buf: bytes, pos: int,
                      end: int) -> Reply | None | Sliced:
        return self._awaited(conn, w.Op.MULTI_GET, buf, pos, end)

    def _op_check(self, conn: Any, buf: bytes, pos: int, end: int) -> Reply | None | Sliced:
        """Whether every key is present; a CHECK read in slices looks at each slice as it is
        read (a key deleted meanwhile, in a slice already read, still counts as present)."""
        found = [True]

        def each(keys: list[bytes]) -> bool:
            data, queues = self._data, self._queues
            found[0] = all([k in data or bool(queues.get(k)) for k in keys])
            return found[0]

        return self._keyed(conn, w.Op.CHECK, buf, pos, end, each,
                           lambda _: ok(b"\x01" if found[0] else b"\x00"))

    def _op_num_keys(self, conn: Any, buf: bytes, pos: int, end: int) -> bytes:
        extra = _INIT_KEY_COUNT if self._waiters.joined else 0
        return ok(w.I64.pack(len(self._data) + extra))

    def _op_delete_key(self, conn: Any, buf: bytes, pos: int, end: int) -> bytes:
        key, _ = _blob(buf, pos, end)
        refusal = self._guard(conn, "delete_key", key)
        if refusal:
            return refusal
        return ok(b"\x01" if self._keys.delete(key) else b"\x00")

    def _op_delete_prefix(self, conn: Any, buf: bytes, pos: int, end: int) -> bytes:
        prefix, _ = _blob(buf, pos, end)
        refusal = self._guard(conn, "delete_prefix", prefix)
        if refusal:
            return refusal
        # a prefix that spans a world (e.g. "") leaves that world's keys alone, and the job
        # keys unless this connection may write them
        return ok(w.I64.pack(self._keys.delete_prefix(
            prefix, reserved_too=False, job_too=self._job_keys.may_write(conn))))

    def _op_multi_set(self, conn: Any, buf: bytes, pos: int,
                      end: int) -> Reply | None | Sliced:
        """All or nothing: every pair is checked as it is read (a slice at a time for many),
        and only then written: at one instant up to ``SLICE_KEYS`` pairs, else that many a
        turn, in order (see :class:`~plugdist.store._server.sliced.ValuesWritten`)."""
        n = self._count(buf, pos, end)
        keys = self._keys
        refusal = keys.too_many("multi_set", n // 2) \
            or self.stranger_refusal(conn, "multi_set", end - pos, n)
        if refusal:
            return refusal
        if n % 2:
            raise ValueError("odd number of blobs")
        if n > (end - pos - 4) // 4:
            raise ValueError(f"blob count {n} does not fit the frame")
        refused: list[bytes] = []

        def each(items: list[bytes]) -> bool:  # slices hold whole pairs: SLICE_KEYS is even
            for i in range(0, len(items), 2):
                why = self._guard(conn, "multi_set", items[i]) \
                    or keys.too_big("multi_set", items[i], len(items[i + 1])) \
                    or self._charge(conn, "multi_set", items[i],
                                    ENTRY_OVERHEAD + len(items[i]) + len(items[i + 1]))
                if why:
                    refused.append(why)
                    return False
            return True

        def finish(items: list[bytes]) -> Reply | Sliced:
            if refused:
                return refused[0]
            if len(items) <= 2 * SLICE_KEYS:
                keys.put_all(dict(zip(items[0::2], items[1::2], strict=True)))
                return OK_EMPTY
            return ValuesWritten(keys, items).step()

        # a whole request is applied whole, even if its client leaves before it is
        return KeysRead(keys, buf, pos + 4, end, n, each, finish, keep=True,
                        must_finish=True).step()

    def _op_queue_push(self, conn: Any, buf: bytes, pos: int, end: int) -> bytes:
        key, pos = _blob(buf, pos, end)
        value, _ = _blob(buf, pos, end)
        refusal = self._guard(conn, "queue_push", key)
        if refusal:
            return refusal
        q = self._queues.get(key)
        size = ENTRY_OVERHEAD + len(value) + (QUEUE_OVERHEAD + len(key) if q is None else 0)
        refusal = self._keys.too_big("queue_push", key, len(value)) \
            or self._charge(conn, "queue_push", key, size)
        if refusal:
            return refusal
        poppers = self._waiters.poppers.get(key)
        if poppers:
            # a parked pop takes the value directly, oldest pop first
            self._waiters.finish(poppers[0], ok_value(value))
            return OK_EMPTY
        if q is None:
            q = self._queues[key] = deque()
        q.append(value)
        if len(q) == 1 and key in self._waiters.waiting:
            self._waiters.key_created(key)
        return OK_EMPTY

    def _op_queue_pop(self, conn: Any, buf: bytes, pos: int, end: int) -> Reply | None:
        timeout, block, kl = _F64_U8_U32.unpack_from(buf, pos)
        timeout = seconds(timeout)
        if pos + 13 + kl != end:
            raise ValueError("key length does not match the frame")
        key = bytes(buf[pos + 13:end])
        refusal = self._guard(conn, "queue_pop", key)
        if refusal:
            return refusal
        q = self._queues.get(key)
        if q:
            value = q.popleft()
            if not q:
                del self._queues[key]
                self._keys.removals += 1
            return ok_value(value)
        if not block:
            return reply(w.Status.QUEUE_EMPTY, f"queue {name(key)!r} is empty".encode())
        if timeout <= 0:
            return reply(w.Status.TIMEOUT,
                         f"queue_pop timeout (0s): queue {name(key)!r} is empty".encode())
        return self._waiters.park(Waiter(conn, w.Op.QUEUE_POP, [key], timeout))

    def _op_queue_len(self, conn: Any, buf: bytes, pos: int, end: int) -> bytes:
        key, _ = _blob(buf, pos, end)
        return ok(w.I64.pack(len(self._queues.get(key, ()))))

    def _op_wait_workers(self, conn: Any, buf: bytes, pos: int, end: int) -> Reply | None:
        timeout, count = _F64_I64.unpack_from(buf, pos)
        timeout = seconds(timeout)
        joined = self._waiters.joined
        if joined >= count:
            return ok(w.I64.pack(joined))
        if timeout <= 0:
            return reply(w.Status.TIMEOUT, (f"Timed out after 0 seconds waiting for clients. "
                                            f"{joined}/{count} clients joined.").encode())
        return self._waiters.park(Waiter(conn, w.Op.WAIT_WORKERS, [], timeout, count))
