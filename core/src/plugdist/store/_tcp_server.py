"""The TCPStore server: one daemon thread, one selector, every client on non-blocking sockets.

This module is the sockets: accepting, the handshake, framing, output buffering and the limits.
What a command does, and the parking of blocking requests (GET, WAIT, MULTI_GET, QUEUE_POP,
WAIT_WORKERS) until a write or their deadline answers them, is the key space's
(:mod:`plugdist.store._tcp_keyspace`).

A client that disconnects, fails authentication, or sends anything that is not a well-formed
protocol frame is dropped and logged; nothing it does reaches other clients. Bounds
(:class:`TCPStoreLimits`): frame size, keys per request, bytes per value, time to prove itself
(the handshake; without a token, its first request), the pace a frame must arrive at, partly
received bytes across all connections, number of connections, bytes a client may send while
its request is parked, bytes of replies a client may leave unread before the server stops
reading its requests, and requests one connection gets served per turn of the loop. A request
of many keys is read, and a reply of many values packed, a slice a turn
(:class:`~plugdist.store._tcp_keyspace.Sliced`); new and
unproven connections (the lobby) are served after the proven ones, a slice a turn, with a
bounded share of the server while strangers are being dropped. Warnings about refused and
dropped clients are rate-limited, each line counting those held back.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import hmac
import ipaddress
import math
import resource
import secrets
import select
import selectors
import socket
import struct
import threading
import time
from datetime import timedelta
from typing import Any

from plugdist._log import get_logger
from plugdist.errors import DistNetworkError
from plugdist.store import _wire as w
from plugdist.store._tcp_keyspace import KeySpace, Sliced

__all__ = ["StoreServer", "TCPStoreLimits"]

_READ = selectors.EVENT_READ
_WRITE = selectors.EVENT_WRITE
_RECV_SIZE = 256 * 1024


@dataclasses.dataclass(frozen=True)
class TCPStoreLimits:
    """Per-server bounds that keep one client from hurting the others.

    ``max_frame_bytes``: the largest request body (a larger announced length drops the client).
    ``max_keys_per_request``: keys of one CHECK, WAIT, MULTI_GET or MULTI_SET (more: refused
    with an error, the connection kept). ``max_value_bytes``: one value (a SET's, an APPEND's
    result, ...; more: refused). ``handshake_timeout``: a new connection must prove itself
    within this time: finish its handshake, and, on a server without a token (where the
    handshake proves nothing), send its first request. ``frame_timeout`` and
    ``min_frame_bytes_per_second``: a frame must arrive whole within ``frame_timeout`` plus its
    size at that pace, counted from its first byte, and, once ``frame_timeout`` has passed,
    must have come at least at that pace on average (a trickle cannot keep it alive, nor a
    frame sent in part and then left to sit).
    ``max_partial_bytes``: bytes of partly received frames held across all connections; past
    it, the connections whose frames came slowest (bytes per second since their first byte)
    are dropped until the rest fit. ``max_connections``: connections beyond
    it are told so (the client retries, then
    raises DistNetworkError saying so) and closed, with one log line per second; the server
    also caps it to the process's open-file limit (less 256), which it raises towards it
    first, and its log line then names that limit (a member of a resilient world holds two
    connections: 16,384 ranks need about 33,000).
    ``max_parked_inbound_bytes``: bytes a client may send while its blocking request is parked
    (one request at a time is the protocol; more drops it). ``max_unread_reply_bytes``: when a
    client's unread replies pass this, the server stops reading its requests until it reads.
    """

    max_frame_bytes: int = w.MAX_FRAME
    max_keys_per_request: int = 131072
    max_value_bytes: int = 32 * 1024 * 1024
    handshake_timeout: timedelta = timedelta(seconds=10)
    frame_timeout: timedelta = timedelta(seconds=5)
    min_frame_bytes_per_second: int = 4 * 1024 * 1024
    max_partial_bytes: int = 128 * 1024 * 1024
    max_connections: int = 65536
    max_parked_inbound_bytes: int = 64 * 1024
    max_unread_reply_bytes: int = 1024 * 1024


_MAX_EVENTS = 1024  # readiness events taken from the kernel per turn of the loop
# what one connection is served per turn of the loop (at least one request): a client that
# pipelines thousands of requests waits for the others' turns between its batches
_TURN_REQUESTS = 32
_TURN_SECONDS = 50e-6
# a partial frame larger than this is looked at for a refusal as soon as its fields tell
_EARLY = 64 * 1024
# the bytes of a refused frame are dropped as they come, and charged to their connection as if
# it took this long per byte (so one who streams refused frames rests like any heavy client)
_SKIP_COST = 1.0 / (64 * 1024 * 1024)
# a partial frame past this many bytes keeps what arrives as the reads' own chunks (joined once
# whole), not in one growing buffer: a buffer of tens of MiB costs milliseconds to grow and, when
# its sender is dropped, to free, in front of everyone
_CHUNKED = 1024 * 1024
# the lobby: accepting new connections and serving those that have not proven themselves (the
# handshake, or without a token a first request). It runs after the members' requests of a turn,
# for at most about _LOBBY_TURN, and what is left waits for the next turn (the kernel keeps it
# ready): a member's request waits behind one slice of a flood at most. Within _STRIKE_MEMORY of
# the lobby dropping a connection (garbage, a failed or stalled handshake: strangers), accepting
# then pauses _LOBBY_REST times as long as the slice took, so a flood of connects gets about
# 1 / (1 + _LOBBY_REST) of the server and waits in the kernel's backlog; connects that all
# succeed (thousands of ranks at a job's start) are never slowed
_LOBBY_TURN = 100e-6
_LOBBY_REST = 4.0
_STRIKE_MEMORY = 1.0
# a connection whose bytes took the server longer than this in one go (a request of thousands
# of keys, a frame of megabytes) is heavy: it is not read again for _HEAVY_REST times as long,
# counted on one timeline for every heavy connection, so heavy work gets at most about
# 1 / (1 + _HEAVY_REST) of the server
_HEAVY = 1e-3
_HEAVY_REST = 3.0
_LOG_BURST = 10  # lines of one warning logged at once before the rate limit applies
_LOG_EVERY = 10.0  # seconds between lines of one warning past the burst


class _Throttle:
    """Rate-limited log lines: per event and level, ``_LOG_BURST`` lines, then one per
    ``_LOG_EVERY`` seconds; a line held back is counted, and the next line of that event (or,
    when none comes, the last one held, logged by :meth:`flush` once its turn comes) carries
    ``suppressed``, how many were held back since the last line."""

    def __init__(self, log: Any) -> None:
        self._log = log
        self._tokens: dict[str, float] = {}
        self._stamp: dict[str, float] = {}
        self._held: dict[str, tuple[int, str, dict[str, Any]]] = {}

    def __call__(self, event: str, level: str = "warning", **fields: Any) -> None:
        now = time.monotonic()
        kind = f"{level}:{event}"  # a client that simply went away never silences a warning
        tokens = min(float(_LOG_BURST), self._tokens.get(kind, float(_LOG_BURST))
                     + (now - self._stamp.get(kind, now)) / _LOG_EVERY)
        self._stamp[kind] = now
        self._tokens[kind] = tokens
        if tokens < 1.0:
            count = self._held.get(kind, (0, "", {}))[0] + 1
            self._held[kind] = (count, event, fields)
            return
        self._emit(kind, event, fields)

    def _emit(self, kind: str, event: str, fields: dict[str, Any]) -> None:
        self._tokens[kind] -= 1.0
        held = self._held.pop(kind, None)
        if held:
            fields = {**fields, "suppressed": held[0] - (held[2] is fields)}
        getattr(self._log, kind.partition(":")[0])(event, **fields)

    def next_flush(self) -> float | None:
        """When :meth:`flush` has a held line to log (monotonic seconds), or None."""
        if not self._held:
            return None
        return min(self._stamp[e] + (1.0 - self._tokens[e]) * _LOG_EVERY for e in self._held)

    def flush(self, now: float) -> None:
        """Log the last line held back of each event whose turn has come."""
        for kind, (_, event, fields) in list(self._held.items()):
            tokens = self._tokens[kind] + (now - self._stamp[kind]) / _LOG_EVERY
            if tokens >= 1.0:
                self._tokens[kind], self._stamp[kind] = min(float(_LOG_BURST), tokens), now
                self._emit(kind, event, fields)


if hasattr(selectors, "EpollSelector"):
    class _Selector(selectors.EpollSelector):
        """epoll with a bounded event buffer: the standard selector asks the kernel for as many
        events as it has sockets, allocating that buffer on every call, which with 16,000
        clients costs more than the few events a turn usually brings."""

        def select(self, timeout: float | None = None) -> list[tuple[Any, int]]:
            if timeout is None:
                timeout = -1
            elif timeout <= 0:
                timeout = 0
            else:
                timeout = math.ceil(timeout * 1e3) * 1e-3
            ready: list[tuple[Any, int]] = []
            try:
                events = self._selector.poll(timeout, _MAX_EVENTS)  # type: ignore[attr-defined]
            except InterruptedError:
                return ready
            for fd, event in events:
                mask = 0
                if event & ~select.EPOLLIN:
                    mask |= _WRITE
                if event & ~select.EPOLLOUT:
                    mask |= _READ
                key = self._fd_to_key.get(fd)  # type: ignore[attr-defined]
                if key:
                    ready.append((key, mask & key.events))
            return ready
else:  # pragma: no cover - not Linux
    _Selector = selectors.DefaultSelector  # type: ignore[misc,assignment]


def _have(conn: _Conn) -> int:
    """Bytes received of ``conn``'s unparsed input."""
    return len(conn.inbuf) + conn.tail_len


class _ProtocolError(Exception):
    """The peer broke the protocol; its connection is dropped."""


class _Conn:
    __slots__ = ("sock", "peer", "inbuf", "need", "out", "handshaken", "proven", "nonce",
                 "waiter", "closed", "since", "started", "held", "skip", "vetted", "paused",
                 "resting", "unwatched", "will", "will_ttl", "will_deadline", "identity",
                 "sliced", "spent", "tail", "tail_len")

    def __init__(self, sock: socket.socket, peer: str, nonce: bytes) -> None:
        self.sock = sock
        self.peer = peer
        self.inbuf = bytearray()  # bytes not yet parsed (a partial frame, or frames behind a wait)
        self.tail: list[bytes] = []  # of a large partial frame, the bytes after inbuf's
        self.tail_len = 0
        self.need = 0             # length inbuf (and tail) must reach before parsing is worth it
        self.out = bytearray()    # bytes the kernel has not taken yet
        self.handshaken = False
        self.proven = False       # proved its token, or (no token) sent a first request
        self.nonce = nonce        # the server nonce sent in this connection's greeting
        self.waiter: Any = None   # the parked request (the key space's), if any
        self.closed = False
        self.since = 0.0          # when it connected (its deadline to prove itself runs from it)
        self.started = 0.0        # when the first byte of its partly received frame came
        self.held = 0             # bytes of a partly received frame, counted in the total
        self.skip = 0             # bytes still to drop of a frame refused before it was whole
        self.vetted = False       # its partial frame was looked at for an early refusal
        self.paused = False       # reading stopped: too many unread replies
        self.resting = False      # reading stopped: its heavy requests had their share
        self.unwatched = False    # out of the selector (neither read nor written for now)
        self.will: tuple[bytes, bytes] | None = None  # (log key, value) written on close
        self.will_ttl = 0.0       # > 0: the will also runs when no RENEW came for this long
        self.will_deadline = 0.0  # when it runs unless renewed (monotonic seconds)
        self.identity: Any = None  # (world, uid) of the member identity it holds, if any
        self.sliced: Sliced | None = None  # its request of many keys, being read or answered
        self.spent = 0.0          # seconds the server spent on that request so far


# descriptors the process keeps for everything but the server's clients (its own files, the
# master's client connections, a backend's sockets)
_FD_RESERVE = 256


def _raise_fd_limit(want: int) -> int:
    """Raise this process's open-file soft limit towards ``want`` (up to the hard limit; many
    distributions default the soft one to 1024) and return the soft limit now in force."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ValueError, OSError):
        return want
    return want if soft == resource.RLIM_INFINITY else int(soft)


class StoreServer:
    """Owns the listening socket and the serving thread. ``start()`` binds and listens in the
    caller's thread (so a busy port raises there), then serves in a daemon thread until
    ``stop()``. Only the serving thread touches the data; ``stop()`` is safe from any thread.

    ``bind_host``: the address to listen on (None: every interface). ``listen_fd``: an already
    bound socket to take over instead of binding. ``token``: when set, every connection must
    prove it knows it before its first request."""

    def __init__(self, family: int, port: int, *, bind_host: str | None = None,
                 listen_fd: int | None = None, token: bytes | None = None,
                 limits: TCPStoreLimits | None = None) -> None:
        self._family = family
        self._want_port = port
        self._bind_host = bind_host
        self._listen_fd = listen_fd
        self.token = token or None
        self.limits = limits or TCPStoreLimits()
        self.port = 0
        self._log = get_logger(component="tcp_store_server")
        self._warn = _Throttle(self._log)
        self._keys = KeySpace(self._answer, self.limits.max_value_bytes, self._arm_will,
                              max_keys=self.limits.max_keys_per_request, notice=self._warn)
        # wills with a ttl, by deadline; a RENEW moves a connection's deadline without touching
        # the heap, and an entry found early is pushed again at the new deadline (lazy), so a
        # renewal costs O(1) and the heap O(log n) per connection per ttl
        self._will_deadlines: list[tuple[float, int, _Conn]] = []
        self._will_seq = 0
        self._dying: list[tuple[bytes, bytes]] = []  # wills of connections closed this turn
        self.max_clients = self.limits.max_connections  # lowered to fit the fd limit at start
        self.fd_limit = 0
        self._accept_paused_until = 0.0  # the listener is out of the selector until then
        self._struck_at = -_STRIKE_MEMORY  # when the lobby last dropped a connection
        self._conns: dict[int, _Conn] = {}
        self._pending: set[_Conn] = set()  # unproven or mid-frame: watched for deadlines
        self._resume: list[_Conn] = []
        self._later: list[_Conn] = []  # served their turn's requests; more wait for the next
        self._orphans: list[Sliced] = []  # left by closed clients, finished a slice a turn
        self._partial_total = 0  # bytes of partly received frames, all connections
        self._resting: list[tuple[float, int, _Conn]] = []  # (until, seq, conn)
        self._rest_seq = 0
        self._heavy_next = 0.0  # when heavy requests have had their share (monotonic)
        self._charged = 0.0  # work charged to the connection being served, beyond its time
        self._holders: set[_Conn] = set()  # the connections holding them
        self._graveyard: collections.deque[bytes] = collections.deque()  # chunks to free
        self._refused_busy = 0
        self._busy_logged_at = 0.0
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def alive(self) -> bool:
        """True while the serving thread runs."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def listening_on(self) -> str:
        """The address the server listens on (``0.0.0.0``/``::``: every interface)."""
        return str(self._lsock.getsockname()[0])

    @property
    def loopback_only(self) -> bool:
        """Whether only this host can reach the server (it listens on a loopback address)."""
        try:
            return ipaddress.ip_address(self.listening_on.split("%")[0]).is_loopback
        except ValueError:
            return False

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self.fd_limit = _raise_fd_limit(self.limits.max_connections + _FD_RESERVE)
        self.max_clients = max(1, min(self.limits.max_connections,
                                      self.fd_limit - _FD_RESERVE))
        if self._listen_fd is not None:
            lsock = socket.socket(fileno=self._listen_fd)
            self._family = lsock.family
        else:
            lsock = socket.socket(self._family, socket.SOCK_STREAM)
        try:
            if self._listen_fd is None:
                lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if self._family == socket.AF_INET6 and self._bind_host is None:
                    lsock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
                if self._bind_host is not None:
                    host = self._bind_host
                else:
                    host = "::" if self._family == socket.AF_INET6 else "0.0.0.0"
                lsock.bind((host, self._want_port))
            lsock.listen(4096)
            lsock.setblocking(False)
        except OSError as e:
            lsock.close()
            where = self._bind_host or "every interface"
            raise DistNetworkError(
                f"The server socket has failed to listen on any local network address. port: "
                f"{self._want_port}, address: {where} ({e.strerror or e}); another process may "
                f"hold the port: pick a free MASTER_PORT, or port 0 for any free port") from e
        self.port = lsock.getsockname()[1]
        self._lsock = lsock
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel = _Selector()
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
        next_sweep = 0.0
        try:
            while not self._stop_event.is_set():
                delay = None
                deadline = self._keys.next_deadline()
                if deadline is not None:
                    delay = min(max(0.0, deadline - time.monotonic()), 3600.0)
                if self._accept_paused_until:
                    pause = max(0.0, self._accept_paused_until - time.monotonic())
                    delay = pause if delay is None else min(delay, pause)
                if self._pending:
                    sweep = max(0.0, next_sweep - time.monotonic())
                    delay = sweep if delay is None else min(delay, sweep)
                if self._will_deadlines:
                    due = max(0.0, self._will_deadlines[0][0] - time.monotonic())
                    delay = due if delay is None else min(delay, due)
                flush = self._warn.next_flush()
                if flush is not None:
                    wait = max(0.0, flush - time.monotonic())
                    delay = wait if delay is None else min(delay, wait)
                if self._resting:
                    wait = max(0.0, self._resting[0][0] - time.monotonic())
                    delay = wait if delay is None else min(delay, wait)
                if self._graveyard or self._orphans or self._keys.untidy:
                    delay = 0.0
                if self._later:  # connections with requests left over from the last turn
                    delay = 0.0
                    self._resume.extend(self._later)
                    self._later = []
                lobby: list[_Conn] = []
                accept = False
                for key, mask in sel.select(delay):
                    conn = key.data
                    if conn is None:
                        if key.fileobj is lsock:
                            accept = True
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
                    if mask & _READ and not conn.closed and not conn.paused \
                            and not conn.resting:
                        if conn.proven:
                            self._serve_conn(conn)
                        else:
                            lobby.append(conn)
                if lobby or accept:
                    self._serve_lobby(lobby, accept)
                now = time.monotonic()
                while self._resting and self._resting[0][0] <= now:
                    self._wake(heapq.heappop(self._resting)[2])
                self._keys.expire(now)
                if self._graveyard:
                    self._bury()
                if self._orphans:
                    self._step_orphan()
                if self._keys.untidy:
                    self._keys.tidy()
                if self._warn.next_flush() is not None:
                    self._warn.flush(now)
                if self._will_deadlines and self._will_deadlines[0][0] <= now:
                    self._lapse_wills(now)
                if self._dying:
                    dying, self._dying = self._dying, []
                    self._keys.execute_wills(dying)
                if self._pending and now >= next_sweep:
                    self._sweep_stalled(now)
                    next_sweep = now + self._sweep_interval()
                if self._accept_paused_until and now >= self._accept_paused_until:
                    self._accept_paused_until = 0.0
                    sel.register(lsock, _READ, None)
                while self._resume:
                    conn = self._resume.pop()
                    # only a whole frame is worth running again: a partial one waits for its
                    # bytes (copying it each turn would cost as much as it holds)
                    if (not conn.closed and conn.waiter is None and not conn.paused
                            and not conn.resting
                            and (conn.sliced is not None
                                 or conn.inbuf and _have(conn) >= conn.need)):
                        self._serve_conn(conn, force=True)
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

    def _step_orphan(self) -> None:
        """One slice of the oldest request whose client left before it was done (one a turn,
        however many clients left so)."""
        try:
            nxt = self._orphans[0].step()
        except (ValueError, IndexError, struct.error, UnicodeDecodeError, OverflowError):
            nxt = None  # malformed: nothing of it was written
        if isinstance(nxt, Sliced):
            self._orphans[0] = nxt
        else:
            self._orphans.pop(0)

    def _arm_will(self, conn: _Conn) -> None:
        self._will_seq += 1
        heapq.heappush(self._will_deadlines, (conn.will_deadline, self._will_seq, conn))

    def _lapse_wills(self, now: float) -> None:
        """Run the will of every connection that sent no RENEW for its ttl (its process stopped
        or hangs), dropping the connection; push back those renewed since they were armed."""
        heap = self._will_deadlines
        while heap and heap[0][0] <= now:
            _, _, conn = heapq.heappop(heap)
            if conn.closed or conn.will is None or conn.will_ttl <= 0:
                continue
            if conn.will_deadline <= now and self._unread(conn):
                # a busy server may not have read a renewal that did arrive: read it first
                self._on_readable(conn)
                if conn.closed:
                    continue
            if conn.will_deadline > now:
                self._arm_will(conn)
                continue
            self._drop(conn, f"its will lapsed: no renewal for {conn.will_ttl:.3g}s (the "
                             f"process stopped, hangs, or lost the network)")

    @staticmethod
    def _unread(conn: _Conn) -> bool:
        """Whether bytes from ``conn`` wait in the kernel, unread."""
        try:
            return bool(conn.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True  # reading it will close it

    def _sweep_interval(self) -> float:
        lim = self.limits
        shortest = min(lim.handshake_timeout, lim.frame_timeout).total_seconds()
        return min(max(shortest / 4, 0.01), 1.0)

    def _sweep_stalled(self, now: float) -> None:
        lim = self.limits
        hs = lim.handshake_timeout.total_seconds()
        grace = lim.frame_timeout.total_seconds()
        rate = max(1, lim.min_frame_bytes_per_second)
        for conn in list(self._pending):
            if conn.closed or conn.paused or conn.resting or conn.waiter is not None \
                    or conn.sliced is not None:
                self._pending.discard(conn)
            elif not conn.handshaken and now - conn.since > hs:
                self._drop(conn, f"no complete handshake within {hs:.3g}s")
            elif not conn.proven and not conn.inbuf and now - conn.since > hs:
                # info: a client's pooled connection may simply sit unused (it reconnects)
                self._drop(conn, f"no request within {hs:.3g}s of connecting (a server "
                                 f"without a token lets a connection prove itself no other way)",
                           gone=True)
            elif (conn.inbuf or conn.skip) and (
                    now - conn.started > grace + conn.need / rate
                    or self._received(conn) < rate * (now - conn.started - grace)):
                self._drop(conn, f"frame arriving too slowly: {self._received(conn)} of "
                                 f"{conn.need} "
                                 f"bytes in {now - conn.started:.3g}s (a frame gets "
                                 f"{grace:.3g}s plus its size at {rate} bytes/s, and must come "
                                 f"at that pace after {grace:.3g}s)")
            elif conn.handshaken and conn.proven and not conn.inbuf and not conn.skip:
                self._pending.discard(conn)

    @staticmethod
    def _received(conn: _Conn) -> int:
        """Bytes of its current frame ``conn`` has sent (held, or dropped as refused)."""
        return conn.need - conn.skip if conn.skip else _have(conn)

    def _serve_lobby(self, lobby: list[_Conn], accept: bool) -> None:
        """The lobby's turn (see ``_LOBBY_TURN``): serve the unproven connections in ``lobby``
        and, with ``accept``, accept new ones, for about ``_LOBBY_TURN``; what is left stays
        ready in the selector for the next turn."""
        began = time.perf_counter()
        for conn in lobby:
            if time.perf_counter() - began > _LOBBY_TURN:
                break
            self._serve_conn(conn)
        if accept:  # at least a quarter of the turn, so served strangers cannot starve it
            self._accept(max(_LOBBY_TURN - (time.perf_counter() - began), _LOBBY_TURN / 4))
        now = time.monotonic()
        if now - self._struck_at < _STRIKE_MEMORY:
            self._pause_accepts(now + (time.perf_counter() - began) * _LOBBY_REST)

    def _pause_accepts(self, until: float) -> None:
        """Take the listener out of the selector until ``until`` (monotonic)."""
        if not self._accept_paused_until:
            self._sel.unregister(self._lsock)
        self._accept_paused_until = max(self._accept_paused_until, until)

    def _accept(self, budget: float) -> None:
        """Accept connections for about ``budget`` seconds (at least one)."""
        began = time.perf_counter()
        while time.perf_counter() - began < budget:  # then the others' turn
            try:
                sock, addr = self._lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                # e.g. EMFILE: the pending connection stays in the backlog and would make the
                # listener readable forever; stop watching it briefly instead of spinning
                self._log.warning("tcp_store_accept_failed", port=self.port, error=str(e))
                self._pause_accepts(time.monotonic() + 0.1)
                return
            peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
            flags = w.GREET_TOKEN if self.token else 0
            if len(self._conns) >= self.max_clients:
                self._refuse_busy(sock, peer, flags)
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nonce = secrets.token_bytes(w.NONCE_SIZE)
            conn = _Conn(sock, peer, nonce)
            conn.since = time.monotonic()
            self._conns[sock.fileno()] = conn
            self._pending.add(conn)
            self._sel.register(sock, _READ, conn)
            self._send(conn, w.GREETING.pack(w.MAGIC, w.VERSION, flags, nonce))

    def _refuse_busy(self, sock: socket.socket, peer: str, flags: int) -> None:
        try:
            sock.setblocking(False)
            sock.send(w.GREETING.pack(w.MAGIC, w.VERSION, flags | w.GREET_BUSY,
                                      bytes(w.NONCE_SIZE)))
        except OSError:
            pass
        sock.close()
        self._refused_busy += 1
        now = time.monotonic()
        if now - self._busy_logged_at >= 1.0:
            if self.max_clients < self.limits.max_connections:
                hint = (f"the process may open {self.fd_limit} files (ulimit -n), which caps "
                        f"clients at {self.max_clients} below TCPStoreLimits.max_connections="
                        f"{self.limits.max_connections}: raise the hard limit of the process "
                        f"that hosts the store (ulimit -Hn, LimitNOFILE=, "
                        f"/etc/security/limits.conf)")
            else:
                hint = ("raise TCPStoreLimits.max_connections or find the client that opens so "
                        "many connections")
            self._log.warning("tcp_store_connection_limit", port=self.port,
                              limit=self.max_clients, refused=self._refused_busy,
                              last_peer=peer, hint=hint)
            self._busy_logged_at = now
            self._refused_busy = 0

    def _serve_conn(self, conn: _Conn, force: bool = False) -> None:
        """Read from ``conn`` (or, ``force``, run the requests left in its buffer), charging the
        time it took: past ``_HEAVY`` the connection rests (see :meth:`_rest`)."""
        began = time.perf_counter()
        self._charged = 0.0
        if force:
            self._process(conn, b"", force=True)
        else:
            self._on_readable(conn)
        took = time.perf_counter() - began + self._charged
        if conn.sliced is not None or conn.spent:  # a request read in slices: its whole cost
            conn.spent = took = conn.spent + took
            if conn.sliced is None or took > _HEAVY:
                conn.spent = 0.0
        if took > _HEAVY and not conn.closed:
            self._rest(conn, took)

    def _on_readable(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(_RECV_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._drop(conn, f"receive failed: {e}", gone=True)
            return
        if not data:
            if conn.waiter is not None and conn.waiter.op == w.Op.LOG_READ and not conn.inbuf:
                self._close(conn)  # a will's holder leaving while it waits on its log
            elif conn.waiter is not None or conn.inbuf:
                self._drop(conn, "client disconnected in the middle of a request", gone=True)
            elif not conn.handshaken:
                self._drop(conn, "client disconnected during the handshake", gone=True)
            else:
                self._close(conn)
            return
        self._process(conn, data)

    def _process(self, conn: _Conn, data: bytes, force: bool = False) -> None:
        if conn.skip and data:  # the rest of a frame refused early: dropped as it comes
            n = min(conn.skip, len(data))
            conn.skip -= n
            self._charged += n * _SKIP_COST
            if conn.skip:
                return
            conn.need = 0
            data = data[n:]
            if not data:
                return
        if conn.sliced is not None and force and not (conn.paused or conn.resting):
            if not self._next_slice(conn):
                return
        if conn.waiter is not None or conn.paused or conn.resting or conn.sliced is not None:
            self._append(conn, data)
            if conn.waiter is not None:
                self._control_frames(conn)
            if _have(conn) > self.limits.max_parked_inbound_bytes and conn.waiter:
                self._drop(conn, f"sent more than {self.limits.max_parked_inbound_bytes} bytes "
                                 f"while its request was parked (one request at a time)")
            return
        if conn.inbuf:
            # a large frame arrives in many reads: append until it is whole
            self._append(conn, data)
            if _have(conn) < conn.need and not force:
                self._hold(conn, _have(conn))
                self._refuse_early(conn)
                return
            if conn.tail:
                buf = b"".join((conn.inbuf, *conn.tail))
                self._forget_tail(conn)
            else:
                buf = bytes(conn.inbuf)
        else:
            buf = data
        pos, end = 0, len(buf)
        max_frame = self.limits.max_frame_bytes
        max_unread = self.limits.max_unread_reply_bytes
        try:
            if not conn.handshaken:
                if end < w.HELLO.size:
                    if buf[:4] != w.MAGIC[:min(4, end)]:
                        raise _ProtocolError("bad magic: not a plugdist TCPStore client")
                    self._keep(conn, buf, 0, w.HELLO.size)
                    return
                pos = self._handshake(conn, buf)
                if conn.closed:
                    return
            served = 0
            turn = time.perf_counter()
            while conn.waiter is None and end - pos >= 5:
                if len(conn.out) > max_unread:
                    self._pause(conn)
                    break
                if served == _TURN_REQUESTS or (served and time.perf_counter() - turn
                                                > _TURN_SECONDS):
                    break  # the others' turn; the rest waits in inbuf for the next one
                length, op = w.HEADER.unpack_from(buf, pos)
                if length > max_frame:
                    raise _ProtocolError(f"frame of {length} bytes exceeds the limit of "
                                         f"{max_frame}")
                stop = pos + 5 + length
                if stop > end:
                    break
                if not self._keys.knows(op):
                    raise _ProtocolError(f"unknown command {op}")
                conn.proven = True
                served += 1
                try:
                    reply = self._keys.handle(conn, op, buf, pos + 5, stop)
                except (ValueError, IndexError, struct.error, UnicodeDecodeError,
                        OverflowError) as e:
                    raise _ProtocolError(f"malformed {w.Op(op).name} request: {e}") from None
                pos = stop
                if isinstance(reply, Sliced):  # read on at the next turns
                    conn.sliced = reply
                    self._pending.discard(conn)
                    self._later.append(conn)
                    break
                if reply is None:  # parked: its clock is the request's timeout now
                    self._pending.discard(conn)
                elif reply:  # RENEW and WILL_DROP have no reply
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
            self._hold(conn, 0)
            if conn.proven:
                self._pending.discard(conn)
            return
        need = 5
        if end - pos >= 5:
            need = 5 + w.HEADER.unpack_from(buf, pos)[0]
        self._keep(conn, buf, pos, need)
        if end - pos >= need and conn.waiter is None and not conn.paused and not conn.resting \
                and conn.sliced is None:
            self._later.append(conn)  # whole requests left: served at the next turn

    def _next_slice(self, conn: _Conn) -> bool:
        """Read the next slice of ``conn``'s request of many keys; True once it was answered
        (or parked) and the requests behind it may run."""
        assert conn.sliced is not None
        try:
            reply = conn.sliced.step()
        except (ValueError, IndexError, struct.error, UnicodeDecodeError, OverflowError) as e:
            self._drop(conn, f"malformed request: {e}")
            return False
        if isinstance(reply, Sliced):
            conn.sliced = reply  # the same request's next part (a reply packed in slices)
            self._later.append(conn)
            return False
        conn.sliced = None
        if reply is None:
            self._pending.discard(conn)
        else:
            self._send(conn, reply)
        return not conn.closed

    def _rest(self, conn: _Conn, spent: float) -> None:
        """``conn`` had ``spent`` seconds of heavy requests: read it again only once every
        heavy connection's work has been followed by ``_HEAVY_REST`` times as long."""
        now = time.monotonic()
        self._heavy_next = max(now, self._heavy_next) + spent * _HEAVY_REST
        conn.resting = True
        self._pending.discard(conn)
        self._rest_seq += 1
        heapq.heappush(self._resting, (self._heavy_next, self._rest_seq, conn))
        self._watch(conn)

    def _wake(self, conn: _Conn) -> None:
        if conn.closed or not conn.resting:
            return
        conn.resting = False
        self._watch(conn)
        self._mind_deadlines(conn)
        if conn.inbuf or conn.sliced is not None:
            self._resume.append(conn)

    def _mind_deadlines(self, conn: _Conn) -> None:
        """Watch ``conn``'s deadlines again (its proof, its partial frame's pace) after a rest or
        a pause, during which they were not watched; a sender that sits still from then on is
        dropped all the same."""
        if conn.waiter is None and conn.sliced is None and (
                not conn.proven or conn.inbuf or conn.skip):
            self._pending.add(conn)

    def _control_frames(self, conn: _Conn) -> None:
        """Run the RENEW and WILL_DROP frames at the front of a parked connection's input (its
        holder renews, or withdraws, its will while its own request waits)."""
        buf = conn.inbuf
        pos = 0
        while len(buf) - pos >= 5:
            length, op = w.HEADER.unpack_from(buf, pos)
            if length or op not in w.CONTROL_OPS:
                break
            self._keys.handle(conn, op, b"", 0, 0)
            pos += 5
        if pos:
            del buf[:pos]

    def _append(self, conn: _Conn, data: bytes) -> None:
        if conn.tail or (conn.need > _CHUNKED and len(conn.inbuf) >= _CHUNKED and data):
            conn.tail.append(data)
            conn.tail_len += len(data)
        else:
            conn.inbuf += data

    def _forget_tail(self, conn: _Conn) -> None:
        """Drop ``conn``'s tail chunks, freed a few a turn (see ``_bury``)."""
        if conn.tail:
            self._graveyard.extend(conn.tail)
            conn.tail, conn.tail_len = [], 0

    def _bury(self) -> None:
        """Free about a megabyte of dropped chunks."""
        freed = 0
        while self._graveyard and freed < _CHUNKED:
            freed += len(self._graveyard.popleft())

    def _keep(self, conn: _Conn, buf: bytes, pos: int, need: int) -> None:
        was_partial = bool(conn.inbuf) and pos == 0
        conn.inbuf = bytearray(memoryview(buf)[pos:])
        conn.need = need
        if not was_partial:
            conn.vetted = False
        if conn.waiter is None and not conn.paused and not conn.resting and conn.sliced is None:
            if not was_partial:  # a new frame's clock starts with its first byte
                conn.started = time.monotonic()
            self._pending.add(conn)
        self._hold(conn, len(conn.inbuf) if len(conn.inbuf) < need else 0)
        if len(conn.inbuf) < need:
            self._refuse_early(conn)

    def _refuse_early(self, conn: _Conn) -> None:
        """A large partial frame whose request is already known to be refused (more keys than
        ``max_keys_per_request``, a value over ``max_value_bytes``): answer its ERROR now and
        drop its bytes as they come instead of holding them (``skip``), still at the pace
        frames must keep."""
        buf = conn.inbuf
        if conn.need <= _EARLY or conn.vetted or len(buf) < 5 or conn.waiter is not None:
            return
        length, op = w.HEADER.unpack_from(buf, 0)
        verdict = self._keys.refusal_ahead(conn, op, buf, 5, len(buf))
        if verdict is None:
            return  # the fields that tell are not here yet
        conn.vetted = True
        if not verdict:
            return
        conn.proven = True
        conn.skip = 5 + length - _have(conn)
        conn.inbuf = bytearray()
        self._forget_tail(conn)
        self._hold(conn, 0)
        self._send(conn, verdict)

    def _hold(self, conn: _Conn, held: int) -> None:
        """``conn`` holds ``held`` bytes of a partly received frame; past the server's total
        (``max_partial_bytes``) the slowest frames' connections are dropped (see
        :class:`TCPStoreLimits`)."""
        self._partial_total += held - conn.held
        conn.held = held
        if held:
            self._holders.add(conn)
        else:
            self._holders.discard(conn)
        cap = self.limits.max_partial_bytes
        if held and self._partial_total > cap:
            now = time.monotonic()
            by_pace = sorted(self._holders, key=lambda c: c.held / max(now - c.started, 1e-3))
            for slowest in by_pace:
                if self._partial_total <= cap:
                    break
                self._drop(slowest, f"partly received frames of all clients held more than "
                                    f"{cap} bytes; this one came slowest ({slowest.held} of "
                                    f"{slowest.need} bytes in {now - slowest.started:.3g}s)")

    def _handshake(self, conn: _Conn, buf: bytes) -> int:
        magic, version, flags, client_nonce, proof = w.HELLO.unpack_from(buf, 0)
        if magic != w.MAGIC:
            raise _ProtocolError("bad magic: not a plugdist TCPStore client")
        if version != w.VERSION:
            self._send(conn, w.WELCOME.pack(w.MAGIC, w.VERSION, w.HELLO_BAD_VERSION, w.NO_PROOF))
            raise _ProtocolError(f"protocol version {version}, server speaks {w.VERSION}")
        reply_proof = w.NO_PROOF
        if self.token:
            if not flags & w.FLAG_PROOF:
                self._refuse_auth(conn, "the client sent no token (set PLUGDIST_STORE_TOKEN or "
                                        "pass token= to every TCPStore of the job)")
                return 0
            expected = w.client_proof(self.token, conn.nonce, client_nonce, flags)
            if not hmac.compare_digest(expected, proof):
                self._refuse_auth(conn, "wrong token (its proof does not match this server's "
                                        "token, or it answered another connection's challenge)")
                return 0
            reply_proof = w.server_proof(self.token, conn.nonce, client_nonce)
        conn.handshaken = True
        conn.proven = self.token is not None
        if conn.proven:
            self._pending.discard(conn)
        self._send(conn, w.WELCOME.pack(w.MAGIC, w.VERSION, w.HELLO_OK, reply_proof))
        if flags & w.FLAG_JOIN:
            self._keys.join()
        return w.HELLO.size

    def _refuse_auth(self, conn: _Conn, why: str) -> None:
        self._struck_at = time.monotonic()
        self._warn("tcp_store_auth_failed", port=self.port, peer=conn.peer, reason=why)
        self._send(conn, w.WELCOME.pack(w.MAGIC, w.VERSION, w.HELLO_AUTH_FAILED, w.NO_PROOF))
        self._close(conn)

    # ---- output ----------------------------------------------------------------------------

    def _answer(self, conn: _Conn, reply: bytes | Sliced) -> None:
        """The key space answered ``conn``'s parked request: send it, then read on (a reply
        made in slices is made at the next turns first)."""
        if isinstance(reply, Sliced):
            conn.sliced = reply
            self._later.append(conn)
            return
        self._send(conn, reply)
        if conn.inbuf:
            self._resume.append(conn)


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
            self._watch(conn)

    def _watch(self, conn: _Conn) -> None:
        if conn.closed:
            return
        events = (0 if conn.paused or conn.resting else _READ) | (_WRITE if conn.out else 0)
        if not events:  # resting with nothing to send
            if not conn.unwatched:
                self._sel.unregister(conn.sock)
                conn.unwatched = True
        elif conn.unwatched:
            self._sel.register(conn.sock, events, conn)
            conn.unwatched = False
        else:
            self._sel.modify(conn.sock, events, conn)

    def _pause(self, conn: _Conn) -> None:
        conn.paused = True
        self._pending.discard(conn)
        self._watch(conn)

    def _flush(self, conn: _Conn) -> None:
        try:
            n = conn.sock.send(conn.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._drop(conn, f"send failed: {e}")
            return
        del conn.out[:n]
        if conn.paused and len(conn.out) <= self.limits.max_unread_reply_bytes // 2:
            conn.paused = False
            self._mind_deadlines(conn)
            if conn.inbuf:
                self._resume.append(conn)
        if not conn.out or not conn.paused:
            self._watch(conn)

    def _drop(self, conn: _Conn, why: str, *, gone: bool = False) -> None:
        """Close ``conn`` and log why: a warning for a client that misbehaved (a stalled
        handshake or frame, too much unread data, a protocol error), info for one that simply
        went away (``gone``: its process exited or was killed; a dead rank is reported by its
        will, through membership, so the store host need not warn too)."""
        if conn.closed:
            return
        if not conn.proven:
            self._struck_at = time.monotonic()
        self._warn("tcp_store_client_dropped", "info" if gone else "warning", port=self.port,
                   peer=conn.peer, reason=why)
        self._close(conn)

    def _close(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        if conn.sliced is not None:
            if conn.sliced.must_finish:
                self._orphans.append(conn.sliced)
            else:
                conn.sliced.abandon()
        conn.sliced = None
        self._forget_tail(conn)
        self._pending.discard(conn)
        self._hold(conn, 0)
        if conn.waiter is not None:
            self._keys.forget(conn.waiter)
            conn.waiter = None
        if conn.will is not None:
            self._dying.append(conn.will)  # executed together at the end of this loop turn
            conn.will = None
        if conn.identity is not None:
            self._keys.worlds.released(conn)
        self._conns.pop(conn.sock.fileno(), None)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

