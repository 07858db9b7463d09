"""The handshake: a new connection's HELLO checked against the server's greeting (magic,
version, and with a token the proof that the client knows it), answered with WELCOME.

With a token, a connection is proven by its handshake; without one, by its first request (the
framing marks it). A failed proof is answered, logged (rate-limited) and counted as a stranger
at the door (:meth:`Lobby.strike <plugdist.store._server.lobby.Lobby.strike>`). Only the
serving thread uses it; nothing here blocks.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from plugdist.store import _wire as w
from plugdist.store._server.conn import Conn, ProtocolError

__all__ = ["Handshake"]


class Handshake:
    """The handshakes of one server. ``token``: what every client must prove it knows (None: no
    proof); ``pending``: the connections whose deadlines are watched; ``warn``: the rate-limited
    log; ``send``, ``close``: the framing's and the server's; ``strike()``: the lobby's;
    ``join()``: a client's handshake carried the join flag (the waiters count it)."""

    def __init__(self, token: bytes | None, pending: set[Conn], warn: Callable[..., None],
                 send: Callable[[Conn, bytes], None], close: Callable[[Conn], None],
                 strike: Callable[[], None], join: Callable[[], None]) -> None:
        self._token = token
        self._pending = pending
        self._warn = warn
        self._send = send
        self._close = close
        self._strike = strike
        self._join = join
        self.port = 0

    def hello(self, conn: Conn, buf: bytes) -> int:
        """Check the HELLO at the start of ``buf`` (whole): the bytes it took, or 0 when the
        connection was refused and closed. Raises ProtocolError for a client that is not one."""
        magic, version, flags, client_nonce, proof = w.HELLO.unpack_from(buf, 0)
        if magic != w.MAGIC:
            raise ProtocolError("bad magic: not a plugdist TCPStore client")
        if version != w.VERSION:
            self._send(conn, w.WELCOME.pack(w.MAGIC, w.VERSION, w.HELLO_BAD_VERSION, w.NO_PROOF))
            raise ProtocolError(f"protocol version {version}, server speaks {w.VERSION}")
        reply_proof = w.NO_PROOF
        if self._token:
            if not flags & w.FLAG_PROOF:
                self._refuse(conn, "the client sent no token (set PLUGDIST_STORE_TOKEN or "
                                   "pass token= to every TCPStore of the job)")
                return 0
            expected = w.client_proof(self._token, conn.nonce, client_nonce, flags)
            if not hmac.compare_digest(expected, proof):
                self._refuse(conn, "wrong token (its proof does not match this server's "
                                   "token, or it answered another connection's challenge)")
                return 0
            reply_proof = w.server_proof(self._token, conn.nonce, client_nonce)
        conn.handshaken = True
        conn.proven = self._token is not None
        if conn.proven:
            self._pending.discard(conn)
        self._send(conn, w.WELCOME.pack(w.MAGIC, w.VERSION, w.HELLO_OK, reply_proof))
        if flags & w.FLAG_JOIN:
            self._join()
        return w.HELLO.size

    def _refuse(self, conn: Conn, why: str) -> None:
        self._strike()
        self._warn("tcp_store_auth_failed", port=self.port, peer=conn.peer, reason=why)
        self._send(conn, w.WELCOME.pack(w.MAGIC, w.VERSION, w.HELLO_AUTH_FAILED, w.NO_PROOF))
        self._close(conn)
