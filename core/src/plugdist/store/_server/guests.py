"""Guests: connections that have not shown they belong to the job, and the bounds on them.

A connection is *trusted* once it proved the server's token, holds a member identity (CLAIM,
JOIN), or vouched with a live identity's credential (VOUCH: a member's client does so on each
of its pooled connections). Every other connection is a guest, and guests are bounded: per
peer address (``TCPStoreLimits.max_guests_per_address``), by the server's connection limit
(a new connection displaces a guest rather than being refused), and by an idle deadline
(``guest_idle_timeout``). A guest displaced is, of the oldest ``_LOOK``, the one that sent
nothing for longest and is not parked in a request nor holds a will, else the oldest: a
stranger holding connections cannot keep a member's new one out, and an idle guest goes
before a busy one (an idle one holding a will is not dropped for idleness: its will would
run). Trusted connections are never displaced.

Only the serving thread uses it; nothing here blocks. Finding whom to displace looks at a
bounded number of the oldest guests (``_LOOK``), so a flood costs O(1) a connection; the idle
deadlines are a heap, so a sweep costs what is due, not a walk of every guest.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable

from plugdist.store._server.conn import Conn
from plugdist.store._server.limits import TCPStoreLimits

__all__ = ["Guests"]


def _last_active(conn: Conn) -> float:
    return conn.active

_LOOK = 64  # oldest guests looked at for one not parked before the oldest is displaced


class Guests:
    """The guests of one server. ``drop(conn, why, gone=False)`` closes a connection and logs
    why (the server's)."""

    def __init__(self, limits: TCPStoreLimits, drop: Callable[..., None]) -> None:
        self._per_address = max(1, limits.max_guests_per_address)
        self._idle = limits.guest_idle_timeout.total_seconds()
        self._drop = drop
        self._all: dict[Conn, None] = {}  # oldest first
        self._by_host: dict[str, dict[Conn, None]] = {}
        # (when to look at it again, seq, conn): a guest's idle deadline from the last time it
        # was looked at; a closed or trusted one is skipped when its entry comes up (and the
        # heap is rebuilt from the guests once it holds twice as many entries as there are)
        self._due: list[tuple[float, int, Conn]] = []
        self._seq = itertools.count()
        self.displaced = 0  # guests displaced so far (for the log and the tests)

    def __len__(self) -> int:
        return len(self._all)

    def admit(self, conn: Conn, at_limit: bool) -> bool:
        """A new connection ``conn`` (a guest until trusted): make room for it, displacing a
        guest when the server is ``at_limit`` or its address has too many. False when no
        room could be made (the server is full of trusted connections)."""
        if at_limit and not self._displace(self._all, "the server is at its connection limit "
                                                      "(TCPStoreLimits.max_connections)"):
            return False
        mine = self._by_host.get(conn.host)
        if mine is not None and len(mine) >= self._per_address:
            self._displace(mine, f"its address has {len(mine)} connections that have not "
                                 f"shown they belong to the job "
                                 f"(TCPStoreLimits.max_guests_per_address)")
        self._all[conn] = None
        self._by_host.setdefault(conn.host, {})[conn] = None
        due = self._due
        if len(due) > 2 * len(self._all) + 1024:
            due[:] = [(c.active + self._idle, next(self._seq), c) for c in self._all]
            heapq.heapify(due)
        else:  # ``active`` is set as it is accepted, just after
            heapq.heappush(due, (time.perf_counter() + self._idle, next(self._seq), conn))
        return True

    def trust(self, conn: Conn) -> None:
        """``conn`` showed it belongs to the job: no longer a guest."""
        conn.trusted = True
        self.forget(conn)

    def forget(self, conn: Conn) -> None:
        """``conn`` closed, or is trusted now."""
        if self._all.pop(conn, 0) is None:
            mine = self._by_host[conn.host]
            del mine[conn]
            if not mine:
                del self._by_host[conn.host]

    def _displace(self, among: dict[Conn, None], why: str) -> bool:
        idle = [c for c in itertools.islice(among, _LOOK) if c.waiter is None and c.will is None]
        victim = min(idle, key=_last_active) if idle else next(iter(among), None)
        if victim is None:
            return False
        self.displaced += 1
        self._drop(victim, f"displaced by a newer connection: {why}; a member's connections "
                           f"(the token, a claimed identity, or its credential) never are")
        self.forget(victim)  # dropped already (closed), or a bug: never looked at again
        return True

    def sweep_interval(self) -> float:
        return min(max(self._idle / 4, 0.05), 5.0)

    def drop_idle(self, now: float) -> None:
        """Drop the guests that sent nothing for ``guest_idle_timeout``, wait in no parked
        request and hold no will (``now``: ``time.perf_counter()``)."""
        due, idle = self._due, self._idle
        recheck = self.sweep_interval()
        while due and due[0][0] <= now:
            conn = heapq.heappop(due)[2]
            if conn not in self._all:
                continue  # closed, or trusted since
            if conn.waiter is not None or conn.will is not None or not conn.handshaken:
                heapq.heappush(due, (now + recheck, next(self._seq), conn))
                continue
            if now - conn.active < idle:  # it sent something since: its deadline moved on
                heapq.heappush(due, (conn.active + idle, next(self._seq), conn))
                continue
            self.forget(conn)
            self._drop(conn, f"a connection that has not shown it belongs to the job sent "
                             f"nothing for {self._idle:.3g}s (TCPStoreLimits."
                             f"guest_idle_timeout); its client opens another when it needs one",
                       gone=True)
