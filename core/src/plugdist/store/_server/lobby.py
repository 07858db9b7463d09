"""The lobby: accepting new connections and serving those that have not proven themselves (the
handshake, or without a token a first request).

The lobby runs after the members' requests of a turn, for at most about ``_LOBBY_TURN``, and
what is left waits for the next turn (the kernel keeps it ready): a member's request waits
behind one slice of a flood at most. Within ``_STRIKE_MEMORY`` of the lobby dropping a
connection (garbage, a failed or stalled handshake: strangers), accepting then pauses
``_LOBBY_REST`` times as long as the slice took, so a flood of connects gets about
1 / (1 + ``_LOBBY_REST``) of the server and waits in the kernel's backlog; connects that all
succeed (thousands of ranks at a job's start) are never slowed. Connections past the server's
limit are told so and closed, with one log line per second.

Only the serving thread uses it; nothing here blocks (the listener is non-blocking).
"""

from __future__ import annotations

import secrets
import socket
import time
from collections.abc import Callable
from typing import Any

from plugdist.store import _wire as w
from plugdist.store._server.conn import READ, Conn, Selector
from plugdist.store._server.guests import Guests
from plugdist.store._server.limits import TCPStoreLimits

__all__ = ["Lobby"]

_LOBBY_TURN = 100e-6
_LOBBY_REST = 4.0
_STRIKE_MEMORY = 1.0


class Lobby:
    """The lobby of one server. ``conns``: every connection by fd (shared with the server);
    ``pending``: the connections whose deadlines are watched; ``serve_conn(conn)`` serves what
    a connection sent; ``send(conn, data)`` sends to it; ``guests``: the bounds on connections
    not yet trusted, which a new one may displace. :meth:`listen` gives it the listener."""

    def __init__(self, conns: dict[int, Conn], pending: set[Conn], token: bytes | None,
                 limits: TCPStoreLimits, log: Any, serve_conn: Callable[[Conn], None],
                 send: Callable[[Conn, bytes], None], guests: Guests) -> None:
        self._conns = conns
        self.guests = guests  # every new connection is one until it shows it is the job's
        self._pending = pending
        self._token = token
        self._limits = limits
        self._log = log
        self._serve_conn = serve_conn
        self._send = send
        self.paused_until = 0.0  # the listener is out of the selector until then
        self._struck_at = -_STRIKE_MEMORY  # when the lobby last dropped a connection
        self._refused_busy = 0
        self._busy_logged_at = 0.0
        self._port = 0
        self._max_clients = limits.max_connections
        self._fd_limit = 0

    def listen(self, lsock: socket.socket, sel: Selector, port: int, max_clients: int,
               fd_limit: int) -> None:
        """Accept on ``lsock`` (watched by ``sel``), at most ``max_clients`` connections at once
        (the process may open ``fd_limit`` files)."""
        self._lsock, self._sel, self._port = lsock, sel, port
        self._max_clients, self._fd_limit = max_clients, fd_limit

    def strike(self) -> None:
        """An unproven connection was dropped: a stranger may be at the door."""
        self._struck_at = time.monotonic()

    def serve(self, lobby: list[Conn], accept: bool) -> None:
        """The lobby's turn (see ``_LOBBY_TURN``): serve the unproven connections in ``lobby``
        and, with ``accept``, accept new ones, for about ``_LOBBY_TURN``; what is left stays
        ready in the selector for the next turn."""
        began = time.perf_counter()
        # the pause below is by the CPU the slice took, not the clock (the host's load is not
        # the strangers'); the CPU clock is a system call, read only while strangers knock
        cpu = time.thread_time() if time.monotonic() - self._struck_at < _STRIKE_MEMORY else None
        for conn in lobby:
            if time.perf_counter() - began > _LOBBY_TURN:
                break
            self._serve_conn(conn)
        if accept:  # at least a quarter of the turn, so served strangers cannot starve it
            self._accept(max(_LOBBY_TURN - (time.perf_counter() - began), _LOBBY_TURN / 4))
        now = time.monotonic()
        if now - self._struck_at < _STRIKE_MEMORY:
            took = time.perf_counter() - began
            if cpu is not None:
                took = min(took, time.thread_time() - cpu)
            self._pause_accepts(now + took * _LOBBY_REST)

    def resume_accepts(self, now: float) -> None:
        """Watch the listener again once its pause is over."""
        if self.paused_until and now >= self.paused_until:
            self.paused_until = 0.0
            self._sel.register(self._lsock, READ, None)

    def _pause_accepts(self, until: float) -> None:
        """Take the listener out of the selector until ``until`` (monotonic)."""
        if not self.paused_until:
            self._sel.unregister(self._lsock)
        self.paused_until = max(self.paused_until, until)

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
                self._log.warning("tcp_store_accept_failed", port=self._port, error=str(e))
                self._pause_accepts(time.monotonic() + 0.1)
                return
            peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
            flags = w.GREET_TOKEN if self._token else 0
            conn = Conn(sock, peer, secrets.token_bytes(w.NONCE_SIZE))
            if not self.guests.admit(conn, len(self._conns) >= self._max_clients):
                self._refuse_busy(sock, peer, flags)
                continue
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nonce = conn.nonce
            conn.since = time.monotonic()
            conn.active = time.perf_counter()
            self._conns[sock.fileno()] = conn
            self._pending.add(conn)
            self._sel.register(sock, READ, conn)
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
            limit = self._limits.max_connections
            if self._max_clients < limit:
                hint = (f"the process may open {self._fd_limit} files (ulimit -n), which caps "
                        f"clients at {self._max_clients} below TCPStoreLimits.max_connections="
                        f"{limit}: raise the hard limit of the process "
                        f"that hosts the store (ulimit -Hn, LimitNOFILE=, "
                        f"/etc/security/limits.conf)")
            else:
                hint = ("raise TCPStoreLimits.max_connections or find the client that opens so "
                        "many connections")
            self._log.warning("tcp_store_connection_limit", port=self._port,
                              limit=self._max_clients, refused=self._refused_busy,
                              last_peer=peer, hint=hint)
            self._busy_logged_at = now
            self._refused_busy = 0
