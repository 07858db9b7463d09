"""How much a store keeps for writers who are not the job's: the strangers' quota.

On a store without a token, every local user reaches a loopback port and may write plain keys
(as with torch's store). Unbounded, that is a way to crash the store's process, and with it
rank 0: values of 32 MiB, one after another, until the host runs out of memory. So the bytes of
plain writes (each key and value: SET, APPEND, COMPARE_SET, MULTI_SET, QUEUE_PUSH, a new
counter, a will's record), each with :data:`ENTRY_OVERHEAD` bytes for the entry that holds it
(and :data:`QUEUE_OVERHEAD` more for a new queue), from connections not known to hold the job's
credential count against ``TCPStoreLimits.max_stranger_bytes`` together, over the server's life
(a deletion gives nothing back). A write that would pass it makes the server ask whether its
connection holds the credential (:class:`~plugdist.store._server.jobkeys.JobKeys`: the token's
handshake, or without a token the store's own Unix user; one kernel query per connection,
kept): one that does takes its bytes out of the count and is never counted again; any other is
refused, naming the limit and the fix. The job's own processes are therefore never refused by
it, and are asked only once the count is full.

The same limit bounds what such connections' parked requests hold at once (a WAIT of 131,072
long keys is 32 MiB, kept until its keys exist or its timeout passes, and a stranger may open
thousands of connections): the bytes of their keys, each with :data:`ENTRY_OVERHEAD`, count
while they are parked and are given back when each is answered or forgotten; past the limit,
a stranger's request is refused instead of parked.

And such a connection's requests are small: at most :data:`STRANGER_REQUEST_BYTES` bytes and
``SLICE_KEYS`` keys each (a larger one asks for the credential first, and a stranger's is
refused; a frame that announces more is answered at once and its bytes dropped as they come).
So a stranger's request is read, run and forgotten within one turn of the serving loop, never
held across turns while it is read in slices: what it holds is bounded by the partial-frame
limit while it arrives and by this quota once parked.

Only the serving thread uses it; nothing blocks but that one kernel query.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from plugdist.store import _wire as w
from plugdist.store._server.jobkeys import JobKeys
from plugdist.store._server.replies import reply, write_refused
from plugdist.store._server.sliced import SLICE_KEYS

__all__ = ["ENTRY_OVERHEAD", "QUEUE_OVERHEAD", "StrangerQuota", "STRANGER_REQUEST_BYTES"]

STRANGER_REQUEST_BYTES = 1024 * 1024  # one request of a connection not known to be the job's
# bytes a stored key, queue entry or parked key costs beyond its own bytes (its bytes object's
# header, its dict, deque or list slot): a key of 8 bytes with an empty value takes ~90 bytes
# in CPython, so a quota of key and value bytes alone let tiny keys take 11 times the limit
ENTRY_OVERHEAD = 96
# what a new queue costs beyond its first entry: its deque (760 bytes empty)
QUEUE_OVERHEAD = 768


class StrangerQuota:
    """``limit``: bytes kept for writers not known to be the job's (see the module docstring);
    ``notice``: the server's rate-limited log."""

    def __init__(self, job_keys: JobKeys, limit: int, notice: Callable[..., None]) -> None:
        self._job_keys = job_keys
        self.limit = limit
        self._notice = notice
        self.counted = 0  # bytes written by connections not known to hold the credential
        self.parked = 0  # bytes their parked requests hold now

    def charge(self, conn: Any, op: str, key: bytes, size: int) -> bytes | None:
        """Count a plain write of ``size`` bytes from ``conn``: None when it may write them,
        else the ERROR reply (logged)."""
        if conn.job_refusal == "":  # known to hold the credential
            return None
        if self.counted + size <= self.limit:
            self.counted += size
            conn.counted += size
            return None
        if self._job_keys.may_write(conn):
            self.counted -= conn.counted
            conn.counted = 0
            return None
        return write_refused(  # the message names the fix
            self._notice, "tcp_store_stranger_quota_full", conn, op, key,
            f"this store keeps at most {self.limit} bytes written by processes that are not "
            f"the job's (TCPStoreLimits.max_stranger_bytes), and {conn.job_refusal}; run it as "
            f"the store's own user, or give it the job's token")

    def hold(self, conn: Any, size: int) -> bool:
        """Whether ``conn`` may park a request holding ``size`` bytes: the parked requests of
        connections not known to hold the credential hold at most ``limit`` bytes at once
        (counted until each is answered or forgotten: :meth:`release`)."""
        if conn.job_refusal == "":
            return True
        if self.parked + size <= self.limit:
            self.parked += size
            return True
        return self._job_keys.may_write(conn)

    def release(self, size: int) -> None:
        """A counted parked request of ``size`` bytes was answered or forgotten."""
        self.parked -= size

    def request_refusal(self, conn: Any, op: str, size: int, keys: int = 0) -> bytes | None:
        """The ERROR reply to a request of ``size`` bytes naming ``keys`` keys from ``conn``
        when it is larger than a stranger's may be and ``conn`` is not the job's; else None."""
        if (size <= STRANGER_REQUEST_BYTES and keys <= SLICE_KEYS) or conn.job_refusal == "" \
                or self._job_keys.may_write(conn):
            return None
        return reply(w.Status.ERROR, (
            f"{op} refused: a request of {size} bytes and {keys} keys; processes that are not "
            f"the job's send at most {STRANGER_REQUEST_BYTES} bytes and {SLICE_KEYS} keys per "
            f"request, and {conn.job_refusal}").encode())
