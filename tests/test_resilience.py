"""Resilient groups with real processes and real SIGKILLs (workers: _resilience_workers.py).

Each test starts a world of real processes over loopback; the victims SIGKILL themselves at a
chosen point; every surviving process writes what it saw, and the test checks each one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from plugdist.errors import DistStoreError
from plugdist.testing.harness import free_port, wait_for

WORKER = str(Path(__file__).with_name("_resilience_workers.py"))


def run_scenario(tmp_path: Path, scenario: str, world: int, backend: str, *,
                 victims: str = "", grow_to: int = 0, joiners: int = 0,
                 joiner_delay: float = 2.0, torch_world: bool = False,
                 timeout: float = 200.0, extra_env: dict[str, str] | None = None,
                 victim_exit: int = -signal.SIGKILL) -> dict[str, dict[str, Any]]:
    """Run ``scenario`` on ``world`` ranks (+ ``joiners`` started later with PLUGDIST_JOIN=1);
    returns each process's result by name. Fails if a process that is not a victim fails or
    writes nothing."""
    results = tmp_path / "results"
    results.mkdir()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(world), BACKEND=backend, VICTIMS=victims, GROW_TO=str(grow_to),
               RESULT_DIR=str(results), PLUGDIST_TORCH_WORLD="1" if torch_world else "0",
               PLUGDIST_RESILIENCE="1",
               # tokenless env:// on loopback: joiners need the store host's consent
               PLUGDIST_ALLOW_TOKENLESS_JOIN="1",
               **(extra_env or {}))
    procs: dict[str, subprocess.Popen] = {}
    logs = {}
    for r in range(world):
        logs[f"rank{r}"] = open(tmp_path / f"rank{r}.log", "w")
        procs[f"rank{r}"] = subprocess.Popen([sys.executable, WORKER, scenario],
                                             env=dict(env, RANK=str(r)), stdout=logs[f"rank{r}"],
                                             stderr=subprocess.STDOUT)
    if joiners:
        time.sleep(joiner_delay)
    for j in range(joiners):
        name = f"joiner{j}"
        logs[name] = open(tmp_path / f"{name}.log", "w")
        join_env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE")}
        procs[name] = subprocess.Popen([sys.executable, WORKER, scenario],
                                       env=dict(join_env, PLUGDIST_JOIN="1"), stdout=logs[name],
                                       stderr=subprocess.STDOUT)
    victim_names = {f"rank{v}" for v in victims.split(",") if v}
    deadline = time.monotonic() + timeout
    try:
        for name, p in procs.items():
            if name not in victim_names:  # a hung victim never exits by itself
                p.wait(max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()
        for f in logs.values():
            f.close()
    problems = []
    for name, p in procs.items():
        if name in victim_names:
            if p.returncode != victim_exit:
                problems.append(f"{name} (a victim) exited with {p.returncode}, not "
                                f"{victim_exit}")
        elif p.returncode != 0:
            log = (tmp_path / f"{name}.log").read_text()[-3000:]
            problems.append(f"{name} exited with {p.returncode}:\n{log}")
    assert not problems, "\n".join(problems)
    return {f.stem: json.loads(f.read_text()) for f in results.glob("*.json")}


def survivors(found: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in found.values() if r["role"] == "survivor"]


@pytest.mark.resilience
@pytest.mark.timeout(260)
@pytest.mark.parametrize("backend", ["gloo", "toy"])
def test_kill_shrink_then_grow(tmp_path: Path, backend: str) -> None:
    """Rank 2 of 4 SIGKILLed mid-way through a loop of collectives: every survivor gets
    DistRankFailureError naming rank 2 within a second, shrinks to 3, runs every collective
    correctly; a new process joins, grow_group admits it, the 4 ranks run every collective.
    torch's default group follows each change (its rank, size and an all_reduce over it)."""
    found = run_scenario(tmp_path, "kill_shrink_grow", 4, backend, victims="2", grow_to=4,
                         joiners=1, torch_world=True)
    alive = survivors(found)
    assert sorted(r["old_rank"] for r in alive) == [0, 1, 3]
    for r in alive:
        assert r["error_type"] == "DistRankFailureError", r
        assert r["error_ranks"] == [2] and r["failed_known"] == [2], r
        assert "rank 2 died" in r["error"] and "shrink_group" in r["error"], r["error"]
        # named by liveness, not by the ops' 60 s timeout (how fast: benchmarks/resilience_bench.py)
        assert r["detect_s"] < 30, f"rank {r['old_rank']} named the failure after {r['detect_s']}s"
        assert r["size"] == 3 and r["bad"] == [], r
        assert r["grown_size"] == 4
        assert r["torch_shrunk"] == {"rank": r["rank"], "size": 3, "world_size": 3, "sum": 3.0,
                                     "plugdist": [r["rank"], 3]}, r
        assert r["torch_grown"] == {"rank": r["rank"], "size": 4, "world_size": 4, "sum": 4.0,
                                    "plugdist": [r["rank"], 4]}, r
        # the flight recorder takes dump requests through each epoch's world, as a joiner does
        for epoch in ("fr_watched_shrunk", "fr_watched_grown"):
            watched, world = r[epoch]
            assert watched == world, (epoch, r)
    assert sorted(r["rank"] for r in alive) == [0, 1, 2], "ranks are compacted in the old order"
    joiner = [r for r in found.values() if r["role"] == "joiner"]
    assert len(joiner) == 1 and joiner[0]["rank"] == 3 and joiner[0]["size"] == 4, joiner
    assert joiner[0]["bad"] == []
    assert joiner[0]["torch"] == {"rank": 3, "size": 4, "world_size": 4, "sum": 4.0,
                                  "plugdist": [3, 4]}, joiner
    assert joiner[0]["fr_watched"][0] == joiner[0]["fr_watched"][1], joiner
    assert joiner[0]["fr_watched"][1] == alive[0]["fr_watched_grown"][1], (joiner, alive)


@pytest.mark.resilience
@pytest.mark.timeout(260)
def test_a_rank_ending_on_an_uncaught_error_is_a_failure_for_the_others(tmp_path: Path) -> None:
    """Rank 2 of 3 raises out of its script (exit status 1, no destroy_process_group): its will
    is not withdrawn at exit as a clean leave's is, so the others get DistRankFailureError
    naming rank 2, instead of a lost connection to a peer that left, and go on without it."""
    found = run_scenario(tmp_path, "kill_shrink_grow", 3, "gloo", victims="2",
                         extra_env={"DIE_BY": "raise"}, victim_exit=1)
    alive = survivors(found)
    assert sorted(r["old_rank"] for r in alive) == [0, 1]
    for r in alive:
        assert r["error_type"] == "DistRankFailureError", r
        assert r["error_ranks"] == [2] and "rank 2 died" in r["error"], r
        assert r["size"] == 2 and r["bad"] == [], r
    assert "fails on purpose" in (tmp_path / "rank2.log").read_text()


@pytest.mark.resilience
@pytest.mark.timeout(260)
def test_the_store_host_destroying_after_a_failure_does_not_wait_for_the_dead(
        tmp_path: Path) -> None:
    """Rank 2 of 3 ends on an uncaught error; ranks 0 (the store's host) and 1 destroy the
    world as soon as they learn of it. The host waits for the others to leave, and the dead
    one never will: it counts as gone, so the wait ends without its timeout (which logs that
    peers did not all leave)."""
    found = run_scenario(tmp_path, "destroy_at_failure", 3, "gloo", victims="2",
                         extra_env={"DIE_BY": "raise"}, victim_exit=1)
    alive = survivors(found)
    assert sorted(r["old_rank"] for r in alive) == [0, 1], found
    assert all(r["error_type"] == "DistRankFailureError" for r in alive), alive
    host_log = (tmp_path / "rank0.log").read_text()
    assert "peers did not all leave" not in host_log, (host_log[-2000:], alive)


@pytest.mark.resilience
@pytest.mark.timeout(260)
def test_a_hung_rank_is_caught_by_heartbeats(tmp_path: Path) -> None:
    """Rank 1 stops (SIGSTOP: alive, connections open, silent): it stops renewing its will,
    whose ttl is the hang timeout, so the store declares it dead 2 s after its last renewal
    (no member reads another's heartbeat); the survivors shrink without it and go on."""
    found = run_scenario(tmp_path, "kill_shrink_grow", 3, "gloo", victims="1",
                         extra_env={"HANG": "1", "PLUGDIST_HEARTBEAT_TIMEOUT": "2"})
    alive = survivors(found)
    assert sorted(r["old_rank"] for r in alive) == [0, 2]
    for r in alive:
        assert r["error_type"] == "DistRankFailureError" and r["error_ranks"] == [1], r
        assert "stopped running for about 2 s" in r["error"], r["error"]
        # not before the will's ttl (its last renewal, every ttl/4, came before the stop); by
        # liveness, not by the ops' 60 s timeout
        assert 1.4 <= r["detect_s"] < 30, r["detect_s"]
        assert r["size"] == 2 and r["bad"] == [], r


@pytest.mark.resilience
@pytest.mark.timeout(260)
def test_two_ranks_die_together(tmp_path: Path) -> None:
    found = run_scenario(tmp_path, "kill_shrink_grow", 4, "gloo", victims="1,2")
    alive = survivors(found)
    assert sorted(r["old_rank"] for r in alive) == [0, 3]
    for r in alive:
        assert r["error_type"] == "DistRankFailureError"
        assert set(r["error_ranks"]) <= {1, 2} and r["error_ranks"], r
        assert r["size"] == 2 and r["bad"] == [], r


@pytest.mark.resilience
@pytest.mark.timeout(260)
def test_rank_dies_during_shrink(tmp_path: Path) -> None:
    """Rank 3 dies; rank 2 dies while the others are inside shrink_group: they end in one
    consistent group of 2."""
    found = run_scenario(tmp_path, "die_during_shrink", 4, "gloo", victims="2,3")
    alive = survivors(found)
    assert len(alive) == 2
    for r in alive:
        assert r["size"] == 2 and r["bad"] == [], r
    assert sorted(r["rank"] for r in alive) == [0, 1]


@pytest.mark.resilience
@pytest.mark.timeout(260)
def test_rank_dies_after_agreeing(tmp_path: Path) -> None:
    """Rank 2 dies after the survivors agreed on a world that holds it, while the new group is
    being built: the build fails fast and the survivors agree again, without it."""
    found = run_scenario(tmp_path, "die_after_agreeing", 4, "gloo", victims="2,3")
    _two_at_epoch_2(found)


def _two_at_epoch_2(found: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The survivors, checked: two, in a group of 2 at epoch 2, every collective right."""
    alive = survivors(found)
    assert len(alive) == 2
    for r in alive:
        assert r["size"] == 2 and r["bad"] == [], r
        assert r["epoch"] == 2, r
    return alive


@pytest.mark.resilience
@pytest.mark.timeout(260)
def test_rank_dies_while_the_others_connect_to_it(tmp_path: Path) -> None:
    """Rank 2 dies after it published its Gloo address for the new group: the others leave
    Gloo's connect as soon as liveness names it (not after Gloo's connect timeout, five times
    the group's 60 s on the listening side) and agree again without it."""
    found = run_scenario(tmp_path, "die_while_connecting", 4, "gloo", victims="2,3")
    for r in _two_at_epoch_2(found):
        assert r["shrink_s"] < 60, f"the shrink waited out a timeout: {r}"
    for name in ("rank0", "rank1"):
        log = (tmp_path / f"{name}.log").read_text()
        retries = [line for line in log.splitlines() if "rebuild_retry" in line]
        assert retries and all("rank 2 died" in line for line in retries), log[-3000:]


@pytest.mark.resilience
@pytest.mark.timeout(120)
def test_resilient_groups_are_on_by_default_where_the_store_expires_wills(
        tmp_path: Path) -> None:
    """Unset: on for a TCPStore world, off for a FileStore one (its wills cannot expire);
    PLUGDIST_RESILIENCE=0 turns them off, =1 on for any store."""
    found = run_scenario(tmp_path, "default_mode", 2, "gloo",
                         extra_env={"SECOND_PORT": str(free_port())})
    want = {"tcp_unset": True, "tcp_off": False, "file_unset": False, "file_on": True}
    assert [found[f"rank{r}"]["resilient"] for r in range(2)] == [want, want]


def test_a_misspelt_resilience_setting_is_refused_with_the_choices() -> None:
    from plugdist._resilience.policy import resilience_mode

    assert [resilience_mode({"PLUGDIST_RESILIENCE": v}) for v in ("", "1", "off")] == [
        "auto", "on", "off"]
    with pytest.raises(ValueError, match="PLUGDIST_RESILIENCE='maybe': use 1"):
        resilience_mode({"PLUGDIST_RESILIENCE": "maybe"})


@pytest.mark.resilience
@pytest.mark.timeout(260)
def test_excluded_rank_that_is_alive_gets_a_clear_error(tmp_path: Path) -> None:
    found = run_scenario(tmp_path, "excluded_alive", 3, "gloo")
    assert "excluded from the world by shrink_group" in found["excluded-1"]["error"]
    alive = survivors(found)
    assert len(alive) == 2 and all(r["size"] == 2 and r["bad"] == [] for r in alive)


@pytest.mark.resilience
@pytest.mark.timeout(260)
def test_torch_ddp_built_before_a_shrink_trains_on_with_the_group_it_holds(
        tmp_path: Path) -> None:
    """torch's own DDP over plugdist_gloo: rank 2 is killed, later rank 1; the survivors catch
    DistRankFailureError from backward, shrink, and keep training with the DDP (and the torch
    group object) built at the start; torch's default group is a new one of the survivors,
    which shrink_group returns; parameters stay identical."""
    found = run_scenario(tmp_path, "torch_ddp", 4, "gloo", victims="2,1", torch_world=True)
    alive = survivors(found)
    assert len(alive) == 2
    for r in alive:
        assert r["size"] == 2 and r["failures"] == 2, r
        assert r["torch_size"] == 2 and r["torch_rank"] == r["rank"], r
        assert r["world_is_new"] and r["returned_world"], r
    assert len({r["sha1"] for r in alive}) == 1, "parameters differ between survivors"


_WILL_CLIENT = """
import os, signal, sys
from plugdist import TCPStore
store = TCPStore("127.0.0.1", int(sys.argv[1]), None, is_master=False)
will = store.hold_will("deaths", sys.argv[2])
if sys.argv[3] == "cancel":
    will.cancel()
    store.close()
    print("cancelled", flush=True)
    sys.exit(0)
print("holding", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.timeout(60)
def test_store_will_runs_when_the_holder_is_killed_and_not_when_cancelled() -> None:
    from datetime import timedelta

    from plugdist import TCPStore

    master = TCPStore("127.0.0.1", 0, None, is_master=True, timeout=timedelta(seconds=20))
    try:
        port = str(master.port)
        done = subprocess.run([sys.executable, "-c", _WILL_CLIENT, port, "polite", "cancel"],
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 0 and "cancelled" in done.stdout, done.stderr
        killed = subprocess.run([sys.executable, "-c", _WILL_CLIENT, port, "victim", "kill"],
                                capture_output=True, text=True, timeout=30)
        assert killed.returncode == -signal.SIGKILL, killed.stderr
        master.wait(["deaths/1"], timedelta(seconds=10))
        assert master.get("deaths") == b"1", "only the killed client's will ran"
        assert master.get("deaths/1") == b"victim"
        master.set("old/a", b"1")
        master.set("old/b/c", b"2")
        master.set("kept", b"3")
        assert master.delete_prefix("old/") == 2
        assert not master.check(["old/a"]) and master.check(["kept"])
    finally:
        master.close()


class _StoreWithLiveness:
    """A will (plugdist.store.api.Will) whose store says it also sees stalled processes (as an
    etcd lease does); it reads its log through the store's own read_log."""

    death_timeout = None  # as liveness_timeout

    def __init__(self, liveness: float | None) -> None:
        self.liveness_timeout = liveness
        self.cancelled = False
        self.store: Any = None
        self.key = ""

    def cancel(self) -> None:
        self.cancelled = True

    def read_log(self, start: int, timeout: float) -> list[bytes]:
        return self.store.read_log(self.key, start, timedelta(seconds=timeout))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("liveness", [None, 2.5])
def test_membership_beats_only_where_the_stores_will_does_not_cover_hangs(liveness) -> None:  # type: ignore[no-untyped-def]
    """The core's contract for a store that serves liveness (Store.hold_will's
    liveness_timeout): membership writes no heartbeat and gives a transport error that long (+1
    s) to be confirmed; a will without it (TCPStore's) keeps heartbeats and the 1 s grace."""
    from plugdist import HashStore
    from plugdist._backend.abort import AbortSignal
    from plugdist._resilience.membership import Membership

    will = _StoreWithLiveness(liveness)

    class Store(HashStore):
        def hold_will(self, key: str, value: bytes | str) -> _StoreWithLiveness:
            will.store, will.key = self, key
            return will

    class Group:
        abort_signal = AbortSignal()

    store = Store()
    store.set("plugdist/epoch/current", "0")
    store.add("plugdist/live/hb/1", 1)  # peer 1 beat once, then went silent
    m = Membership(store, "0", ["0", "1"], interval=0.05, hang_timeout=0.1)
    m.start()
    try:
        m.watch(Group(), ["0", "1"])  # type: ignore[arg-type]
        if liveness is None:  # a silent peer hangs for heartbeats
            assert wait_for(lambda: "1" in m.failed, 10), m.failed
        else:  # where the store watches liveness, its will runs: the monitor loops a few times
            time.sleep(0.5)
            assert "1" not in m.failed, m.failed
        beats = store.check(["plugdist/live/hb/0"])
        assert beats == (liveness is None)
        default = AbortSignal().confirm_grace
        assert Group.abort_signal.confirm_grace == (
            default if liveness is None else max(default, liveness + 1.0))
    finally:
        m.stop()
    assert will.cancelled


_MPI_SHRINK = """
import plugdist as dist
dist.init_process_group("mpi")
try:
    dist.shrink_group(ranks_to_exclude=[1])
    print("no error")
except dist.DistError as err:
    print("refused:", err)
dist.destroy_process_group()
"""


@pytest.mark.timeout(90)
def test_mpi_refuses_shrink_with_a_clear_error(tmp_path: Path) -> None:
    """Under mpiexec (MPICH from pip) a dead rank takes every rank down with it, and no process
    can join MPI_COMM_WORLD: shrink_group says so instead of trying."""
    mpiexec = Path(sys.executable).with_name("mpiexec")
    if not mpiexec.exists():
        pytest.skip("mpiexec is not installed (pip install mpich)")
    script = tmp_path / "shrink.py"
    script.write_text(_MPI_SHRINK)
    done = subprocess.run([str(mpiexec), "-n", "2", sys.executable, str(script)],
                          capture_output=True, text=True, timeout=80,
                          env=dict(os.environ, PLUGDIST_TORCH_WORLD="0", PLUGDIST_RESILIENCE="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout  # the two ranks' lines may interleave
    assert out.count("refused:") == 2 and "no error" not in out, out
    assert out.count("backend 'mpi', op shrink_group]") == 2 and out.count("MPICH's mpiexec") == 2
    assert "Use gloo for resilient training" in out


def test_a_failure_reported_by_a_backend_reaches_every_member() -> None:
    """Membership.report (the target of plugdist._lifecycle.regroup.report_failed_ranks): the
    reporter learns
    at once and aborts its groups; the death log tells the others, once per failed member."""
    import json

    from plugdist._backend.base import BackendBase
    from plugdist._group.process_group import ProcessGroup
    from plugdist._resilience.membership import Membership
    from plugdist.store import HashStore
    from plugdist.store._worldkeys import DEATHS

    store = HashStore()
    members = ["0", "1", "2"]
    reporter, other = Membership(store, "0", members), Membership(store, "1", members)
    pg = ProcessGroup(BackendBase(0, 3))
    reporter.watch(pg, members)
    reporter.report([2], "MPI reported it: MPI_ERR_PROC_FAILED")
    reporter.report([2, 0], "again")  # known already, or this process itself: ignored
    assert reporter.failed_ranks() == [2]
    assert pg.abort_signal.fired and pg.abort_signal.ranks == (2,)
    assert "rank 2 failed (MPI reported it: MPI_ERR_PROC_FAILED)" in str(pg.abort_signal.reason)
    assert store.add(DEATHS, 0) == 1
    assert json.loads(store.get(f"{DEATHS}/1"))["cause"] == "reported"
    other._read_deaths(store)
    assert other.failed_ranks() == [2] and "MPI_ERR_PROC_FAILED" in other.failed["2"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["tcp", "hash"])
def test_the_stores_keys_stay_bounded_over_many_shrinks_and_grows(monkeypatch, kind) -> None:  # type: ignore[no-untyped-def]
    """Membership on a real store (a TCPStore, whose wills and parked reads serve liveness; a
    HashStore, with heartbeats), one thread per member, through rounds of: a member dies (its
    will's record is appended: a TCPStore's server writes it when the member's connection drops),
    the survivors shrink, a joiner is admitted. The death log keeps counting, but its old
    entries, the join tickets, the claims and the heartbeats go: the store's keys stay flat.
    Every member learns every death, and a process excluded long ago, whose next entry was
    deleted, skips to what is left and learns that it is out (a TCPStore refuses it outright:
    its identity's holder left)."""
    monkeypatch.setenv("PLUGDIST_ALLOW_TOKENLESS_JOIN", "1")  # tokenless: the host consents
    import socket
    import threading
    from datetime import timedelta

    from plugdist import HashStore, Store, TCPStore
    from plugdist._resilience import liveness
    from plugdist._resilience.joining import request_join
    from plugdist._resilience.membership import Membership
    from plugdist._resilience.writes import append_log
    from plugdist.store._worldkeys import DEATHS, TRIM

    monkeypatch.setattr(liveness, "_PARKED_WAIT", 1.0)  # a stranded reader looks again within 1 s
    limit = timedelta(seconds=30)
    tcp = TCPStore("127.0.0.1", 0, None, is_master=True, timeout=limit) if kind == "tcp" else None
    master: Store = tcp or HashStore()
    stores = [master]

    def client() -> Store:
        if tcp is None:
            return master
        stores.append(TCPStore("127.0.0.1", tcp.port, None, timeout=limit))
        return stores[-1]

    def concurrently(calls: list[Any]) -> list[Any]:
        out: list[Any] = [None] * len(calls)

        def run(i: int) -> None:
            try:
                out[i] = calls[i]()
            except BaseException as err:  # noqa: BLE001 - reported below
                out[i] = err
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        errors = [o for o in out if isinstance(o, BaseException)]
        assert not errors, errors
        return out

    def eventually(what: Any, seconds: float = 10.0) -> bool:
        return wait_for(what, seconds)

    first = ["0", "1", "2", "3"]
    world = [Membership(client(), u, first) for u in first]
    stale: Membership | None = None
    try:
        for m in world:
            m.start()
        keys, logged, victims = [], [], []
        for round_ in range(8):
            victim = world.pop(round_ % len(world))
            victims.append(victim.uid)
            if tcp is not None:  # its connection drops, as when its process dies
                victim._stop.set()
                victim._will._conn.sock.shutdown(socket.SHUT_RDWR)
                victim.stop(withdraw=False)
            else:
                victim.stop()
                append_log(master, DEATHS, json.dumps({"uid": victim.uid, "cause": "died"}))
            concurrently([lambda m=m: m.enter(m.agree_shrink(None, limit)) for m in world])
            for m in world:
                assert eventually(lambda m=m, v=victim.uid: v in m.failed), (m.uid, victim.uid)
            ticket = f"plugdist/join/{round_ + 1}"
            joined = concurrently([lambda: request_join(client(), limit)] + [
                lambda m=m, t=ticket: eventually(lambda: master.check([t])) and m.enter(
                    m.agree_grow(limit)) for m in world])
            joiner, decision = joined[0]
            joiner.enter(decision)
            world.append(joiner)
            assert [m.epoch for m in world] == [2 * round_ + 2] * 4
            keys.append(master.num_keys())
            logged.append(master.add(DEATHS, 0))
        assert logged[-1] >= 3 * 8, logged  # a death, a decision and a join request a round
        assert max(keys[2:]) <= keys[1] + 4, f"the store's keys grew: {keys}"
        trim = json.loads(master.get(TRIM))
        assert trim["log"] >= logged[-3] and trim["tickets"] >= 5, (trim, logged)
        gone = [f"{DEATHS}/1", "plugdist/join/1", "plugdist/join/1/admitted",
                "plugdist/epoch/1/members"]
        assert not [k for k in gone if master.check([k])]
        # member "0" was stopped (and declared dead) in round 0; it comes back as it was then
        stale = Membership(client(), "0", first)
        if tcp is not None:
            with pytest.raises(DistStoreError, match="already left"):
                stale.start()
            stale = None
            return
        stale.start()
        assert eventually(lambda: stale.excluded_reason is not None
                          and stale._seen_deaths >= trim["log"]), (stale._seen_deaths, trim)
        # the last death came after the last trim: read from the log
        assert eventually(lambda: victims[-1] in stale.failed), (victims, stale.failed)
    finally:
        for m in world + ([stale] if stale else []):
            m.stop()
        for store in reversed(stores):
            store.close()


@pytest.mark.timeout(60)
def test_a_joiner_that_gave_up_is_never_admitted(monkeypatch: pytest.MonkeyPatch) -> None:
    """A joiner whose wait for admission timed out says so in the death log: the members'
    next grow skips its ticket and admits only the joiner still waiting (a withdrawn ticket
    once got admitted, and the grown group then waited in vain for the process that left)."""
    import threading
    from datetime import timedelta

    from plugdist import TCPStore
    from plugdist._resilience.joining import request_join
    from plugdist._resilience.membership import Membership
    from plugdist.errors import DistTimeoutError

    monkeypatch.setenv("PLUGDIST_ALLOW_TOKENLESS_JOIN", "1")  # tokenless: the host consents
    limit = timedelta(seconds=20)
    master = TCPStore("127.0.0.1", 0, None, is_master=True, timeout=limit)
    stores = [master]

    def client() -> TCPStore:
        stores.append(TCPStore("127.0.0.1", master.port, None, timeout=limit))
        return stores[-1]

    member = Membership(client(), "0", ["0"])
    joined: list[Any] = []
    try:
        member.start()
        with pytest.raises(DistTimeoutError, match="admission"):
            request_join(client(), timedelta(seconds=0.5))
        wait_for(lambda: "j1" in member.failed, 10)
        assert member.failed.get("j1", "").startswith("left (it gave up joining"), member.failed
        # recounted as the record is learnt; and the monitor's periodic look at the store's
        # join counters (every 30 s here, parked on the will's connection) goes on leaving the
        # ticket out: it once counted it again
        assert wait_for(lambda: member.joiners_waiting == 0, 10), member.joiners_waiting
        member._beat_and_check(member.store)
        assert member.joiners_waiting == 0
        waiting = threading.Thread(target=lambda: joined.append(request_join(client(), limit)))
        waiting.start()
        assert wait_for(lambda: master.check(["plugdist/join/2"]), 20)
        decision = member.agree_grow(limit)
        waiting.join(20)
        assert decision is not None and decision.joined == ["j2"], decision
        assert decision.members == ["0", "j2"] and joined[0][1].members == ["0", "j2"]
    finally:
        for m in [member] + [j for j, _ in joined]:
            m.stop()
        for store in reversed(stores):
            store.close()


@pytest.mark.timeout(60)
def test_a_transport_error_waits_for_membership_once() -> None:
    """AbortSignal.explain: an op's transport error waits up to ``confirm_grace`` for
    membership to name a failed member, once (when its Work fails; a wait on that Work looked
    again and waited a second grace), and not at all once the group is shut down; a failure
    named later still turns it into DistRankFailureError. The graces that must not be waited
    are 120 s here: the test's timeout fails such a wait."""
    from plugdist._backend.abort import AbortSignal
    from plugdist.errors import DistNetworkError, DistRankFailureError

    signal = AbortSignal()
    signal.monitored, signal.confirm_grace = True, 0.2
    err = DistNetworkError("lost its connection to a peer")
    assert signal.explain(err, "[here]") is err  # nobody failed: as it was, after the grace
    signal.confirm_grace = 120.0
    assert signal.explain(err, "[here]") is err  # the Work's wait: no second grace
    signal.fire("rank 1 died", (1,))
    named = signal.explain(err, "[here]")
    assert isinstance(named, DistRankFailureError) and named.__cause__ is err, named
    assert named.ranks == (1,) and "rank 1 died" in str(named)

    closing = AbortSignal()
    closing.monitored, closing.confirm_grace = True, 120.0
    closing.close()
    fresh = DistNetworkError("the group was shut down")
    assert closing.explain(fresh, "[here]") is fresh


@pytest.mark.timeout(60)
def test_keeping_the_will_for_the_exit_does_not_wait_for_the_parked_monitor() -> None:
    """``stop(withdraw=False)``, as at an exit on an uncaught exception, keeps the will (it runs
    when the process's connections close). The monitor parked on the will's connection wakes
    only when the will is withdrawn, so stop does not join it: joining held such an exit up
    for a second, and the others learned of the failure that much later. The kept will still
    runs when its connection drops, and the monitor ends then. A clean stop joins it."""
    import socket

    from plugdist import TCPStore
    from plugdist._resilience import liveness
    from plugdist._resilience.membership import Membership
    from plugdist.store._worldkeys import DEATHS

    limit = timedelta(seconds=20)
    master = TCPStore("127.0.0.1", 0, None, is_master=True, timeout=limit)
    clients = [TCPStore("127.0.0.1", master.port, None, timeout=limit) for _ in range(2)]
    try:
        failing, leaving = (Membership(clients[i], str(i), ["0", "1"]) for i in range(2))
        joined: dict[str, list[float | None]] = {"0": [], "1": []}
        monitors = {}
        for m in (failing, leaving):
            m.start()
            assert m._parked and m._thread is not None, m.uid
            monitors[m.uid] = thread = m._thread
            real_join = thread.join

            def recorded(timeout: float | None = None, uid: str = m.uid,
                         join: Any = real_join) -> None:
                joined[uid].append(timeout)
                join(timeout)
            thread.join = recorded  # type: ignore[method-assign]
        failing.stop(withdraw=False)
        assert joined["0"] == [] and monitors["0"].is_alive()
        will = liveness._kept_wills[-1]
        will._conn.sock.shutdown(socket.SHUT_RDWR)  # the process's connections close
        assert wait_for(lambda: master.add(DEATHS, 0) == 1, 10), "the kept will did not run"
        assert wait_for(lambda: not monitors["0"].is_alive(), 10)
        liveness._kept_wills.remove(will)
        leaving.stop()
        assert joined["1"] == [1.0] and not monitors["1"].is_alive()
    finally:
        for c in clients:
            c.close()
        master.close()
