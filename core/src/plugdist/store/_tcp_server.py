"""The TCPStore server: one daemon thread, one selector, every client on non-blocking sockets.

Blocking requests (GET, WAIT, MULTI_GET, WAIT_WORKERS) park the connection on the keys it waits
for; a write that creates a key answers the parked connections at once, and a deadline heap
answers the ones whose timeout passes. A client that disconnects, or sends anything that is not
a well-formed protocol-1 frame, is dropped and logged; nothing it does reaches other clients.
"""

from __future__ import annotations

import heapq
import itertools
import resource
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable

from ..errors import DistNetworkError
from ..log import get_logger
from . import _wire as w

__all__ = ["StoreServer"]

_READ = selectors.EVENT_READ
_WRITE = selectors.EVENT_WRITE
_RECV_SIZE = 256 * 1024


class _ProtocolError(Exception):
    """The peer broke the protocol; its connection is dropped."""


class _Conn:
    __slots__ = ("sock", "peer", "inbuf", "need", "out", "handshaken", "waiter", "closed")

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.inbuf = bytearray()  # bytes not yet parsed (a partial frame, or frames behind a wait)
        self.need = 0             # length inbuf must reach before parsing is worth trying
        self.out = bytearray()    # bytes the kernel has not taken yet
        self.handshaken = False
        self.waiter: _Waiter | None = None
        self.closed = False


class _Waiter:
    __slots__ = ("conn", "op", "keys", "missing", "deadline", "timeout", "count", "done")

    def __init__(self, conn: _Conn, op: w.Op, keys: list[bytes], missing: set[bytes],
                 timeout: float, count: int = 0) -> None:
        self.conn = conn
        self.op = op
        self.keys = keys
        self.missing = missing
        self.timeout = timeout
        self.deadline = time.monotonic() + max(timeout, 0.0)
        self.count = count
        self.done = False


def _raise_fd_limit(want: int = 65536) -> None:
    # a server holds one descriptor per client; many distributions default the soft limit to 1024
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        pass


class StoreServer:
    """Owns the listening socket and the serving thread. ``start()`` binds and listens in the
    caller's thread (so a busy port raises there), then serves in a daemon thread until
    ``stop()``. Only the serving thread touches the data; ``stop()`` is safe from any thread."""

    def __init__(self, family: int, port: int) -> None:
        self._family = family
        self._want_port = port
        self.port = 0
        self._data: dict[bytes, bytes] = {}
        self._waiting: dict[bytes, list[_Waiter]] = {}
        self._worker_waiters: list[_Waiter] = []
        self._deadlines: list[tuple[float, int, _Waiter]] = []
        self._seq = itertools.count()
        self._joined = 0
        self._parked = 0
        self._accept_paused_until = 0.0
        self._conns: dict[int, _Conn] = {}
        self._resume: list[_Conn] = []
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None
        self._log = get_logger(component="tcp_store_server")
        self._handlers: dict[int, Callable[[_Conn, bytes, int, int], bytes | None]] = {
            w.Op.SET: self._op_set, w.Op.GET: self._op_get, w.Op.ADD: self._op_add,
            w.Op.COMPARE_SET: self._op_compare_set, w.Op.WAIT: self._op_wait,
            w.Op.CHECK: self._op_check, w.Op.NUM_KEYS: self._op_num_keys,
            w.Op.DELETE_KEY: self._op_delete_key, w.Op.MULTI_GET: self._op_multi_get,
            w.Op.MULTI_SET: self._op_multi_set, w.Op.WAIT_WORKERS: self._op_wait_workers,
        }

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        _raise_fd_limit()
        lsock = socket.socket(self._family, socket.SOCK_STREAM)
        try:
            lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if self._family == socket.AF_INET6:
                lsock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            lsock.bind(("::" if self._family == socket.AF_INET6 else "0.0.0.0", self._want_port))
            lsock.listen(4096)
            lsock.setblocking(False)
        except OSError as e:
            lsock.close()
            raise DistNetworkError(
                f"TCPStore server could not listen on port {self._want_port} ({e.strerror or e}); "
                f"another process may hold it: pick a free MASTER_PORT, or port 0 for any free "
                f"port") from e
        self.port = lsock.getsockname()[1]
        self._lsock = lsock
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(lsock, _READ, None)
        self._sel.register(self._wake_r, _READ, None)
        self._thread = threading.Thread(target=self._serve, name=f"plugdist-tcpstore-{self.port}",
                                        daemon=True)
        self._thread.start()

    def stop(self, join_timeout: float = 5.0) -> None:
        """Stop serving, close every socket, free the port. Idempotent; blocks up to
        ``join_timeout`` for the thread unless called from it."""
        if self._thread is None or self._stop_event.is_set():
            return
        self._stop_event.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if threading.current_thread() is not self._thread:
            self._thread.join(join_timeout)

    # ---- the loop --------------------------------------------------------------------------

    def _serve(self) -> None:
        sel = self._sel
        lsock = self._lsock
        wake = self._wake_r
        try:
            while not self._stop_event.is_set():
                delay = None
                if self._deadlines:
                    delay = min(max(0.0, self._deadlines[0][0] - time.monotonic()), 3600.0)
                if self._accept_paused_until:
                    pause = max(0.0, self._accept_paused_until - time.monotonic())
                    delay = pause if delay is None else min(delay, pause)
                for key, mask in sel.select(delay):
                    conn = key.data
                    if conn is None:
                        if key.fileobj is lsock:
                            self._accept()
                        elif key.fileobj is wake:
                            try:
                                wake.recv(64)
                            except OSError:
                                pass
                        continue
                    if conn.closed:
                        continue
                    if mask & _WRITE:
                        self._flush(conn)
                    if mask & _READ and not conn.closed:
                        self._on_readable(conn)
                if self._deadlines:
                    self._expire(time.monotonic())
                if self._accept_paused_until and time.monotonic() >= self._accept_paused_until:
                    self._accept_paused_until = 0.0
                    sel.register(lsock, _READ, None)
                while self._resume:
                    conn = self._resume.pop()
                    if not conn.closed and conn.waiter is None and conn.inbuf:
                        self._process(conn, b"", force=True)
        except Exception as e:  # a bug here must not leave clients hanging silently
            self._log.error("tcp_store_server_crashed", port=self.port, error=repr(e))
            raise
        finally:
            for conn in list(self._conns.values()):
                self._close(conn)
            for s in (lsock, wake, self._wake_w):
                try:
                    sel.unregister(s)
                except (KeyError, ValueError):
                    pass
                s.close()
            sel.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self._lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                # e.g. EMFILE: the pending connection stays in the backlog and would make the
                # listener readable forever; stop watching it briefly instead of spinning
                self._log.warning("tcp_store_accept_failed", port=self.port, error=str(e))
                self._sel.unregister(self._lsock)
                self._accept_paused_until = time.monotonic() + 0.1
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock, f"{addr[0]}:{addr[1]}")
            self._conns[sock.fileno()] = conn
            self._sel.register(sock, _READ, conn)

    def _on_readable(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(_RECV_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._drop(conn, f"receive failed: {e}")
            return
        if not data:
            if conn.waiter is not None or conn.inbuf:
                self._drop(conn, "client disconnected in the middle of a request")
            else:
                self._close(conn)
            return
        self._process(conn, data)

    def _process(self, conn: _Conn, data: bytes, force: bool = False) -> None:
        if conn.inbuf:
            # a large frame arrives in many reads: append (amortised O(1)) until it is whole
            conn.inbuf += data
            if conn.waiter is not None or (len(conn.inbuf) < conn.need and not force):
                return
            buf = bytes(conn.inbuf)
        elif conn.waiter is not None:
            conn.inbuf += data
            return
        else:
            buf = data
        pos, end = 0, len(buf)
        try:
            if not conn.handshaken:
                pos = self._handshake(conn, buf)
                if not conn.handshaken:
                    self._keep(conn, buf, 0, w.PREAMBLE.size)
                    return
            while conn.waiter is None and end - pos >= 5:
                length, op = w.HEADER.unpack_from(buf, pos)
                if length > w.MAX_FRAME:
                    raise _ProtocolError(f"frame of {length} bytes exceeds the limit of "
                                         f"{w.MAX_FRAME}")
                stop = pos + 5 + length
                if stop > end:
                    break
                handler = self._handlers.get(op)
                if handler is None:
                    raise _ProtocolError(f"unknown command {op}")
                try:
                    reply = handler(conn, buf, pos + 5, stop)
                except (ValueError, IndexError, struct.error, UnicodeDecodeError) as e:
                    raise _ProtocolError(f"malformed {w.Op(op).name} request: {e}") from None
                pos = stop
                if reply is not None:
                    self._send(conn, reply)
                    if conn.closed:
                        return
        except _ProtocolError as e:
            self._drop(conn, str(e))
            return
        except Exception as e:  # a server bug: lose this client, keep serving the others
            self._log.error("tcp_store_internal_error", port=self.port, peer=conn.peer,
                            error=repr(e))
            self._close(conn)
            return
        if pos >= end:
            if conn.inbuf:
                conn.inbuf = bytearray()
            conn.need = 0
            return
        need = 5
        if end - pos >= 5:
            need = 5 + w.HEADER.unpack_from(buf, pos)[0]
        self._keep(conn, buf, pos, need)

    @staticmethod
    def _keep(conn: _Conn, buf: bytes, pos: int, need: int) -> None:
        conn.inbuf = bytearray(memoryview(buf)[pos:])
        conn.need = need

    def _handshake(self, conn: _Conn, buf: bytes) -> int:
        head = bytes(buf[:4])
        if head != w.MAGIC[:len(head)]:
            raise _ProtocolError("bad magic: not a plugdist TCPStore client")
        if len(buf) < w.PREAMBLE.size:
            return 0
        _, version, flags = w.PREAMBLE.unpack_from(buf, 0)
        if version != w.VERSION:
            try:  # tell the client why before hanging up; best effort on a fresh socket
                conn.sock.send(w.PREAMBLE.pack(w.MAGIC, w.VERSION, w.HELLO_BAD_VERSION))
            except OSError:
                pass
            raise _ProtocolError(f"protocol version {version}, server speaks {w.VERSION}")
        conn.handshaken = True
        self._send(conn, w.PREAMBLE.pack(w.MAGIC, w.VERSION, w.HELLO_OK))
        if flags & w.FLAG_JOIN:
            self._joined += 1
            if self._worker_waiters:
                for waiter in [x for x in self._worker_waiters if self._joined >= x.count]:
                    self._finish(waiter, _ok(w.I64.pack(self._joined)))
        return w.PREAMBLE.size

    # ---- output ----------------------------------------------------------------------------

    def _send(self, conn: _Conn, data: bytes) -> None:
        if conn.out:
            conn.out += data
            return
        try:
            n = conn.sock.send(data)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError as e:
            self._drop(conn, f"send failed: {e}")
            return
        if n < len(data):
            conn.out += data[n:]
            self._sel.modify(conn.sock, _READ | _WRITE, conn)

    def _flush(self, conn: _Conn) -> None:
        try:
            n = conn.sock.send(conn.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._drop(conn, f"send failed: {e}")
            return
        del conn.out[:n]
        if not conn.out:
            self._sel.modify(conn.sock, _READ, conn)

    def _drop(self, conn: _Conn, why: str) -> None:
        self._log.warning("tcp_store_client_dropped", port=self.port, peer=conn.peer, reason=why)
        self._close(conn)

    def _close(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        if conn.waiter is not None:
            self._forget(conn.waiter)
            conn.waiter = None
        self._conns.pop(conn.sock.fileno(), None)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    # ---- waiting ---------------------------------------------------------------------------

    def _park(self, waiter: _Waiter) -> None:
        waiter.conn.waiter = waiter
        if waiter.op == w.Op.WAIT_WORKERS:
            self._worker_waiters.append(waiter)
        else:
            for k in waiter.missing:
                self._waiting.setdefault(k, []).append(waiter)
        self._parked += 1
        dl = self._deadlines
        if len(dl) > 1024 and len(dl) > 4 * self._parked:
            # answered waiters stay in the heap until their deadline; drop them in bulk so a
            # stream of short waits under a long timeout cannot grow it without bound
            dl[:] = [e for e in dl if not e[2].done]
            heapq.heapify(dl)
        heapq.heappush(dl, (waiter.deadline, next(self._seq), waiter))

    def _forget(self, waiter: _Waiter) -> None:
        if waiter.done:
            return
        waiter.done = True
        self._parked -= 1
        if waiter.op == w.Op.WAIT_WORKERS:
            self._worker_waiters.remove(waiter)
            return
        for k in waiter.missing:
            lst = self._waiting.get(k)
            if lst is not None:
                try:
                    lst.remove(waiter)
                except ValueError:
                    pass
                if not lst:
                    del self._waiting[k]

    def _finish(self, waiter: _Waiter, reply: bytes) -> None:
        self._forget(waiter)
        conn = waiter.conn
        conn.waiter = None
        self._send(conn, reply)
        if conn.inbuf:
            self._resume.append(conn)

    def _key_created(self, key: bytes) -> None:
        waiters = self._waiting.pop(key, None)
        if not waiters:
            return
        data = self._data
        for waiter in waiters:
            waiter.missing.discard(key)
            if waiter.missing or waiter.done:
                continue
            # a key seen earlier may have been deleted since: wait for it again
            again = {k for k in waiter.keys if k not in data}
            if again:
                waiter.missing = again
                for k in again:
                    self._waiting.setdefault(k, []).append(waiter)
            else:
                self._finish(waiter, self._ready_reply(waiter))

    def _ready_reply(self, waiter: _Waiter) -> bytes:
        if waiter.op == w.Op.GET:
            return _ok(self._data[waiter.keys[0]])
        if waiter.op == w.Op.MULTI_GET:
            return _ok(w.pack_blobs([self._data[k] for k in waiter.keys]))
        return _OK_EMPTY

    def _expire(self, now: float) -> None:
        dl = self._deadlines
        while dl and dl[0][0] <= now:
            _, _, waiter = heapq.heappop(dl)
            if waiter.done:
                continue
            if waiter.op == w.Op.WAIT_WORKERS:
                msg = (f"{self._joined} of {waiter.count} workers joined within "
                       f"{waiter.timeout:.3g}s")
            else:
                missing = [k.decode(errors="replace") for k in waiter.keys if k in waiter.missing]
                msg = f"timed out after {waiter.timeout:.3g}s waiting for keys {missing}"
            self._finish(waiter, _reply(w.Status.TIMEOUT, msg.encode()))

    def _wait_for(self, conn: _Conn, op: w.Op, keys: list[bytes], timeout: float) -> bytes | None:
        data = self._data
        missing = {k for k in keys if k not in data}
        if not missing:
            return self._ready_reply(_Waiter(conn, op, keys, missing, 0.0))
        if timeout <= 0:
            names = [k.decode(errors="replace") for k in keys if k in missing]
            return _reply(w.Status.TIMEOUT, f"keys {names} not present (timeout 0)".encode())
        self._park(_Waiter(conn, op, keys, missing, timeout))
        return None

    # ---- commands: (conn, buf, body start, body end) -> reply frame or None when parked ----

    def _op_set(self, conn: _Conn, buf: bytes, pos: int, end: int) -> bytes:
        key, pos = _blob(buf, pos, end)
        value, _ = _blob(buf, pos, end)
        created = key not in self._data
        self._data[key] = value
        if created:
            self._key_created(key)
        return _OK_EMPTY

    def _op_get(self, conn: _Conn, buf: bytes, pos: int, end: int) -> bytes | None:
        timeout, kl = _F64_U32.unpack_from(buf, pos)
        if pos + 12 + kl != end:
            raise ValueError("key length does not match the frame")
        key = buf[pos + 12:end]
        value = self._data.get(key)
        if value is not None:
            return _ok(value)
        return self._wait_for(conn, w.Op.GET, [key], timeout)

    def _op_add(self, conn: _Conn, buf: bytes, pos: int, end: int) -> bytes:
        amount, kl = _I64_U32.unpack_from(buf, pos)
        if pos + 12 + kl != end:
            raise ValueError("key length does not match the frame")
        key = buf[pos + 12:end]
        old = self._data.get(key)
        if old is None:
            total = amount
        else:
            try:
                total = int(old) + amount
            except ValueError:
                return _reply(w.Status.ERROR, (
                    f"add({key.decode(errors='replace')!r}) met a value that is not an integer "
                    f"({old[:32]!r}): the key was written by set(); use a separate key for "
                    f"counters").encode())
        self._data[key] = str(total).encode()
        if old is None:
            self._key_created(key)
        return _ok(w.I64.pack(total))

    def _op_compare_set(self, conn: _Conn, buf: bytes, pos: int, end: int) -> bytes:
        key, pos = _blob(buf, pos, end)
        expected, pos = _blob(buf, pos, end)
        desired, _ = _blob(buf, pos, end)
        current = self._data.get(key)
        if current is None:
            if expected:
                return _ok(expected)
            self._data[key] = desired
            self._key_created(key)
            return _ok(desired)
        if current == expected:
            self._data[key] = desired
            return _ok(desired)
        return _ok(current)

    def _op_wait(self, conn: _Conn, buf: bytes, pos: int, end: int) -> bytes | None:
        (timeout,) = w.F64.unpack_from(buf, pos)
        keys, _ = w.unpack_blobs(buf, pos + 8, end)
        return self._wait_for(conn, w.Op.WAIT, keys, timeout)

    def _op_multi_get(self, conn: _Conn, buf: bytes, pos: int, end: int) -> bytes | None:
        (timeout,) = w.F64.unpack_from(buf, pos)
        keys, _ = w.unpack_blobs(buf, pos + 8, end)
        return self._wait_for(conn, w.Op.MULTI_GET, keys, timeout)

    def _op_check(self, conn: _Conn, buf: bytes, pos: int, end: int) -> bytes:
        keys, _ = w.unpack_blobs(buf, pos, end)
        data = self._data
        return _ok(b"\x01" if all(k in data for k in keys) else b"\x00")

    def _op_num_keys(self, conn: _Conn, buf: bytes, pos: int, end: int) -> bytes:
        return _ok(w.I64.pack(len(self._data)))

    def _op_delete_key(self, conn: _Conn, buf: bytes, pos: int, end: int) -> bytes:
        key, _ = _blob(buf, pos, end)
        return _ok(b"\x01" if self._data.pop(key, None) is not None else b"\x00")

    def _op_multi_set(self, conn: _Conn, buf: bytes, pos: int, end: int) -> bytes:
        items, _ = w.unpack_blobs(buf, pos, end)
        if len(items) % 2:
            raise ValueError("odd number of blobs")
        for i in range(0, len(items), 2):
            key = items[i]
            created = key not in self._data
            self._data[key] = items[i + 1]
            if created:
                self._key_created(key)
        return _OK_EMPTY

    def _op_wait_workers(self, conn: _Conn, buf: bytes, pos: int, end: int) -> bytes | None:
        timeout, count = _F64_I64.unpack_from(buf, pos)
        if self._joined >= count:
            return _ok(w.I64.pack(self._joined))
        if timeout <= 0:
            return _reply(w.Status.TIMEOUT, f"{self._joined} of {count} workers joined".encode())
        self._park(_Waiter(conn, w.Op.WAIT_WORKERS, [], set(), timeout, count))
        return None


_F64_U32 = struct.Struct("!dI")
_I64_U32 = struct.Struct("!qI")
_F64_I64 = struct.Struct("!dq")


def _reply(status: w.Status, body: bytes) -> bytes:
    return w.HEADER.pack(len(body), status) + body


def _ok(body: bytes) -> bytes:
    return w.HEADER.pack(len(body), 0) + body


_OK_EMPTY = _ok(b"")


def _blob(buf: bytes, pos: int, end: int) -> tuple[bytes, int]:
    if pos + 4 > end:
        raise ValueError("truncated length")
    (n,) = w.U32.unpack_from(buf, pos)
    stop = pos + 4 + n
    if stop > end:
        raise ValueError("field runs past the frame")
    return bytes(buf[pos + 4:stop]), stop

