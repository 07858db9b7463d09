"""Will expiry: a connection's will with a ttl runs (the connection is dropped, and its will
written as every closed connection's is, see ``KeySpace.will_died``) when no RENEW came for
that long.

Wills with a ttl wait in a heap by deadline; a RENEW moves a connection's deadline without
touching the heap, and an entry found early is pushed again at the new deadline (lazy), so a
renewal costs O(1) and the heap O(log n) per connection per ttl.

A ttl counts what the holder controls, not the server's backlog: before a will lapses, what the
kernel holds for its connection is read, and a renewal (or a withdrawal) found among the frames
the server has received but not run yet counts. A busy server leaves frames unrun: a connection
resting after heavy requests (:mod:`plugdist.store._server.turns`) or paused for unread replies
is not read, and a turn may end before a connection's input is parsed; without this, a holder
that renewed on time would lose its will because the server was slow to look. Only the serving
thread uses it; nothing here blocks (a renewal the kernel holds unread is peeked at, not waited
for).
"""

from __future__ import annotations

import heapq
import socket
from collections.abc import Callable

from plugdist.store import _wire as w
from plugdist.store._server.conn import Conn, have

__all__ = ["Wills"]

# input a connection may already hold for the lapse check to read more (a will's holder sends
# 5-byte renewals; a connection holding more is read at its own turns)
_CATCH_UP_BYTES = 64 * 1024
# frames of unrun input looked through for a renewal (each a header read and a jump)
_SCAN_FRAMES = 4096


class Wills:
    """The wills of one server's connections. ``drop(conn, why)`` closes a connection and logs
    why; ``read(conn)`` (set once the framing exists) reads what a connection sent."""

    def __init__(self, drop: Callable[..., None]) -> None:
        self._drop = drop
        self.read: Callable[[Conn], None]
        self.deadlines: list[tuple[float, int, Conn]] = []
        self._seq = 0

    def arm(self, conn: Conn) -> None:
        """Watch ``conn``'s will deadline (``conn.will_deadline``)."""
        self._seq += 1
        heapq.heappush(self.deadlines, (conn.will_deadline, self._seq, conn))

    def lapse(self, now: float) -> None:
        """Run the will of every connection that sent no RENEW for its ttl (its process stopped
        or hangs), dropping the connection; push back those renewed since they were armed."""
        heap = self.deadlines
        while heap and heap[0][0] <= now:
            _, _, conn = heapq.heappop(heap)
            if conn.closed or conn.will is None or conn.will_ttl <= 0:
                continue
            if conn.will_deadline <= now:
                self._catch_up(conn, now)
                if conn.closed or conn.will is None or conn.will_ttl <= 0:
                    continue  # gone meanwhile, or its holder withdrew the will
            if conn.will_deadline > now:
                self.arm(conn)
                continue
            self._drop(conn, f"its will lapsed: no renewal for {conn.will_ttl:.3g}s (the "
                             f"process stopped, hangs, or lost the network)")

    def _catch_up(self, conn: Conn, now: float) -> None:
        """Count what ``conn``'s holder sent for its will but the server has not run: read what
        the kernel holds (a little: a connection that floods is read at its own turns), then run
        the RENEW and WILL_DROP frames among the whole frames received (neither has a reply, so
        they may run ahead of the requests before them)."""
        if have(conn) < _CATCH_UP_BYTES and _unread(conn):
            self.read(conn)
            if conn.closed or conn.will_deadline > now:
                return
        buf = conn.inbuf
        pos, end, kept, parts = 0, len(buf), 0, []
        for _ in range(_SCAN_FRAMES):
            if end - pos < w.HEADER.size:
                break
            length, op = w.HEADER.unpack_from(buf, pos)
            if length == 0 and op in w.CONTROL_OPS:
                if op == w.Op.WILL_DROP:
                    conn.will, conn.will_ttl = None, 0.0
                elif conn.will_ttl > 0:
                    conn.will_deadline = now + conn.will_ttl
                parts.append(buf[kept:pos])
                kept = pos + w.HEADER.size
            pos += w.HEADER.size + length
        if parts:  # the frames run are taken out of the input
            parts.append(buf[kept:])
            conn.inbuf = bytearray().join(parts)


def _unread(conn: Conn) -> bool:
    """Whether bytes from ``conn`` wait in the kernel, unread."""
    try:
        return bool(conn.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True  # reading it will close it
