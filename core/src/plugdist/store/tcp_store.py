"""``TCPStore``: a key-value store served over TCP by the master process.

The master (``is_master=True``) runs the server (see ``_server``) in a daemon thread and talks to
it through a client connection like everyone else. Blocking calls are answered by the server
when the keys arrive or the timeout passes; clients never poll. The wire protocol, including the
token handshake every connection makes, is in ``_wire``; wills and member identities are in
``_tcp_client``; where the token comes from, and when a master needs one, in ``tokens``.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
import socket
import struct
import threading
import time
import weakref
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from plugdist.errors import (
    DistExcludedError,
    DistNetworkError,
    DistStoreError,
    DistTimeoutError,
    QueueEmptyError,
)
from plugdist.store import _wire as w
from plugdist.store._server import StoreServer, TCPStoreLimits
from plugdist.store._server.peers import socket_owner
from plugdist.store._tcp_client import MIN_IO_TIMEOUT as _MIN_IO_TIMEOUT
from plugdist.store._tcp_client import REPLY_GRACE as _REPLY_GRACE
from plugdist.store._tcp_client import TCPStoreSession, TCPStoreWill, read_log, renewer
from plugdist.store._tcp_client import clamp_seconds as to_seconds
from plugdist.store._tokens import (
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    is_loopback,
    resolve_token,
    tokenless_exposure,
)
from plugdist.store._util import check_amount, check_key, check_keys
from plugdist.store._worldkeys import DEATHS
from plugdist.store.api import DEFAULT_STORE_TIMEOUT, Store, to_bytes

__all__ = ["TCPStore", "TCPStoreLimits", "TOKEN_ENV"]

_JOIN_REPLY = struct.Struct("!qq")
_OP_SET, _OP_GET, _OP_ADD = int(w.Op.SET), int(w.Op.GET), int(w.Op.ADD)


def _resolve(host: str, port: int) -> list[tuple[int, tuple]]:
    """Addresses to try for ``host``: a numeric address as is; a name through one getaddrinfo.
    ``localhost`` is one address (IPv4 loopback where the host has it), the one a master binds:
    a client that tried the other family as well could reach another local user's listener
    there while the master is not up yet."""
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ip = ipaddress.ip_address(bare)
    except ValueError:
        pass
    else:
        if ip.version == 6:
            return [(socket.AF_INET6, (str(ip), port, 0, 0))]
        return [(socket.AF_INET, (str(ip), port))]
    try:
        infos = socket.getaddrinfo(bare, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise DistNetworkError(f"TCPStore: cannot resolve host {host!r} ({e}); set MASTER_ADDR "
                               f"to the master's IP address or a resolvable name") from e
    out: list[tuple[int, tuple]] = []
    for family, _, _, _, sockaddr in infos:
        if (family, sockaddr) not in out and family in (socket.AF_INET, socket.AF_INET6):
            out.append((family, sockaddr))
    if is_loopback(host) and out:
        out = [next((a for a in out if a[0] == socket.AF_INET), out[0])]
    return out


class _Connection:
    """One client socket. Not thread-safe for requests: the store hands it to one request at a
    time; :meth:`send_control` (a will's renewal) may come from another thread meanwhile."""

    __slots__ = ("sock", "buf", "view", "sock_timeout", "send_lock", "vouched")

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        self.sock = sock
        self.buf = bytearray(64 * 1024)
        self.view = memoryview(self.buf)
        self.sock_timeout = timeout
        self.send_lock = threading.Lock()  # a request's bytes never interleave a renewal's
        self.vouched = False  # it showed the server this store's member credential

    def send_control(self, frame: bytes) -> None:
        """Send a frame that has no reply (RENEW, WILL_DROP). Raises OSError."""
        with self.send_lock:
            self.sock.sendall(frame)

    def roundtrip(self, frame: bytes, timeout: float) -> tuple[int, bytes]:
        """Send one request frame, read one response frame. Raises OSError/ConnectionError;
        _DroppedUnused when the server closed this connection without a byte of reply: it had
        closed it before the request came (a new connection that sent nothing, a guest dropped
        when idle or displaced; a request the server read is always answered before it closes
        a connection), so the request never ran and may go on another connection."""
        sock = self.sock
        if timeout != self.sock_timeout:
            sock.settimeout(timeout)
            self.sock_timeout = timeout
        try:
            with self.send_lock:
                sock.sendall(frame)
            n = sock.recv_into(self.buf)
        except (ConnectionResetError, BrokenPipeError) as e:
            raise _DroppedUnused(str(e)) from e
        if n == 0:
            raise _DroppedUnused("the server closed it before the request came")
        while n < 5:
            if n == 0 or (got := sock.recv_into(self.view[n:])) == 0:
                raise ConnectionError("server closed the connection")
            n += got
        length, status = w.HEADER.unpack_from(self.buf)
        total = 5 + length
        view = self.view
        if total > len(self.buf):
            if length > w.MAX_FRAME:
                raise ConnectionError(f"server sent a {length}-byte frame")
            # a one-off buffer: a connection keeps only its small one between requests
            view = memoryview(bytearray(total))
            view[:n] = self.view[:n]
        while n < total:
            got = sock.recv_into(view[n:total])
            if got == 0:
                raise ConnectionError("server closed the connection")
            n += got
        return status, bytes(view[5:total])

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class _DroppedUnused(ConnectionError):
    """A connection the server closed before the request on it came (nothing of it ran)."""


class _Tenancy:
    """A server shared by the multi-tenant masters of this process on one port."""

    def __init__(self, server: StoreServer) -> None:
        self.server = server
        self.users = 1


_tenants: dict[int, _Tenancy] = {}
_tenants_lock = threading.Lock()


def _release_tenant(port: int, server: StoreServer) -> None:
    with _tenants_lock:
        tenancy = _tenants.get(port)
        if tenancy is None or tenancy.server is not server:
            return
        tenancy.users -= 1
        if tenancy.users > 0:
            return
        del _tenants[port]
    server.stop()


def _close_all(conns: list[_Connection], server: StoreServer | None, multi_tenant: bool,
               pid: int) -> None:
    if os.getpid() != pid:
        # a forked child (e.g. a DataLoader worker) inherited this store: the sockets and the
        # server belong to the parent, which is still using them
        return
    for c in conns:
        c.close()
    conns.clear()
    if server is not None:
        if multi_tenant:
            _release_tenant(server.port, server)
        else:
            server.stop()


def _agent_store_port(port: int) -> bool:
    """torchelastic's agent store: when the launcher serves the store on MASTER_PORT, a worker's
    master store on that port connects to it instead of serving (as torch's TCPStore does)."""
    use = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() in ("1", "true")
    return use and port != 0 and os.environ.get("MASTER_PORT") == str(port)


class TCPStore(Store):
    """A store whose data lives in the master process and is reached over TCP.

    ``TCPStore(host_name, port, world_size=None, is_master=False, timeout=timedelta(seconds=300),
    wait_for_workers=True, multi_tenant=False, master_listen_fd=None, use_libuv=True, *,
    token=None, bind_host=None, limits=None)``: the master binds ``port`` (0 picks a free one:
    read ``.port``) on ``bind_host``, or, without one, on ``host_name`` when that is written as a
    loopback address (``127.0.0.1``, ``::1``, ``localhost``), else on every interface; it serves
    from a daemon thread;
    every store (the master's too) connects to ``host_name:port``, retrying with backoff until
    ``timeout``, then raises DistNetworkError. With a fixed ``world_size`` (clients + the master)
    and ``wait_for_workers``, the master's constructor blocks until that many stores connected,
    or raises DistTimeoutError ("Timed out after N seconds waiting for clients. k/N clients
    joined.").

    ``token`` (default: the ``PLUGDIST_STORE_TOKEN`` environment variable, else the file
    ``PLUGDIST_STORE_TOKEN_FILE`` names; ``""`` for none): a shared secret. A master with a
    token refuses every connection that does not prove it knows the token (challenge-response;
    the token never crosses the wire), and a client with a token refuses a server that cannot
    prove it: either side raises DistNetworkError saying authentication failed. A master that
    would listen beyond loopback without a token raises DistStoreError saying how to hand one to
    every process, unless tokens were turned off explicitly (``token=""``, or
    ``PLUGDIST_STORE_TOKEN`` set empty), which it then says once, plainly (a warning).
    ``multi_tenant=True``: masters of one process on one port share one server (and its data);
    it stops when the last of them closes. ``master_listen_fd``: serve on
    this already bound socket. ``use_libuv`` is accepted and reported as ``libuvBackend`` for code
    written for torch; plugdist has one server implementation. ``limits``: a
    :class:`TCPStoreLimits` for the master's server.

    Thread safety: one store object may be shared by threads; each request borrows a connection
    from a small pool (a second connection opens only while another thread's request, e.g. a
    blocking ``get``, holds the first), so a thread blocked in ``get`` never stalls a ``set``.
    The server stops, and its port is freed, on the master's ``close()``, when the master store is
    garbage collected, or at interpreter exit.
    """

    def __init__(self, host_name: str, port: int, world_size: int | None = None,
                 is_master: bool = False, timeout: timedelta = DEFAULT_STORE_TIMEOUT,
                 wait_for_workers: bool = True, multi_tenant: bool = False,
                 master_listen_fd: int | None = None, use_libuv: bool = True, *,
                 token: str | bytes | None = None, bind_host: str | None = None,
                 limits: TCPStoreLimits | None = None) -> None:
        super().__init__(timeout)
        if not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"TCPStore port must be an int in [0, 65535], got {port!r}")
        if world_size == 0:
            raise ValueError("TCPStore world size cannot be 0; pass the number of stores (the "
                             "master + every client), or None/-1 for a variable number")
        if world_size is not None and world_size != -1 and world_size < 1:
            raise ValueError(f"TCPStore world_size must be >= 1, or None/-1 for a variable number "
                             f"of users; got {world_size}")
        if is_master and _agent_store_port(port):
            is_master = False
        if port == 0 and not is_master:
            raise ValueError("TCPStore: port 0 (pick a free port) only makes sense for the master; "
                             "clients need the master's actual port (master_store.port)")
        self.host = host_name
        self.world_size = world_size if world_size is not None and world_size > 0 else None
        self.is_master = is_master
        self.libuvBackend = bool(use_libuv)  # noqa: N815 (torch's attribute name)
        self._token, self._token_chosen = resolve_token(token)
        self._multi_tenant = multi_tenant
        self._addrs = _resolve(host_name, port)
        self._idle: list[_Connection] = []
        self._vouch: bytes | None = None  # a VOUCH frame once this store holds an identity
        self._lock = threading.Lock()
        self._closed = False
        self._server: StoreServer | None = None
        if is_master:
            self._server = self._serve(port, multi_tenant, master_listen_fd, bind_host, limits)
            port = self._server.port
            self._addrs = [(fam, (sa[0], port) + tuple(sa[2:])) for fam, sa in self._addrs]
        self.port = port
        self._finalizer = weakref.finalize(self, _close_all, self._idle, self._server,
                                          multi_tenant, os.getpid())
        try:
            join = self.world_size is not None and wait_for_workers
            self._idle.append(self._connect(join=join, timeout=max(to_seconds(timeout), 1.0)))
            if is_master and self.world_size is not None and wait_for_workers:
                self._wait_workers(self.world_size, to_seconds(timeout))
        except BaseException:
            self.close()
            raise

    def _serve(self, port: int, multi_tenant: bool, listen_fd: int | None,
               bind_host: str | None, limits: TCPStoreLimits | None) -> StoreServer:
        def start() -> StoreServer:
            where = bind_host
            if where is None and listen_fd is None and is_loopback(self.host):
                where = str(self._addrs[0][1][0])  # nothing off this host needs the store
            server = StoreServer(self._addrs[0][0], port, bind_host=where,
                                 listen_fd=listen_fd, token=self._token, limits=limits)
            server.start()
            if self._token is None and not server.loopback_only:
                try:
                    tokenless_exposure(server.listening_on, self._token_chosen, server.port)
                except BaseException:
                    server.stop()
                    raise
            return server

        if not multi_tenant:
            return start()
        with _tenants_lock:
            tenancy = _tenants.get(port) if port else None
            if tenancy is not None and tenancy.server.alive:
                if tenancy.server.token != self._token:
                    raise ValueError(f"TCPStore(multi_tenant=True): port {port} is already served "
                                     f"by this process with a different token; the masters "
                                     f"sharing a port must share its token")
                tenancy.users += 1
                return tenancy.server
            server = start()
            _tenants[server.port] = _Tenancy(server)
            return server

    def __repr__(self) -> str:
        role = "master" if self.is_master else "client"
        auth = ", token" if self._token else ""
        return f"TCPStore({self.host}:{self.port}, {role}{auth})"

    def has_extended_api(self) -> bool:
        return True

    def clone(self) -> TCPStore:
        """A new client of the same server with its own connections (it does not count as a
        worker, and closing it never stops the server)."""
        return TCPStore(self.host, self.port, None, False, self._timeout,
                        wait_for_workers=False, use_libuv=self.libuvBackend,
                        token=self._token or b"")

    # ---- connections -----------------------------------------------------------------------

    def _connect(self, join: bool, timeout: float, refused_is_final: bool = False) -> _Connection:
        """Connect and handshake, retrying refused/failed attempts with backoff until timeout.
        ``refused_is_final``: a pass in which every address refused the connection raises at
        once instead (see ``_request``)."""
        deadline = time.monotonic() + timeout
        delay = 0.01
        last: BaseException | None = None
        while True:
            refused = 0
            for family, sockaddr in self._addrs:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                sock = socket.socket(family, socket.SOCK_STREAM)
                try:
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
                    sock.settimeout(min(left, 30.0))
                    sock.connect(sockaddr)
                    if self._token is None:
                        self._check_server_user(sock)
                    return self._handshake(sock, join, timeout)
                except (DistStoreError, DistNetworkError):
                    sock.close()
                    raise
                except OSError as e:
                    sock.close()
                    last = e
                    refused += isinstance(e, ConnectionRefusedError)
            if refused_is_final and refused == len(self._addrs):
                raise DistNetworkError(
                    f"TCPStore {self.host}:{self.port}: the server refused a new connection; "
                    f"the master process (which serves the store) exited or closed it") from last
            left = deadline - time.monotonic()
            if left <= 0:
                raise DistNetworkError(
                    f"TCPStore: could not connect to {self.host}:{self.port} within "
                    f"{timeout:.3g}s (last error: {last}); is the master store running there and "
                    f"is the port right? (MASTER_ADDR/MASTER_PORT, or the master's store.port)"
                ) from last
            time.sleep(min(delay, left))
            delay = min(delay * 2, 1.0)

    def _check_server_user(self, sock: socket.socket) -> None:
        """Without a token, a server on this host must be run by this process's Unix user (or
        root): another user's program that holds the port is not this job's store."""
        owner = socket_owner(sock, listener=True)
        if owner is None or owner in (-1, 0, os.geteuid()):
            return
        raise DistStoreError(
            f"TCPStore {self.host}:{self.port}: the process listening there runs as another "
            f"Unix user (uid {owner}), not this job's store; without a token this client "
            f"trusts only its own user's server. Pick another MASTER_PORT, or give every "
            f"process of the job the same token ({TOKEN_ENV} or {TOKEN_FILE_ENV})")

    def _auth_error(self, why: str) -> DistNetworkError:
        return DistNetworkError(f"TCPStore {self.host}:{self.port}: authentication failed: {why}")

    def _handshake(self, sock: socket.socket, join: bool, timeout: float) -> _Connection:
        head = _recv_exact(sock, len(w.MAGIC))
        if head != w.MAGIC:
            raise DistStoreError(f"TCPStore: {self.host}:{self.port} is not a plugdist TCPStore "
                                 f"server (bad handshake)")
        magic, version, greet, server_nonce = w.GREETING.unpack(
            head + _recv_exact(sock, w.GREETING.size - len(head)))
        if magic != w.MAGIC:
            raise DistStoreError(f"TCPStore: {self.host}:{self.port} is not a plugdist TCPStore "
                                 f"server (bad handshake)")
        if version != w.VERSION:
            raise DistStoreError(f"TCPStore: server at {self.host}:{self.port} speaks protocol "
                                 f"version {version}, this client {w.VERSION}; install the same "
                                 f"plugdist version on every node")
        if greet & w.GREET_BUSY:
            raise ConnectionError("the server is at its connection limit "
                                  "(TCPStoreLimits.max_connections)")
        token = self._token
        flags = w.FLAG_JOIN if join else 0
        client_nonce = secrets.token_bytes(w.NONCE_SIZE)
        proof = w.NO_PROOF
        if token is not None:
            flags |= w.FLAG_PROOF
            proof = w.client_proof(token, server_nonce, client_nonce, flags)
        sock.sendall(w.HELLO.pack(w.MAGIC, w.VERSION, flags, client_nonce, proof))
        try:
            magic, version, status, their_proof = w.WELCOME.unpack(
                _recv_exact(sock, w.WELCOME.size))
        except ConnectionError:
            if greet & w.GREET_TOKEN and token is None:
                raise self._auth_error(
                    f"the server requires a token and this client has none; set {TOKEN_ENV} "
                    f"or {TOKEN_FILE_ENV} (or pass token=) to the master's token, or this is "
                    f"another job's store: check MASTER_PORT") from None
            raise
        if status == w.HELLO_AUTH_FAILED:
            if token is None:
                raise self._auth_error(
                    f"the server requires a token and this client has none; set {TOKEN_ENV} "
                    f"or {TOKEN_FILE_ENV} (or pass token=) to the master's token, or this is "
                    f"another job's store: check MASTER_PORT")
            raise self._auth_error(
                f"the server refused this client's token; every store of the job needs the "
                f"same token ({TOKEN_ENV}, {TOKEN_FILE_ENV} or token=), or this is another "
                f"job's store: check MASTER_PORT")
        if status != w.HELLO_OK:
            raise DistStoreError(f"TCPStore: server at {self.host}:{self.port} speaks protocol "
                                 f"version {version}, this client {w.VERSION}; install the same "
                                 f"plugdist version on every node")
        if token is not None:
            if not greet & w.GREET_TOKEN:
                raise self._auth_error(
                    "this client has a token but the server was started without one, so it "
                    "cannot prove it is the job's store; give the master the same token "
                    f"({TOKEN_ENV} or token=), or unset it here")
            expected = w.server_proof(token, server_nonce, client_nonce)
            if not hmac.compare_digest(expected, their_proof):
                raise self._auth_error("the server's proof does not match this client's token; "
                                       "it is not the job's store, or its token differs")
        sock.settimeout(timeout)
        return _Connection(sock, timeout)

    def _request(self, op: str, frame: bytes, wait: float | None = None) -> bytes:
        """One request/response on a pooled connection; maps failures to Dist* errors."""
        if len(frame) - w.HEADER.size > w.MAX_FRAME:
            raise DistStoreError(f"TCPStore {self.host}:{self.port}: {op} request of "
                                 f"{len(frame)} bytes exceeds the protocol's frame limit of "
                                 f"{w.MAX_FRAME} bytes; store large data elsewhere (a file, or a "
                                 f"collective) and put its location in the store")
        with self._lock:
            if self._closed:
                raise DistStoreError(f"{self!r} is closed; {op} needs an open store")
            conn = self._idle.pop() if self._idle else None
        io_timeout = (max(to_seconds(self._timeout), _MIN_IO_TIMEOUT) if wait is None
                      else max(wait, 0.0) + _REPLY_GRACE)
        try:
            if conn is None:
                # this store reached its server when it was built: a refused connection now
                # means the process serving it exited (its port is closed), not that it has yet
                # to start, so it is not retried for the whole store timeout. (Retried, every
                # request of a rank that outlives the store's host blocked that long: a peer of
                # rank 0 exiting at once lost a minute per store call, e.g. a flight-recorder
                # dump after a mismatch report.)
                conn = self._connect(join=False, timeout=max(to_seconds(self._timeout), 1.0),
                                     refused_is_final=True)
            try:
                if self._vouch is not None and not conn.vouched:
                    self._vouch_on(conn, io_timeout)
                status, body = conn.roundtrip(frame, io_timeout)
            except _DroppedUnused:
                conn.close()
                conn = self._connect(join=False, timeout=max(to_seconds(self._timeout), 1.0),
                                     refused_is_final=True)
                if self._vouch is not None:
                    self._vouch_on(conn, io_timeout)
                status, body = conn.roundtrip(frame, io_timeout)
        except DistStoreError:
            raise
        except (OSError, ConnectionError) as e:
            if conn is not None:
                conn.close()
            if isinstance(e, TimeoutError):
                raise DistNetworkError(
                    f"TCPStore {self.host}:{self.port}: no reply to {op} within {io_timeout:.3g}s; "
                    f"the master process may be hung or unreachable") from e
            raise DistNetworkError(
                f"TCPStore {self.host}:{self.port}: connection lost during {op} ({e}); the "
                f"master process (which serves the store) may have exited") from e
        except BaseException:
            # e.g. KeyboardInterrupt mid-request: the reply is still on its way, so this
            # connection is out of step with the server and must not be reused
            if conn is not None:
                conn.close()
            raise
        with self._lock:
            if self._closed:
                conn.close()
            else:
                self._idle.append(conn)
        if status == w.Status.OK:
            return body
        msg = body.decode(errors="replace")
        if status == w.Status.TIMEOUT:
            raise DistTimeoutError(f"TCPStore {self.host}:{self.port}: {op}: {msg}")
        if status == w.Status.QUEUE_EMPTY:
            raise QueueEmptyError(f"TCPStore {self.host}:{self.port}: {op}: {msg}")
        if status == w.Status.GONE:
            raise DistExcludedError(f"TCPStore {self.host}:{self.port}: {op}: {msg}; this "
                                    f"process can come back only as a new member, with "
                                    f"init_process_group(join=True)")
        raise DistStoreError(f"TCPStore {self.host}:{self.port}: {op}: {msg}")

    def _vouch_on(self, conn: _Connection, timeout: float) -> None:
        """Show the server, on ``conn``, the credential of the identity this store holds: the
        connection is a member's from then on (never displaced or dropped as a guest). A
        refusal (the identity was left since) leaves it a guest."""
        assert self._vouch is not None
        conn.roundtrip(self._vouch, timeout)
        conn.vouched = True

    def _wait_workers(self, count: int, timeout: float) -> None:
        frame = w.HDR_F64_I64.pack(16, w.Op.WAIT_WORKERS, timeout, count)
        try:
            self._request("wait_for_workers", frame, wait=timeout)
        except DistTimeoutError as e:
            raise DistTimeoutError(
                f"{e} Start the other ranks with the same master address and port, or check "
                f"world_size ({count} = clients + 1 for the master)") from None

    # ---- Store API -------------------------------------------------------------------------

    def set(self, key: str, value: bytes | str) -> None:
        """Write ``value`` under ``key``; wakes every client waiting on ``key``."""
        k = check_key(key).encode()
        v = to_bytes(value)
        self._request("set", b"".join((w.HDR_BLOB.pack(8 + len(k) + len(v), _OP_SET, len(k)),
                                       k, w.U32.pack(len(v)), v)))

    def get(self, key: str) -> bytes:
        """The value of ``key``; blocks (server-side) until it exists or the store timeout."""
        k = check_key(key).encode()
        t = to_seconds(self._timeout)
        return self._request("get", w.HDR_F64_BLOB.pack(12 + len(k), _OP_GET, t, len(k)) + k,
                             wait=t)

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the counter ``key`` (created at 0); returns the sum."""
        k = check_key(key).encode()
        frame = w.HDR_I64_BLOB.pack(12 + len(k), _OP_ADD, check_amount(amount), len(k)) + k
        body = self._request("add", frame)
        return w.I64.unpack(body)[0]

    def compare_set(self, key: str, expected_value: bytes | str,
                    desired_value: bytes | str) -> bytes:
        """See ``Store.compare_set``; atomic on the server."""
        k = check_key(key).encode()
        e, d = to_bytes(expected_value), to_bytes(desired_value)
        body = b"".join((w.U32.pack(len(k)), k, w.U32.pack(len(e)), e, w.U32.pack(len(d)), d))
        return self._request("compare_set", w.request(w.Op.COMPARE_SET, body))

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        """Block until every key exists; DistTimeoutError names the missing ones."""
        t = to_seconds(timeout if timeout is not None else self._timeout)
        body = w.F64.pack(t) + w.pack_blobs(_encoded(keys))
        self._request("wait", w.request(w.Op.WAIT, body), wait=t)

    def append(self, key: str, value: bytes | str) -> None:
        """Append ``value`` to the bytes under ``key`` (created if missing); atomic."""
        k = check_key(key).encode()
        v = to_bytes(value)
        body = b"".join((w.U32.pack(len(k)), k, w.U32.pack(len(v)), v))
        self._request("append", w.request(w.Op.APPEND, body))

    def queue_push(self, key: str, value: bytes | str) -> None:
        """Append ``value`` to queue ``key``; a parked ``queue_pop`` gets it at once."""
        k = check_key(key).encode()
        v = to_bytes(value)
        body = b"".join((w.U32.pack(len(k)), k, w.U32.pack(len(v)), v))
        self._request("queue_push", w.request(w.Op.QUEUE_PUSH, body))

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """The oldest value of queue ``key``; blocks (server-side) up to the store's timeout, or
        raises QueueEmptyError at once with ``block=False``."""
        k = check_key(key).encode()
        t = to_seconds(self._timeout)
        frame = w.HDR_F64_U8_BLOB.pack(13 + len(k), w.Op.QUEUE_POP, t, bool(block), len(k)) + k
        return self._request("queue_pop", frame, wait=t if block else None)

    def queue_len(self, key: str) -> int:
        """Number of values in queue ``key``."""
        k = check_key(key).encode()
        body = self._request("queue_len", w.request(w.Op.QUEUE_LEN, w.U32.pack(len(k)) + k))
        return w.I64.unpack(body)[0]

    def check(self, keys: Sequence[str]) -> bool:
        """True when every key exists now (a value, or a non-empty queue). Does not block."""
        frame = w.request(w.Op.CHECK, w.pack_blobs(_encoded(keys)))
        return self._request("check", frame) == b"\x01"

    def num_keys(self) -> int:
        """Number of keys held by the server (every user's, every prefix's), plus one for the
        worker counter once a store with a fixed world size joined (as torch counts it)."""
        return w.I64.unpack(self._request("num_keys", w.request(w.Op.NUM_KEYS, b"")))[0]

    def delete_key(self, key: str) -> bool:
        """Delete ``key`` (its value and its queue); True if it existed."""
        k = check_key(key).encode()
        frame = w.request(w.Op.DELETE_KEY, w.U32.pack(len(k)) + k)
        return self._request("delete_key", frame) == b"\x01"

    def delete_prefix(self, prefix: str) -> int:
        """Delete every key (value and queue) that starts with ``prefix``; returns how many."""
        p = prefix.encode()
        frame = w.request(w.Op.DELETE_PREFIX, w.U32.pack(len(p)) + p)
        return w.I64.unpack(self._request("delete_prefix", frame))[0]

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        """All values in one round trip; blocks like ``get`` until every key exists."""
        t = to_seconds(self._timeout)
        body = w.F64.pack(t) + w.pack_blobs(_encoded(keys))
        reply = self._request("multi_get", w.request(w.Op.MULTI_GET, body), wait=t)
        values, _ = w.unpack_blobs(reply, 0, len(reply))
        return values

    def multi_set(self, keys: Sequence[str], values: Sequence[bytes | str]) -> None:
        """Set every key in one round trip: all or nothing, applied in order; other clients see
        up to 1,024 keys set at one instant, a larger request 1,024 keys at a time."""
        ks = _encoded(keys)
        if len(ks) != len(values):
            raise ValueError(f"multi_set got {len(ks)} keys but {len(values)} values")
        blobs: list[bytes] = []
        for k, v in zip(ks, values, strict=True):
            blobs.append(k)
            blobs.append(to_bytes(v))
        self._request("multi_set", w.request(w.Op.MULTI_SET, w.pack_blobs(blobs)))

    def read_log(self, key: str, start: int, timeout: timedelta | None = None) -> list[bytes]:
        """The consecutive entries of the numbered log ``key`` from ``start`` (see
        ``Store.read_log``): one request, parked on the server until ``key/start`` exists."""
        return read_log(self._request, key, start,
                         to_seconds(timeout if timeout is not None else self._timeout))

    def hold_will(self, key: str, value: bytes | str, ttl: float | None = None) -> TCPStoreWill:
        """Leave a will with the server: if this process's hold on it ends without
        ``cancel()`` (the process died, or its connection dropped), the server appends
        ``value`` to the numbered log ``key`` (the counter ``key`` becomes n, the value is at
        ``f"{key}/{n}"``). With ``ttl`` (seconds) the server also executes it when no renewal
        came for that long (a stopped or hung process): a thread of this process (one for all
        its wills) renews it every quarter ttl with a 5-byte frame that has no reply. One
        dedicated connection per will. Blocks for one round trip."""
        k, v = check_key(key).encode(), to_bytes(value)
        if ttl is not None and not ttl > 0:
            raise ValueError(f"hold_will: ttl must be a positive number of seconds, got {ttl!r}")
        conn = self._connect(join=False, timeout=max(to_seconds(self._timeout), 1.0))
        will = TCPStoreWill(self, conn, key, ttl)
        try:
            will._send(k, v)
        except BaseException:
            conn.close()
            raise
        if ttl is not None:
            renewer().add(will)
        return will

    def claim_member(self, root: str, uid: str, world_size: int, ttl: float) -> TCPStoreSession:
        """Hold the identity ``uid`` (a rank of the first epoch of a world of ``world_size``
        ranks, whose membership lives under the key prefix ``root``) on a connection of its own,
        with a will the server writes itself (see ``Store.claim_member``). Raises
        DistStoreError when the server refuses it: this process cannot show the job's
        credential (the token, or without one the store's Unix user), another live process
        holds ``uid``, its holder left, or the world's size differs; the error says what holds
        the identity. Blocks for one round trip."""
        r = root.encode()
        body = b"".join((w.U32.pack(len(r)), r, w.U32.pack(len(uid.encode())), uid.encode(),
                         w.I64.pack(world_size), w.F64.pack(ttl)))
        return self._hold_identity("claim", root, uid, w.request(w.Op.CLAIM, body), ttl)

    def join_member(self, root: str, ttl: float) -> TCPStoreSession:
        """Ask to join the world under ``root``: the server takes a ticket, writes it, announces
        it in the death log, and makes this process the joiner identity ``j<ticket>`` on a
        connection of its own (see ``Store.join_member``). Refused without the job's credential,
        and on a tokenless store unless its host set ``PLUGDIST_ALLOW_TOKENLESS_JOIN=1``.
        Blocks for one round trip."""
        r = root.encode()
        body = w.U32.pack(len(r)) + r + w.F64.pack(ttl)
        return self._hold_identity("join", root, "", w.request(w.Op.JOIN, body), ttl)

    def _hold_identity(self, op: str, root: str, uid: str, frame: bytes,
                       ttl: float) -> TCPStoreSession:
        if not ttl > 0:
            raise ValueError(f"{op}_member: ttl must be a positive number of seconds, got {ttl!r}")
        conn = self._connect(join=False, timeout=max(to_seconds(self._timeout), 1.0))
        where = f"TCPStore {self.host}:{self.port}"
        try:
            try:
                status, reply = conn.roundtrip(frame, max(_MIN_IO_TIMEOUT,
                                                          to_seconds(self._timeout)))
            except (OSError, ConnectionError) as e:
                raise DistNetworkError(f"{where}: connection lost during {op} ({e})") from e
            if status != w.Status.OK:
                raise DistStoreError(f"{where}: {reply.decode(errors='replace')}")
            start = ticket = 0
            if op == "join":
                ticket, start = _JOIN_REPLY.unpack_from(reply, 0)
                reply = reply[_JOIN_REPLY.size:]
                uid = f"j{ticket}"
            (n,) = w.U32.unpack_from(reply, 0)
            secret = reply[4:4 + n]
        except BaseException:
            conn.close()
            raise
        will = TCPStoreWill(self, conn, root + DEATHS, ttl)
        renewer().add(will)
        session = TCPStoreSession(self._request, will, root.encode(), uid, secret, start, ticket)
        session.using(self)  # this store's pooled connections vouch with the identity
        return session

    def server_stats(self) -> dict[str, Any] | None:
        """The load of the server this master runs (``StoreServer.stats``), or None on a
        client. Any thread; never blocks."""
        return self._server.stats() if self._server is not None else None

    def close(self) -> None:
        """Close this store's connections; on the master also stop the server (other clients
        then get DistNetworkError). Idempotent."""
        with self._lock:
            self._closed = True
        self._finalizer()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    got = b""
    while len(got) < n:
        chunk = sock.recv(n - len(got))
        if not chunk:
            raise ConnectionError("the server closed the connection during the handshake")
        got += chunk
    return got


def _encoded(keys: Sequence[str]) -> list[bytes]:
    return [k.encode() for k in check_keys(keys)]

