"""The keys of a resilient world's membership, and the rule that reserves them in a store.

A world keeps who is in it under a *root* of its store: the store's top (``env://``,
``tcp://``) or a prefix (plugdist-run's worlds live under ``plugdist/worker/round_<n>/``).
Below the root: the death log (``plugdist/live/deaths``, entries ``.../deaths/<n>``), the
agreement and epoch records (``plugdist/epoch/...``), the join tickets (``plugdist/join/...``)
and ``plugdist/closed``. :mod:`plugdist._resilience` owns what they mean.

Every key whose name holds one of those segments, at the top or after a ``/``, is *reserved*: a
TCPStore server refuses a plain write to it (set, add, compare_set, append, delete, queues, a
will on it) from every client, and writes such keys only itself (a member's will, a join
ticket) or through the checked operations of a world's members (docs/stores.md, "Who may write
what"). Reads stay open to every client.
"""

from __future__ import annotations

import json
import re

__all__ = ["DEATHS", "DECLARED", "HEARTBEATS", "TRIM", "NO_TRIM", "CURRENT", "FORGOTTEN",
           "JOIN", "JOIN_COUNT", "JOIN_DONE", "CLOSED", "epoch_key", "is_reserved",
           "RESERVED_NAMES", "epoch_prefix", "join_ticket", "join_admitted", "group_prefix"]

DEATHS = "plugdist/live/deaths"
DECLARED = "plugdist/live/declared"
HEARTBEATS = "plugdist/live/hb"
# what was deleted so far (see plugdist._resilience.cleanup.trim): the epoch whose first rank
# did it, the death log's entries up to ``log``, the join tickets up to ``tickets``, and
# ``done``: the tickets the next trim may delete
TRIM = "plugdist/live/trim"
NO_TRIM = json.dumps({"epoch": -1, "log": 0, "tickets": 0, "done": 0})
CURRENT = "plugdist/epoch/current"
FORGOTTEN = "plugdist/epoch/forgotten"  # the epochs up to this one were forgotten
JOIN = "plugdist/join"
JOIN_COUNT = "plugdist/join/count"
JOIN_DONE = "plugdist/join/done"
CLOSED = "plugdist/closed"  # set when every member of the last epoch left

RESERVED_NAMES = "plugdist/live/, plugdist/epoch/, plugdist/join/ and plugdist/closed"
_RESERVED = re.compile(rb"(?:^|/)plugdist/(?:(?:live|epoch|join)(?:/|$)|closed$)")


def is_reserved(key: bytes) -> bool:
    """Whether ``key`` (a full key, with any prefix) belongs to some world's membership."""
    return b"plugdist/" in key and _RESERVED.search(key) is not None


def epoch_key(epoch: int, tail: str) -> str:
    """The key ``tail`` of epoch ``epoch``'s agreement records."""
    return f"plugdist/epoch/{epoch}/{tail}"


def epoch_prefix(epoch: int) -> str:
    """The prefix of every agreement record of epoch ``epoch``."""
    return epoch_key(epoch, "")


def join_ticket(n: int) -> str:
    """Join ticket ``n``: the joiner's uid and where it started reading the death log."""
    return f"{JOIN}/{n}"


def join_admitted(n: int) -> str:
    """Set to the epoch that admitted the holder of join ticket ``n``."""
    return f"{JOIN}/{n}/admitted"


def group_prefix(epoch: int, name: str) -> str:
    """Where the groups of ``epoch`` keep their keys in the world's store (not reserved: a
    group's own keys are written by its members' plain operations)."""
    return f"plugdist/group/{name}" if epoch == 0 else f"plugdist/egroup/{epoch}/{name}"
