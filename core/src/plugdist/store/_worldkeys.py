"""The keys plugdist keeps in a store, spelled once: a resilient world's membership, the rule
that reserves it, and the other keys of the core (a group's leave barrier, the fault-tolerant
loop's votes, the launcher's and the workers' roots).

A world keeps who is in it under a *root* of its store: the store's top (``env://``,
``tcp://``) or a prefix (plugdist-run's worlds live under :func:`worker_round_root`). Below the
root: the death log (``plugdist/live/deaths``, entries ``.../deaths/<n>``), the agreement and
epoch records (``plugdist/epoch/...``, with each epoch's leave count), the join tickets
(``plugdist/join/...``), ``plugdist/closed``, and the outcomes of the fault-tolerant loop's
votes (``plugdist/ft/...``). :mod:`plugdist._resilience` owns what the membership keys mean,
:mod:`plugdist.parallel.fault_tolerant` the outcomes.

Every key whose name holds one of those segments, at the top or after a ``/``, is *reserved*: a
TCPStore server refuses a plain write to it (set, add, compare_set, append, delete, queues, a
will on it) from every client, and writes such keys only itself (a member's will, a join
ticket) or through the checked operations of a world's members (docs/stores.md, "Who may write
what"). Reads stay open to every client. The launchers' rendezvous rounds (``plugdist/rdzv/``)
are *job keys*: plain keys, written only by connections that hold the job's credential
(:func:`is_job_key`).

What a member may write, and the shape of each value, is :data:`MEMBER_WRITES`; what it may
delete, :data:`MEMBER_DELETE_PREFIXES` (the death log and the join tickets are deleted by the
server alone, when a member's trim record is accepted). They are templates whose
``{fields}`` the key functions below fill and :func:`template_pattern` turns into the
server's checks, so a key renamed here is renamed for the members and the server at once.
"""

from __future__ import annotations

import json
import re

__all__ = [
    "DEATHS", "DECLARED", "HEARTBEATS", "TRIM", "NO_TRIM", "CURRENT", "FORGOTTEN", "JOIN",
    "JOIN_COUNT", "JOIN_DONE", "CLOSED", "LIVE", "EPOCH", "RESERVED_TREES", "RESERVED_NAMES",
    "MEMBERS", "DECISION", "RETRY_DECISION", "GROW", "SEEN", "ARRIVED", "ARRIVAL", "HEARTBEAT",
    "DECLARED_UID", "DEATH", "TICKET", "ADMITTED", "EPOCH_TREE", "LEAVING", "LEFT", "FT",
    "FT_EPOCH_TREE", "FT_BLOCK_TREE", "FT_STEP", "FT_AGREEMENT", "FT_STATE", "MEMBER_WRITES",
    "MEMBER_DELETES", "MEMBER_DELETE_PREFIXES", "member_leaving_key", "member_left_key",
    "template_pattern", "is_reserved", "epoch_key",
    "members_key", "decision_key", "grow_key", "seen_key", "arrived_key", "heartbeat_key",
    "declared_key", "death_key", "ticket_key", "admitted_key", "epoch_prefix", "joiner_uid",
    "group_prefix", "leaving_key", "left_key", "FT_FORGOTTEN", "ft_epoch_prefix", "ft_state_key",
    "ft_step_key", "ft_block_prefix", "ft_vote_key", "worker_round_root",
    "worker_attempt_root", "RDZV", "rdzv_root", "is_job_key", "PAGE_DUMP", "page_status_key",
    "page_ops_key",
]

# ---- a world's membership (reserved) ---------------------------------------------------------

LIVE = "plugdist/live"
EPOCH = "plugdist/epoch"
JOIN = "plugdist/join"
CLOSED = "plugdist/closed"  # set when every member of the last epoch left
FT = "plugdist/ft"  # the fault-tolerant loop's vote outcomes
RESERVED_TREES = (LIVE, EPOCH, JOIN, FT)  # every key below these is reserved, and CLOSED

DEATHS = f"{LIVE}/deaths"
DECLARED = f"{LIVE}/declared"
HEARTBEATS = f"{LIVE}/hb"
# what was deleted so far (see plugdist._resilience.cleanup.trim): the epoch whose first rank
# did it, the death log's entries up to ``log``, the join tickets up to ``tickets``, and
# ``done``: the tickets the next trim may delete
TRIM = f"{LIVE}/trim"
NO_TRIM = json.dumps({"epoch": -1, "log": 0, "tickets": 0, "done": 0})
CURRENT = f"{EPOCH}/current"
FORGOTTEN = f"{EPOCH}/forgotten"  # the epochs up to this one were forgotten
JOIN_COUNT = f"{JOIN}/count"
JOIN_DONE = f"{JOIN}/done"

# templates: a number field ({epoch}, {retry}, {seq}, {n}, {ticket}, {block}, {step},
# {agreement}) holds digits, {uid} a member id (no "/")
EPOCH_TREE = EPOCH + "/{epoch}/"  # every record of one epoch
MEMBERS = EPOCH + "/{epoch}/members"  # the epoch's members, a JSON list of uids
DECISION = EPOCH + "/{epoch}/next"  # what follows the epoch, a JSON object
RETRY_DECISION = EPOCH + "/{epoch}/next/{retry}"  # the same, decided again
GROW = EPOCH + "/{epoch}/grow/{seq}"  # a grow's record, a JSON object
SEEN = EPOCH + "/{epoch}/seen/{uid}"  # the deaths a member had seen, an int
ARRIVED = EPOCH + "/{epoch}/shrink/{retry}/arrived"  # a log (its counter) of arrivals
ARRIVAL = EPOCH + "/{epoch}/shrink/{retry}/arrived/{n}"  # one arrival: a uid
HEARTBEAT = HEARTBEATS + "/{uid}"  # a member's heartbeat counter
DECLARED_UID = DECLARED + "/{uid}"  # a member declared failed
DEATH = DEATHS + "/{n}"  # an entry of the death log
TICKET = JOIN + "/{ticket}"  # a join ticket, written by the server
ADMITTED = JOIN + "/{ticket}/admitted"  # the epoch that admitted a joiner, an int
LEAVING = EPOCH + "/{epoch}/leaving"  # members of the epoch that reached destroy, a counter
LEFT = EPOCH + "/{epoch}/left"  # set once every member of the epoch reached destroy
# the fault-tolerant loop (plugdist.parallel.fault_tolerant): each attempt's outcome, decided
# once ("abort", or "commit" and the sums of the vote's extras as a JSON list)
FT_FORGOTTEN = f"{FT}/forgotten"  # the outcomes of the epochs up to this one were dropped
FT_EPOCH_TREE = FT + "/{epoch}/"  # every outcome of one epoch
FT_BLOCK_TREE = FT + "/{epoch}/step/{block}/"  # the step outcomes of one block of steps
FT_STEP = FT + "/{epoch}/step/{block}/{step}"  # a step's attempt
FT_AGREEMENT = FT + "/{epoch}/step/{block}/{step}/{agreement}"  # an agree() after a step
FT_STATE = FT + "/{epoch}/state"  # the training state's transfer to joiners

# what a member may write under its world's root: the template, and the kind of value it holds,
# each kind one check of the server's (plugdist.store._server.checks says what each allows)
MEMBER_WRITES: tuple[tuple[str, str], ...] = (
    (CURRENT, "current"),
    (FORGOTTEN, "forgotten"),
    (MEMBERS, "members"),
    (DECISION, "decision"),
    (RETRY_DECISION, "decision"),
    (GROW, "grow"),
    (SEEN, "seen"),
    (ARRIVED, "counter"),
    (ARRIVAL, "own_uid"),
    (TRIM, "trim"),
    (HEARTBEAT, "counter"),
    (JOIN_DONE, "join_done"),
    (ADMITTED, "admitted"),
    (LEAVING, "counter"),
    (LEFT, "left"),
    (FT_FORGOTTEN, "forgotten"),
    (FT_STEP, "outcome"),
    (FT_AGREEMENT, "outcome"),
    (FT_STATE, "outcome"),
)
# the single keys a member may delete (none: what a trim forgets, the server deletes)
MEMBER_DELETES: tuple[str, ...] = ()
# the prefixes a member may delete with delete_prefix (an epoch forgotten, a block of outcomes)
MEMBER_DELETE_PREFIXES: tuple[str, ...] = (EPOCH_TREE, FT_EPOCH_TREE, FT_BLOCK_TREE)

_FIELD = re.compile(r"\{(\w+)\}")


def template_pattern(template: str) -> re.Pattern[str]:
    """A pattern matching exactly the keys ``template`` spells, each field a named group: digits
    for the number fields, a member id for ``{uid}``."""
    parts, at = [], 0
    for field in _FIELD.finditer(template):
        parts.append(re.escape(template[at:field.start()]))
        name = field.group(1)
        parts.append(f"(?P<{name}>[^/]+)" if name == "uid" else f"(?P<{name}>\\d+)")
        at = field.end()
    parts.append(re.escape(template[at:]))
    return re.compile("".join(parts))


RESERVED_NAMES = ", ".join(f"{tree}/" for tree in RESERVED_TREES) + f" and {CLOSED}"
_RESERVED = re.compile(
    b"(?:^|/)(?:(?:" + b"|".join(re.escape(t.encode()) for t in RESERVED_TREES)
    + b")(?:/|$)|" + re.escape(CLOSED.encode()) + b"$)")


def is_reserved(key: bytes) -> bool:
    """Whether ``key`` (a full key, with any prefix) belongs to some world's membership."""
    return b"plugdist/" in key and _RESERVED.search(key) is not None


def epoch_key(epoch: int, tail: str) -> str:
    """The key ``tail`` of epoch ``epoch``'s agreement records."""
    return f"{EPOCH}/{epoch}/{tail}"


def members_key(epoch: int) -> str:
    return MEMBERS.format(epoch=epoch)


def decision_key(epoch: int, retry: int = 0) -> str:
    """What follows ``epoch``, as decided at its ``retry``-th attempt."""
    return DECISION.format(epoch=epoch) if retry == 0 \
        else RETRY_DECISION.format(epoch=epoch, retry=retry)


def grow_key(epoch: int, seq: int) -> str:
    return GROW.format(epoch=epoch, seq=seq)


def seen_key(epoch: int, uid: str) -> str:
    return SEEN.format(epoch=epoch, uid=uid)


def arrived_key(epoch: int, retry: int) -> str:
    return ARRIVED.format(epoch=epoch, retry=retry)


def heartbeat_key(uid: str) -> str:
    return HEARTBEAT.format(uid=uid)


def declared_key(uid: str) -> str:
    return DECLARED_UID.format(uid=uid)


def death_key(n: int) -> str:
    return DEATH.format(n=n)


def ticket_key(ticket: int) -> str:
    return TICKET.format(ticket=ticket)


def admitted_key(ticket: int) -> str:
    return ADMITTED.format(ticket=ticket)


def epoch_prefix(epoch: int) -> str:
    return EPOCH_TREE.format(epoch=epoch)


def joiner_uid(ticket: int) -> str:
    """The member id of the joiner holding join ticket ``ticket``."""
    return f"j{ticket}"


# ---- the rest of the core's keys (the members' leave counts and the vote outcomes reserved) ---

def group_prefix(epoch: int, name: str) -> str:
    """Where the groups of ``epoch`` keep their keys in the world's store."""
    return f"plugdist/group/{name}" if epoch == 0 else f"plugdist/egroup/{epoch}/{name}"


def leaving_key(epoch: int) -> str:
    """The counter of a group's ranks that reached destroy_process_group in ``epoch``, where
    the store does not own the world's membership (plain keys); else :func:`member_leaving_key`."""
    return "plugdist/leaving" + ("" if epoch == 0 else f"@{epoch}")


def left_key(epoch: int) -> str:
    """Set once every rank of ``epoch`` reached destroy_process_group (plain keys)."""
    return "plugdist/left" + ("" if epoch == 0 else f"@{epoch}")


def member_leaving_key(epoch: int) -> str:
    """:func:`leaving_key` of a world whose store owns its membership: a member's checked add."""
    return LEAVING.format(epoch=epoch)


def member_left_key(epoch: int) -> str:
    """:func:`left_key` of a world whose store owns its membership: a member's checked set."""
    return LEFT.format(epoch=epoch)


def ft_epoch_prefix(epoch: int) -> str:
    """Every vote outcome of the fault-tolerant loop in ``epoch``."""
    return FT_EPOCH_TREE.format(epoch=epoch)


def ft_state_key(epoch: int) -> str:
    return FT_STATE.format(epoch=epoch)


def ft_block_prefix(epoch: int, block: int) -> str:
    """The step outcomes of one block of steps."""
    return FT_BLOCK_TREE.format(epoch=epoch, block=block)


def ft_step_key(epoch: int, block: int, step: int) -> str:
    return FT_STEP.format(epoch=epoch, block=block, step=step)


def ft_vote_key(epoch: int, block: int, step: int, agreement: int) -> str:
    return FT_AGREEMENT.format(epoch=epoch, block=block, step=step, agreement=agreement)


def worker_round_root(round_: str | int) -> str:
    """The root of plugdist-run's world in its rendezvous round ``round_``."""
    return f"plugdist/worker/round_{round_}"


def worker_attempt_root(attempt: str | int) -> str:
    """The root of a world under torchrun's agent store, in restart ``attempt``."""
    return f"plugdist/worker/attempt_{attempt}"


RDZV = "plugdist/rdzv"  # the launchers' rendezvous rounds: job keys (see is_job_key)
_JOB_KEY = re.compile(b"(?:^|/)" + re.escape(RDZV.encode()) + b"/")


def rdzv_root(run_id: str) -> str:
    """The launcher's rendezvous keys of run ``run_id``."""
    return f"{RDZV}/{run_id}/"


def is_job_key(key: bytes) -> bool:
    """Whether ``key`` is a launcher's rendezvous key (under ``plugdist/rdzv/``, at the top or
    after a ``/``): a TCPStore server takes a plain write to it only from a connection that
    holds the job's credential (its token, or without one the store's Unix user)."""
    return b"plugdist/rdzv/" in key and _JOB_KEY.search(key) is not None


# plugdist-run's live page (--page): what each rank publishes for it, under the world's root
PAGE_DUMP = "plugdist/page/dump"  # a counter: each increment asks every rank for its recent ops


def page_status_key(uid: str) -> str:
    """A rank's status for the live page (a JSON object), under member id ``uid``."""
    return f"plugdist/page/status/{uid}"


def page_ops_key(uid: str) -> str:
    """A rank's answer to the live page's last request for its recent ops (a JSON object)."""
    return f"plugdist/page/ops/{uid}"
