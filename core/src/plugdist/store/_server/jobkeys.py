"""Who may write the launchers' rendezvous rounds: the job keys (``plugdist/rdzv/...``).

A round's keys decide who is in the world (``closed``), where its workers meet (``master``),
why it ended (``outcome``, ``failure``) and who is alive (``hb/<node>``). They are plain keys,
but a write to one (set, add, compare_set, append, delete, a multi-set, a queue, a will) is
taken only from a connection that holds the job's credential: the same test a claim passes
(:class:`~plugdist.store._server.peers.Admission`: the token's handshake, or without a token the
store's own Unix user, or a peer on another host of a store whose tokens were turned off).
A ``delete_prefix`` from any other connection leaves the job keys alone. Reads stay open: they
hold addresses and counts, no secret.

The answer is asked once per connection (one kernel query without a token) and kept on it.
Only the serving thread uses this.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from plugdist.store._server.replies import write_refused

__all__ = ["JobKeys"]

_WHAT = ("act as the job (write its launchers' rounds, send large requests, store more than "
         "a stranger's share)")


class JobKeys:
    """``admission(conn, what)``: None when ``conn`` holds the job's credential, else why not;
    ``notice``: the server's rate-limited log."""

    def __init__(self, admission: Callable[[Any, str], str | None],
                 notice: Callable[..., None]) -> None:
        self._admission = admission
        self._notice = notice

    def may_write(self, conn: Any) -> bool:
        """Whether ``conn`` holds the job's credential (asked once per connection)."""
        why = conn.job_refusal
        if why is None:
            why = conn.job_refusal = self._admission(conn, _WHAT) or ""
        return not why

    def refusal(self, conn: Any, op: str, key: bytes) -> bytes | None:
        """None when ``conn`` may ``op`` the job key ``key``, else the ERROR reply (logged)."""
        if self.may_write(conn):
            return None
        return write_refused(
            self._notice, "tcp_store_job_key_write_refused", conn, op, key,
            f"keys under plugdist/rdzv/ are the launcher's rendezvous rounds, written only by "
            f"the job's own processes, and {conn.job_refusal}")
