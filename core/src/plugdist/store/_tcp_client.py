"""The TCPStore client's long-lived connections: wills (``TCPStore.hold_will``) with the one
thread per process that renews them, and member identities (``TCPStore.claim_member``,
``TCPStore.join_member``): a will the server writes itself, plus the checked writes of a
world's members (see :mod:`plugdist.store._server.worlds`). Also the client's timing constants.
"""

from __future__ import annotations

import copy
import heapq
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from plugdist.errors import DistNetworkError, DistStoreError, DistTimeoutError
from plugdist.store import _wire as w
from plugdist.store._util import check_amount, check_key
from plugdist.store.api import to_bytes
from plugdist.store.api import to_seconds as _to_seconds

__all__ = ["TCPStoreWill", "TCPStoreSession", "REPLY_GRACE", "MIN_IO_TIMEOUT", "MAX_TIMEOUT",
           "clamp_seconds", "read_log", "renewer"]

# extra seconds a client waits beyond a blocking call's timeout for the server's own answer
REPLY_GRACE = 10.0
# least time a non-blocking request waits for its reply: a store timeout of a fraction of a
# second is meant for get/wait, and must not fail a set on a loaded machine
MIN_IO_TIMEOUT = 5.0
# longest timeout honoured (~115 days): timedelta.max would overflow socket and poll timeouts
MAX_TIMEOUT = 1e7


def clamp_seconds(timeout: timedelta | float | int) -> float:
    """Seconds in [0, MAX_TIMEOUT]."""
    return min(max(_to_seconds(timeout), 0.0), MAX_TIMEOUT)


class TCPStoreWill:
    """A will left with a TCPStore server (see ``TCPStore.hold_will``). ``cancel`` withdraws
    it and closes its connection; idempotent.

    ``liveness_timeout``: the ttl (None without one: the server then sees a dropped connection
    but not a process that stalls with its connection open, and membership keeps heartbeats).
    ``death_timeout`` is 0: a process that dies drops its connection, which the server sees at
    once. :meth:`read_log` waits on the log on the will's own connection (one thread at a
    time)."""

    death_timeout = 0.0

    def __init__(self, store: Any, conn: Any, key: str = "",
                 ttl: float | None = None) -> None:
        self._store = store
        self._conn: Any = conn
        self._lock = threading.Lock()
        self.key = key
        self.liveness_timeout: float | None = ttl
        self.renew_period = ttl / 4 if ttl is not None else 0.0
        self._reading = threading.Lock()  # held while read_log waits on the connection
        self._where = f"TCPStore {store.host}:{store.port}"

    def __repr__(self) -> str:
        state = "cancelled" if self._conn is None else "held"
        return f"TCPStoreWill({self.key!r}, ttl={self.liveness_timeout}, {self._where}, {state})"

    def renew(self) -> bool:
        """Send one renewal (no reply). False once the will is cancelled or its connection is
        gone (then nothing renews it any more). Called by the process's renewal thread."""
        conn = self._conn
        if conn is None:
            return False
        try:
            conn.send_control(w.RENEW_FRAME)
        except OSError:
            return False
        return True

    def read_log(self, start: int, timeout: timedelta | float) -> list[bytes]:
        """``TCPStore.read_log`` of this will's log, on the will's own connection: blocks until
        entry ``start`` exists, up to ``timeout``. Raises DistTimeoutError at the timeout,
        DistNetworkError when the will was cancelled meanwhile or the server went away."""
        conn = self._conn
        if conn is None:
            raise DistNetworkError(f"{self._where}: read_log on a cancelled will")
        seconds = clamp_seconds(timeout)

        def request(op: str, frame: bytes, wait: float | None = None) -> bytes:
            assert conn is not None
            try:
                with self._reading:
                    status, body = conn.roundtrip(frame, (wait or 0.0) + REPLY_GRACE)
            except (OSError, ConnectionError) as e:
                raise DistNetworkError(f"{self._where}: connection of the will on "
                                       f"{self.key!r} lost during {op} ({e})") from e
            if status == w.Status.TIMEOUT:
                raise DistTimeoutError(f"{self._where}: {op}: {body.decode(errors='replace')}")
            if status != w.Status.OK:
                raise DistStoreError(f"{self._where}: {op}: {body.decode(errors='replace')}")
            return body

        return read_log(request, self.key, start, seconds)

    def _send(self, key: bytes, value: bytes) -> None:
        body = b"".join((w.U32.pack(len(key)), key, w.U32.pack(len(value)), value))
        if self.liveness_timeout is not None:
            body += w.F64.pack(self.liveness_timeout)
        conn = self._conn
        if conn is None:
            return
        try:
            status, reply = conn.roundtrip(w.request(w.Op.WILL, body), max(
                MIN_IO_TIMEOUT, clamp_seconds(self._store.timeout)))
        except (OSError, ConnectionError) as e:
            raise DistNetworkError(f"TCPStore {self._store.host}:{self._store.port}: connection "
                                   f"lost while leaving a will ({e})") from e
        if status != w.Status.OK:
            raise DistStoreError(f"TCPStore {self._store.host}:{self._store.port}: will: "
                                 f"{reply.decode(errors='replace')}")

    def cancel(self) -> None:
        """Withdraw the will, then close its connection. A ``read_log`` waiting on it (another
        thread's) ends with DistNetworkError. Blocks until the server closed its end (it has
        then read the withdrawal), at most about five seconds."""
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            # no reply, and read even while a read_log is parked: then end our side, so the
            # server reads the withdrawal, then the end of the stream, and closes its side
            conn.send_control(w.WILL_DROP_FRAME)
            conn.sock.shutdown(socket.SHUT_WR)
            if self._reading.acquire(timeout=MIN_IO_TIMEOUT):
                try:  # nobody reads: wait for the server's end of the stream ourselves
                    conn.sock.settimeout(MIN_IO_TIMEOUT)
                    while conn.sock.recv(65536):
                        pass
                finally:
                    self._reading.release()
        except OSError:
            pass  # the server is gone: nobody is left to read the will
        finally:
            conn.close()


class _Renewer:
    """The one thread of a process that renews its TCPStore wills that have a ttl, each every
    quarter of its ttl. Drops a will once it is cancelled or its connection is gone."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._due: list[tuple[float, int, TCPStoreWill]] = []
        self._seq = 0
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def add(self, will: TCPStoreWill) -> None:
        with self._lock:
            self._seq += 1
            heapq.heappush(self._due, (time.monotonic() + will.renew_period, self._seq, will))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="plugdist-will-renewal",
                                                daemon=True)
                self._thread.start()
            self._lock.notify()

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._due or self._due[0][0] > time.monotonic():
                    wait = self._due[0][0] - time.monotonic() if self._due else None
                    self._lock.wait(wait)
                _, seq, will = heapq.heappop(self._due)
            if will.renew():
                with self._lock:
                    heapq.heappush(self._due, (time.monotonic() + will.renew_period, seq, will))


_renewer_lock = threading.Lock()
_the_renewer: _Renewer | None = None


def renewer() -> _Renewer:
    """This process's renewal thread (a fresh one in a forked child)."""
    global _the_renewer
    with _renewer_lock:
        if _the_renewer is None or _the_renewer._pid != os.getpid():
            _the_renewer = _Renewer()
        return _the_renewer


def read_log(request: Callable[..., bytes], key: str, start: int,
              timeout: float) -> list[bytes]:
    """``Store.read_log`` over ``request``: one request parked until ``key/start`` exists,
    and, after a reply of ``LOG_READ_ENTRIES`` entries (the most a reply carries), requests that
    do not wait for the entries behind them, until a shorter reply or a missing entry."""
    k = check_key(key).encode()
    if start < 1:
        raise ValueError(f"read_log: entries are numbered from 1, got start={start}")
    frame = w.HDR_F64_I64_BLOB.pack(20 + len(k), w.Op.LOG_READ, timeout, start, len(k)) + k
    reply = request("read_log", frame, wait=timeout)
    entries, _ = w.unpack_blobs(reply, 0, len(reply))
    batch = len(entries)
    while batch == w.LOG_READ_ENTRIES:
        frame = w.HDR_F64_I64_BLOB.pack(20 + len(k), w.Op.LOG_READ, 0.0, start + len(entries),
                                        len(k)) + k
        try:
            reply = request("read_log", frame, wait=0.0)
        except DistTimeoutError:
            break  # none behind it
        more, _ = w.unpack_blobs(reply, 0, len(reply))
        entries += more
        batch = len(more)
    return entries


class TCPStoreSession:
    """A member identity held with a TCPStore server (``TCPStore.claim_member`` or
    ``join_member``): ``will`` is its will (the server writes the death record itself when its
    connection drops or its ttl lapses; ``cancel()`` withdraws it and ends the identity), and
    the write methods change the world's reserved keys through the server's checks (see
    :mod:`plugdist.store._server.worlds`). Keys are relative to the world's root. ``uid`` is the
    identity; ``start`` how far the death log ran when a joiner took its ``ticket`` (0 and 0
    for a rank). ``protected``: True, the server owns the membership keys. Thread-safe (each
    write borrows a connection of the store's pool)."""

    protected = True

    def __init__(self, request: Callable[..., bytes], will: TCPStoreWill, root: bytes, uid: str,
                 secret: bytes, start: int = 0, ticket: int = 0) -> None:
        self._request = request
        self.will = will
        self.uid = uid
        self.start = start
        self.ticket = ticket
        self._head = b"".join((w.U32.pack(len(root)), root, w.U32.pack(len(uid.encode())),
                               uid.encode(), w.U32.pack(len(secret)), secret))

    def __repr__(self) -> str:
        return f"TCPStoreSession({self.uid!r}, {self.will!r})"

    def using(self, store: Any) -> TCPStoreSession:
        """This identity's writes through the connections of ``store``, another TCPStore client
        of the same server (a process whose members share a few connections); the identity
        itself stays on its own connection. ``store``'s connections vouch with this identity's
        credential, if they vouch with none yet (the server then never displaces them)."""
        twin = copy.copy(self)
        twin._request = store._request
        if getattr(store, "_vouch", False) is None:
            store._vouch = w.request(w.Op.VOUCH, self._head)
        return twin

    def _member(self, what: str, op: w.Op, body: bytes) -> bytes:
        return self._request(what, w.request(w.Op.MEMBER, self._head + w.U8.pack(op) + body))

    def set(self, key: str, value: bytes | str) -> None:
        k, v = check_key(key).encode(), to_bytes(value)
        self._member("set", w.Op.SET, _blob(k) + _blob(v))

    def add(self, key: str, amount: int) -> int:
        k = check_key(key).encode()
        body = w.I64.pack(check_amount(amount)) + w.U32.pack(len(k)) + k
        return int(w.I64.unpack(self._member("add", w.Op.ADD, body))[0])

    def compare_set(self, key: str, expected_value: bytes | str,
                    desired_value: bytes | str) -> bytes:
        k = check_key(key).encode()
        body = _blob(k) + _blob(to_bytes(expected_value)) + _blob(to_bytes(desired_value))
        return self._member("compare_set", w.Op.COMPARE_SET, body)

    def append_log(self, key: str, value: bytes | str) -> int:
        """Append ``value`` to the numbered log ``key`` in one round trip: the server counts it
        (n) and writes ``key/n``, checking both as the two writes would be; returns n."""
        k = check_key(key).encode()
        return int(w.I64.unpack(self._member("append_log", w.Op.LOG_APPEND,
                                             _blob(k) + _blob(to_bytes(value))))[0])

    def delete_key(self, key: str) -> bool:
        return self._member("delete_key", w.Op.DELETE_KEY,
                            _blob(check_key(key).encode())) == b"\x01"

    def delete_prefix(self, prefix: str) -> int:
        reply = self._member("delete_prefix", w.Op.DELETE_PREFIX, _blob(prefix.encode()))
        return int(w.I64.unpack(reply)[0])

    def record(self, record: bytes | str) -> bool:
        """Append ``record`` (a JSON object) to the world's death log, as the server allows it
        (see :mod:`plugdist.store._server.worlds`): False when it declares a member another one
        declared first (nothing appended)."""
        reply = self._request("record", w.request(w.Op.RECORD,
                                                  self._head + _blob(to_bytes(record))))
        return reply == b"\x01"


def _blob(data: bytes) -> bytes:
    return w.U32.pack(len(data)) + data
