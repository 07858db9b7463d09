"""Framing, pacing and backpressure: the bytes a connection sends cut into frames and run
through the commands, and the bounds on how they arrive and how replies leave.

A frame must arrive at the pace :class:`~plugdist.store._server.limits.TCPStoreLimits` sets
(:meth:`Framing.sweep_stalled` drops the stalled ones, and a connection that has not proven
itself in time); partly received frames across all connections are bounded, the slowest
dropped past it (:meth:`Framing.hold`); a large frame already known to be refused is answered
early and its bytes dropped as they come; a client that leaves too many replies unread is not
read until it reads (``paused``); one that sends while its request is parked only renews or
withdraws its will. The request loop of :meth:`Framing.process` is the server's hot path: it
serves a connection's requests up to its turn (:mod:`plugdist.store._server.turns`).

Only the serving thread uses it. Sockets are non-blocking: nothing here blocks.
"""

from __future__ import annotations

import collections
import struct
import time
import traceback
from collections.abc import Callable
from typing import Any

from plugdist.store import _wire as w
from plugdist.store._server.commands import Commands
from plugdist.store._server.conn import READ, WRITE, Conn, ProtocolError, Selector, have
from plugdist.store._server.limits import TCPStoreLimits
from plugdist.store._server.replies import Parts, Reply
from plugdist.store._server.replies import reply as reply_frame
from plugdist.store._server.sliced import Sliced
from plugdist.store._server.turns import TURN_REQUESTS, TURN_SECONDS, Turns

__all__ = ["Framing"]

_RECV_SIZE = 256 * 1024
# a partial frame larger than this is looked at for a refusal as soon as its fields tell
_EARLY = 64 * 1024
# the bytes of a refused frame are dropped as they come, and charged to their connection as if
# it took this long per byte (so one who streams refused frames rests like any heavy client)
_SKIP_COST = 1.0 / (64 * 1024 * 1024)
# a partial frame past this many bytes keeps what arrives as the reads' own chunks (joined once
# whole), not in one growing buffer: a buffer of tens of MiB costs milliseconds to grow and, when
# its sender is dropped, to free, in front of everyone
_CHUNKED = 1024 * 1024
# a turn copies the front of a connection's queued input to run from: the frames it may serve,
# but past the first, no more than this (a turn may end after one large frame)
_CUT_BYTES = 64 * 1024


class Framing:
    """The frames of one server's connections. ``pending``: the connections whose deadlines
    :meth:`sweep_stalled` watches (shared with the other parts); ``turns``: whose turn it is;
    ``drop(conn, why, gone=False)`` and ``close(conn)``: the server's; ``log``, its logger,
    and ``warn``, its rate-limited one (:class:`~plugdist.store._server.limits.Throttle`). Set
    once it runs: ``sel`` (the selector), ``hello`` and ``proof_waiting`` (the handshake's check
    of a HELLO, and whether a late proof waits unread) and ``port`` (for log lines)."""

    def __init__(self, limits: TCPStoreLimits, commands: Commands, pending: set[Conn],
                 turns: Turns, drop: Callable[..., None], close: Callable[[Conn], None],
                 log: Any, warn: Callable[..., None]) -> None:
        self._limits = limits
        self._commands = commands
        self._pending = pending
        self._turns = turns
        self._later = turns.later  # the same lists: appended to, never replaced
        self._resume = turns.resume
        self._next_slice = turns.next_slice
        self._drop = drop
        self._close = close
        self._log = log
        self._warn = warn
        self.sel: Selector
        self.hello: Callable[[Conn, bytes], int]
        self.proof_waiting: Callable[[Conn], bool]
        self.port = 0
        self._partial_total = 0  # bytes of partly received frames, all connections
        self._holders: set[Conn] = set()  # the connections holding them
        self.graveyard: collections.deque[bytes] = collections.deque()  # chunks to free

    def on_readable(self, conn: Conn) -> None:
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
        self.process(conn, data)

    def process(self, conn: Conn, data: bytes, force: bool = False) -> None:
        if conn.skip and data:  # the rest of a frame refused early: dropped as it comes
            n = min(conn.skip, len(data))
            conn.skip -= n
            self._turns.charged += n * _SKIP_COST
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
            if have(conn) > self._limits.max_parked_inbound_bytes and conn.waiter:
                self._drop(conn, f"sent more than {self._limits.max_parked_inbound_bytes} bytes "
                                 f"while its request was parked (one request at a time)")
            return
        queued: bytearray | None = None  # conn.inbuf, when buf holds only its front
        if conn.inbuf:
            # a large frame arrives in many reads: append until it is whole
            self._append(conn, data)
            if have(conn) < conn.need and not force:
                self.hold(conn, have(conn))
                self._refuse_early(conn)
                return
            if conn.tail:
                buf = b"".join((conn.inbuf, *conn.tail))
                self.forget_tail(conn)
            elif conn.handshaken:
                # only the frames this turn may serve are copied: the rest stays in inbuf,
                # whose front is then deleted in place (bytearray does that without a copy)
                queued = conn.inbuf
                buf = bytes(queued[:_turn_cut(queued)])
            else:
                buf = bytes(conn.inbuf)
        else:
            buf = data
        pos, end = 0, len(buf)
        max_frame = self._limits.max_frame_bytes
        max_unread = self._limits.max_unread_reply_bytes
        try:
            if not conn.handshaken:
                if end < w.HELLO.size:
                    if buf[:4] != w.MAGIC[:min(4, end)]:
                        raise ProtocolError("bad magic: not a plugdist TCPStore client")
                    self._keep(conn, buf, 0, w.HELLO.size)
                    return
                pos = self.hello(conn, buf)
                if conn.closed:
                    return
            served = 0
            conn.active = turn = time.perf_counter()
            while conn.waiter is None and end - pos >= 5:
                if len(conn.out) > max_unread:
                    self._pause(conn)
                    break
                if served == TURN_REQUESTS or (served and time.perf_counter() - turn
                                                > TURN_SECONDS):
                    break  # the others' turn; the rest waits in inbuf for the next one
                length, op = w.HEADER.unpack_from(buf, pos)
                if length > max_frame:
                    raise ProtocolError(f"frame of {length} bytes exceeds the limit of "
                                         f"{max_frame}")
                stop = pos + 5 + length
                if stop > end:
                    break
                if not self._commands.knows(op):
                    raise ProtocolError(f"unknown command {op}")
                conn.proven = True
                served += 1
                try:
                    reply = self._commands.handle(conn, op, buf, pos + 5, stop)
                except (ValueError, IndexError, struct.error, UnicodeDecodeError,
                        OverflowError) as e:
                    raise ProtocolError(f"malformed {w.Op(op).name} request: {e}") from None
                except Exception as e:  # a server bug: answer this request, serve on
                    reply = self.internal_error(conn, w.Op(op).name, e)
                pos = stop
                if isinstance(reply, Sliced):  # read on at the next turns
                    conn.sliced = reply
                    self._pending.discard(conn)
                    self._later.append(conn)
                    break
                if reply is None:  # parked: its clock is the request's timeout now
                    self._pending.discard(conn)
                elif reply:  # RENEW and WILL_DROP have no reply
                    self.send(conn, reply)
                    if conn.closed:
                        return
        except ProtocolError as e:
            self._drop(conn, str(e))
            return
        except Exception as e:  # a server bug outside a command: lose this client only
            self.internal_error(conn, "framing", e)
            self._close(conn)
            return
        new_frame = pos > 0  # one was served: what is left starts a new frame
        left: bytes | bytearray = buf
        if queued is not None:
            if pos:
                del queued[:pos]
            left, pos, end = queued, 0, len(queued)
        if pos >= end:
            if conn.inbuf:
                conn.inbuf = bytearray()
            conn.need = 0
            self.hold(conn, 0)
            if conn.proven:
                self._pending.discard(conn)
            return
        need = 5
        if end - pos >= 5:
            need = 5 + w.HEADER.unpack_from(left, pos)[0]
        if queued is not None:
            self._kept(conn, need, new_frame)
        else:
            self._keep(conn, buf, pos, need)
        if end - pos >= need and conn.waiter is None and not conn.paused and not conn.resting \
                and conn.sliced is None:
            self._later.append(conn)  # whole requests left: served at the next turn

    def internal_error(self, conn: Conn | None, where: str, e: BaseException) -> bytes:
        """A bug of the server met while serving ``conn`` (``where``: the command or the
        part): logged (rate-limited, with the traceback), and the ERROR reply that answers the
        request instead, so the client raises and the serving loop goes on."""
        self._warn("tcp_store_internal_error", "error", port=self.port,
                   peer=conn.peer if conn is not None else "-", where=where, error=repr(e),
                   traceback=traceback.format_exc(limit=8))
        return reply_frame(w.Status.ERROR, (f"{where} failed inside the store's server ({e!r}); "
                                            f"the server logged it (tcp_store_internal_error) "
                                            f"and serves on: report it with that log line"
                                            ).encode())

    def _control_frames(self, conn: Conn) -> None:
        """Run the RENEW and WILL_DROP frames at the front of a parked connection's input (its
        holder renews, or withdraws, its will while its own request waits)."""
        buf = conn.inbuf
        pos = 0
        while len(buf) - pos >= 5:
            length, op = w.HEADER.unpack_from(buf, pos)
            if length or op not in w.CONTROL_OPS:
                break
            try:
                self._commands.handle(conn, op, b"", 0, 0)
            except Exception as e:  # RENEW and WILL_DROP have no reply to carry an error
                self.internal_error(conn, w.Op(op).name, e)
            pos += 5
        if pos:
            del buf[:pos]

    def _append(self, conn: Conn, data: bytes) -> None:
        if conn.tail or (conn.need > _CHUNKED and len(conn.inbuf) >= _CHUNKED and data):
            conn.tail.append(data)
            conn.tail_len += len(data)
        else:
            conn.inbuf += data

    def forget_tail(self, conn: Conn) -> None:
        """Drop ``conn``'s tail chunks, freed a few a turn (see ``_bury``)."""
        if conn.tail:
            self.graveyard.extend(conn.tail)
            conn.tail, conn.tail_len = [], 0

    def bury(self) -> None:
        """Free about a megabyte of dropped chunks."""
        freed = 0
        while self.graveyard and freed < _CHUNKED:
            freed += len(self.graveyard.popleft())

    def _keep(self, conn: Conn, buf: bytes, pos: int, need: int) -> None:
        """Keep ``buf[pos:]`` (the front of a frame ``need`` bytes long, or whole frames the next
        turns serve) as ``conn``'s input."""
        new_frame = not conn.inbuf or pos > 0
        conn.inbuf = bytearray(memoryview(buf)[pos:])
        self._kept(conn, need, new_frame)

    def _kept(self, conn: Conn, need: int, new_frame: bool) -> None:
        """``conn.inbuf`` holds the unserved input, the first frame of which is ``need`` bytes
        long; ``new_frame``: that frame was not the one held before."""
        conn.need = need
        if new_frame:
            conn.vetted = False
        if conn.waiter is None and not conn.paused and not conn.resting and conn.sliced is None:
            if new_frame:  # a new frame's clock starts with its first byte
                conn.started = time.monotonic()
            self._pending.add(conn)
        self.hold(conn, len(conn.inbuf) if len(conn.inbuf) < need else 0)
        if len(conn.inbuf) < need:
            self._refuse_early(conn)

    def _refuse_early(self, conn: Conn) -> None:
        """A large partial frame whose request is already known to be refused (more keys than
        ``max_keys_per_request``, a value over ``max_value_bytes``): answer its ERROR now and
        drop its bytes as they come instead of holding them (``skip``), still at the pace
        frames must keep."""
        buf = conn.inbuf
        if conn.need <= _EARLY or conn.vetted or len(buf) < 5 or conn.waiter is not None:
            return
        length, op = w.HEADER.unpack_from(buf, 0)
        verdict = self._commands.stranger_refusal(conn, _op_name(op), 5 + length) \
            or self._commands.refusal_ahead(conn, op, buf, 5, len(buf))
        if verdict is None:
            return  # the fields that tell are not here yet
        conn.vetted = True
        if not verdict:
            return
        conn.proven = True
        conn.skip = 5 + length - have(conn)
        conn.inbuf = bytearray()
        self.forget_tail(conn)
        self.hold(conn, 0)
        self.send(conn, verdict)

    def hold(self, conn: Conn, held: int) -> None:
        """``conn`` holds ``held`` bytes of a partly received frame; past the server's total
        (``max_partial_bytes``) the slowest frames' connections are dropped (see
        :class:`TCPStoreLimits`)."""
        self._partial_total += held - conn.held
        conn.held = held
        if held:
            self._holders.add(conn)
        else:
            self._holders.discard(conn)
        cap = self._limits.max_partial_bytes
        if held and self._partial_total > cap:
            now = time.monotonic()
            by_pace = sorted(self._holders, key=lambda c: c.held / max(now - c.started, 1e-3))
            for slowest in by_pace:
                if self._partial_total <= cap:
                    break
                self._drop(slowest, f"partly received frames of all clients held more than "
                                    f"{cap} bytes; this one came slowest ({slowest.held} of "
                                    f"{slowest.need} bytes in {now - slowest.started:.3g}s)")


    def send(self, conn: Conn, data: Reply) -> None:
        """Send a reply frame (bytes, or :class:`Parts` that refer to stored values): what the
        kernel does not take waits in ``conn.out``, and the selector watches for writability."""
        out = conn.out
        if isinstance(data, Parts):  # a large reply, never joined
            for part in data:
                out.add(part)
            if len(out) == data.size:  # nothing waited before it
                self.flush(conn)
                if out:
                    self.watch(conn)
            return
        if out:
            out.add(data)
            return
        try:
            n = conn.sock.send(data)
        except (BlockingIOError, InterruptedError):
            n = 0
        except OSError as e:
            self._drop(conn, f"send failed: {e}")
            return
        if n < len(data):
            out.add(memoryview(data)[n:])
            self.watch(conn)

    def watch(self, conn: Conn) -> None:
        if conn.closed:
            return
        events = (0 if conn.paused or conn.resting else READ) | (WRITE if conn.out else 0)
        if not events:  # resting with nothing to send
            if not conn.unwatched:
                self.sel.unregister(conn.sock)
                conn.unwatched = True
        elif conn.unwatched:
            self.sel.register(conn.sock, events, conn)
            conn.unwatched = False
        else:
            self.sel.modify(conn.sock, events, conn)

    def _pause(self, conn: Conn) -> None:
        conn.paused = True
        self._pending.discard(conn)
        self.watch(conn)

    def flush(self, conn: Conn) -> None:
        try:
            conn.out.send(conn.sock)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._drop(conn, f"send failed: {e}")
            return
        if conn.paused and len(conn.out) <= self._limits.max_unread_reply_bytes // 2:
            conn.paused = False
            self._turns.mind_deadlines(conn)
            if conn.inbuf:
                self._resume.append(conn)
        if not conn.out or not conn.paused:
            self.watch(conn)

    def sweep_interval(self) -> float:
        lim = self._limits
        shortest = min(lim.handshake_timeout, lim.frame_timeout).total_seconds()
        return min(max(shortest / 4, 0.01), 1.0)

    def sweep_stalled(self, now: float) -> None:
        lim = self._limits
        hs = lim.handshake_timeout.total_seconds()
        grace = lim.frame_timeout.total_seconds()
        rate = max(1, lim.min_frame_bytes_per_second)
        for conn in list(self._pending):
            if conn.closed or conn.paused or conn.resting or conn.waiter is not None \
                    or conn.sliced is not None:
                self._pending.discard(conn)
            elif not conn.proven and now - conn.since > hs and self.proof_waiting(conn):
                # the peer sent it in time; the server's backlog kept it unread. Served now,
                # with a fresh deadline for what the peer must send next
                conn.since = now
                self._turns.serve_conn(conn)
            elif not conn.handshaken and now - conn.since > hs:
                self._drop(conn, f"no complete handshake within {hs:.3g}s")
            elif not conn.proven and not conn.inbuf and now - conn.since > hs:
                # info: a client's pooled connection may simply sit unused (it reconnects)
                self._drop(conn, f"no request within {hs:.3g}s of connecting (a server "
                                 f"without a token lets a connection prove itself no other way)",
                           gone=True)
            elif (conn.skip or have(conn) < conn.need) and (
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
    def _received(conn: Conn) -> int:
        """Bytes of its current frame ``conn`` has sent (held, or dropped as refused)."""
        return conn.need - conn.skip if conn.skip else have(conn)


def _turn_cut(buf: bytearray) -> int:
    """The length of the front of ``buf`` one turn may serve: its first whole frame, and those
    after it up to ``TURN_REQUESTS`` frames and ``_CUT_BYTES`` bytes (at least a header's worth,
    so the first frame's length is checked)."""
    pos, end = 0, len(buf)
    for _ in range(TURN_REQUESTS):
        if end - pos < 5:
            break
        stop = pos + 5 + w.HEADER.unpack_from(buf, pos)[0]
        if stop > end or (pos and stop > _CUT_BYTES):
            break
        pos = stop
    return pos or min(end, 5)


def _op_name(op: int) -> str:
    try:
        return w.Op(op).name.lower()
    except ValueError:
        return f"command {op}"
