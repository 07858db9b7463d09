"""The TCPStore server: one daemon thread, one selector, every client on non-blocking sockets.

:class:`StoreServer` owns the listening socket, the serving thread and its loop, and ties the
parts, each an object with one job, sharing the connections and their flags
(:class:`~plugdist.store._server.conn.Conn`):

- :mod:`~plugdist.store._server.lobby`: accepting, and the unproven connections' share;
- :mod:`~plugdist.store._server.guests`: the bounds on connections not yet trusted;
- :mod:`~plugdist.store._server.handshake`: the HELLO, and the token's proof;
- :mod:`~plugdist.store._server.framing`: frames, their pace, partly received bytes, unread
  replies, and the request loop;
- :mod:`~plugdist.store._server.turns`: fair turns, requests served a slice a turn, heavy
  connections' rests, leavers' requests finished;
- :mod:`~plugdist.store._server.wills`: wills whose ttl lapsed;
- :mod:`~plugdist.store._server.limits`: the bounds, the fd limit, rate-limited warnings;
- the key space (:mod:`~plugdist.store._server.keyspace`, its waiters and commands) and the
  worlds (:mod:`~plugdist.store._server.worlds`): what a command does, with no sockets.

A client that disconnects, fails authentication, or sends anything that is not a well-formed
protocol frame is dropped and logged; nothing it does reaches other clients. Threading: only the
serving thread touches the parts; :meth:`StoreServer.start` binds in the caller's thread and
:meth:`StoreServer.stop` is safe from any thread. The serving thread blocks only in the
selector, until a socket is ready or the next deadline (a parked request's, a will's, a rest's,
a stalled frame's sweep, a held log line's).
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from typing import Any

from plugdist._log import get_logger
from plugdist.errors import DistNetworkError
from plugdist.store._server.commands import Commands
from plugdist.store._server.conn import READ, WRITE, Conn, Selector
from plugdist.store._server.framing import Framing
from plugdist.store._server.guests import Guests
from plugdist.store._server.handshake import Handshake
from plugdist.store._server.jobkeys import JobKeys
from plugdist.store._server.keyspace import KeySpace
from plugdist.store._server.limits import FD_RESERVE, TCPStoreLimits, Throttle, raise_fd_limit
from plugdist.store._server.lobby import Lobby
from plugdist.store._server.peers import Admission
from plugdist.store._server.quota import StrangerQuota
from plugdist.store._server.turns import Turns
from plugdist.store._server.wills import Wills
from plugdist.store._server.worlds import Worlds

__all__ = ["StoreServer", "TCPStoreLimits"]


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
        self.limits = limits = limits or TCPStoreLimits()
        self.port = 0
        self._log = get_logger(component="tcp_store_server")
        self._warn = Throttle(self._log)
        self.max_clients = limits.max_connections  # lowered to fit the fd limit at start
        self.fd_limit = 0
        self._conns: dict[int, Conn] = {}
        self._pending: set[Conn] = set()  # unproven or mid-frame: watched for deadlines
        self._turns = turns = Turns(self._pending, self._drop)
        self._wills = wills = Wills(self._drop)
        self._keys = keys = KeySpace(turns.answer, limits.max_value_bytes, wills.arm,
                                     max_keys=limits.max_keys_per_request,
                                     max_reply_bytes=limits.max_reply_bytes, notice=self._warn)
        self._waiters = keys.waiters
        admission = Admission(self.token is not None).refusal
        self._worlds = Worlds(keys, self._warn, admission)
        job_keys = JobKeys(admission, self._warn)
        quota = StrangerQuota(job_keys, limits.max_stranger_bytes, self._warn)
        self._waiters.hold, self._waiters.release = quota.hold, quota.release
        self._commands = Commands(keys, self._worlds, job_keys, quota)
        self._frames = frames = Framing(limits, self._commands, self._pending, turns,
                                        self._drop, self._close, self._log, self._warn)
        turns.attach(frames.process, frames.on_readable, frames.send, frames.watch,
                     frames.internal_error)
        wills.read = frames.on_readable
        self._guests = guests = Guests(limits, self._drop)
        self._commands.trust = guests.trust
        self._lobby = lobby = Lobby(self._conns, self._pending, self.token, limits, self._log,
                                    turns.serve_conn, frames.send, guests)
        self._handshake = Handshake(self.token, self._pending, self._warn, frames.send,
                                    self._close, lobby.strike, self._waiters.join)
        frames.hello = self._hello
        frames.proof_waiting = self._handshake.proof_waiting
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

    def stats(self, top: int = 5) -> dict[str, Any]:
        """A snapshot of the load (for ``plugdist-run --page``): open connections, requests
        served so far, parked requests, and the ``top`` keys with the most parked waiters. Any
        thread; no lock: it reads counters and copies one dict, so the numbers may be a turn
        apart."""
        waiting = list(self._waiters.waiting.items())
        busiest = sorted(((len(ws), k) for k, ws in waiting if ws), reverse=True)[:top]
        return {"connections": len(self._conns), "requests": self._commands.served,
                "parked": self._waiters.parked,
                "top_waiters": [{"key": k.decode("utf-8", "replace"), "waiters": n}
                                for n, k in busiest]}

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self.fd_limit = raise_fd_limit(self.limits.max_connections + FD_RESERVE)
        self.max_clients = max(1, min(self.limits.max_connections,
                                      self.fd_limit - FD_RESERVE))
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
        self._sel = Selector()
        self._sel.register(lsock, READ, None)
        self._sel.register(self._wake_r, READ, None)
        self._frames.sel = self._sel
        self._frames.port = self._handshake.port = self.port
        self._lobby.listen(lsock, self._sel, self.port, self.max_clients, self.fd_limit)
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
        keys, waiters, warn = self._keys, self._waiters, self._warn
        turns, frames, lobby, wills = self._turns, self._frames, self._lobby, self._wills
        pending, later, resume, resting = self._pending, turns.later, turns.resume, turns.resting
        will_deadlines, graveyard, orphans = wills.deadlines, frames.graveyard, turns.orphans
        serve_conn, flush = turns.serve_conn, frames.flush
        next_sweep = 0.0
        guests = self._guests
        idle_every = guests.sweep_interval()
        next_idle = time.perf_counter() + idle_every
        try:
            while not self._stop_event.is_set():
                try:
                    delay = None
                    deadline = waiters.next_deadline()
                    if deadline is not None:
                        delay = min(max(0.0, deadline - time.monotonic()), 3600.0)
                    if lobby.paused_until:
                        pause = max(0.0, lobby.paused_until - time.monotonic())
                        delay = pause if delay is None else min(delay, pause)
                    if pending:
                        sweep = max(0.0, next_sweep - time.monotonic())
                        delay = sweep if delay is None else min(delay, sweep)
                    if will_deadlines:
                        due = max(0.0, will_deadlines[0][0] - time.monotonic())
                        delay = due if delay is None else min(delay, due)
                    held = warn.next_flush()
                    if held is not None:
                        wait = max(0.0, held - time.monotonic())
                        delay = wait if delay is None else min(delay, wait)
                    if resting:
                        wait = max(0.0, resting[0][0] - time.monotonic())
                        delay = wait if delay is None else min(delay, wait)
                    if guests:
                        wait = max(0.0, next_idle - time.perf_counter())
                        delay = wait if delay is None else min(delay, wait)
                    if keys.dying:
                        due = keys.wills_due(time.monotonic())
                        delay = due if delay is None else min(delay, due)
                    if graveyard or orphans or keys.untidy:
                        delay = 0.0
                    if later:  # connections with requests left over from the last turn
                        delay = 0.0
                        resume.extend(later)
                        later.clear()
                    unproven: list[Conn] = []
                    accept = False
                    ready = sel.select(delay)
                    turns.new_turn()
                    for key, mask in ready:
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
                        if mask & WRITE:
                            flush(conn)
                        if mask & READ and not conn.closed and not conn.paused \
                                and not conn.resting:
                            if conn.proven:
                                serve_conn(conn)
                            else:
                                unproven.append(conn)
                    if unproven or accept:
                        lobby.serve(unproven, accept)
                    now = time.monotonic()
                    if resting:
                        turns.wake_rested(now)
                    waiters.expire(now)
                    if graveyard:
                        frames.bury()
                    if orphans:
                        turns.step_orphan()
                    if keys.untidy:
                        keys.tidy()
                    if warn.next_flush() is not None:
                        warn.flush(now)
                    if will_deadlines and will_deadlines[0][0] <= now:
                        wills.lapse(now)
                    if keys.dying and keys.wills_due(now) == 0.0:
                        keys.flush_wills()
                    if pending and now >= next_sweep:
                        frames.sweep_stalled(now)
                        next_sweep = now + frames.sweep_interval()
                    if lobby.paused_until:
                        lobby.resume_accepts(now)
                    if resume:
                        turns.serve_resumed()
                    if guests and time.perf_counter() >= next_idle:
                        guests.drop_idle(time.perf_counter())
                        next_idle = time.perf_counter() + idle_every
                except Exception as e:  # a server bug: log it (rate-limited), serve on
                    self._frames.internal_error(None, "the serving loop", e)
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

    def _hello(self, conn: Conn, buf: bytes) -> int:
        """The handshake's check of a HELLO; a connection that proved the token is trusted."""
        took = self._handshake.hello(conn, buf)
        if took and self.token is not None:
            self._guests.trust(conn)
        return took

    # ---- leaving -----------------------------------------------------------------------------

    def _drop(self, conn: Conn, why: str, *, gone: bool = False) -> None:
        """Close ``conn`` and log why: a warning for a client that misbehaved (a stalled
        handshake or frame, too much unread data, a protocol error), info for one that simply
        went away (``gone``: its process exited or was killed; a dead rank is reported by its
        will, through membership, so the store host need not warn too)."""
        if conn.closed:
            return
        if not conn.proven:
            self._lobby.strike()
        self._warn("tcp_store_client_dropped", "info" if gone else "warning", port=self.port,
                   peer=conn.peer, reason=why)
        self._close(conn)

    def _close(self, conn: Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        if not conn.trusted:
            self._guests.forget(conn)
        self._turns.orphan(conn)
        self._frames.forget_tail(conn)
        self._pending.discard(conn)
        self._frames.hold(conn, 0)
        if conn.waiter is not None:
            self._waiters.forget(conn.waiter)
            conn.waiter = None
        if conn.will is not None:
            self._keys.will_died(conn.will)
            conn.will = None
        if conn.identity is not None:
            try:
                self._worlds.released(conn)
            except Exception as e:  # a bug must not leave the socket open or the loop dead
                conn.identity = None
                self._frames.internal_error(conn, "releasing an identity", e)
        self._conns.pop(conn.sock.fileno(), None)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
