"""Will expiry: a connection's will with a ttl runs (the connection is dropped, and its will
written with the others of its turn) when no RENEW came for that long.

Wills with a ttl wait in a heap by deadline; a RENEW moves a connection's deadline without
touching the heap, and an entry found early is pushed again at the new deadline (lazy), so a
renewal costs O(1) and the heap O(log n) per connection per ttl. Only the serving thread uses
it; nothing here blocks (a renewal the kernel holds unread is peeked at, not waited for).
"""

from __future__ import annotations

import heapq
import socket
from collections.abc import Callable

from plugdist.store._server.conn import Conn

__all__ = ["Wills"]


class Wills:
    """The wills of one server's connections. ``drop(conn, why)`` closes a connection and logs
    why; ``read(conn)`` (set once the framing exists) reads what a connection sent."""

    def __init__(self, drop: Callable[..., None]) -> None:
        self._drop = drop
        self.read: Callable[[Conn], None]
        self.deadlines: list[tuple[float, int, Conn]] = []
        self._seq = 0
        self.dying: list[tuple[bytes, bytes]] = []  # wills of connections closed this turn

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
            if conn.will_deadline <= now and _unread(conn):
                # a busy server may not have read a renewal that did arrive: read it first
                self.read(conn)
                if conn.closed:
                    continue
            if conn.will_deadline > now:
                self.arm(conn)
                continue
            self._drop(conn, f"its will lapsed: no renewal for {conn.will_ttl:.3g}s (the "
                             f"process stopped, hangs, or lost the network)")


def _unread(conn: Conn) -> bool:
    """Whether bytes from ``conn`` wait in the kernel, unread."""
    try:
        return bool(conn.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True  # reading it will close it
