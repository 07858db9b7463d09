"""How much a store keeps for writers who are not the job's: the strangers' quota.

On a store without a token, every local user reaches a loopback port and may write plain keys
(as with torch's store). Unbounded, that is a way to crash the store's process, and with it
rank 0: values of 32 MiB, one after another, until the host runs out of memory. So the bytes
of plain writes (each key and value: SET, APPEND, COMPARE_SET, MULTI_SET, QUEUE_PUSH, a new
counter, a will's record) from connections not known to hold the job's credential count
against ``TCPStoreLimits.max_stranger_bytes`` together, over the server's life (a deletion
gives nothing back). A write that would pass it makes the server ask whether its connection
holds the credential (:class:`~plugdist.store._server.jobkeys.JobKeys`: the token's
handshake, or without a token the store's own Unix user; one kernel query per connection,
kept): one that does takes its bytes out of the count and is never counted again; any other
is refused, naming the limit and the fix. The job's own processes are therefore never refused
by it, and are asked only once the count is full.

Only the serving thread uses it; nothing blocks but that one kernel query.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from plugdist.store._server.jobkeys import JobKeys
from plugdist.store._server.replies import write_refused

__all__ = ["StrangerQuota"]


class StrangerQuota:
    """``limit``: bytes kept for writers not known to be the job's (see the module docstring);
    ``notice``: the server's rate-limited log."""

    def __init__(self, job_keys: JobKeys, limit: int, notice: Callable[..., None]) -> None:
        self._job_keys = job_keys
        self.limit = limit
        self._notice = notice
        self.counted = 0  # bytes written by connections not known to hold the credential

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
        return write_refused(
            self._notice, "tcp_store_stranger_quota_full", conn, op, key,
            f"this store keeps at most {self.limit} bytes written by processes that are not "
            f"the job's (TCPStoreLimits.max_stranger_bytes), and {conn.job_refusal}; run it as "
            f"the store's own user, or give it the job's token")
