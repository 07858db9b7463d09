"""Processes for tests/test_security.py: a rank that trains through whatever a stranger does,
and the stranger (a process that knows only the store's port, and maybe its token).

``python _security_workers.py train RESULT_DIR``: a rank of a Gloo world (env:// or under
plugdist-run). Until the file ``RESULT_DIR/stop`` appears it all-reduces ones (checking the sum
equals the world size), shrinks past a rank that fails, and every 0.2 s writes
``rank<uid>.json``: steps, world size, rank, and what happened (failures, shrinks, exclusion,
wrong sums). Its store's address and token go to ``store.json`` (rank 0, for the test). A rank
whose ``init_process_group`` is refused (a stray process of another job) writes ``refused.json``
with the error and exits 3.

``python _security_workers.py stranger HOST:PORT ROOT ATTACK...``: each ATTACK (see
``ATTACKS``) against the store at HOST:PORT, whose world's membership lives under key prefix
ROOT ("" for env://); prints one JSON line: attack -> "refused: <why>" or "accepted: <what>".
The token, if any, comes from PLUGDIST_STORE_TOKEN like any client's; the ``round_*`` attacks
write under RDZV_PREFIX (the launchers' current rendezvous round). With STRANGER_UID set,
it runs as that Unix user (another local user: it imports as the user who started it, then
drops to that uid before it opens a socket).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any


def _write(path: str, data: dict[str, Any]) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def train(result_dir: str) -> None:
    import plugdist as dist
    import torch

    try:
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    except dist.DistError as err:
        _write(os.path.join(result_dir, f"refused-{os.getpid()}.json"),
               {"error": str(err), "kind": type(err).__name__})
        sys.exit(3)
    from plugdist._world.state import world
    uid = world.membership.uid if world.membership is not None else str(dist.get_rank())
    if dist.get_rank() == 0:
        store = world.store
        inner = getattr(store, "underlying_store", store)
        _write(os.path.join(result_dir, "store.json"), {
            "host": inner.host, "port": inner.port,
            "root": (store.prefix + "/") if inner is not store else "",
            "token": os.environ.get("PLUGDIST_STORE_TOKEN", ""),
            "run_id": os.environ.get("PLUGDIST_RUN_ID", ""),
            "protected": world.membership is not None and world.membership.protected})
    events: list[str] = []
    misbehaved: dict[str, str] = {}
    steps, last = 0, 0.0
    stop = os.path.join(result_dir, "stop")
    out = os.path.join(result_dir, f"rank{uid}.json")
    while True:
        now = time.monotonic()
        if now - last > 0.2:
            last = now
            if steps and not misbehaved and os.environ.get("MISBEHAVE") == uid:
                misbehaved = _misbehave(world)
            _write(out, {"steps": steps, "size": dist.get_world_size(), "rank": dist.get_rank(),
                         "events": events, "pid": os.getpid(), "misbehaved": misbehaved})
            if os.path.exists(stop):
                break
        try:
            t = torch.ones(2)
            dist.all_reduce(t)
            if t.tolist() != [float(dist.get_world_size())] * 2:
                events.append(f"wrong sum {t.tolist()} at step {steps}")
            steps += 1
            time.sleep(0.01)
        except dist.DistExcludedError as err:
            events.append(f"excluded: {err}")
            break
        except dist.DistRankFailureError as err:
            events.append(f"failure of ranks {list(err.ranks)}")
            dist.shrink_group()
            events.append(f"shrunk to {dist.get_world_size()}")
    _write(out, {"steps": steps, "size": dist.get_world_size(), "rank": dist.get_rank(),
                 "events": events, "pid": os.getpid(), "done": True})
    dist.destroy_process_group()


def _misbehave(world: Any) -> dict[str, str]:
    """A member's own process, with its credential, writing what the store must refuse from any
    member (a bug, or code that should not be there): attack -> "refused: ..."/"accepted"."""
    from plugdist.errors import DistError
    writes = world.membership.writes
    me = world.membership.uid
    other = next(u for u in world.membership.members if u != me)
    tries: dict[str, Callable[[], Any]] = {
        "decision naming strangers": lambda: writes.compare_set(
            "plugdist/epoch/0/next", "", json.dumps({"excluded": [other, "77"]})),
        "members naming strangers": lambda: writes.compare_set(
            "plugdist/epoch/1/members", "", json.dumps([me, "j99"])),
        "grow of an unknown joiner": lambda: writes.compare_set(
            "plugdist/epoch/0/grow/0", "", json.dumps({"joiners": [[5, "j5"]], "done": 5})),
        "trim mark of 10^6": lambda: writes.compare_set(
            "plugdist/live/trim", json.dumps({"epoch": -1, "log": 0, "tickets": 0, "done": 0}),
            json.dumps({"epoch": 0, "log": 10**6, "tickets": 0, "done": 0})),
        "another's seen mark": lambda: writes.set(f"plugdist/epoch/0/seen/{other}", "0"),
        "a death record deleted": lambda: writes.delete_key("plugdist/live/deaths/1"),
        "an outcome of an epoch it is not in": lambda: writes.compare_set(
            "plugdist/ft/7/step/0/0", "", "commit [0.0, 1.0]"),
        "everyone left": lambda: writes.set("plugdist/epoch/0/left", "1"),
    }
    got = {}
    for name, attempt in tries.items():
        try:
            attempt()
            got[name] = "accepted"
        except DistError as err:
            got[name] = f"refused: {err}"
    return got


# ---------------------------------------------------------------------------- the stranger

def _deaths(root: str) -> str:
    return f"{root}plugdist/live/deaths"


def _attack_evict(store: Any, root: str) -> str:
    """Append a death naming healthy rank 1 to the death log (add, then set)."""
    n = store.add(_deaths(root), 1)
    store.set(f"{_deaths(root)}/{n}", json.dumps({"uid": "1", "cause": "died"}))
    return f"entry {n} written"


def _attack_will(store: Any, root: str) -> str:
    """Leave a will that names rank 2 on the death log, then drop it."""
    will = store.hold_will(_deaths(root), json.dumps({"uid": "2", "cause": "died"}))
    will._conn.close()  # dropped without withdrawing: it runs
    return "will left and dropped"


def _attack_end(store: Any, root: str) -> str:
    """Pre-write the next epoch with no members, and a decision excluding everyone."""
    members = [str(r) for r in range(64)]
    store.set(f"{root}plugdist/epoch/0/next", json.dumps({"excluded": members}))
    store.set(f"{root}plugdist/epoch/1/members", "[]")
    store.set(f"{root}plugdist/epoch/current", "1")
    return "next epoch written"


def _attack_hang(store: Any, root: str) -> str:
    """Pre-write a member list naming a rank that does not exist."""
    store.set(f"{root}plugdist/epoch/0/next", json.dumps({"members": ["0", "2", "7"]}))
    store.compare_set(f"{root}plugdist/epoch/1/members", "", json.dumps(["0", "2", "7"]))
    return "member list written"


def _attack_hide(store: Any, root: str) -> str:
    """Overwrite the death counter with a non-number (a later death could not be counted)."""
    store.set(_deaths(root), "not a number")
    return "counter overwritten"


def _attack_queue(store: Any, root: str) -> str:
    """Make a reserved key look present with a queue (a reader that checks, then gets, hangs)."""
    store.queue_push(f"{root}plugdist/epoch/1/members", "x")
    return "queue pushed"


def _attack_vote(store: Any, root: str) -> str:
    """Forge the fault-tolerant loop's outcomes: commit with the stop flag for the next steps
    (every member would stop), and the state transfer's."""
    steps = [f"{root}plugdist/ft/0/step/0/{s}" for s in range(64)]
    store.multi_set(steps, ["commit [0.0, 1.0]"] * len(steps))
    store.compare_set(f"{root}plugdist/ft/0/state", "", "commit []")
    return "outcomes written"


def _attack_leave(store: Any, root: str) -> str:
    """Count every member out (the world closes early), or past its size (every close waits)."""
    store.add(f"{root}plugdist/epoch/0/leaving", 100)
    store.set(f"{root}plugdist/epoch/0/left", "1")
    return "leave count written"


def _attack_wipe(store: Any, root: str) -> str:
    """Delete every key (a buggy tool's cleanup)."""
    return f"{store.delete_prefix('')} keys deleted"


def _round_key(name: str) -> str:
    """A key of the launchers' current rendezvous round (RDZV_PREFIX: its prefix)."""
    return os.environ["RDZV_PREFIX"] + name


def _attack_round_end(store: Any, root: str) -> str:
    """End the launchers' round: a forged outcome and failure (every node restarts)."""
    store.compare_set(_round_key("outcome"), "", "failed: rank 0 on node 0")
    store.set(_round_key("failure"), json.dumps({"rank": 0, "node": 0}))
    return "outcome written"


def _attack_round_master(store: Any, root: str) -> str:
    """Point the round's workers at the stranger's own rank 0."""
    store.set(_round_key("master"), "127.0.0.1:1")
    return "master written"


def _attack_round_closed(store: Any, root: str) -> str:
    """Rewrite who is in the round."""
    store.set(_round_key("closed"), json.dumps({"count": 1, "restart_count": 0}))
    return "closed written"


def _attack_round_heartbeat(store: Any, root: str) -> str:
    """Keep a node's heartbeat going (a dead node would look alive)."""
    return f"heartbeat at {store.add(_round_key('hb/1'), 1000)}"


def _attack_round_wipe(store: Any, root: str) -> str:
    """Delete every rendezvous key (the launchers would lose their rounds)."""
    return f"{store.delete_prefix('plugdist/rdzv/')} keys deleted"


def _attack_claim(store: Any, root: str) -> str:
    """Claim rank 1's identity (a second process saying it is rank 1 of a world of
    CLAIM_SIZE)."""
    session = store.claim_member(root, "1", int(os.environ["CLAIM_SIZE"]), 10.0)
    session.will.cancel()
    return "claimed member 1"


def _attack_join(store: Any, root: str) -> str:
    """Ask to join the world (what init_process_group(join=True) does)."""
    session = store.join_member(root, 10.0)
    session.will.cancel()
    return f"joined as {session.uid}"


def _attack_join_raw(store: Any, root: str) -> str:
    """A raw JOIN with ttl 0 (an identity that would never lapse), on a connection of its own."""
    from plugdist.store import _wire as w
    r = root.encode()
    conn = store._connect(join=False, timeout=10.0)
    try:
        status, reply = conn.roundtrip(
            w.request(w.Op.JOIN, w.U32.pack(len(r)) + r + w.F64.pack(0.0)), 10.0)
    finally:
        conn.close()
    if status != w.Status.OK:
        from plugdist.errors import DistStoreError
        raise DistStoreError(reply.decode(errors="replace"))
    return "joined with ttl 0"


def _attack_forge(store: Any, root: str) -> str:
    """A member's checked write with a guessed credential."""
    from plugdist.store._tcp_client import TCPStoreSession
    forged = TCPStoreSession(store._request, None, root.encode(), "0",  # type: ignore[arg-type]
                           os.urandom(16))
    forged.set("plugdist/epoch/1/members", json.dumps(["0"]))
    return "forged write accepted"


def _attack_check_flood(store: Any, root: str) -> str:
    """One CHECK of 4 million empty keys (16 MiB)."""
    from plugdist.store import _wire as w
    frame = w.request(w.Op.CHECK, w.U32.pack(4_000_000) + b"\0" * 16_000_000)
    start = time.monotonic()
    store._request("check", frame)
    return f"answered in {time.monotonic() - start:.2f}s"


def _attack_root_crash(store: Any, root: str) -> str:
    """The four frames that ended every world: a claim on a root without '/', a plain set of
    that root's epoch to a non-number, and the claim's connection closed (the server parsed
    the epoch as it released the world)."""
    store.set("xplugdist/epoch/current", "not a number")  # a plain key: accepted
    session = store.claim_member("x", "0", 1, 10.0)
    session.will._conn.close()
    time.sleep(0.5)
    return "claimed under root 'x' and closed"


def _attack_big_multi_get(store: Any, root: str) -> str:
    """A 460-byte MULTI_GET naming one 8 MiB value 64 times (a 512 MiB reply); then 16
    connections that send MULTI_GETs of 7 of them (56 MiB each) and never read."""
    from plugdist.errors import DistStoreError
    from plugdist.store import _wire as w
    store.set("stranger/big", os.urandom(8 << 20))
    try:
        store.multi_get(["stranger/big"] * 64)
        answer = "answered"
    except DistStoreError as err:
        answer = f"refused: {err}"
    host, port = store.host, store.port
    frame = w.request(w.Op.MULTI_GET, w.F64.pack(30.0) + w.pack_blobs([b"stranger/big"] * 7))
    hogs = []
    for _ in range(16):
        s = _raw(host, port)
        s.setblocking(False)
        for _ in range(20):
            try:
                s.send(frame)
            except BlockingIOError:
                break
        hogs.append(s)
    time.sleep(3)
    for s in hogs:
        s.close()
    store.delete_key("stranger/big")
    return answer


def _held_connections(host: str, port: int, settle: float = 2.0) -> str:
    """5,000 tokenless connections from the world's address (loopback), each sending one
    NUM_KEYS (which proved a connection before) and then held: guests past the per-address
    bound are displaced; the rest would go when idle."""
    import resource

    from plugdist.store import _wire as w
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))
    held = []
    for _ in range(5000):
        try:
            s = socket.create_connection((host, port), timeout=10)
            s.sendall(w.HELLO.pack(w.MAGIC, w.VERSION, 0, os.urandom(w.NONCE_SIZE), w.NO_PROOF)
                      + w.request(w.Op.NUM_KEYS, b""))
            held.append(s)
        except OSError:
            pass
    deadline = time.monotonic() + settle
    closed = 0
    while True:  # up to ``settle`` seconds, until every one is closed
        closed = sum(_closed(s, 0.0) for s in held)
        if closed == len(held) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for s in held:
        s.close()
    return f"{closed} of {len(held)} closed by the server"


ATTACKS: dict[str, Callable[[Any, str], str]] = {
    "evict": _attack_evict, "will": _attack_will, "end": _attack_end, "hang": _attack_hang,
    "hide": _attack_hide, "queue": _attack_queue, "wipe": _attack_wipe, "claim": _attack_claim,
    "forge": _attack_forge, "check_flood": _attack_check_flood, "join": _attack_join,
    "join_raw": _attack_join_raw, "vote": _attack_vote, "leave": _attack_leave,
    "root_crash": _attack_root_crash, "big_multi_get": _attack_big_multi_get,
    "round_end": _attack_round_end, "round_master": _attack_round_master,
    "round_closed": _attack_round_closed, "round_heartbeat": _attack_round_heartbeat,
    "round_wipe": _attack_round_wipe,
}


def _raw(host: str, port: int) -> socket.socket:
    """A connection that did the handshake by hand (with PLUGDIST_STORE_TOKEN's proof when
    that is set: a token holder's own code)."""
    from plugdist.store import _wire as w
    s = socket.create_connection((host, port), timeout=10)
    got = b""
    while len(got) < w.GREETING.size:
        got += s.recv(w.GREETING.size - len(got))
    nonce, flags, proof = os.urandom(w.NONCE_SIZE), 0, w.NO_PROOF
    token = os.environ.get("PLUGDIST_STORE_TOKEN")
    if token:
        flags = w.FLAG_PROOF
        proof = w.client_proof(token.encode(), got[8:24], nonce, flags)
    s.sendall(w.HELLO.pack(w.MAGIC, w.VERSION, flags, nonce, proof))
    return s


def _flood_partial(host: str, port: int) -> str:
    """Connections that each send 40 MiB of a 48 MiB frame and then sit: the server's total on
    partly received bytes drops those past it at once, its pace rule the rest soon after."""
    from plugdist.store import _wire as w
    socks, at_once = [], 0
    start = time.monotonic()
    for _ in range(8):
        try:
            s = _raw(host, port)
            s.sendall(w.HEADER.pack(48 << 20, w.Op.SET) + b"\0" * (40 << 20))
            socks.append(s)
        except OSError:
            at_once += 1
    time.sleep(0.5)
    at_once += sum(_closed(s, 0.0) for s in socks)
    for s in socks:
        _closed(s, 60.0)
    return f"{at_once} of 8 dropped at once, all within {time.monotonic() - start:.0f}s"


def _trickle(host: str, port: int) -> str:
    """A frame sent one byte every 0.5 s (a timer that each byte restarts would keep it)."""
    from plugdist.store import _wire as w
    s = _raw(host, port)
    s.sendall(w.HEADER.pack(1 << 20, w.Op.SET))
    start = time.monotonic()
    try:
        while time.monotonic() - start < 60:
            s.sendall(b"x")
            time.sleep(0.5)
            if _closed(s, 0.0):
                return f"dropped after {time.monotonic() - start:.0f}s"
    except OSError:
        return f"dropped after {time.monotonic() - start:.0f}s"
    return "still connected after 60s"


def _strangers(host: str, port: int) -> str:
    """500 connections that send garbage."""
    for _ in range(500):
        try:
            with socket.create_connection((host, port), timeout=10) as s:
                s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        except OSError:
            pass
    return "500 sent garbage"


RAW_ATTACKS: dict[str, Callable[[str, int], str]] = {
    "partial_frames": _flood_partial, "trickle": _trickle, "garbage": _strangers,
    "held_connections": _held_connections,
    # with a token: each fails its handshake, or is dropped by the handshake deadline (10 s)
    "held_unproven": lambda host, port: _held_connections(host, port, settle=20.0),
}


def _closed(s: socket.socket, wait: float = 5.0) -> bool:
    s.settimeout(wait if wait else 0.001)
    try:
        while True:
            data = s.recv(65536)
            if not data:
                return True
    except (TimeoutError, BlockingIOError):
        return False
    except OSError:
        return True


def stranger(address: str, root: str, attacks: list[str]) -> None:
    from plugdist.errors import DistError
    from plugdist.store import TCPStore, _wire  # noqa: F401 (imported before dropping the uid)
    from plugdist.store._tcp_client import TCPStoreSession  # noqa: F401

    if os.environ.get("STRANGER_UID"):
        os.setgid(int(os.environ["STRANGER_UID"]))
        os.setuid(int(os.environ["STRANGER_UID"]))
    host, _, port = address.rpartition(":")
    out: dict[str, str] = {}
    store: Any = None
    for name in attacks:
        if name in RAW_ATTACKS:
            out[name] = "accepted: " + RAW_ATTACKS[name](host, int(port))
            continue
        try:
            if store is None:
                store = TCPStore(host, int(port), timeout=timedelta(seconds=20))
            out[name] = "accepted: " + ATTACKS[name](store, root)
        except DistError as err:
            out[name] = f"refused: {err}"
    print(json.dumps(out), flush=True)
    os._exit(0)


if __name__ == "__main__":
    if sys.argv[1] == "train":
        train(sys.argv[2])
    else:
        stranger(sys.argv[2], sys.argv[3], sys.argv[4:])
