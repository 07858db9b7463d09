"""A world only its members can change: a stranger process against real worlds.

Each test starts one real world (env:// with and without a token, plugdist-run on one node and
on two, two hosts in network namespaces with a token), whose ranks train (all_reduce) until
told to stop (tests/_security_workers.py), and turns a stranger on it: a separate process that
knows the store's port (and, where said, its token: a user's own code, a buggy tool). Every
attack on the world's membership (evict a healthy rank, end the world, hang it, hide a death,
claim a member's identity, forge a member's write) must be refused, and the ranks must train
on: same world size, more steps, nothing happened to them. A stray process of another job
(same MASTER_PORT) is refused with an error that says so. The limits of the store's server are
abused against the same live world. The last act of a world is a real SIGKILL: the death is
still logged (the counter could not be hidden) and the survivors shrink.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from plugdist.testing.harness import free_port
from plugdist.testing.hosts import Hosts

pytestmark = pytest.mark.resilience

WORKERS = str(Path(__file__).with_name("_security_workers.py"))
LAUNCHER = [sys.executable, "-m", "plugdist_run"]
MEMBERSHIP_ATTACKS = ["evict", "will", "end", "hang", "hide", "queue", "claim", "forge", "vote",
                      "leave"]
# a buggy tool's delete_prefix(""): the env:// worlds' plain keys are only their own (under
# plugdist-run the launchers' rendezvous keys live in the same store)
WIPE = ["wipe"]
NOBODY = 65534  # another local user (the tests run as root)
# the launchers' rendezvous round: its outcome, master, members and heartbeats, a wipe of it
# (refused: the prefix is theirs), and a wipe of every key (the rounds' stay)
ROUND_ATTACKS = ["round_end", "round_master", "round_closed", "round_heartbeat", "round_wipe",
                 "wipe"]
# the four frames that ended every world, and a reply of 512 MiB
SERVER_ATTACKS = ["root_crash", "big_multi_get"]


class World:
    """Processes of one world and the files they write."""

    def __init__(self, tmp: Path, procs: list[subprocess.Popen[bytes]], logs: list[Path],
                 size: int, env: dict[str, str] | None = None) -> None:
        self.dir, self.procs, self.logs, self.size = tmp, procs, logs, size
        self.env = env  # an env:// world's environment (its ranks', but RANK)

    def start_rank(self, rank: int) -> None:
        """Start rank ``rank`` of an env:// world."""
        assert self.env is not None
        self.logs.append(self.dir / f"rank{rank}.log")
        with open(self.logs[-1], "wb") as log:
            self.procs.append(subprocess.Popen([sys.executable, WORKERS, "train", str(self.dir)],
                                               env={**self.env, "RANK": str(rank)}, stdout=log,
                                               stderr=subprocess.STDOUT))

    def ranks(self) -> dict[str, dict[str, Any]]:
        out = {}
        for f in self.dir.glob("rank*.json"):
            try:
                out[f.stem] = json.loads(f.read_text())
            except ValueError:
                pass  # being replaced
        return out

    def store(self) -> dict[str, Any]:
        return dict(json.loads((self.dir / "store.json").read_text()))

    def wait_started(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ranks = self.ranks()
            if (self.dir / "store.json").exists() and len(ranks) == self.size and all(
                    r["steps"] > 0 for r in ranks.values()):
                return
            dead = [p.args for p in self.procs if p.poll() is not None]
            assert not dead, f"a process of the world ended: {dead}\n{self.log_tail()}"
            time.sleep(0.1)
        raise AssertionError(f"the world did not start training:\n{self.log_tail()}")

    def trains_on(self, size: int | None = None) -> None:
        """Every rank took more steps since the last look, is in a world of ``size``, and saw
        nothing happen (no failure, shrink, exclusion or wrong sum)."""
        size = size or self.size
        before = {k: v["steps"] for k, v in self.ranks().items()}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            now = self.ranks()
            if len(now) == len(before) and all(now[k]["steps"] > before[k] + 5 for k in before):
                break
            time.sleep(0.1)
        now = self.ranks()
        for uid, r in now.items():
            assert r["size"] == size and r["events"] == [], (uid, r, self.log_tail())
            assert r["steps"] > before[uid] + 5, (uid, r["steps"], before[uid], self.log_tail())

    def log_tail(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2500:]}" for p in self.logs
                         if p.exists())

    def stop(self) -> None:
        (self.dir / "stop").write_text("")
        deadline = time.monotonic() + 30
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def assert_misbehaving_member_refused(world: World, uid: str) -> None:
    """Member ``uid`` (``MISBEHAVE``) tried, with its own credential, every write a member may
    not make; each was refused by the store's checks of its values."""
    deadline = time.monotonic() + 30
    while not world.ranks().get(f"rank{uid}", {}).get("misbehaved"):
        assert time.monotonic() < deadline, world.log_tail()
        time.sleep(0.1)
    got = world.ranks()[f"rank{uid}"]["misbehaved"]
    assert len(got) == 8 and all(
        v.startswith("refused") and "member write refused" in v for v in got.values()), got


def env_world(tmp: Path, size: int, extra: dict[str, str] | None = None,
              hold_back: int | None = None) -> World:
    """``size`` ranks over env:// on loopback; rank ``hold_back`` only when
    ``world.start_rank`` is called (a slow rank)."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": str(size), **(extra or {})}
    env.pop("PLUGDIST_RESILIENCE", None)  # the default: on
    world = World(tmp, [], [], size, env)
    for r in range(size):
        if r != hold_back:
            world.start_rank(r)
    return world


def launched_world(tmp: Path, nodes: int, nproc: int, argv_for: Any = None,
                   conf: str = "", env: dict[str, str] | None = None) -> World:
    """``nodes`` plugdist-run launchers of ``nproc`` workers each (c10d on loopback when
    several); ``argv_for(node, argv)`` may wrap a node's command line (another host)."""
    env = {**{k: v for k, v in os.environ.items() if k not in ("PLUGDIST_RESILIENCE",)},
           **(env or {})}
    endpoint = f"127.0.0.1:{free_port()}"
    procs, logs = [], []
    for node in range(nodes):
        argv = [*LAUNCHER, "--nproc-per-node", str(nproc)]
        if nodes > 1:
            argv += ["--nnodes", str(nodes), "--rdzv-backend", "c10d", "--rdzv-endpoint",
                     endpoint, "--rdzv-conf", f"last_call_timeout=1{conf}"]
        argv += [WORKERS, "train", str(tmp)]
        if argv_for is not None:
            argv = argv_for(node, argv)
        logs.append(tmp / f"node{node}.log")
        with open(logs[-1], "wb") as log:
            procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))
    return World(tmp, procs, logs, nodes * nproc)


def stranger(address: str, root: str, attacks: list[str], token: str | None = None,
             argv_for: Any = None, timeout: float = 120, size: int = 3,
             uid: int | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Run the stranger process with ``attacks``; ``size``: the world size its claim says;
    ``uid``: the Unix user it runs as (None: the test's); ``extra``: more of its environment."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PLUGDIST_STORE_TOKEN", "PLUGDIST_STORE_TOKEN_FILE")}
    env.update(extra or {})
    env["CLAIM_SIZE"] = str(size)
    if uid is not None:
        env["STRANGER_UID"] = str(uid)
    if token is not None:
        env["PLUGDIST_STORE_TOKEN"] = token
    argv = [sys.executable, WORKERS, "stranger", address, root, *attacks]
    if argv_for is not None:
        argv = argv_for(argv)
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def assert_membership_attacks_refused(got: dict[str, str]) -> None:
    """Each membership attack was refused, for the reason it should be."""
    reserved = "belongs to a world's membership"
    for name in ("evict", "will", "end", "hang", "hide", "queue", "vote", "leave"):
        assert got[name].startswith("refused") and reserved in got[name], (name, got[name])
    # the refusal says who holds the identity: its holder's address, when, live
    assert re.search(r"held by another live process, taken by a connection from "
                     r"[\d.]+:\d+ at \d\d:\d\d:\d\d UTC, \d+s ago \(live\)", got["claim"]), got
    assert "check MASTER_PORT" in got["claim"], got["claim"]
    assert "holds no identity in this world" in got["forge"], got["forge"]
    if "wipe" in got:
        assert got["wipe"].startswith("accepted"), got["wipe"]  # plain keys: the world lives


def assert_server_attacks_refused(got: dict[str, str]) -> None:
    """The attacks on the server itself were refused, naming the rule or the limit."""
    assert got["root_crash"].startswith("refused") and "must be empty or end in '/'" in \
        got["root_crash"], got["root_crash"]
    assert got["big_multi_get"].startswith("accepted: refused") and "max_reply_bytes" in \
        got["big_multi_get"], got["big_multi_get"]


def round_prefix(world: World) -> dict[str, str]:
    """The stranger's RDZV_PREFIX: the launchers' keys of the round the workers run in."""
    info = world.store()
    round_ = re.fullmatch(r"plugdist/worker/round_(\d+)/", info["root"])
    assert round_ and info["run_id"], info
    return {"RDZV_PREFIX": f"plugdist/rdzv/{info['run_id']}/r{round_.group(1)}/"}


def round_keys(addr: str, prefix: str) -> dict[str, Any]:
    """The launchers' keys of a round that the round attacks aim at, read as the job would."""
    from plugdist.store import TCPStore

    host, _, port = addr.rpartition(":")
    store = TCPStore(host, int(port), timeout=timedelta(seconds=20))
    try:
        got: dict[str, Any] = {name: store.get(prefix + name) if store.check([prefix + name])
                               else None for name in ("outcome", "master", "closed")}
        got["hb/1"] = store.add(prefix + "hb/1", 0)
        return got
    finally:
        store.close()


def assert_round_attacks_refused(got: dict[str, str]) -> None:
    """Every write on the launchers' round was refused for want of the job's credential; a
    wipe of every key was taken (plain keys) and left the rounds' (the job trains on after)."""
    for name in ROUND_ATTACKS[:-1]:
        assert got[name].startswith("refused") and "the launcher's rendezvous rounds, written " \
            "only by the job's own processes" in got[name] and "runs as nobody" in got[name], \
            (name, got[name])
    assert got["wipe"].startswith("accepted"), got["wipe"]


def address(world: World) -> tuple[str, str, str]:
    info = world.store()
    return f"{info['host']}:{info['port']}", info["root"], info["token"]


def kill_one_and_see_the_others_shrink(world: World, victim_uid: str) -> None:
    """A real death after everything the stranger tried is logged: the others shrink."""
    victim = world.ranks()[f"rank{victim_uid}"]
    os.kill(victim["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        others = {k: v for k, v in world.ranks().items() if k != f"rank{victim_uid}"}
        if all(v["size"] == world.size - 1 for v in others.values()):
            break
        time.sleep(0.1)
    for uid, r in world.ranks().items():
        if uid == f"rank{victim_uid}":
            continue
        assert r["size"] == world.size - 1, (uid, r, world.log_tail())
        assert r["events"][0].startswith("failure of ranks"), (uid, r)


@pytest.fixture
def tmp(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path


@pytest.mark.timeout(240)
def test_env_world_without_token(tmp: Path) -> None:
    """env:// on loopback, no token (torch's only mode), joins allowed by the store's host:
    the store listens on loopback only; another local user's process that claims rank 1
    before the slow real rank 1 does, or asks to join, is refused (its socket's owner is not
    the store's user), and the job starts; every membership attack is refused (forged vote
    outcomes and leave counts too); a member that writes what no member may (a decision naming
    strangers, a trim past what was read, another's seen mark, a death record deleted, ...) is
    refused; a stray process of another job (RANK=1 of 3, and a WORLD_SIZE=4) is refused with
    an error that says who holds the identity; the server's limits hold against a 16 MiB CHECK,
    48 MiB frames left half sent, a byte-a-second frame and 500 garbage clients; the ranks
    train on through all of it; then a real SIGKILL is seen and shrunk past."""
    world = env_world(tmp, 3, {"PLUGDIST_ALLOW_TOKENLESS_JOIN": "1", "MISBEHAVE": "1"},
                      hold_back=1)
    try:
        assert world.env is not None
        if os.geteuid() == 0:  # a second Unix user is at hand
            squat = stranger(f"127.0.0.1:{world.env['MASTER_PORT']}", "",
                             ["claim", "join", "join_raw"], uid=NOBODY)
            for name, got in squat.items():
                assert got.startswith("refused") and "runs as nobody (uid 65534), but this " \
                    "store belongs to root (uid 0)" in got, (name, got)
        world.start_rank(1)
        world.wait_started()
        addr, root, token = address(world)
        assert root == "" and token == "" and world.store()["protected"]
        assert_misbehaving_member_refused(world, "1")
        assert addr.startswith("127.0.0.1:")
        # slow abuse, in the background while the rest goes on
        slow = [subprocess.Popen([sys.executable, WORKERS, "stranger", addr, root, attack],
                                 stdout=subprocess.PIPE, text=True)
                for attack in ("trickle", "partial_frames")]
        got = stranger(addr, root, MEMBERSHIP_ATTACKS + WIPE + ["check_flood", "garbage"]
                       + SERVER_ATTACKS + ["held_connections"])
        assert_membership_attacks_refused(got)
        assert "at most 131072 keys per request" in got["check_flood"], got
        assert_server_attacks_refused(got)
        # 5,000 tokenless connections from loopback, held as guests (under the per-address
        # bound): the members' connections, trusted, are untouched and the ranks train on
        closed, _, held = got["held_connections"].removeprefix("accepted: ").partition(" of ")
        assert int(held.split()[0]) == 5000, got
        world.trains_on()

        # a stray second job: same MASTER_PORT, RANK=1 of 3, and one of another size
        port = addr.rpartition(":")[2]
        strays = [subprocess.Popen(
            [sys.executable, WORKERS, "train", str(tmp)], stderr=subprocess.PIPE,
            env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                 "RANK": rank, "WORLD_SIZE": size}) for rank, size in (("1", "3"), ("3", "4"))]
        errors = [s.communicate(timeout=90)[1][-2000:] for s in strays]
        assert [s.returncode for s in strays] == [3, 3], errors
        refusals = sorted(json.loads(f.read_text())["error"] for f in tmp.glob("refused-*"))
        assert len(refusals) == 2
        assert all("check MASTER_PORT" in e for e in refusals), refusals
        assert any("held by another live process" in e for e in refusals), refusals
        assert any(re.search(r"has 3 ranks: rank \d taken by a connection from [\d.]+:\d+ "
                             r"at .*; this process says its world has 4", e)
                   for e in refusals), refusals
        world.trains_on()

        trickle = json.loads(slow[0].communicate(timeout=90)[0])["trickle"]
        partial = json.loads(slow[1].communicate(timeout=90)[0])["partial_frames"]
        # 1 MiB announced, a byte every 0.5 s: dropped once the 5 s grace is over (or before,
        # as the slowest frame, when the partial frames pass the server's total)
        assert trickle.startswith("accepted: dropped after"), trickle
        assert int(trickle.rpartition(" ")[2][:-1]) <= 6, trickle
        # 128 MiB of partial frames at most: three of 40 MiB fit; those three go after
        # 5 s + 48 MiB at 4 MiB/s (17 s)
        assert partial.startswith("accepted: 5 of 8 dropped at once, all within"), partial
        assert int(partial.rpartition(" ")[2][:-1]) <= 25, partial
        world.trains_on()
        # 509 clients dropped (500 garbage, 8 partial, the trickle): the log of rank 0, which
        # hosts the store, says so in a few lines, the held-back ones counted
        deadline = time.monotonic() + 20
        while "suppressed=" not in world.logs[0].read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        host_log = world.logs[0].read_text()
        dropped = [line for line in host_log.splitlines() if "tcp_store_client_dropped" in line]
        assert 0 < len(dropped) <= 25, len(dropped)
        counted = sum(int(line.split("suppressed=")[1].split()[0]) for line in dropped
                      if "suppressed=" in line)
        assert counted + len(dropped) >= 500, (counted, len(dropped))

        kill_one_and_see_the_others_shrink(world, "2")
    finally:
        world.stop()


@pytest.mark.timeout(180)
def test_env_world_with_token_from_a_file(tmp: Path) -> None:
    """env:// with PLUGDIST_STORE_TOKEN_FILE: a stranger without the token is refused at the
    handshake; one with it (a user's own code) still cannot change the membership; a stray job
    with another token is told it reached another job's store."""
    secret = tmp / "token"
    secret.write_text(os.urandom(24).hex())
    secret.chmod(0o600)
    world = env_world(tmp, 3, {"PLUGDIST_STORE_TOKEN_FILE": str(secret)}, hold_back=1)
    try:
        assert world.env is not None
        # a squatter on rank 1 before the slow real rank 1, and a joiner: no token, no entry
        squat = stranger(f"127.0.0.1:{world.env['MASTER_PORT']}", "", ["claim", "join"])
        assert all(v.startswith("refused") and "authentication failed" in v
                   for v in squat.values()), squat
        world.start_rank(1)
        world.wait_started()
        addr, root, _ = address(world)
        got = stranger(addr, root, ["evict", "hide"])
        assert all(v.startswith("refused") and "authentication failed" in v
                   for v in got.values()), got
        held = stranger(addr, root, ["held_unproven"])["held_unproven"]
        assert held.startswith("accepted: 5000 of 5000 closed"), held  # the token's proof
        got = stranger(addr, root, MEMBERSHIP_ATTACKS + SERVER_ATTACKS,
                       token=secret.read_text())
        assert_membership_attacks_refused(got)
        assert_server_attacks_refused(got)
        stray = subprocess.run(
            [sys.executable, WORKERS, "train", str(tmp)], capture_output=True, timeout=90,
            env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": addr.rpartition(":")[2],
                 "RANK": "1", "WORLD_SIZE": "3", "PLUGDIST_STORE_TOKEN": "another job's"})
        assert stray.returncode == 3, stray.stderr[-2000:]
        refusal = json.loads(next(tmp.glob("refused-*")).read_text())["error"]
        assert "authentication failed" in refusal, refusal
        assert "another job's store: check MASTER_PORT" in refusal, refusal
        world.trains_on()
    finally:
        world.stop()


@pytest.mark.timeout(180)
def test_plugdist_run_one_node(tmp: Path) -> None:
    """plugdist-run on one node (a fresh token per run): a stranger that knows the port is
    refused at the handshake; with the token, its membership attacks are refused too."""
    world = launched_world(tmp, 1, 2)
    try:
        world.wait_started()
        addr, root, token = address(world)
        assert root.startswith("plugdist/worker/round_") and token
        got = stranger(addr, root, ["evict", "end", "join", "round_end"],
                       extra=round_prefix(world))
        assert all("authentication failed" in v for v in got.values()), got
        got = stranger(addr, root, MEMBERSHIP_ATTACKS, token=token, size=2)
        assert_membership_attacks_refused(got)
        world.trains_on()
    finally:
        world.stop()


@pytest.mark.timeout(180)
def test_plugdist_run_two_nodes_on_loopback(tmp: Path) -> None:
    """Two plugdist-run launchers meeting on 127.0.0.1 (no token: loopback only), with the
    default run id (no flag: the nodes agree on it): every membership attack on the workers'
    world is refused, and a member's writes that no member may make; another local user's
    writes on the launchers' rendezvous round (its outcome, master, members, heartbeats) are
    refused and its wipe deletes none of them; it trains on."""
    world = launched_world(tmp, 2, 1, env={"MISBEHAVE": "0"})
    try:
        world.wait_started()
        assert_misbehaving_member_refused(world, "0")
        addr, root, token = address(world)
        assert addr.startswith("127.0.0.1:") and token == ""
        got = stranger(addr, root, MEMBERSHIP_ATTACKS, size=2)
        assert_membership_attacks_refused(got)
        if os.geteuid() == 0:  # a second Unix user is at hand
            before = round_keys(addr, round_prefix(world)["RDZV_PREFIX"])
            got = stranger(addr, root, ROUND_ATTACKS, uid=NOBODY, extra=round_prefix(world))
            assert_round_attacks_refused(got)
            after = round_keys(addr, round_prefix(world)["RDZV_PREFIX"])
            assert after["outcome"] is None and after["master"] == before["master"], after
            assert after["closed"] == before["closed"] and after["hb/1"] < 1000, after
        world.trains_on()
    finally:
        world.stop()


@pytest.mark.timeout(200)
def test_two_hosts_need_a_token_and_with_one_keep_strangers_out(hosts: Hosts,
                                                                 tmp: Path) -> None:
    """Across two hosts (network namespaces) the store listens beyond loopback: without a token
    plugdist-run refuses to start, saying how to give one; with --rdzv-conf token_file, a
    stranger on the other host is refused at the handshake, and with the token its
    membership attacks are refused; the ranks train on."""
    endpoint = f"{hosts.addr[0]}:{free_port()}"
    bare = subprocess.run(hosts.argv(0, [*LAUNCHER, "--nnodes", "2", "--rdzv-backend", "c10d",
                                         "--rdzv-endpoint", endpoint, WORKERS, "train",
                                         str(tmp)]),
                          capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in os.environ.items()
                               if not k.startswith("PLUGDIST_STORE_TOKEN")})
    assert bare.returncode != 0 and "beyond loopback" in bare.stderr, bare.stderr[-2000:]
    assert "token_file" in bare.stderr

    secret = tmp / "token"
    secret.write_text(os.urandom(24).hex() + "\n")
    secret.chmod(0o600)

    def on_host(node: int, argv: list[str]) -> list[str]:
        argv = [a if not a.startswith("127.0.0.1:") else endpoint for a in argv]
        return hosts.argv(node, argv)

    world = launched_world(tmp, 2, 1, on_host, f",token_file={secret}",
                           {"GLOO_SOCKET_IFNAME": "pdnet"})
    try:
        world.wait_started()
        addr, root, token = address(world)
        assert addr.startswith(hosts.addr[0]) and token == ""  # workers read the file
        got = stranger(addr, root, ["evict"], argv_for=lambda a: hosts.argv(1, a))
        assert "authentication failed" in got["evict"], got
        got = stranger(addr, root, MEMBERSHIP_ATTACKS, token=secret.read_text().strip(),
                       argv_for=lambda a: hosts.argv(1, a), size=2)
        assert_membership_attacks_refused(got)
        world.trains_on()
    finally:
        world.stop()
