"""Requests served a slice a turn: one of many keys is read, and a reply of many values packed
or many pairs written, ``SLICE_KEYS`` keys per turn of the server's loop, so a request of
131,072 keys (about 60 ms of Python) does not hold every other client that long.

Only the serving thread uses them; nothing here blocks. The server steps a :class:`Sliced`
once a turn (:mod:`plugdist.store._server.turns`) and finishes the ones that must be finished
(a MULTI_SET's writes) even when their client left first.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

from plugdist.store import _wire as w
from plugdist.store._server.replies import OK_EMPTY, Blobs, Reply

__all__ = ["SLICE_KEYS", "KeysRead", "Sliced", "ValuesRead", "ValuesWritten"]

# a request naming more keys than this is read this many keys a turn of the server's loop
SLICE_KEYS = 1024  # even: a MULTI_SET's slices hold whole pairs


class Space(Protocol):
    """What slices need of the key space and its waiters."""

    def value(self, key: bytes) -> bytes | None: ...
    def reply_too_big(self, op: str, n: int, size: int) -> bytes | None: ...
    def put_all(self, values: dict[bytes, bytes]) -> None: ...
    def discard(self, items: list[bytes]) -> None: ...
    def wait_again(self, conn: Any, keys: list[bytes],
                   timeout: float) -> Reply | None | Sliced: ...


class Sliced:
    """A request served a slice a turn: the server calls :meth:`step` once a turn of its loop
    until it returns the reply (bytes, or None when the request was parked, as
    :meth:`Commands.handle <plugdist.store._server.commands.Commands.handle>` does), serving the
    other clients in between."""

    __slots__ = ()
    must_finish = False  # True: finished even when its client leaves first

    def step(self) -> Reply | None | Sliced:
        """The next slice's work: the reply once done, else a :class:`Sliced` (``self`` or what
        follows it) to step at the next turn. Raises ValueError for a malformed body."""
        raise NotImplementedError

    def abandon(self) -> None:
        """Its client left before it was done: let go of what it holds, a slice a turn."""


class KeysRead(Sliced):
    """A request of many keys (blobs), read ``SLICE_KEYS`` at a time. Each slice is looked at
    as it is read (``each``, whose falsy result stops the reading early: a CHECK whose key is
    missing, a MULTI_SET pair refused); ``finish(kept)`` makes the reply from the slices kept
    (``keep``)."""

    __slots__ = ("space", "buf", "pos", "end", "left", "keys", "each", "finish", "keep",
                 "must_finish")

    def __init__(self, space: Space, buf: bytes, pos: int, end: int, n: int,
                 each: Callable[[list[bytes]], bool] | None,
                 finish: Callable[[list[bytes]], Reply | None | Sliced],
                 keep: bool = False, must_finish: bool = False) -> None:
        self.space, self.must_finish = space, must_finish
        self.buf, self.pos, self.end, self.left = buf, pos, end, n
        self.keys: list[bytes] = []  # the slices read, kept for ``finish`` when ``keep``
        self.each, self.finish, self.keep = each, finish, keep

    def step(self) -> Reply | None | Sliced:
        buf, pos, end, unpack = self.buf, self.pos, self.end, w.U32.unpack_from
        take = min(self.left, SLICE_KEYS)
        part = []
        for _ in range(take):
            if pos + 4 > end:
                raise ValueError("truncated blob length")
            (ln,) = unpack(buf, pos)
            pos += 4
            if pos + ln > end:
                raise ValueError("blob runs past the frame")
            part.append(buf[pos:pos + ln])
            pos += ln
        self.pos, self.left = pos, self.left - take
        if self.each is not None and not self.each(part):
            self.left = 0
        elif self.keep:
            self.keys.extend(part)
        if self.left:
            return self
        self.buf = b""
        return self.finish(self.keys)

    def abandon(self) -> None:
        self.space.discard(self.keys)


class ValuesRead(Sliced):
    """A MULTI_GET of many keys whose every key was present: its values taken ``SLICE_KEYS``
    keys a turn, each slice's values at one instant, and sent as they are stored (never
    copied). A key deleted before its slice is read sends the request back to waiting (with
    what is left of its timeout); a reply that grows past the server's reply limit is
    refused."""

    __slots__ = ("space", "conn", "keys", "deadline", "done", "blobs", "size")

    def __init__(self, space: Space, conn: Any, keys: list[bytes], deadline: float) -> None:
        self.space, self.conn, self.keys, self.deadline = space, conn, keys, deadline
        self.done = 0
        self.blobs = Blobs(len(keys))
        self.size = 4 + 4 * len(keys)  # the reply's body so far, with the blobs' lengths

    def step(self) -> Reply | None | Sliced:
        stop = self.done + SLICE_KEYS
        keys = self.keys[self.done:stop]
        values = [v for v in map(self.space.value, keys) if v is not None]
        if len(values) < len(keys):
            left = self.deadline - time.monotonic()
            return self.space.wait_again(self.conn, self.keys, left)
        self.size += sum(map(len, values))
        refusal = self.space.reply_too_big("multi_get", len(self.keys), self.size)
        if refusal:  # found before the values are packed, a slice at a time
            self.abandon()
            return refusal
        self.blobs.add(values)
        self.done = stop
        if stop < len(self.keys):
            return self
        self.space.discard(self.keys)
        return self.blobs.reply()

    def abandon(self) -> None:
        self.space.discard(self.keys)


class ValuesWritten(Sliced):
    """A MULTI_SET of many pairs, all checked: written ``SLICE_KEYS`` pairs a turn, in order,
    each slice at one instant. ``step`` until it returns the reply; the server finishes the
    writes of a client that left meanwhile (no MULTI_SET is left half written)."""

    __slots__ = ("space", "items", "done")
    must_finish = True

    def __init__(self, space: Space, items: list[bytes]) -> None:
        self.space, self.items, self.done = space, items, 0

    def step(self) -> Reply | Sliced:
        items, stop = self.items, self.done + 2 * SLICE_KEYS
        self.space.put_all(dict(zip(items[self.done:stop:2], items[self.done + 1:stop:2],
                                    strict=True)))
        self.done = stop
        if stop < len(items):
            return self
        self.space.discard(items)
        return OK_EMPTY
