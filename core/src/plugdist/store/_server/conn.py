"""A client connection's state on the server (:class:`Conn`), and the selector that watches
them all (:class:`Selector`).

Every part of the server reads and writes a :class:`Conn`'s fields; only the serving thread
touches them. :meth:`Selector.select` is the one place the serving thread blocks (until a
socket is ready or the loop's next deadline).
"""

from __future__ import annotations

import collections
import itertools
import math
import select
import selectors
import socket
from typing import Any

from plugdist.store._server.sliced import Sliced

__all__ = ["READ", "WRITE", "Conn", "Outbox", "ProtocolError", "Selector", "have"]

READ = selectors.EVENT_READ
WRITE = selectors.EVENT_WRITE
_MAX_EVENTS = 1024  # readiness events taken from the kernel per turn of the loop
_JOIN_BELOW = 64 * 1024  # pieces of an outbox smaller than this are joined
_SEND_AT_ONCE = 256 * 1024  # bytes of an outbox offered to the kernel in one call


if hasattr(selectors, "EpollSelector"):
    class Selector(selectors.EpollSelector):
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
                    mask |= WRITE
                if event & ~select.EPOLLOUT:
                    mask |= READ
                key = self._fd_to_key.get(fd)  # type: ignore[attr-defined]
                if key:
                    ready.append((key, mask & key.events))
            return ready
else:  # pragma: no cover - not Linux
    Selector = selectors.DefaultSelector  # type: ignore[misc,assignment]


class Outbox:
    """The bytes of a connection's replies the kernel has not taken yet, as the pieces they
    came in (a large value is the stored one, never copied), small pieces joined. ``len`` is
    how many bytes wait."""

    __slots__ = ("chunks", "size")

    def __init__(self) -> None:
        self.chunks: collections.deque[bytes | bytearray | memoryview] = collections.deque()
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def add(self, data: bytes | bytearray | memoryview) -> None:
        n = len(data)
        if not n:
            return
        self.size += n
        chunks = self.chunks
        if n < _JOIN_BELOW:
            if chunks and type(chunks[-1]) is bytearray and len(chunks[-1]) < _JOIN_BELOW:
                chunks[-1] += data  # type: ignore[operator]
            else:
                chunks.append(bytearray(data))
        else:
            chunks.append(data)

    def send(self, sock: socket.socket) -> int:
        """Send what the kernel takes now, up to 64 pieces and ``_SEND_AT_ONCE`` bytes (a
        reader of large replies costs each turn that much copying, not megabytes); the bytes
        sent. Raises
        BlockingIOError and the like as ``socket.sendmsg`` does."""
        chunks = self.chunks
        offer: list[bytes | bytearray | memoryview] = []
        room = _SEND_AT_ONCE
        for chunk in itertools.islice(chunks, 64):
            if len(chunk) >= room:
                offer.append(memoryview(chunk)[:room])
                break
            offer.append(chunk)
            room -= len(chunk)
        n = sock.sendmsg(offer)
        self.size -= n
        left = n
        while left:
            head = chunks[0]
            if len(head) <= left:
                left -= len(head)
                chunks.popleft()
            else:
                chunks[0] = memoryview(head)[left:]
                left = 0
        return n


def have(conn: Conn) -> int:
    """Bytes received of ``conn``'s unparsed input."""
    return len(conn.inbuf) + conn.tail_len


class ProtocolError(Exception):
    """The peer broke the protocol; its connection is dropped."""


class Conn:
    """One client connection: its socket, its input and output buffers, and the flags each
    part of the server keeps on it (see each field's comment)."""

    __slots__ = ("sock", "peer", "inbuf", "need", "out", "handshaken", "proven", "nonce",
                 "waiter", "closed", "since", "started", "held", "skip", "vetted", "paused",
                 "resting", "unwatched", "will", "will_ttl", "will_deadline", "identity",
                 "sliced", "spent", "tail", "tail_len", "trusted", "host", "active",
                 "job_refusal", "counted")

    def __init__(self, sock: socket.socket, peer: str, nonce: bytes) -> None:
        self.sock = sock
        self.peer = peer
        self.inbuf = bytearray()  # bytes not yet parsed (a partial frame, or frames behind a wait)
        self.tail: list[bytes] = []  # of a large partial frame, the bytes after inbuf's
        self.tail_len = 0
        self.need = 0             # length inbuf (and tail) must reach before parsing is worth it
        self.out = Outbox()       # bytes the kernel has not taken yet
        self.handshaken = False
        self.proven = False       # proved its token, or (no token) sent a first request
        self.trusted = False      # a member's: proved the token, holds an identity, or vouched
        self.host = peer.rpartition(":")[0]  # the peer's address (its guests are bounded)
        self.active = 0.0         # when it last sent something (time.perf_counter)
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
        self.job_refusal: str | None = None  # why it may not write job keys ("": it may)
        self.counted = 0          # bytes of its plain writes in the strangers' quota

