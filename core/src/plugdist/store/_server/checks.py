"""What a member's write may hold: the TCPStore server's checks of the keys and values that
members write on their world's reserved keys (:mod:`plugdist.store._server.worlds` runs them
after it has checked the writer's credential).

Every key a member writes has one *kind* (:data:`plugdist.store._worldkeys.MEMBER_WRITES`);
each kind is one check here. A check runs only when the write would change the key: a
compare_set that finds another value is answered with that value, as it was checked when it
was written. What each kind allows, where *E* is the epoch the key names and *members(E)* its
members record (epoch 0: the ranks of the first claim):

- ``current``: an epoch with a members record, not below the current one, that the writer is in.
- ``forgotten``: -1, or an epoch at least two before the current one.
- ``members`` (the record of epoch E): distinct ids, the writer among them, each a member of
  epoch E-1 or a joiner with a ticket that no record admitted yet.
- ``decision``: written by a member of E; ``excluded`` and ``members`` name members of E only,
  and not the writer.
- ``grow``: written by a member of E; every joiner named has a ticket (``[n, "j<n>"]``) and was
  not admitted yet; ``done`` is at most the tickets taken.
- ``seen``: the writer's own mark, at most the death log's length.
- ``own_uid`` (a shrink's arrival): the writer's own id, by a member of E.
- ``counter`` (by add, 1 at a time): an arrival log and a leave count by members of E, a
  member's own heartbeat; a leave count never passes the size of E.
- ``left``: by a member of E, once the leave count of E reached its size.
- ``join_done``: never down, never past the tickets taken.
- ``admitted``: an epoch, for a ticket that was taken.
- ``trim``: a later epoch than the last trim's, with the writer in it, never backwards; the
  death log trimmed only up to what every member of E had read on entering E-1 and what every
  joiner still waiting needs. The server then deletes the trimmed entries and tickets itself:
  no member deletes or overwrites a death record.
- ``outcome`` (the fault-tolerant loop's): written once, by a member of E: ``abort``, or
  ``commit`` with at most 8 finite, non-negative sums. The server cannot see the vote itself
  (an all_reduce between the members), so it cannot check that a ``commit`` follows one that
  every member completed: that rests on the members' own code, as any write inside a member's
  rights does.

Only the serving thread uses it; nothing blocks.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Collection, Iterator
from typing import Any, Protocol

from plugdist.store import _wire as w
from plugdist.store._worldkeys import (
    CURRENT,
    DEATHS,
    JOIN_COUNT,
    JOIN_DONE,
    MEMBER_DELETE_PREFIXES,
    MEMBER_WRITES,
    NO_TRIM,
    admitted_key,
    death_key,
    joiner_uid,
    member_leaving_key,
    seen_key,
    template_pattern,
    ticket_key,
)

__all__ = ["Refused", "FirstRanks", "Roster", "WorldRecords", "KeyReader", "kind_of",
           "check_value", "check_add", "check_delete_prefix", "apply_trim", "check_uids",
           "members_of"]

_KEYS: list[tuple[re.Pattern[str], str]] = [
    (template_pattern(template), kind) for template, kind in MEMBER_WRITES]
_PREFIXES = [template_pattern(template) for template in MEMBER_DELETE_PREFIXES]
_MAX_SUMS = 8


class Refused(Exception):
    """A world operation refused; its message is the ERROR reply."""

    status = w.Status.ERROR


class FirstRanks(Collection[str]):
    """The members of a world's first epoch, ranks ``"0"`` to ``str(size - 1)``, without
    building them: every check of a world of 16,384 ranks asks whether one uid is among them,
    and must not cost 16,384 strings."""

    __slots__ = ("size",)

    def __init__(self, size: int) -> None:
        self.size = size

    def __contains__(self, uid: object) -> bool:
        return isinstance(uid, str) and uid.isascii() and uid.isdigit() \
            and str(int(uid)) == uid and int(uid) < self.size

    def __iter__(self) -> Iterator[str]:
        return (str(r) for r in range(self.size))

    def __len__(self) -> int:
        return self.size


class Roster(Collection[str]):
    """An epoch's members as a members record lists them, in its order, with a set beside
    the list: every checked write asks whether its writer is a member, in O(1)."""

    __slots__ = ("_order", "_set")

    def __init__(self, uids: list[str]) -> None:
        self._order = list(uids)
        self._set = frozenset(self._order)

    def __contains__(self, uid: object) -> bool:
        return uid in self._set

    def __iter__(self) -> Iterator[str]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)


class WorldRecords(Protocol):
    """What the checks read of a world (``worlds._World``)."""

    root: bytes
    size: int
    members: dict[int, Roster]
    admitted: set[str]
    held: dict[str, Any]


class KeyReader(Protocol):
    def value(self, key: bytes) -> bytes | None: ...
    def delete(self, key: bytes) -> bool: ...


def kind_of(rel: str, counter: bool) -> tuple[str, dict[str, str]]:
    """The kind of ``rel``, a key a member may write (by add when ``counter``), and its fields."""
    for pattern, kind in _KEYS:
        match = pattern.fullmatch(rel)
        if match is not None:
            if (kind == "counter") != counter:
                break
            return kind, match.groupdict()
    raise Refused(f"{rel!r} is not a key a member writes this way")


def members_of(world: WorldRecords, epoch: int) -> Collection[str] | None:
    """The members of ``epoch`` as recorded (epoch 0: the first claim's ranks), or None."""
    members = world.members.get(epoch)
    if members is None and epoch == 0:
        return FirstRanks(world.size)
    return members


def _member_of(world: WorldRecords, uid: str, epoch: int) -> Collection[str]:
    members = members_of(world, epoch)
    if members is None:
        raise Refused(f"epoch {epoch} has no members record")
    if uid not in members:
        raise Refused(f"member {uid} is not in epoch {epoch}, so it does not write its records")
    return members


def _int(value: bytes | None, what: str) -> int:
    if value is None:
        raise Refused(f"{what} does not exist")
    text = value.decode("ascii", errors="replace").strip()
    if not re.fullmatch(r"-?\d{1,19}", text):
        raise Refused(f"{what}: {value[:40]!r} is not an integer")
    return int(text)


def _stored(world: WorldRecords, keys: KeyReader, key: str, default: int = 0) -> int:
    """A number the world keeps (the server's or a checked write's); ``default`` if absent or
    unreadable (never raises: a check refuses, it does not fail)."""
    raw = keys.value(world.root + key.encode())
    try:
        return int(raw) if raw is not None else default
    except ValueError:
        return default


def _json(value: bytes, what: str) -> Any:
    try:
        return json.loads(value)
    except (ValueError, RecursionError) as e:  # RecursionError: nested past the parser's depth
        raise Refused(f"{what}: a malformed value ({type(e).__name__})") from None


def check_uids(world: WorldRecords, keys: KeyReader, uids: Any) -> list[str]:
    """``uids`` must be a list of distinct identities the world knows: ranks of its first
    epoch, or joiners with a ticket."""
    if not isinstance(uids, list) or not all(isinstance(u, str) for u in uids) \
            or len(set(uids)) != len(uids):
        raise Refused("a members list must be distinct member ids (strings)")
    tickets = _stored(world, keys, JOIN_COUNT)
    for u in uids:
        if u.isdigit() and int(u) < world.size:
            continue
        if u.startswith("j") and u[1:].isdigit() and 0 < int(u[1:]) <= tickets:
            continue
        raise Refused(f"{u!r} is not a member of this world (ranks 0..{world.size - 1} "
                      f"and joiners j1..j{tickets} are)")
    return list(uids)


def check_value(world: WorldRecords, keys: KeyReader, uid: str, rel: str, kind: str,
                fields: dict[str, str], value: bytes, before: bytes | None) -> None:
    """Refuse ``value`` for ``rel`` (of ``kind``, with ``fields``) from member ``uid``, the
    key holding ``before``; see the module docstring for what each kind allows."""
    _VALUE_CHECKS[kind](world, keys, uid, fields, value, before)


def _current(world: WorldRecords, keys: KeyReader, uid: str, fields: dict[str, str],
             value: bytes, before: bytes | None) -> None:
    epoch = _int(value, CURRENT)
    if epoch == 0 and before in (None, b"0"):
        return
    if epoch not in world.members:
        raise Refused(f"epoch {epoch} has no members record; it cannot be current")
    if epoch < _stored(world, keys, CURRENT):
        raise Refused(f"epoch {epoch} is older than the current one")
    _member_of(world, uid, epoch)


def _forgotten(world: WorldRecords, keys: KeyReader, uid: str, fields: dict[str, str],
               value: bytes, before: bytes | None) -> None:
    epoch = _int(value, "a forgotten mark")
    if epoch != -1 and epoch > _stored(world, keys, CURRENT) - 2:
        raise Refused(f"epoch {epoch} may still be read; only the epochs two before the current "
                      f"one are forgotten")


def _members(world: WorldRecords, keys: KeyReader, uid: str, fields: dict[str, str],
             value: bytes, before: bytes | None) -> None:
    epoch = int(fields["epoch"])
    new = check_uids(world, keys, _json(value, "a members record"))
    if uid not in new:
        raise Refused(f"a members record of epoch {epoch} without its writer {uid}")
    previous = members_of(world, epoch - 1) if epoch > 0 else None
    if previous is None:
        raise Refused(f"epoch {epoch - 1} has no members record; epoch {epoch} cannot follow it")
    if uid not in previous:
        raise Refused(f"member {uid} is not in epoch {epoch - 1}, so it does not decide the next")
    strangers = [u for u in new if u not in previous and (u.isdigit() or u in world.admitted)]
    if strangers:
        raise Refused(f"{strangers} are neither members of epoch {epoch - 1} nor joiners "
                      f"waiting to be admitted")


def _decision(world: WorldRecords, keys: KeyReader, uid: str, fields: dict[str, str],
              value: bytes, before: bytes | None) -> None:
    epoch = int(fields["epoch"])
    members = _member_of(world, uid, epoch)
    record = _json(value, "a decision")
    if not isinstance(record, dict) or not ({"excluded", "members"} & record.keys()):
        raise Refused("a decision is a JSON object with 'excluded' or 'members'")
    for field in ("excluded", "members"):
        if field in record:
            named = check_uids(world, keys, record[field])
            outside = [u for u in named if u not in members]
            if outside:
                raise Refused(f"a decision of epoch {epoch} names {outside}, who are not its "
                              f"members")
    if uid in record.get("excluded", ()) or \
            ("members" in record and uid not in record["members"]):
        raise Refused(f"member {uid} may not decide to leave itself out; it leaves by ending")


def _grow(world: WorldRecords, keys: KeyReader, uid: str, fields: dict[str, str],
          value: bytes, before: bytes | None) -> None:
    _member_of(world, uid, int(fields["epoch"]))
    record = _json(value, "a grow record")
    if not isinstance(record, dict) or not isinstance(record.get("joiners"), list):
        raise Refused("a grow record is a JSON object with 'joiners' and 'done'")
    count = _stored(world, keys, JOIN_COUNT)
    for entry in record["joiners"]:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], int)
                and entry[1] == joiner_uid(entry[0])):
            raise Refused(f"a grow names joiners as [ticket, 'j<ticket>'], not {entry!r}")
        if not 0 < entry[0] <= count or \
                keys.value(world.root + ticket_key(entry[0]).encode()) is None:
            raise Refused(f"{entry[1]} has no join ticket")
        if entry[1] in world.admitted:
            raise Refused(f"{entry[1]} was admitted already; a grow names waiting joiners only")
    done = record.get("done")
    if not isinstance(done, int) or not 0 <= done <= count:
        raise Refused(f"a grow's 'done' must be a ticket taken (0..{count}), not {done!r}")


def _seen(world: WorldRecords, keys: KeyReader, uid: str, fields: dict[str, str],
          value: bytes, before: bytes | None) -> None:
    if fields["uid"] != uid:
        raise Refused(f"member {uid} writes its own seen mark only, not {fields['uid']}'s")
    mark = _int(value, "a seen mark")
    if not 0 <= mark <= _stored(world, keys, DEATHS):
        raise Refused(f"a seen mark of {mark}: the death log has "
                      f"{_stored(world, keys, DEATHS)} entries")


def _own_uid(world: WorldRecords, keys: KeyReader, uid: str, fields: dict[str, str],
             value: bytes, before: bytes | None) -> None:
    _member_of(world, uid, int(fields["epoch"]))
    if value != uid.encode():
        raise Refused(f"member {uid} arrives as itself only")


def _left(world: WorldRecords, keys: KeyReader, uid: str, fields: dict[str, str],
          value: bytes, before: bytes | None) -> None:
    epoch = int(fields["epoch"])
    members = _member_of(world, uid, epoch)
    leaving = _stored(world, keys, member_leaving_key(epoch))
    if leaving < len(members):
        raise Refused(f"{leaving} of the {len(members)} members of epoch {epoch} are leaving; "
                      f"it is left once they all are")


def _join_done(world: WorldRecords, keys: KeyReader, uid: str, fields: dict[str, str],
               value: bytes, before: bytes | None) -> None:
    done, count = _int(value, JOIN_DONE), _stored(world, keys, JOIN_COUNT)
    if not _stored(world, keys, JOIN_DONE) <= done <= count:
        raise Refused(f"join tickets done up to {done}: {count} were taken, and it never goes "
                      f"down")


def _admitted(world: WorldRecords, keys: KeyReader, uid: str, fields: dict[str, str],
              value: bytes, before: bytes | None) -> None:
    if int(fields["ticket"]) > _stored(world, keys, JOIN_COUNT):
        raise Refused(f"ticket {fields['ticket']} was not taken")
    if _int(value, "an admitting epoch") < 1:
        raise Refused("a joiner is admitted into an epoch after the first")


def _trim(world: WorldRecords, keys: KeyReader, uid: str, fields: dict[str, str],
          value: bytes, before: bytes | None) -> None:
    old, new = _trim_record(before or NO_TRIM.encode()), _trim_record(value)
    epoch = new["epoch"]
    members = _member_of(world, uid, epoch)
    if not old["epoch"] < epoch <= _stored(world, keys, CURRENT):
        raise Refused(f"a trim at epoch {epoch}: the last was at {old['epoch']}, the current "
                      f"epoch is {_stored(world, keys, CURRENT)}")
    if not old["log"] <= new["log"] <= _stored(world, keys, DEATHS):
        raise Refused(f"a trim of the death log up to {new['log']}: it was trimmed up to "
                      f"{old['log']} and has {_stored(world, keys, DEATHS)} entries")
    if new["log"] > old["log"]:
        floor = _read_by_all(world, keys, members, epoch)
        if new["log"] > floor:
            raise Refused(f"a trim of the death log up to {new['log']}: a member or a waiting "
                          f"joiner still needs the entries after {floor}")
    if not old["tickets"] <= new["tickets"] <= old["done"] <= new["done"] \
            <= _stored(world, keys, JOIN_DONE):
        raise Refused(f"a trim's tickets ({new['tickets']}, done {new['done']}) must follow the "
                      f"last one's ({old['tickets']}, done {old['done']}) and the tickets done "
                      f"({_stored(world, keys, JOIN_DONE)})")


def _trim_record(raw: bytes) -> dict[str, int]:
    record = _json(raw, "a trim record")
    fields = ("epoch", "log", "tickets", "done")
    if not isinstance(record, dict) or not all(isinstance(record.get(f), int) for f in fields):
        raise Refused(f"a trim record is a JSON object of integers {list(fields)}")
    return {f: record[f] for f in fields}


def _read_by_all(world: WorldRecords, keys: KeyReader, members: Collection[str],
                 epoch: int) -> int:
    """How far every member of ``epoch`` had read the death log on entering the epoch before,
    and every joiner still waiting started reading it."""
    floor = None
    for u in members:
        mark = keys.value(world.root + seen_key(epoch - 1, u).encode())
        if mark is None:
            raise Refused(f"member {u} of epoch {epoch} had not entered epoch {epoch - 1}; "
                          f"nothing is trimmed until a later epoch")
        floor = _int(mark, "a seen mark") if floor is None else min(floor, _int(mark, "a mark"))
    for u in world.held:
        if u.startswith("j") and u not in world.admitted:
            ticket = keys.value(world.root + ticket_key(int(u[1:])).encode())
            try:
                start = int(json.loads(ticket)["start"]) if ticket is not None else 0
            except (ValueError, TypeError, KeyError):
                start = 0
            floor = start if floor is None else min(floor, start)
    return floor or 0


def apply_trim(world: WorldRecords, keys: KeyReader, before: bytes | None,
               value: bytes) -> None:
    """A trim record was written over ``before``: delete the death log's entries and the join
    tickets (with their admissions) it trimmed."""
    old, new = _trim_record(before or NO_TRIM.encode()), _trim_record(value)
    root = world.root
    for n in range(old["log"] + 1, new["log"] + 1):
        keys.delete(root + death_key(n).encode())
    for n in range(old["tickets"] + 1, new["tickets"] + 1):
        keys.delete(root + ticket_key(n).encode())
        keys.delete(root + admitted_key(n).encode())


def _outcome(world: WorldRecords, keys: KeyReader, uid: str, fields: dict[str, str],
             value: bytes, before: bytes | None) -> None:
    _member_of(world, uid, int(fields["epoch"]))
    if before is not None:
        raise Refused("an outcome is decided once: it is never overwritten")
    if value == b"abort":
        return
    if not value.startswith(b"commit "):
        raise Refused(f"an outcome is 'abort' or 'commit [sums]', not {value[:40]!r}")
    sums = _json(value[len(b"commit "):], "an outcome's sums")
    if not isinstance(sums, list) or len(sums) > _MAX_SUMS or not all(
            isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s)
            and s >= 0 for s in sums):
        raise Refused(f"an outcome's sums are at most {_MAX_SUMS} finite non-negative numbers")


_VALUE_CHECKS: dict[str, Callable[..., None]] = {
    "current": _current, "forgotten": _forgotten, "members": _members, "decision": _decision,
    "grow": _grow, "seen": _seen, "own_uid": _own_uid, "left": _left, "join_done": _join_done,
    "admitted": _admitted, "trim": _trim, "outcome": _outcome,
}


def check_add(world: WorldRecords, keys: KeyReader, uid: str, rel: str,
              fields: dict[str, str], amount: int) -> None:
    """Refuse member ``uid``'s add of ``amount`` to the counter ``rel`` (with ``fields``)."""
    if amount != 1:
        raise Refused(f"a member's counters count by 1, not {amount}")
    if "uid" in fields:
        if fields["uid"] != uid:
            raise Refused(f"member {uid} beats its own heartbeat only, not {fields['uid']}'s")
        return
    epoch = int(fields["epoch"])
    members = _member_of(world, uid, epoch)
    if rel == member_leaving_key(epoch) and _stored(world, keys, rel) >= len(members):
        raise Refused(f"every member of epoch {epoch} is leaving already")


def check_delete_prefix(world: WorldRecords, keys: KeyReader, uid: str, rel: str) -> bool:
    """Whether member ``uid`` deletes the reserved keys under ``rel`` too (a tree of an epoch
    two before the current one, or a block of vote outcomes of an epoch it is in); refuses
    another reserved prefix. A prefix that names no reserved tree deletes plain keys only."""
    for pattern in _PREFIXES:
        match = pattern.fullmatch(rel)
        if match is None:
            continue
        epoch = int(match.group("epoch"))
        if "block" in match.groupdict():
            _member_of(world, uid, epoch)
        elif epoch > _stored(world, keys, CURRENT) - 2:
            raise Refused(f"epoch {epoch}'s records may still be read; a member forgets only "
                          f"the epochs two before the current one")
        return True
    return False

