"""The TCPStore wire protocol (version 1): constants, frame layout and the encoders both ends share.

Connection start (both directions, 8 bytes): ``PREAMBLE`` = magic ``b"PDST"``, u16 version,
u16 flags. The client sends its version and flags (``FLAG_JOIN``: count me as a worker); the server
answers with its own version and a status in the flags field (``HELLO_OK`` or
``HELLO_BAD_VERSION``) and closes the connection on a mismatch.

Every later message is a frame: ``HEADER`` = u32 body length, u8 code; then the body. A request's
code is an ``Op``; a response's code is a ``Status``. Integers are big-endian; a "blob" (key,
value, message) is a u32 length and that many bytes; timeouts are f64 seconds. A body longer than
``MAX_FRAME`` is refused. Request bodies::

    SET          blob key, blob value                     -> OK ""
    GET          f64 timeout, blob key                     -> OK value | TIMEOUT msg
    ADD          i64 amount, blob key                      -> OK i64 | ERROR msg
    COMPARE_SET  blob key, blob expected, blob desired     -> OK value
    WAIT         f64 timeout, u32 n, n blobs               -> OK "" | TIMEOUT msg
    CHECK        u32 n, n blobs                            -> OK u8
    NUM_KEYS     (empty)                                   -> OK i64
    DELETE_KEY   blob key                                  -> OK u8
    MULTI_GET    f64 timeout, u32 n, n blobs               -> OK u32 n, n blobs | TIMEOUT msg
    MULTI_SET    u32 n, n x (blob key, blob value)         -> OK ""
    WAIT_WORKERS f64 timeout, i64 count                    -> OK i64 joined | TIMEOUT msg
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence

__all__ = [
    "MAGIC", "VERSION", "PREAMBLE", "FLAG_JOIN", "HELLO_OK", "HELLO_BAD_VERSION", "HEADER",
    "MAX_FRAME", "Op", "Status", "pack_blobs", "unpack_blobs", "request",
]

MAGIC = b"PDST"
VERSION = 1
PREAMBLE = struct.Struct("!4sHH")
FLAG_JOIN = 1
HELLO_OK = 0
HELLO_BAD_VERSION = 1

HEADER = struct.Struct("!IB")
MAX_FRAME = 64 * 1024 * 1024

U8 = struct.Struct("!B")
U32 = struct.Struct("!I")
I64 = struct.Struct("!q")
F64 = struct.Struct("!d")
# request headers with their fixed leading fields fused, so a request is one pack + joins
HDR_BLOB = struct.Struct("!IBI")          # header, key length
HDR_F64_BLOB = struct.Struct("!IBdI")     # header, timeout, key length
HDR_I64_BLOB = struct.Struct("!IBqI")     # header, amount, key length
HDR_F64_I64 = struct.Struct("!IBdq")      # header, timeout, count


class Op(enum.IntEnum):
    SET = 1
    GET = 2
    ADD = 3
    COMPARE_SET = 4
    WAIT = 5
    CHECK = 6
    NUM_KEYS = 7
    DELETE_KEY = 8
    MULTI_GET = 9
    MULTI_SET = 10
    WAIT_WORKERS = 11


class Status(enum.IntEnum):
    OK = 0
    ERROR = 1
    TIMEOUT = 2


def pack_blobs(blobs: Sequence[bytes]) -> bytes:
    """u32 count then each blob length-prefixed."""
    parts = [U32.pack(len(blobs))]
    for b in blobs:
        parts.append(U32.pack(len(b)))
        parts.append(b)
    return b"".join(parts)


def unpack_blobs(buf: bytes | bytearray | memoryview, pos: int,
                 end: int) -> tuple[list[bytes], int]:
    """Inverse of ``pack_blobs`` reading ``buf[pos:end]``; raises ValueError on a malformed body."""
    if pos + 4 > end:
        raise ValueError("truncated blob count")
    (n,) = U32.unpack_from(buf, pos)
    pos += 4
    if n > (end - pos) // 4:
        raise ValueError(f"blob count {n} does not fit the frame")
    out = []
    for _ in range(n):
        if pos + 4 > end:
            raise ValueError("truncated blob length")
        (ln,) = U32.unpack_from(buf, pos)
        pos += 4
        if pos + ln > end:
            raise ValueError("blob runs past the frame")
        out.append(bytes(buf[pos:pos + ln]))
        pos += ln
    return out, pos


def request(op: Op, body: bytes) -> bytes:
    """A whole request frame for ``op`` with a pre-built ``body``."""
    return HEADER.pack(len(body), op) + body
