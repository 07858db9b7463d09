"""The TCPStore wire protocol (version 3): constants, frame layout and the encoders both ends share.

Connection start. The server speaks first, then one exchange:

    server -> client  GREETING  magic "PDST", u16 version, u16 flags, 16-byte server nonce
    client -> server  HELLO     magic, u16 version, u16 flags, 16-byte client nonce,
                                32-byte proof
    server -> client  WELCOME   magic, u16 version, u16 status, 32-byte server proof

GREETING flags: ``GREET_TOKEN`` (the server requires a token), ``GREET_BUSY`` (the server is at
its connection limit and closes this connection). HELLO flags: ``FLAG_JOIN`` (count this store as
a worker for ``wait_for_workers``), ``FLAG_PROOF`` (the proof field holds a proof). WELCOME
status: ``HELLO_OK``, ``HELLO_BAD_VERSION`` or ``HELLO_AUTH_FAILED``; after either error the
server closes the connection.

Authentication (when the server has a token): the client's proof is HMAC-SHA256(token,
``CLIENT_LABEL`` + server nonce + client nonce + u16 flags), the server's proof is
HMAC-SHA256(token, ``SERVER_LABEL`` + server nonce + client nonce). The token never crosses the
wire; a fresh server nonce per connection makes a recorded client proof useless on any other
connection, and the client's nonce does the same for a recorded server proof. Without a token
both proof fields are zeros.

Every later message is a frame: ``HEADER`` = u32 body length, u8 code; then the body. A request's
code is an ``Op``; a response's code is a ``Status``. Integers are big-endian; a "blob" (key,
value, message) is a u32 length and that many bytes; timeouts are f64 seconds. Request bodies::

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
    APPEND       blob key, blob value                      -> OK ""
    QUEUE_PUSH   blob key, blob value                      -> OK ""
    QUEUE_POP    f64 timeout, u8 block, blob key           -> OK value | TIMEOUT | QUEUE_EMPTY
    QUEUE_LEN    blob key                                  -> OK i64
    DELETE_PREFIX blob prefix                              -> OK i64 deleted
    WILL         blob key, blob value[, f64 ttl]           -> OK ""
    LOG_READ     f64 timeout, i64 start, blob key          -> OK u32 n, n blobs | TIMEOUT msg
    RENEW        (empty)                                   -> no reply
    WILL_DROP    (empty)                                   -> no reply
    CLAIM        blob root, blob uid, i64 size, f64 ttl    -> OK blob secret | ERROR msg
    JOIN         blob root, f64 ttl                        -> OK i64 ticket, i64 start,
                                                              blob secret | ERROR msg
    MEMBER       blob root, blob uid, blob secret, u8 op,  -> the reply of op | ERROR msg |
                 op's body (keys relative to root; op:        GONE msg
                 SET, ADD, COMPARE_SET, DELETE_KEY, DELETE_PREFIX)
    RECORD       blob root, blob uid, blob secret,         -> OK u8 appended | ERROR msg |
                 blob record (JSON)                           GONE msg

WILL leaves a will on this connection: when the connection closes without WILL_DROP (or a WILL
with an empty key), the server appends ``value`` to the numbered log ``key`` (the counter
``key`` goes up to n, the value lands at ``key/n``). With ``ttl`` > 0 the will also lapses: a
connection that sends no RENEW for ``ttl`` seconds is dropped and its will executed (a stopped
process stops renewing). RENEW and WILL_DROP have no reply and are the only frames the server
reads while a request of the connection is parked, so a holder may renew, or withdraw its will,
while its own LOG_READ waits. LOG_READ parks until ``key/start`` exists, then answers the
consecutive entries ``key/start``, ``key/start+1``, ... present, at most
:data:`LOG_READ_ENTRIES` of them (and 16 MiB): one wake carries a burst of entries, and a reply
of ``LOG_READ_ENTRIES`` entries may have more behind it, which the client reads on.

Worlds (version 3). Keys that :mod:`plugdist.store._worldkeys` reserves for a world's membership
are written only by the server: a plain write to one is answered ERROR. CLAIM makes this
connection the identity ``uid`` (a rank of the world's first epoch, ``size`` ranks) of the world
under ``root`` and leaves its will (the server appends ``{"uid": uid, "cause": "died"}`` to the
world's death log when the connection drops, or lapses as WILL's ttl); the reply's secret is the
credential of that identity's later MEMBER and RECORD requests, which may come on any
connection. JOIN does the same for a process that asks to join: the server takes a ticket
(``uid`` ``j<ticket>``), writes it, and announces it in the death log. MEMBER runs a write on
the world's reserved keys for a current member, after the server checked the credential, the key
and the value; RECORD appends a checked record (a decision, a declared failure, a joiner
leaving) to the death log. Both answer GONE to the credential of an identity whose holder left:
that process was cut off from the store long enough for its will to run, and is out of the
world. The server refuses a claim on an identity another live connection holds, one whose holder
has left, or one that disagrees with the world's size: that is another job's process reaching
this store.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
from collections.abc import Sequence

__all__ = [
    "MAGIC", "VERSION", "GREETING", "HELLO", "WELCOME", "NONCE_SIZE", "PROOF_SIZE", "NO_PROOF",
    "GREET_TOKEN", "GREET_BUSY", "FLAG_JOIN", "FLAG_PROOF", "HELLO_OK", "HELLO_BAD_VERSION",
    "HELLO_AUTH_FAILED", "HEADER", "MAX_FRAME", "Op", "Status", "pack_blobs", "unpack_blobs",
    "request", "client_proof", "server_proof", "CONTROL_OPS", "RENEW_FRAME", "WILL_DROP_FRAME",
]

MAGIC = b"PDST"
VERSION = 3
NONCE_SIZE = 16
PROOF_SIZE = 32
NO_PROOF = bytes(PROOF_SIZE)
GREETING = struct.Struct(f"!4sHH{NONCE_SIZE}s")
HELLO = struct.Struct(f"!4sHH{NONCE_SIZE}s{PROOF_SIZE}s")
WELCOME = struct.Struct(f"!4sHH{PROOF_SIZE}s")
GREET_TOKEN = 1
GREET_BUSY = 2
FLAG_JOIN = 1
FLAG_PROOF = 2
HELLO_OK = 0
HELLO_BAD_VERSION = 1
HELLO_AUTH_FAILED = 2
CLIENT_LABEL = b"plugdist-tcpstore-v3 client"
SERVER_LABEL = b"plugdist-tcpstore-v3 server"

HEADER = struct.Struct("!IB")
MAX_FRAME = 64 * 1024 * 1024
LOG_READ_ENTRIES = 1024  # a LOG_READ reply's most entries: one reply costs the server little

U8 = struct.Struct("!B")
U16 = struct.Struct("!H")
U32 = struct.Struct("!I")
I64 = struct.Struct("!q")
F64 = struct.Struct("!d")
# request headers with their fixed leading fields fused, so a request is one pack + joins
HDR_BLOB = struct.Struct("!IBI")          # header, key length
HDR_F64_BLOB = struct.Struct("!IBdI")     # header, timeout, key length
HDR_I64_BLOB = struct.Struct("!IBqI")     # header, amount, key length
HDR_F64_I64 = struct.Struct("!IBdq")      # header, timeout, count
HDR_F64_U8_BLOB = struct.Struct("!IBdBI")  # header, timeout, block, key length
HDR_F64_I64_BLOB = struct.Struct("!IBdqI")  # header, timeout, start, key length


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
    APPEND = 12
    QUEUE_PUSH = 13
    QUEUE_POP = 14
    QUEUE_LEN = 15
    DELETE_PREFIX = 17  # prefix: delete every key (and queue) starting with it; replies the count
    WILL = 16  # key, value[, ttl]: on this connection's close, log value under key (empty: cancel)
    LOG_READ = 18  # parks until key/start exists; replies the consecutive entries from there
    RENEW = 19  # no reply: renews this connection's will (its ttl starts again)
    WILL_DROP = 20  # no reply: withdraws this connection's will
    CLAIM = 21  # this connection becomes a world's member identity, with its will
    JOIN = 22  # this connection becomes a joiner of a world: a ticket, an identity, its will
    MEMBER = 23  # a member's checked write on its world's reserved keys
    RECORD = 24  # a member's checked record appended to its world's death log
    VOUCH = 25  # root, uid, credential: this connection is a member's (its client holds one)
    LOG_APPEND = 26  # in MEMBER only: key, value: the log's counter up to n, value at key/n


# frames the server reads while a request of the connection is parked (they have no reply)
CONTROL_OPS = frozenset((Op.RENEW, Op.WILL_DROP))


class Status(enum.IntEnum):
    OK = 0
    ERROR = 1
    TIMEOUT = 2
    QUEUE_EMPTY = 3
    GONE = 4  # MEMBER/RECORD with the credential of an identity whose holder left


RENEW_FRAME = HEADER.pack(0, Op.RENEW)
WILL_DROP_FRAME = HEADER.pack(0, Op.WILL_DROP)


def client_proof(token: bytes, server_nonce: bytes, client_nonce: bytes, flags: int) -> bytes:
    """What a client sends to prove it knows ``token`` (see the module docstring)."""
    msg = CLIENT_LABEL + server_nonce + client_nonce + U16.pack(flags)
    return hmac.new(token, msg, hashlib.sha256).digest()


def server_proof(token: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """What the server sends back to prove it knows ``token`` too."""
    return hmac.new(token, SERVER_LABEL + server_nonce + client_nonce, hashlib.sha256).digest()


def pack_blobs(blobs: Sequence[bytes]) -> bytes:
    """u32 count then each blob length-prefixed."""
    parts = [U32.pack(len(blobs))]
    for b in blobs:
        parts.append(U32.pack(len(b)))
        parts.append(b)
    return b"".join(parts)


def read_blob(buf: bytes | bytearray | memoryview, pos: int, end: int) -> tuple[bytes, int]:
    """The blob at ``buf[pos:end]`` and where the next field starts; raises ValueError when it
    runs past ``end``."""
    if pos + 4 > end:
        raise ValueError("truncated length")
    (n,) = U32.unpack_from(buf, pos)
    stop = pos + 4 + n
    if stop > end:
        raise ValueError("field runs past the frame")
    return bytes(buf[pos + 4:stop]), stop


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
