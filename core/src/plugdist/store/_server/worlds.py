"""The TCPStore server's worlds: who holds which member identity, and the checked writes of
members on their world's reserved keys (:mod:`plugdist.store._worldkeys`).

A world is named by its root (the key prefix its membership lives under). Its identities are
connections: CLAIM makes a connection rank ``uid`` of the world's first epoch, JOIN makes it a
joiner ``j<ticket>``; each carries the identity's will, which the server runs itself (the death
log gets ``{"uid": uid, "cause": "died"}``) when the connection drops or its ttl lapses. An
identity is held once: a second claim while its holder lives, a claim on an identity whose
holder has left, and a claim that disagrees with the world's size are refused, with a message
that says what holds the identity (its holder's address, when it claimed, live or left). Only
a connection that shows the job's credential may claim or join
(:class:`~plugdist.store._server.peers.Admission`: the token's handshake, or without a token the
store's own Unix user), and an identity's will always has a ttl of at least
:data:`MIN_IDENTITY_TTL`. A credential (a random secret returned to the holder) lets the
holder's other connections act for it.

Members (the world's first-epoch ranks, and the joiners a members record admitted) write the
agreement and epoch records, their leave counts and the fault-tolerant loop's vote outcomes
through MEMBER (a numbered log's next entry, as a shrink's arrival, in one LOG_APPEND checked
as its two writes would be), which checks the credential, then the key and the value
(:mod:`plugdist.store._server.checks`), and append decisions and declared failures through
RECORD. The server alone writes the death log (its counter and its ``died`` and ``joining``
entries; it deletes the entries a member's accepted trim record forgets), the join tickets and
``closed`` (when every member of the current epoch has left). Only the serving thread uses it;
nothing here blocks.
"""

from __future__ import annotations

import hmac
import json
import secrets
import struct
import time
from collections.abc import Callable, Collection
from typing import Any, Protocol

from plugdist.store import _wire as w
from plugdist.store._server import checks
from plugdist.store._server.checks import Refused as _Refused
from plugdist.store._server.replies import ok as _ok
from plugdist.store._server.replies import pack_blob as _pack_blob
from plugdist.store._wire import read_blob as _blob
from plugdist.store._worldkeys import (
    CLOSED,
    CURRENT,
    DEATHS,
    JOIN_COUNT,
    JOIN_DONE,
    NO_TRIM,
    RESERVED_TREES,
    TRIM,
    joiner_uid,
    ticket_key,
)

__all__ = ["MIN_IDENTITY_TTL", "Worlds"]

MIN_IDENTITY_TTL = 1.0  # seconds: an identity's will lapses when its renewals stop, ttl 0 too

_I64_I64 = struct.Struct("!qq")
_I64_F64 = struct.Struct("!qd")
_I64_U32 = struct.Struct("!qI")

_DECLARING = frozenset(("excluded", "reported", "hung"))
_MAX_RECORD = 64 * 1024


class KeyPrimitives(Protocol):
    """What the worlds need of the key space (:class:`~plugdist.store._server.keyspace.KeySpace`,
    which owns them): its writes, each waking whoever waits on the key."""

    def value(self, key: bytes) -> bytes | None: ...
    def put(self, key: bytes, value: bytes) -> None: ...
    def add_to(self, key: bytes, amount: int) -> int | bytes: ...
    def compare_set(self, key: bytes, expected: bytes, desired: bytes) -> bytes: ...
    def delete(self, key: bytes) -> bool: ...
    def delete_prefix(self, prefix: bytes, reserved_too: bool) -> int: ...
    def append_entry(self, log: bytes, value: bytes) -> int: ...
    def read_counter(self, key: bytes) -> bytes: ...
    def arm(self, conn: Any, ttl: float) -> None: ...
    def flush_wills(self) -> None: ...


class _Gone(_Refused):
    """A member's write with the credential of an identity whose holder left (the server ran
    its will): the writer is no longer in the world; answered GONE."""

    status = w.Status.GONE


class _World:
    """One world's identities. ``size``: ranks of its first epoch (0 until the first claim)."""

    __slots__ = ("root", "size", "held", "secrets", "left", "admitted", "declared", "members",
                 "claims")

    def __init__(self, root: bytes) -> None:
        self.root = root
        self.size = 0
        self.held: dict[str, Any] = {}        # uid -> the connection holding it
        self.secrets: dict[str, bytes] = {}   # uid -> its credential (while held)
        self.left: set[str] = set()           # uids whose holder left (died or withdrew)
        self.admitted: set[str] = set()       # joiners some members record named
        self.declared: set[str] = set()       # uids a member declared failed (once each)
        self.members: dict[int, checks.Roster] = {}  # epoch -> its members, as recorded
        self.claims: dict[str, tuple[str, float]] = {}  # uid -> (holder's peer, when it took it)

    def where(self) -> str:
        return f"the world at {self.root.decode(errors='replace')!r}" if self.root else \
            "this store's world"

    def holder(self, uid: str) -> str:
        """Who took ``uid``, when, and whether it still holds it."""
        peer, since = self.claims.get(uid, ("an unknown address", 0.0))
        stamp = time.strftime("%H:%M:%S UTC", time.gmtime(since)) if since else "an unknown time"
        ago = f", {time.time() - since:.0f}s ago" if since else ""
        state = "live" if uid in self.held else "it has left since"
        return f"taken by a connection from {peer} at {stamp}{ago} ({state})"


class Worlds:
    """Every world of one server's key space (see the module docstring)."""

    def __init__(self, keys: KeyPrimitives, notice: Callable[..., None],
                 admission: Callable[[Any, str], str | None] | None = None) -> None:
        self._keys = keys
        self._notice = notice
        self._admission = admission  # why a connection may not claim/join (None: it may)
        self._worlds: dict[bytes, _World] = {}

    # ---- identities --------------------------------------------------------------------------

    def _world(self, root: bytes, afresh_if_closed: bool = False) -> _World:
        """The world under ``root``, made (with its control keys) when there is none, or, with
        ``afresh_if_closed``, when every member of the last one left (a process that builds a
        world again on the same store: nobody needs the old one's membership any more).
        Raises _Refused for a root that breaks :func:`check_root`'s rule."""
        check_root(root)
        world = self._worlds.get(root)
        if world is not None and afresh_if_closed \
                and self._keys.value(root + CLOSED.encode()) is not None:
            self._keys.flush_wills()  # the last world's deaths land in its own log
            for name in (*(f"{tree}/" for tree in RESERVED_TREES), CLOSED):
                self._keys.delete_prefix(root + name.encode(), reserved_too=True)
            world = None
        if world is None:
            world = self._worlds[root] = _World(root)
            keys = self._keys
            for key, value in ((CURRENT, b"0"), (JOIN_COUNT, b"0"), (JOIN_DONE, b"0"),
                               (TRIM, NO_TRIM.encode())):
                if keys.value(root + key.encode()) is None:
                    keys.put(root + key.encode(), value)
        return world

    def _current(self, world: _World) -> tuple[int, Collection[str]]:
        raw = self._keys.value(world.root + CURRENT.encode())
        try:
            epoch = int(raw) if raw else 0
        except ValueError:  # only members' checked writes reach it; never raise for it
            self._notice("tcp_store_world_unreadable", root=_name(world.root),
                         key=CURRENT, value=_name(raw or b"")[:64])
            epoch = 0
        return epoch, checks.members_of(world, epoch) or ()

    def _hold(self, conn: Any, world: _World, uid: str, ttl: float) -> bytes:
        if not ttl >= MIN_IDENTITY_TTL:  # NaN too
            ttl = MIN_IDENTITY_TTL
        secret = secrets.token_bytes(16)
        world.held[uid] = conn
        world.secrets[uid] = secret
        world.claims[uid] = (getattr(conn, "peer", "?"), time.time())
        conn.identity = (world, uid)
        conn.will = (world.root + DEATHS.encode(),
                     json.dumps({"uid": uid, "cause": "died"}).encode())
        self._keys.arm(conn, ttl)
        return secret

    def op_claim(self, conn: Any, buf: bytes, pos: int, end: int) -> bytes:
        root, pos = _blob(buf, pos, end)
        uid_b, pos = _blob(buf, pos, end)
        size, ttl = _I64_F64.unpack_from(buf, pos)
        uid = uid_b.decode()
        try:
            self._check_free(conn)
            check_root(root)  # a malformed request is refused for what it is, first
            self._check_credential(conn, "claim")
            if size < 1 or not (uid.isascii() and uid.isdigit()) or uid != str(int(uid)) \
                    or int(uid) >= size:  # one spelling per rank: "01" or "\u0661" is not "1"
                raise _Refused(f"claim of member {uid!r} in a world of {size} ranks: the rank is "
                               f"out of range")
            world = self._world(root, afresh_if_closed=True)
            self._check_claim(conn, world, uid, size)
        except _Refused as e:
            return self._refuse(conn, "claim", str(e))
        world.size = size
        return _ok(_pack_blob(self._hold(conn, world, uid, ttl)))

    def _check_free(self, conn: Any) -> None:
        if getattr(conn, "identity", None) is not None or conn.will is not None:
            raise _Refused("this connection already holds a will or an identity; each identity "
                           "needs a connection of its own")

    def _check_credential(self, conn: Any, op: str) -> None:
        why = self._admission(conn, op) if self._admission is not None else None
        if why is not None:
            raise _Refused(why)

    def _check_claim(self, conn: Any, world: _World, uid: str, size: int) -> None:
        stray = ("two processes of this job were given the same RANK, or another job of yours "
                 "uses this store's port: check MASTER_PORT")
        if world.size and size != world.size:
            first = next(iter(world.claims), None)
            by = f": rank {first} {world.holder(first)}" if first is not None else ""
            raise _Refused(f"{world.where()} has {world.size} ranks{by}; this process says its "
                           f"world has {size} (WORLD_SIZE). Check WORLD_SIZE, or: {stray}")
        if uid in world.held:
            raise _Refused(f"member {uid} of {world.where()} is held by another live process, "
                           f"{world.holder(uid)}: {stray}")
        if uid in world.left:
            raise _Refused(f"member {uid} of {world.where()} already left it ({world.holder(uid)}"
                           f"; its process ended, or it was excluded); a process can come back "
                           f"only as a new member, with init_process_group(join=True). Or: "
                           f"{stray}")
        epoch, members = self._current(world)
        if epoch > 0 and uid not in members:
            raise _Refused(f"{world.where()} is at epoch {epoch} and rank {uid} of its first "
                           f"epoch is not in it; a process can come back only as a new member, "
                           f"with init_process_group(join=True). Or: {stray}")

    def op_join(self, conn: Any, buf: bytes, pos: int, end: int) -> bytes:
        root, pos = _blob(buf, pos, end)
        (ttl,) = w.F64.unpack_from(buf, pos)
        try:
            self._check_free(conn)
            check_root(root)  # a malformed request is refused for what it is, first
            self._check_credential(conn, "join")
            world = self._world(root)
        except _Refused as e:
            return self._refuse(conn, "join", str(e))
        keys = self._keys
        ticket = keys.add_to(root + JOIN_COUNT.encode(), 1)
        assert isinstance(ticket, int)  # the server alone writes the counter
        uid = joiner_uid(ticket)
        start = int(keys.value(root + DEATHS.encode()) or 0)
        keys.put(root + ticket_key(ticket).encode(),
                 json.dumps({"uid": uid, "start": start}).encode())
        secret = self._hold(conn, world, uid, ttl)
        keys.append_entry(root + DEATHS.encode(), json.dumps(
            {"uid": uid, "cause": "joining", "ticket": ticket}).encode())
        return _ok(_I64_I64.pack(ticket, start) + _pack_blob(secret))

    def released(self, conn: Any) -> None:
        """``conn``, which held an identity, closed (its will, if still left, is being run):
        the identity is gone for good. When every member of the current epoch has left, the
        world is closed (``plugdist/closed``: joiners stop waiting)."""
        world, uid = conn.identity
        conn.identity = None
        if world.held.get(uid) is conn:
            del world.held[uid]
            world.secrets.pop(uid, None)
        world.left.add(uid)
        epoch, members = self._current(world)  # total: an unreadable epoch reads as 0
        # counted first: every release runs this, and a world of 16,384 ranks is still whole
        if members and len(world.left) >= len(members) and all(u in world.left for u in members):
            key = world.root + CLOSED.encode()
            if self._keys.value(key) is None:
                self._keys.put(key, str(epoch).encode())

    def op_vouch(self, conn: Any, buf: bytes, pos: int, end: int) -> bytes:
        """VOUCH: root, uid, credential. OK when the credential is a live identity's of that
        world: ``conn`` is then that member's client's (the server trusts it)."""
        try:
            self._member(conn, buf, pos, end, admitted=False)
        except _Refused as e:
            return self._refuse(conn, "vouch", str(e), e.status)
        return _ok(b"")

    # ---- members' checked writes -------------------------------------------------------------

    def _member(self, conn: Any, buf: bytes, pos: int, end: int,
                admitted: bool = True) -> tuple[_World, str, int]:
        """The world and uid a credential proves, and where the request's own body starts."""
        root, pos = _blob(buf, pos, end)
        uid_b, pos = _blob(buf, pos, end)
        secret, pos = _blob(buf, pos, end)
        check_root(root)
        uid = uid_b.decode(errors="replace")
        world = self._worlds.get(root)
        held = world.secrets.get(uid) if world is not None else None
        if world is not None and held is None and uid in world.left:
            raise _Gone(f"member {uid!r} is no longer in {world.where()}: its identity's holder "
                        f"left (its connection to the store dropped, or its will lapsed), and "
                        f"the store wrote its death")
        if world is None or held is None or not hmac.compare_digest(held, secret):
            raise _Refused(f"member {uid!r} holds no identity in this world with that credential "
                           f"(its holder left, or this is not one of the world's processes)")
        if admitted and not (uid.isdigit() or uid in world.admitted):
            raise _Refused(f"joiner {uid} is not a member yet: the members admit it first")
        return world, uid, pos

    def op_member(self, conn: Any, buf: bytes, pos: int, end: int) -> bytes:
        keys = self._keys
        try:
            world, uid, pos = self._member(conn, buf, pos, end)
            op = buf[pos]
            pos += 1
            root = world.root
            if op == w.Op.ADD:
                amount, kl = _I64_U32.unpack_from(buf, pos)
                rel = _rel(bytes(buf[pos + 12:pos + 12 + kl]))
                if amount == 0:
                    return keys.read_counter(root + rel.encode())
                kind, fields = checks.kind_of(rel, counter=True)
                checks.check_add(world, keys, uid, rel, fields, amount)
                total = keys.add_to(root + rel.encode(), amount)
                return total if isinstance(total, bytes) else _ok(w.I64.pack(total))
            if op == w.Op.LOG_APPEND:
                key_b, pos = _blob(buf, pos, end)
                value, _ = _blob(buf, pos, end)
                return self._append_log(world, uid, _rel(key_b), value)
            if op in (w.Op.SET, w.Op.COMPARE_SET):
                key_b, pos = _blob(buf, pos, end)
                rel = _rel(key_b)
                expected = b""
                if op == w.Op.COMPARE_SET:
                    expected, pos = _blob(buf, pos, end)
                value, _ = _blob(buf, pos, end)
                kind, fields = checks.kind_of(rel, counter=False)
                key = root + rel.encode()
                before = keys.value(key)
                if op == w.Op.COMPARE_SET and not _would_set(before, expected):
                    # answered with what the key holds, checked when it was written
                    return _ok(keys.compare_set(key, expected, value))
                if op == w.Op.SET and kind == "outcome":
                    raise _Refused("an outcome is decided once, by compare_set")
                checks.check_value(world, keys, uid, rel, kind, fields, value, before)
                if op == w.Op.SET:
                    keys.put(key, value)
                else:
                    keys.compare_set(key, expected, value)
                if kind == "members":
                    self._admit(world, int(fields["epoch"]), value)
                elif kind == "trim":
                    checks.apply_trim(world, keys, before, value)
                return _ok(b"" if op == w.Op.SET else value)
            if op == w.Op.DELETE_KEY:
                key_b, _ = _blob(buf, pos, end)
                raise _Refused(f"{_rel(key_b)!r}: a member deletes no single key of its world "
                               f"(the server deletes what a trim forgets)")
            if op == w.Op.DELETE_PREFIX:
                prefix_b, _ = _blob(buf, pos, end)
                rel = _rel(prefix_b)
                reserved = checks.check_delete_prefix(world, keys, uid, rel)
                return _ok(w.I64.pack(keys.delete_prefix(root + rel.encode(), reserved)))
            raise _Refused(f"command {op} is not a member's write")
        except _Refused as e:
            return self._refuse(conn, "member write", str(e), e.status)

    def _append_log(self, world: _World, uid: str, rel: str, value: bytes) -> bytes:
        """A member's append to the numbered log ``rel``: checked as its two writes would be
        (the counter's add of 1, then the entry's set), done as one."""
        keys = self._keys
        kind, fields = checks.kind_of(rel, counter=True)
        checks.check_add(world, keys, uid, rel, fields, 1)
        counter = world.root + rel.encode()
        count = keys.value(counter) or b"0"
        try:
            n = int(count) + 1
        except ValueError:
            raise _Refused(f"{rel!r} is not a log's counter ({count[:40]!r})") from None
        entry_rel = f"{rel}/{n}"
        entry_kind, entry_fields = checks.kind_of(entry_rel, counter=False)
        entry = world.root + entry_rel.encode()
        checks.check_value(world, keys, uid, entry_rel, entry_kind, entry_fields, value,
                           keys.value(entry))
        keys.add_to(counter, 1)
        keys.put(entry, value)
        return _ok(w.I64.pack(n))

    def _admit(self, world: _World, epoch: int, value: bytes) -> None:
        """A members record was written: its joiners are members from now on."""
        members = checks.Roster(json.loads(value))
        world.members[epoch] = members
        world.admitted.update(u for u in members if not u.isdigit())

    def op_record(self, conn: Any, buf: bytes, pos: int, end: int) -> bytes:
        try:
            world, uid, pos = self._member(conn, buf, pos, end, admitted=False)
            raw, _ = _blob(buf, pos, end)
            if len(raw) > _MAX_RECORD:
                raise _Refused(f"a record of {len(raw)} bytes (at most {_MAX_RECORD})")
            try:
                record = json.loads(raw)
            except (ValueError, RecursionError) as e:
                raise _Refused(f"a malformed record ({type(e).__name__})") from None
            if not isinstance(record, dict) or not isinstance(record.get("uid"), str):
                raise _Refused("a record is a JSON object naming a member ('uid')")
            cause, target = record.get("cause"), record["uid"]
            member = uid.isdigit() or uid in world.admitted
            if cause == "left" and target == uid:
                pass
            elif cause == "decided" and target == uid and member:
                pass
            elif cause in _DECLARING and member and target != uid:
                checks.check_uids(world, self._keys, [target])
                if target in world.declared:
                    return _ok(b"\x00")  # another member declared it first
                world.declared.add(target)
            else:
                raise _Refused(f"a record with cause {cause!r} about {target!r} is not one "
                               f"member {uid} may append")
        except _Refused as e:
            return self._refuse(conn, "record", str(e), e.status)
        self._keys.append_entry(world.root + DEATHS.encode(), raw)
        return _ok(b"\x01")

    def _refuse(self, conn: Any, op: str, why: str,
                status: w.Status = w.Status.ERROR) -> bytes:
        self._notice("tcp_store_world_refused", peer=getattr(conn, "peer", "?"), op=op,
                     reason=why[:300])
        body = f"{op} refused: {why}".encode()
        return w.HEADER.pack(len(body), status) + body


def check_root(root: bytes) -> None:
    """A world's root is empty or ends in ``/``: only then are the keys under it reserved
    (:func:`plugdist.store._worldkeys.is_reserved` matches a name at the top or after a ``/``),
    so only then can no plain write reach its membership. Raises _Refused naming the rule."""
    if root and not root.endswith(b"/"):
        raise _Refused(f"world root {_name(root)[:200]!r} must be empty or end in '/' (the "
                       f"keys under any other root are not reserved, so any client could write "
                       f"its membership); use {_name(root)[:200] + '/'!r}")


def _name(key: bytes) -> str:
    return key.decode(errors="replace")


def _would_set(before: bytes | None, expected: bytes) -> bool:
    """Whether a compare_set expecting ``expected`` writes over ``before`` (None: absent)."""
    return before == expected if before is not None else not expected


def _rel(key: bytes) -> str:
    """A key relative to a world's root, as the member sent it."""
    return key.decode()
