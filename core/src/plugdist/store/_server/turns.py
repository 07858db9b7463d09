"""Fair turns: what one connection gets served before the others' turn comes, and the work
carried over to the next turns of the server's loop.

A connection is served at most ``TURN_REQUESTS`` requests, or ``TURN_SECONDS``, a turn (the
request loop in :mod:`plugdist.store._server.framing` keeps to it); the rest waits in its input
for the next turn (:attr:`Turns.later`). A request of many keys runs a slice a turn
(:mod:`plugdist.store._server.sliced`); one whose client left before it was done is finished
a slice a turn if it must be (a MULTI_SET's writes: :attr:`Turns.orphans`). A connection whose
bytes took the server longer than ``HEAVY`` (of its CPU: not the host's load) in one go rests
(is not read) for ``HEAVY_REST`` times as long, counted on one timeline for every heavy
connection, so heavy work gets at most about 1 / (1 + ``HEAVY_REST``) of the server.

Only the serving thread uses it; nothing here blocks.
"""

from __future__ import annotations

import heapq
import struct
import time
from collections.abc import Callable
from typing import Any

from plugdist.store._server.conn import Conn, have
from plugdist.store._server.replies import Reply
from plugdist.store._server.sliced import Sliced

__all__ = ["HEAVY", "TURN_REQUESTS", "TURN_SECONDS", "Turns"]

# what one connection is served per turn of the loop (at least one request): a client that
# pipelines thousands of requests waits for the others' turns between its batches
TURN_REQUESTS = 32
TURN_SECONDS = 50e-6
# a connection whose bytes took the server longer than this in one go (a request of thousands
# of keys, a frame of megabytes) is heavy: it is not read again for _HEAVY_REST times as long,
# counted on one timeline for every heavy connection, so heavy work gets at most about
# 1 / (1 + _HEAVY_REST) of the server
HEAVY = 1e-3
_HEAVY_REST = 3.0
# a request's cost is its time by the clock, and past HEAVY, at most the serving thread's CPU
# time since a mark taken before it: a cheap request that spanned a preemption (a loaded host)
# is not heavy. The mark is taken at the first request of a turn and every _MARK_EVERY
# requests (the thread's CPU clock is a system call, too dear to read around every request),
# so the bound counts a few cheap requests before the one measured
_MARK_EVERY = 16


class Turns:
    """The turns of one server's connections. ``pending``: the connections whose deadlines
    the framing watches (shared with it); ``drop(conn, why)`` closes a connection and logs why.
    :meth:`attach` gives it the framing's reading, sending and watching."""

    def __init__(self, pending: set[Conn], drop: Callable[..., None]) -> None:
        self._pending = pending
        self._drop = drop
        self.later: list[Conn] = []  # served their turn's requests; more wait for the next
        self.resume: list[Conn] = []  # to serve again this turn (from their buffered input)
        self.orphans: list[Sliced] = []  # left by closed clients, finished a slice a turn
        self.resting: list[tuple[float, int, Conn]] = []  # (until, seq, conn)
        self._rest_seq = 0
        self._heavy_next = 0.0  # when heavy requests have had their share (monotonic)
        self.charged = 0.0  # work charged to the connection being served, beyond its time
        self._cpu_mark: float | None = None  # the thread's CPU time before this turn's requests
        self._since_mark = 0  # requests served since the mark

    def attach(self, process: Callable[..., None], on_readable: Callable[[Conn], None],
               send: Callable[[Conn, Reply], None], watch: Callable[[Conn], None],
               internal_error: Callable[[Conn | None, str, BaseException], bytes]) -> None:
        """The framing's: run the input a connection holds, read it, send to it, watch it in
        the selector for what it now waits for, and report a server bug (the ERROR reply)."""
        self._process = process
        self._on_readable = on_readable
        self._send = send
        self._watch = watch
        self._internal_error = internal_error

    def serve_conn(self, conn: Conn, force: bool = False) -> None:
        """Read from ``conn`` (or, ``force``, run the requests left in its buffer), charging the
        time it took: past ``HEAVY`` the connection rests (see :meth:`rest`). Past ``HEAVY`` by
        the clock, the time is bounded by the serving thread's CPU time (see ``_MARK_EVERY``):
        its client must not rest for the host's load."""
        if self._cpu_mark is None or self._since_mark >= _MARK_EVERY:
            self._cpu_mark, self._since_mark = time.thread_time(), 0
        self._since_mark += 1
        began = time.perf_counter()
        self.charged = 0.0
        if force:
            self._process(conn, b"", force=True)
        else:
            self._on_readable(conn)
        took = time.perf_counter() - began
        if took > HEAVY:
            cpu = time.thread_time()
            took = min(took, cpu - self._cpu_mark)
            self._cpu_mark, self._since_mark = cpu, 0
        took += self.charged
        if conn.sliced is not None or conn.spent:  # a request read in slices: its whole cost
            conn.spent = took = conn.spent + took
            if conn.sliced is None or took > HEAVY:
                conn.spent = 0.0
        if took > HEAVY and not conn.closed:
            self.rest(conn, took)

    def new_turn(self) -> None:
        """Work not served through :meth:`serve_conn` may run from here on (the loop's own):
        the next request takes a fresh CPU mark."""
        self._cpu_mark = None

    def serve_resumed(self) -> None:
        """Run again the connections whose input holds whole requests (the end of a turn)."""
        self.new_turn()  # the loop's own work (wills, waiters' timeouts) came since the mark
        resume = self.resume
        while resume:
            conn = resume.pop()
            # only a whole frame is worth running again: a partial one waits for its
            # bytes (copying it each turn would cost as much as it holds)
            if (not conn.closed and conn.waiter is None and not conn.paused
                    and not conn.resting
                    and (conn.sliced is not None
                         or conn.inbuf and have(conn) >= conn.need)):
                self.serve_conn(conn, force=True)

    def next_slice(self, conn: Conn) -> bool:
        """Read the next slice of ``conn``'s request of many keys; True once it was answered
        (or parked) and the requests behind it may run."""
        assert conn.sliced is not None
        try:
            reply = conn.sliced.step()
        except (ValueError, IndexError, struct.error, UnicodeDecodeError, OverflowError) as e:
            self._drop(conn, f"malformed request: {e}")
            return False
        except Exception as e:  # a server bug: answer the request, serve on
            reply = self._internal_error(conn, "a request read in slices", e)
        if isinstance(reply, Sliced):
            conn.sliced = reply  # the same request's next part (a reply packed in slices)
            self.later.append(conn)
            return False
        conn.sliced = None
        if reply is None:
            self._pending.discard(conn)
        else:
            self._send(conn, reply)
        return not conn.closed

    def step_orphan(self) -> None:
        """One slice of the oldest request whose client left before it was done (one a turn,
        however many clients left so)."""
        try:
            nxt = self.orphans[0].step()
        except (ValueError, IndexError, struct.error, UnicodeDecodeError, OverflowError):
            nxt = None  # malformed: nothing of it was written
        except Exception as e:  # a server bug: let go of it, serve on
            self._internal_error(None, "a left client's request", e)
            nxt = None
        if isinstance(nxt, Sliced):
            self.orphans[0] = nxt
        else:
            self.orphans.pop(0)

    def answer(self, conn: Any, reply: Reply | Sliced) -> None:
        """The key space answered ``conn``'s parked request: send it, then read on (a reply
        made in slices is made at the next turns first)."""
        if isinstance(reply, Sliced):
            conn.sliced = reply
            self.later.append(conn)
            return
        self._send(conn, reply)
        if conn.inbuf:
            self.resume.append(conn)

    def rest(self, conn: Conn, spent: float) -> None:
        """``conn`` had ``spent`` seconds of heavy requests: read it again only once every
        heavy connection's work has been followed by ``_HEAVY_REST`` times as long."""
        now = time.monotonic()
        self._heavy_next = max(now, self._heavy_next) + spent * _HEAVY_REST
        conn.resting = True
        self._pending.discard(conn)
        self._rest_seq += 1
        heapq.heappush(self.resting, (self._heavy_next, self._rest_seq, conn))
        self._watch(conn)

    def wake_rested(self, now: float) -> None:
        """Read again the connections whose rest is over."""
        resting = self.resting
        while resting and resting[0][0] <= now:
            self._wake(heapq.heappop(resting)[2])

    def _wake(self, conn: Conn) -> None:
        if conn.closed or not conn.resting:
            return
        conn.resting = False
        self._watch(conn)
        self.mind_deadlines(conn)
        if conn.inbuf or conn.sliced is not None:
            self.resume.append(conn)

    def mind_deadlines(self, conn: Conn) -> None:
        """Watch ``conn``'s deadlines again (its proof, its partial frame's pace) after a rest or
        a pause, during which they were not watched; a sender that sits still from then on is
        dropped all the same."""
        if conn.waiter is None and conn.sliced is None and (
                not conn.proven or conn.inbuf or conn.skip):
            self._pending.add(conn)

    def orphan(self, conn: Conn) -> None:
        """``conn`` closed: its request in slices is finished without it when it must be (a
        MULTI_SET's writes), let go of otherwise."""
        if conn.sliced is not None:
            if conn.sliced.must_finish:
                self.orphans.append(conn.sliced)
            else:
                conn.sliced.abandon()
        conn.sliced = None
