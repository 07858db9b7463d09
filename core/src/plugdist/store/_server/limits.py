"""The TCPStore server's bounds: :class:`TCPStoreLimits` (what one client may cost the
others), the process's open-file limit the server fits its connections into, and the rate
limit of its warnings (:class:`Throttle`).

Only the serving thread logs through a :class:`Throttle`; :func:`raise_fd_limit` runs once, in
the thread that starts the server. Nothing here blocks.
"""

from __future__ import annotations

import dataclasses
import resource
import time
from datetime import timedelta
from typing import Any

from plugdist.store import _wire as w

__all__ = ["FD_RESERVE", "TCPStoreLimits", "Throttle", "raise_fd_limit"]


@dataclasses.dataclass(frozen=True)
class TCPStoreLimits:
    """Per-server bounds that keep one client from hurting the others.

    ``max_frame_bytes``: the largest request body (a larger announced length drops the client).
    ``max_keys_per_request``: keys of one CHECK, WAIT, MULTI_GET or MULTI_SET (more: refused
    with an error, the connection kept). ``max_value_bytes``: one value (a SET's, an APPEND's
    result, ...; more: refused). ``handshake_timeout``: a new connection must prove itself
    within this time: finish its handshake, and, on a server without a token (where the
    handshake proves nothing), send its first request. ``frame_timeout`` and
    ``min_frame_bytes_per_second``: a frame must arrive whole within ``frame_timeout`` plus its
    size at that pace, counted from its first byte, and, once ``frame_timeout`` has passed,
    must have come at least at that pace on average (a trickle cannot keep it alive, nor a
    frame sent in part and then left to sit).
    ``max_partial_bytes``: bytes of partly received frames held across all connections; past
    it, the connections whose frames came slowest (bytes per second since their first byte)
    are dropped until the rest fit. ``max_connections``: connections beyond
    it are told so (the client retries, then
    raises DistNetworkError saying so) and closed, with one log line per second; the server
    also caps it to the process's open-file limit (less 256), which it raises towards it
    first, and its log line then names that limit (a member of a resilient world holds three
    connections, the flight recorder's watcher's among them: 16,384 ranks need about 50,000).
    ``max_parked_inbound_bytes``: bytes a client may send while its blocking request is parked
    (one request at a time is the protocol; more drops it). ``max_unread_reply_bytes``: when a
    client's unread replies pass this, the server stops reading its requests until it reads.
    ``max_reply_bytes``: one reply's body (a MULTI_GET's values together; more: refused with an
    error naming it, before anything is packed); at most the frame limit a client reads.
    Replies of large values refer to the stored values (no copy), so what a client leaves
    unread costs the server its share of this limit, not new memory.
    ``max_guests_per_address``, ``guest_idle_timeout``: a *guest* is a connection that has not
    shown it belongs to the job (the token's proof, a member identity it holds, or a member's
    credential its client vouched with); a new connection from an address that already has
    this many guests, or one that finds the server at ``max_connections``, displaces a guest
    (of that address; of all): among the oldest, the one idle longest that is not waiting in
    a parked request, if any, else the oldest; a guest that sends nothing for
    ``guest_idle_timeout`` is dropped (the client opens another when it needs one).
    Members' connections are never displaced.
    ``max_stranger_bytes``: bytes of plain writes (keys and values, and what each entry costs
    the server beyond them) the server takes, over its life, from connections not known to
    hold the job's credential (on a tokenless store, other local users' processes), and bytes
    of keys their parked requests hold at once; past it, such a write or request is refused,
    naming the limit. A connection that holds the credential (the token's proof, or the
    store's own Unix user) is never refused by it (see :mod:`plugdist.store._server.quota`).
    """

    max_frame_bytes: int = w.MAX_FRAME
    max_keys_per_request: int = 131072
    max_value_bytes: int = 32 * 1024 * 1024
    handshake_timeout: timedelta = timedelta(seconds=10)
    frame_timeout: timedelta = timedelta(seconds=5)
    min_frame_bytes_per_second: int = 4 * 1024 * 1024
    max_partial_bytes: int = 128 * 1024 * 1024
    max_connections: int = 65536
    max_parked_inbound_bytes: int = 64 * 1024
    max_unread_reply_bytes: int = 1024 * 1024
    max_reply_bytes: int = w.MAX_FRAME
    max_guests_per_address: int = 32768
    guest_idle_timeout: timedelta = timedelta(seconds=60)
    max_stranger_bytes: int = 256 * 1024 * 1024

    def __post_init__(self) -> None:
        if not self.max_value_bytes + 64 <= self.max_reply_bytes <= w.MAX_FRAME:
            raise ValueError(f"TCPStoreLimits.max_reply_bytes={self.max_reply_bytes} must hold "
                             f"one value (max_value_bytes={self.max_value_bytes}, plus 64) and "
                             f"be at most the protocol's frame limit {w.MAX_FRAME}")


_LOG_BURST = 10  # lines of one warning logged at once before the rate limit applies
_LOG_EVERY = 10.0  # seconds between lines of one warning past the burst


class Throttle:
    """Rate-limited log lines: per event and level, ``_LOG_BURST`` lines, then one per
    ``_LOG_EVERY`` seconds; a line held back is counted, and the next line of that event (or,
    when none comes, the last one held, logged by :meth:`flush` once its turn comes) carries
    ``suppressed``, how many were held back since the last line."""

    def __init__(self, log: Any) -> None:
        self._log = log
        self._tokens: dict[str, float] = {}
        self._stamp: dict[str, float] = {}
        self._held: dict[str, tuple[int, str, dict[str, Any]]] = {}

    def __call__(self, event: str, level: str = "warning", **fields: Any) -> None:
        now = time.monotonic()
        kind = f"{level}:{event}"  # a client that simply went away never silences a warning
        tokens = min(float(_LOG_BURST), self._tokens.get(kind, float(_LOG_BURST))
                     + (now - self._stamp.get(kind, now)) / _LOG_EVERY)
        self._stamp[kind] = now
        self._tokens[kind] = tokens
        if tokens < 1.0:
            count = self._held.get(kind, (0, "", {}))[0] + 1
            self._held[kind] = (count, event, fields)
            return
        self._emit(kind, event, fields)

    def _emit(self, kind: str, event: str, fields: dict[str, Any]) -> None:
        self._tokens[kind] -= 1.0
        held = self._held.pop(kind, None)
        if held:
            fields = {**fields, "suppressed": held[0] - (held[2] is fields)}
        getattr(self._log, kind.partition(":")[0])(event, **fields)

    def next_flush(self) -> float | None:
        """When :meth:`flush` has a held line to log (monotonic seconds), or None."""
        if not self._held:
            return None
        return min(self._stamp[e] + (1.0 - self._tokens[e]) * _LOG_EVERY for e in self._held)

    def flush(self, now: float) -> None:
        """Log the last line held back of each event whose turn has come."""
        for kind, (_, event, fields) in list(self._held.items()):
            tokens = self._tokens[kind] + (now - self._stamp[kind]) / _LOG_EVERY
            if tokens >= 1.0:
                self._tokens[kind], self._stamp[kind] = min(float(_LOG_BURST), tokens), now
                self._emit(kind, event, fields)



# descriptors the process keeps for everything but the server's clients (its own files, the
# master's client connections, a backend's sockets)
FD_RESERVE = 256


def raise_fd_limit(want: int) -> int:
    """Raise this process's open-file soft limit towards ``want`` (up to the hard limit; many
    distributions default the soft one to 1024) and return the soft limit now in force."""
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = want if hard == resource.RLIM_INFINITY else min(want, hard)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ValueError, OSError):
        return want
    return want if soft == resource.RLIM_INFINITY else int(soft)
