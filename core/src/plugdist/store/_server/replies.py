"""The reply frames the key space and the worlds answer with, and the small conversions of
request fields they share. Pure functions and constants; no state, safe from any thread."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from plugdist.store import _wire as w

__all__ = ["MAX_TIMEOUT", "OK_EMPTY", "Blobs", "Parts", "Reply", "name", "ok", "ok_value",
           "write_refused",
           "ok_values", "pack_blob", "reply", "seconds", "whole_seconds"]

MAX_TIMEOUT = 1e7  # seconds; longer ones are clamped (the deadline heap needs finite numbers)


def seconds(timeout: float) -> float:
    """A timeout from the wire: NaN is malformed; the rest is clamped to [0, ~115 days]."""
    if timeout != timeout:
        raise ValueError("timeout is NaN")
    return min(max(timeout, 0.0), MAX_TIMEOUT)


def whole_seconds(secs: float) -> int:
    return max(int(secs + 0.999), 0)


def name(key: bytes) -> str:
    """A key as a log line or an error message shows it."""
    return key.decode(errors="replace")


def reply(status: w.Status, body: bytes) -> bytes:
    """A reply frame of ``status`` carrying ``body``."""
    return w.HEADER.pack(len(body), status) + body


def ok(body: bytes) -> bytes:
    """An OK reply frame carrying ``body``."""
    return w.HEADER.pack(len(body), 0) + body


# a reply whose values together pass this is sent in parts that refer to the stored values
# (no copy: a stranger's MULTI_GET naming one large value many times costs no memory)
_JOIN_BELOW = 64 * 1024
_REFER_FROM = 4096  # a value this large is one part of its own; smaller ones are joined


class Parts(list[bytes]):
    """A reply frame in pieces, the header first, sent as they are (``sendmsg``) and never
    joined: its values are the stored ones, not copies."""

    __slots__ = ("size",)

    def __init__(self, parts: list[bytes], size: int) -> None:
        super().__init__(parts)
        self.size = size  # bytes in all


Reply = bytes | Parts


def ok_value(value: bytes) -> Reply:
    """An OK reply frame carrying ``value``, in parts when it is large."""
    if len(value) < _JOIN_BELOW:
        return w.HEADER.pack(len(value), 0) + value
    return Parts([w.HEADER.pack(len(value), 0), value], 5 + len(value))


def ok_values(values: list[bytes]) -> Reply:
    """An OK reply frame carrying ``values`` as blobs (a MULTI_GET's), in parts when large."""
    size = 4 + 4 * len(values) + sum(map(len, values))
    if size < _JOIN_BELOW:
        return ok(w.pack_blobs(values))
    blobs = Blobs(len(values))
    blobs.add(values)
    return blobs.reply()


class Blobs:
    """The body of a reply of ``n`` blobs, added a few at a time (a slice a turn): large
    values become parts of their own (referred to, not copied), the small pieces between them
    are joined. :meth:`reply` makes the frame once all ``n`` were added."""

    __slots__ = ("parts", "small", "size")

    def __init__(self, n: int) -> None:
        self.parts: list[bytes] = []
        self.small = [w.U32.pack(n)]
        self.size = 4

    def add(self, values: list[bytes]) -> None:
        pack, small, parts = w.U32.pack, self.small, self.parts
        for v in values:
            small.append(pack(len(v)))
            if len(v) < _REFER_FROM:
                small.append(v)
            else:
                parts.append(b"".join(small))
                parts.append(v)
                small.clear()
            self.size += 4 + len(v)

    def reply(self) -> Reply:
        if self.small:
            self.parts.append(b"".join(self.small))
            self.small = []
        if self.size < _JOIN_BELOW:
            return ok(b"".join(self.parts))
        return Parts([w.HEADER.pack(self.size, 0), *self.parts], 5 + self.size)


def pack_blob(data: bytes) -> bytes:
    return w.U32.pack(len(data)) + data


OK_EMPTY = ok(b"")


def write_refused(notice: Callable[..., None], event: str, conn: Any, op: str, key: bytes,
                  why: str) -> bytes:
    """The ERROR reply to a write ``op`` on ``key`` that a rule refuses (``why``), logged
    (rate-limited) as ``event`` with the peer, op and key."""
    shown = name(key)[:200]
    notice(event, peer=getattr(conn, "peer", "?"), op=op, key=shown)
    return reply(w.Status.ERROR, f"{op}({shown!r}) refused: {why}".encode())
