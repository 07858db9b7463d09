"""The handshake: a new connection's HELLO checked against the server's greeting (magic,
version, and with a token the proof that the client knows it), answered with WELCOME.

With a token, a connection is proven by its handshake; without one, by its first request (the
framing marks it). A failed proof is answered, logged (rate-limited) and counted as a stranger
at the door (:meth:`Lobby.strike <plugdist.store._server.lobby.Lobby.strike>`).

The deadline to prove itself counts what the peer controls, not the server's backlog: the lobby
reads unproven connections for a slice of each turn, so while thousands connect at once a
HELLO can wait unread in the kernel past the deadline. Before dropping a connection for it,
the sweep asks :meth:`Handshake.proof_waiting`: a proof that waits whole is served instead.
Only the serving thread uses it; nothing here blocks.
"""

from __future__ import annotations

import hmac
import socket
from collections.abc import Callable

from plugdist.store import _wire as w
from plugdist.store._server.conn import Conn, ProtocolError, have

__all__ = ["Handshake"]

# a first request larger than this is not looked for whole in the kernel (it proves itself by
# arriving at the frames' pace instead)
_PEEK_LIMIT = 64 * 1024


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

    @staticmethod
    def proof_waiting(conn: Conn) -> bool:
        """Whether what would prove ``conn`` has arrived whole but is still unread in the
        kernel: the rest of its HELLO, or, once handshaken on a server without a token, its
        first request. Then the peer did its part in time and only the server was late to
        read; a part of it, or nothing, proves nothing (a trickle cannot stretch the
        deadline)."""
        if conn.handshaken:
            if conn.inbuf:
                return False  # a partial first frame: its pace is the frame deadline's
            head = _peek(conn, 5)
            if len(head) < 5:
                return False
            need = 5 + w.HEADER.unpack_from(head)[0]
            return need <= _PEEK_LIMIT and len(_peek(conn, need)) == need
        missing = w.HELLO.size - have(conn)
        return missing > 0 and len(_peek(conn, missing)) == missing


def _peek(conn: Conn, n: int) -> bytes:
    """Up to ``n`` bytes ``conn``'s peer sent that wait unread, left there."""
    try:
        return conn.sock.recv(n, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except OSError:
        return b""  # nothing waits (or the connection failed: it is dropped all the same)
