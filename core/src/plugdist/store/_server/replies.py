"""The reply frames the key space and the worlds answer with, and the small conversions of
request fields they share. Pure functions and constants; no state, safe from any thread."""

from __future__ import annotations

from plugdist.store import _wire as w

__all__ = ["MAX_TIMEOUT", "OK_EMPTY", "name", "ok", "pack_blob", "reply", "seconds",
           "whole_seconds"]

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


def pack_blob(data: bytes) -> bytes:
    return w.U32.pack(len(data)) + data


OK_EMPTY = ok(b"")
