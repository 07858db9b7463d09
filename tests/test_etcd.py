"""plugdist-etcd against real etcd servers started by the tests: a 3-member cluster on loopback
whose leader is SIGKILLed, a minority member killed and restarted, every member killed, while
real processes use the store; a gloo job whose store is etcd survives the leader's death.

The store conformance tests (every Store op) run on etcd in tests/test_stores.py; the launcher
with --rdzv-backend etcd in tests/test_launcher.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.pool import ThreadPool

import pytest

pytest.importorskip("plugdist_etcd")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import plugdist  # noqa: E402
from _store_workers import result, spawn, wait_ready  # noqa: E402
from plugdist.errors import DistStoreError  # noqa: E402
from plugdist.testing.harness import wait_for  # noqa: E402
from plugdist_etcd import EtcdStore, EtcdUnavailableError, parse_etcd_url  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def _heal(cluster) -> None:  # type: ignore[no-untyped-def]
    for i in range(cluster.size):
        if cluster.procs[i] is None:
            cluster.restart(i)
    cluster.wait_healthy(60)


def _churn(cluster, during: Callable[[], None], nproc: int = 3) -> list[dict]:  # type: ignore[no-untyped-def]
    """``nproc`` processes add and set in a loop while ``during()`` hurts the cluster; checks
    that every add counted exactly once and every set is there. Returns each process's report."""
    url = cluster.url(f"churn/{os.urandom(6).hex()}")
    s = plugdist.open_store(url, timedelta(seconds=30))
    procs = [spawn("churn", spec={"kind": "url", "url": url, "timeout": 30}, me=i, go="go",
                   stop="stop") for i in range(nproc)]
    try:
        for p in procs:
            wait_ready(p)
        s.set("go", "1")
        time.sleep(0.7)
        during()
        time.sleep(1.0)
        s.set("stop", "1")
        outs = [result(p, 90) for p in procs]
    finally:
        for p in procs:
            p.kill()
        _heal(cluster)
    assert [o["errors"] for o in outs] == [[]] * nproc
    adds = sorted(v for o in outs for v in o["adds"])
    assert len(adds) > 10 * nproc
    assert adds == list(range(1, len(adds) + 1)), "an add was lost or applied twice"
    assert s.get("counter") == str(len(adds)).encode()
    for i, o in enumerate(outs):
        got = s.multi_get([f"w{i}/{n}" for n in range(o["sets"])])
        assert len(got) == o["sets"]  # no key lost
    s.close()
    return outs


@pytest.mark.timeout(180)
def test_leader_sigkill_loses_nothing_and_stalls_briefly(etcd3) -> None:  # type: ignore[no-untyped-def]
    killed: list[float] = []

    def kill_leader() -> None:
        killed.append(time.time())
        etcd3.kill(etcd3.leader())

    outs = _churn(etcd3, kill_leader)
    stalls = [o["longest"] for o in outs]
    print(f"longest op per process across the leader's SIGKILL: {stalls}")
    # etcd elects a new leader in about a second (its defaults); a stall of several seconds
    # would mean the client waited out a dead member instead of moving on
    assert max(stalls) < 5.0, stalls


@pytest.mark.timeout(180)
def test_minority_member_killed_and_restarted_goes_unnoticed(etcd3) -> None:  # type: ignore[no-untyped-def]
    def bounce_follower() -> None:
        follower = (etcd3.leader() + 1) % etcd3.size
        etcd3.kill(follower)
        time.sleep(0.5)
        etcd3.restart(follower)

    outs = _churn(etcd3, bounce_follower)
    stalls = [o["longest"] for o in outs]
    print(f"longest op per process across a follower's restart: {stalls}")
    assert max(stalls) < 3.0, stalls


@pytest.mark.timeout(180)
def test_every_member_down_fails_each_pending_op_in_time(etcd3) -> None:  # type: ignore[no-untyped-def]
    limit = 2.0
    s = EtcdStore(etcd3.endpoints, f"down/{os.urandom(6).hex()}", timedelta(seconds=limit))
    s.set("kept", "1")
    s.set("text", "a")
    ops = {"set": lambda: s.set("x", "1"), "get": lambda: s.get("never"),
           "add": lambda: s.add("n", 1), "wait": lambda: s.wait(["never"]),
           "compare_set": lambda: s.compare_set("text", "a", "b"),
           "num_keys": s.num_keys, "queue_pop": lambda: s.queue_pop("q"),
           "append": lambda: s.append("text", "z")}
    outcome: dict[str, tuple[BaseException | None, float]] = {}

    def run(name: str, fn: Callable[[], object]) -> None:
        t0 = time.monotonic()
        try:
            fn()
            outcome[name] = (None, time.monotonic() - t0)
        except BaseException as err:  # noqa: BLE001
            outcome[name] = (err, time.monotonic() - t0)

    try:
        threads = [threading.Thread(target=run, args=(n, f)) for n, f in ops.items()
                   if n in ("get", "wait", "queue_pop")]
        for t in threads:
            t.start()
        time.sleep(0.3)  # the blocking ones are parked in watches now
        for i in range(etcd3.size):
            etcd3.kill(i)
        threads += [threading.Thread(target=run, args=(n, f)) for n, f in ops.items()
                    if n not in ("get", "wait", "queue_pop")]
        for t in threads[3:]:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        _heal(etcd3)
    for name, (err, took) in outcome.items():
        assert isinstance(err, EtcdUnavailableError) and isinstance(err, DistStoreError), \
            (name, err)
        assert all(e in str(err) for e in etcd3.endpoints), str(err)
        assert "no etcd endpoint" in str(err)
        assert took < limit + 2.0, (name, took)
    assert s.get("kept") == b"1"  # the data survived; the store works again
    s.close()


@pytest.mark.timeout(240)
def test_gloo_job_survives_the_leader_sigkill(etcd3) -> None:  # type: ignore[no-untyped-def]
    url = etcd3.url(f"job/{os.urandom(6).hex()}")
    ranks = [subprocess.Popen([sys.executable, os.path.join(HERE, "_etcd_job.py"), url, str(r)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    try:
        for p in ranks:
            wait_ready(p)
        time.sleep(1.0)
        etcd3.kill(etcd3.leader())
        time.sleep(2.0)
        plugdist.open_store(url, timedelta(seconds=30)).set("stop", "1")
        outs = [result(p, 120) for p in ranks]
    finally:
        for p in ranks:
            p.kill()
        _heal(etcd3)
    assert outs[0]["steps"] == outs[1]["steps"] > 1
    assert [o["bad"] for o in outs] == [0, 0]
    s = plugdist.open_store(url, timedelta(seconds=30))
    assert s.get("steps") == str(2 * outs[0]["steps"]).encode()
    s.close()


_WILL_HOLDER = r"""
import os, signal, sys
from datetime import timedelta
import plugdist
url, name, how = sys.argv[1:4]
store = plugdist.open_store(url, timedelta(seconds=20))
will = store.hold_will("deaths", name)
if how == "cancel":
    will.cancel()
    store.close()
    print("cancelled", flush=True)
else:
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.timeout(90)
def test_will_runs_once_when_its_holder_is_killed_and_not_when_cancelled(etcd1) -> None:  # type: ignore[no-untyped-def]
    """Three holders here watch (each process holding a will executes the orphaned ones); a
    holder that cancels leaves no entry, a SIGKILLed one exactly one, within the lease's
    liveness timeout."""
    url = etcd1.url(f"will/{os.urandom(6).hex()}")
    stores = [plugdist.open_store(url, timedelta(seconds=20)) for _ in range(3)]
    wills = [s.hold_will("deaths", f"watcher{i}") for i, s in enumerate(stores)]
    try:
        assert all(2.0 <= w.liveness_timeout <= 3.0 for w in wills), wills
        done = subprocess.run([sys.executable, "-c", _WILL_HOLDER, url, "polite", "cancel"],
                              capture_output=True, text=True, timeout=30)
        assert done.returncode == 0 and "cancelled" in done.stdout, done.stderr
        killed = subprocess.run([sys.executable, "-c", _WILL_HOLDER, url, "victim", "kill"],
                                capture_output=True, text=True, timeout=30)
        died = time.monotonic()
        assert killed.returncode == -signal.SIGKILL, killed.stderr
        stores[0].wait(["deaths/1"], timedelta(seconds=10))
        took = time.monotonic() - died
        assert took < wills[0].liveness_timeout + 1.0, took
        time.sleep(1.5)  # a second execution, or the cancelled will's, would be in by now
        assert stores[1].get("deaths") == b"1", "one will ran, once"
        assert stores[2].get("deaths/1") == b"victim"
        assert not stores[0].check(["deaths/2"])
        print(f"the killed holder's will ran {took:.2f}s after its death")
        wills[0].cancel()  # the other two would run it if it were still there
        time.sleep(wills[0].liveness_timeout + 0.5)
        assert stores[1].get("deaths") == b"1", "a cancelled will ran"
    finally:
        for w in wills:
            w.cancel()
        for s in stores:
            s.close()


def test_the_ring_finds_each_successor_near_far_and_around_the_end(etcd1) -> None:  # type: ignore[no-untyped-def]
    """_successor on real liveness keys: a near successor (within the first lookup's window),
    a far one (the whole-ring lookup), the first id after the last (around the end), and none
    for a holder alone."""
    from plugdist_etcd.client import b64
    store = EtcdStore(etcd1.endpoints, f"ring/{os.urandom(6).hex()}", timedelta(seconds=20))
    try:
        ids = [b"%016x" % v for v in (0x1000, 0x1000 + (1 << 40), 0x9000 << 48)]
        near, far, last = ids
        live = store._p + b"l/"
        store._txn([], [{"request_put": {"key": b64(live + near), "value": b64(b"x")}}], [], "t")
        assert store._successor(near)[0] is None, "alone"
        store._txn([], [{"request_put": {"key": b64(live + w), "value": b64(b"x")}}
                        for w in (far, last)], [], "t")
        assert store._successor(near)[0] == far          # 2^40 above: inside the window
        assert store._successor(far)[0] == last          # far above: the whole ring
        assert store._successor(last)[0] == near         # around the end
        assert store._successor(b"%016x" % 0x1001)[0] == far  # an id between two holders
    finally:
        store.delete_all()
        store.close()


_RING_HOLDER = r"""
import sys
from datetime import timedelta
import plugdist
url, name, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
stores = [plugdist.open_store(url, timedelta(seconds=20)) for _ in range(count)]
wills = [s.hold_will("deaths", f"{name}.{i}") for i, s in enumerate(stores)]
print("held", flush=True)
sys.stdin.readline()
"""


@pytest.mark.timeout(120)
def test_neighbours_killed_together_each_will_runs_once(etcd1) -> None:  # type: ignore[no-untyped-def]
    """5 processes hold 3 wills each (16 holders with the test's own, in a random ring order);
    two processes are SIGKILLed at once, so some of the 6 dead holders are likely neighbours
    in the ring: every one of their wills runs, exactly once, and no live holder's does."""
    url = etcd1.url(f"ring/{os.urandom(6).hex()}")
    store = plugdist.open_store(url, timedelta(seconds=30))
    watcher = store.hold_will("deaths", "watcher")
    procs = [subprocess.Popen([sys.executable, "-c", _RING_HOLDER, url, f"p{i}", "3"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(5)]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline() == "held\n", p.communicate()[1]
        procs[1].kill()
        procs[3].kill()
        store.wait(["deaths/6"], timedelta(seconds=60))
        time.sleep(2.0)  # a will run twice, or a live holder's, would be in by now
        assert store.get("deaths") == b"6"
        ran = sorted(store.get(f"deaths/{n}").decode() for n in range(1, 7))
        assert ran == [f"p{i}.{j}" for i in (1, 3) for j in range(3)], ran
    finally:
        for p in procs:
            p.kill()
            p.communicate()
        watcher.cancel()
        store.close()


def test_a_watcher_etcd_did_not_create_ends_the_stream(etcd1) -> None:  # type: ignore[no-untyped-def]
    """etcd's JSON gateway drops some create requests of a stream that carries many: the
    client tells each stream's watchers acknowledged from those it reports lost (a result
    with ``lost_creates``), so a caller never waits on a watcher that does not exist."""
    from plugdist_etcd import EtcdClient
    from plugdist_etcd.client import b64
    client = EtcdClient([f"http://{e}" for e in etcd1.endpoints], pool_size=1)
    accounted = []
    try:
        for r in range(10):
            creates = [{"key": b64(f"/lost/{os.getpid()}/{r}/{i}".encode()),
                        "start_revision": "1"} for i in range(32)]
            created = lost = 0
            for result in client.watch(creates, time.monotonic() + 20):
                created += bool(result.get("created"))
                lost += int(result.get("lost_creates", 0))
                if created == len(creates) or lost:
                    break
            accounted.append((created, lost))
    finally:
        client.close()
    assert all(c + n == 32 for c, n in accounted), accounted
    print("streams (created, reported lost):", accounted)


_NODE_WORKER = r"""
import sys
from datetime import timedelta
import plugdist
url, name, ttl = sys.argv[1], sys.argv[2], float(sys.argv[3])
store = plugdist.open_store(url, timedelta(seconds=20))
will = store.hold_will("deaths", name, ttl=ttl)
print("held", flush=True)
if sys.stdin.readline().strip() == "cancel":
    will.cancel()
    print("cancelled", flush=True)
sys.stdin.readline()
"""


def _liveness_leases(url: str) -> dict[bytes, int]:
    """The job's will liveness keys at ``url`` and the lease each was put with."""
    from plugdist_etcd import EtcdClient
    from plugdist_etcd.client import b64, prefix_end, unb64
    u = parse_etcd_url(url)
    client = EtcdClient(list(u.endpoints))
    live = f"/{u.prefix}/l/".encode()
    data = client.call("kv/range", {"key": b64(live), "range_end": b64(prefix_end(live))},
                       time.monotonic() + 10, "test")
    client.close()
    return {unb64(kv["key"]): int(kv.get("lease", 0)) for kv in data.get("kvs", [])}


@pytest.mark.timeout(150)
def test_a_node_keeper_renews_its_workers_wills_with_one_lease(etcd1, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """keep_node_wills: workers given the keeper's env put their liveness keys with the node's
    one lease and grant none of their own; a SIGKILLed worker's will runs at once (the keeper
    sees its process gone: with a 60 s lease that path is the only one that can run it within
    30 s), a SIGSTOPped one's after its will's 3 s TTL, a cancelled one's never, and a worker
    whose keeper names a lease of another cluster renews its own; closing the keeper runs the
    wills still held. The test process holds a will of its own: the ring's watcher."""
    url = etcd1.url(f"node/{os.urandom(6).hex()}", live_ttl=60)
    store = plugdist.open_store(url, timedelta(seconds=30))
    watcher = store.hold_will("deaths", "watcher")
    keeper = store.keep_node_wills(str(tmp_path / "node"))
    workers: dict[str, subprocess.Popen[str]] = {}

    def start(name: str, env: dict[str, str]) -> None:
        p = subprocess.Popen([sys.executable, "-c", _NODE_WORKER, url, name, "3"],
                             env=dict(os.environ, **env), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        workers[name] = p
        assert p.stdout is not None and p.stdout.readline() == "held\n", p.communicate()[1]

    try:
        assert keeper.lease.ttl == 60 and set(keeper.env) == {
            "PLUGDIST_ETCD_NODE_LEASE", "PLUGDIST_ETCD_NODE_DIR"}
        for name in ("killed", "stopped", "polite", "left"):
            start(name, keeper.env)
        start("elsewhere", dict(keeper.env, PLUGDIST_ETCD_NODE_LEASE="12345:60"))
        leases = sorted(_liveness_leases(url).values())
        assert leases.count(keeper.lease.id) == 4 and len(leases) == 6, leases
        own = [lease for lease in leases if lease != keeper.lease.id]
        assert 12345 not in own and len(set(own)) == 2, "the watcher's and 'elsewhere''s own"

        workers["killed"].kill()
        store.wait(["deaths/1"], timedelta(seconds=30))
        assert store.get("deaths/1") == b"killed"
        # the keeper counts a will after etcd deleted its key, which the watcher may see first
        assert wait_for(lambda: keeper.released == 1, 30), keeper.released

        os.kill(workers["stopped"].pid, signal.SIGSTOP)
        store.wait(["deaths/2"], timedelta(seconds=30))
        assert store.get("deaths/2") == b"stopped"
        assert wait_for(lambda: keeper.released == 2, 30), keeper.released
        os.kill(workers["stopped"].pid, signal.SIGCONT)

        polite = workers["polite"]
        assert polite.stdin is not None and polite.stdout is not None
        polite.stdin.write("cancel\n")
        polite.stdin.flush()
        assert polite.stdout.readline() == "cancelled\n"
        assert len(os.listdir(tmp_path / "node")) == 1, os.listdir(tmp_path / "node")

        keeper.close()   # 'left' still holds its will: it runs
        store.wait(["deaths/3"], timedelta(seconds=30))
        assert store.get("deaths/3") == b"left"
        time.sleep(1.0)  # a cancelled will, or a second run of one, would be in by now
        assert store.get("deaths") == b"3", store.get("deaths")
    finally:
        keeper.close()
        for p in workers.values():
            p.kill()
            p.communicate()
        watcher.cancel()
        store.close()


@pytest.mark.timeout(120)
def test_wills_outlive_the_etcd_leaders_death(etcd3) -> None:  # type: ignore[no-untyped-def]
    """No renewal reaches etcd while it elects a new leader (1-2 s, near the wills' 2 s TTL);
    the new leader extends every lease, so no live holder is taken for dead."""
    url = etcd3.url(f"willfail/{os.urandom(6).hex()}")
    stores = [plugdist.open_store(url, timedelta(seconds=30)) for _ in range(3)]
    wills = [s.hold_will("deaths", f"holder{i}") for i, s in enumerate(stores)]
    try:
        etcd3.kill(etcd3.leader())
        time.sleep(wills[0].liveness_timeout + 3.0)
        assert not stores[0].check(["deaths/1"]), stores[0].get("deaths/1")
    finally:
        for w in wills:
            w.cancel()
        for s in stores:
            s.close()
        _heal(etcd3)


def _heartbeat_keys(url: str) -> list[bytes]:
    """Keys of the job at ``url`` that belong to membership's heartbeats."""
    from plugdist_etcd import EtcdClient
    from plugdist_etcd.client import b64, prefix_end, unb64
    u = parse_etcd_url(url)
    client = EtcdClient(list(u.endpoints))
    p = f"/{u.prefix}/".encode()
    data = client.call("kv/range", {"key": b64(p), "range_end": b64(prefix_end(p)),
                                    "keys_only": True}, time.monotonic() + 10, "test")
    client.close()
    return [k for k in (unb64(kv["key"]) for kv in data.get("kvs", [])) if b"live/hb" in k]


_RESILIENT_PAIR = r"""
import sys, time
import plugdist as dist, torch
dist.init_process_group("gloo", init_method=sys.argv[1], rank=int(sys.argv[2]), world_size=2)
t = torch.ones(2)
dist.all_reduce(t)
time.sleep(1.0)  # the monitor's loop runs about ten times
dist.all_reduce(t)
print("SUM", t.tolist(), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.timeout(90)
def test_no_heartbeats_where_etcd_serves_liveness(etcd1) -> None:  # type: ignore[no-untyped-def]
    """With resilient groups on an etcd store, the ranks' liveness is their wills' leases: no
    heartbeat key is ever written."""
    url = etcd1.url(f"nohb/{os.urandom(6).hex()}")
    env = dict(os.environ, PLUGDIST_RESILIENCE="1")
    procs = [subprocess.Popen([sys.executable, "-c", _RESILIENT_PAIR, url, str(r)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0 and "SUM [4.0, 4.0]" in out, err[-2000:]
    assert _heartbeat_keys(url) == []
    # the job's keys stay (its lease outlives it by ttl): membership did run here
    s = plugdist.open_store(url, timedelta(seconds=10))
    assert s.check(["plugdist/epoch/current"])
    s.close()


@pytest.mark.resilience
@pytest.mark.timeout(150)
@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_resilient_gloo_world_on_etcd_names_a_failed_rank_and_shrinks(etcd1, tmp_path, how) -> None:  # type: ignore[no-untyped-def]
    """4 gloo ranks whose store is etcd; rank 2 SIGKILLs itself mid-loop (or SIGSTOPs: alive,
    connections open, silent): every survivor gets DistRankFailureError naming rank 2 within
    the will lease's TTL + 1 s, shrinks to 3 ranks and runs every collective correctly; no
    heartbeat key was written (the lease covers the hang too)."""
    from test_resilience import run_scenario, survivors
    url = etcd1.url(f"resilient/{os.urandom(6).hex()}")
    env = {"INIT_METHOD": url, **({"HANG": "1"} if how == "SIGSTOP" else {})}
    found = run_scenario(tmp_path, "kill_shrink_grow", 4, "gloo", victims="2", extra_env=env)
    alive = survivors(found)
    assert sorted(r["old_rank"] for r in alive) == [0, 1, 3]
    print(f"{how}: to the error per survivor:", [round(r["detect_s"], 2) for r in alive])
    for r in alive:
        assert r["error_type"] == "DistRankFailureError", r
        assert r["error_ranks"] == [2] and r["failed_known"] == [2], r
        assert "rank 2 died" in r["error"] and "shrink_group" in r["error"], r["error"]
        assert "stopped running" in r["error"], r["error"]
        # through the lease (2 s TTL), not the ops' 60 s timeout (speed: the benchmark)
        assert r["detect_s"] < 30, f"rank {r['old_rank']} named it after {r['detect_s']}s"
        assert r["size"] == 3 and r["bad"] == [], r
    assert sorted(r["rank"] for r in alive) == [0, 1, 2]
    assert _heartbeat_keys(url) == []


def test_url_parsing_keeps_credentials_out_of_reprs(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    u = parse_etcd_url("etcd://alice:s3cret@h1:2379,h2/jobs/j1?ttl=5&live_ttl=4")
    assert u.endpoints == ("http://h1:2379", "http://h2:2379") and u.prefix == "jobs/j1"
    assert u.user == "alice" and u.password == "s3cret" and u.ttl == 5 and u.live_ttl == 4
    assert "s3cret" not in repr(u)
    monkeypatch.setenv("ETCDCTL_USER", "bob:pw")
    monkeypatch.setenv("ETCDCTL_CACERT", "/ca.pem")
    u = parse_etcd_url("etcd://h1:1")
    assert (u.user, u.password, u.prefix) == ("bob", "pw", "plugdist")
    assert u.tls is not None and u.tls.ca_file == "/ca.pem" and u.endpoints == ("https://h1:1",)


@pytest.mark.timeout(60)
def test_user_and_password_auth(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """etcd with authentication on (its own member: enabling auth is cluster-wide): the store
    logs in with the URL's user, and a wrong password is refused without being shown."""
    from plugdist_etcd import EtcdClient, EtcdError
    from plugdist_etcd.testing import EtcdCluster
    with EtcdCluster(1, str(tmp_path)) as cluster:
        admin = EtcdClient([f"http://{cluster.endpoints[0]}"])
        deadline = time.monotonic() + 10
        try:
            admin.call("auth/user/add", {"name": "root", "password": "rootpw"}, deadline, "setup")
        except EtcdError as err:
            # a first try slower than the client's wait went through, and its repeat is refused
            if "already exists" not in str(err):
                raise
        admin.call("auth/user/grant", {"user": "root", "role": "root"}, deadline, "setup")
        admin.call("auth/enable", {}, deadline, "setup")
        s = plugdist.open_store(f"etcd://root:rootpw@{cluster.endpoints[0]}/auth",
                                timedelta(seconds=10))
        s.set("k", "v")
        assert s.add("n", 2) == 2 and s.get("k") == b"v"
        assert "rootpw" not in repr(s)
        s.close()
        with pytest.raises(DistStoreError) as info:
            plugdist.open_store(f"etcd://root:wrong@{cluster.endpoints[0]}/auth",
                                timedelta(seconds=5)).set("k", "v")
        assert "wrong" not in str(info.value) and "root" in str(info.value)


@pytest.mark.timeout(120)
def test_add_under_contention_counts_each_once(etcd1) -> None:  # type: ignore[no-untyped-def]
    """Many handles adding to one counter at once take the contention-free path (increments as
    keys, summed in the same transaction, folded later): each result is distinct and dense, and
    get, set, compare_set and append see the counter's sum."""
    url = etcd1.url(f"contend/{os.urandom(6).hex()}")
    nthreads, times = 24, 15
    seen: list[int] = []
    lock = threading.Lock()
    start = threading.Barrier(nthreads)

    def adder() -> None:
        s = plugdist.open_store(url, timedelta(seconds=60))
        start.wait()
        got = [s.add("counter", 1) for _ in range(times)]
        with lock:
            seen.extend(got)
        s.close()

    threads = [threading.Thread(target=adder) for _ in range(nthreads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total = nthreads * times
    assert sorted(seen) == list(range(1, total + 1))
    s = plugdist.open_store(url, timedelta(seconds=10))
    assert s.get("counter") == str(total).encode()
    assert s.num_keys() == 1
    assert s.compare_set("counter", str(total), "1000") == b"1000"
    assert s.add("counter", 5) == 1005
    # increments pending again, then set() replaces the whole counter
    with ThreadPool(8) as pool:
        pool.map(lambda _: plugdist.open_store(url, timedelta(seconds=30)).add("c2", 2), range(8))
    assert s.get("c2") == b"16"
    s.set("c2", "text")
    assert s.get("c2") == b"text"
    with pytest.raises(DistStoreError, match="not an integer"):
        s.add("c2", 1)
    assert s.get("c2") == b"text"
    s.append("c2", "!")
    assert s.get("c2") == b"text!"
    s.close()



@pytest.mark.timeout(120)
def test_adds_of_one_and_of_others_mix_on_one_counter(etcd1) -> None:  # type: ignore[no-untyped-def]
    """Adds of 1 (counted by etcd, not read) and of other amounts (read and summed) at once on
    one counter: the results put every add in one order, each the sum of those before it and
    its own, and the counter ends at the total."""
    url = etcd1.url(f"mixed/{os.urandom(6).hex()}")
    amounts = [1, 1, 3, 1, -2, 1, 7, 1] * 4
    start = threading.Barrier(len(amounts))
    results: list[tuple[int, int]] = []
    lock = threading.Lock()

    def adder(amount: int) -> None:
        s = plugdist.open_store(url, timedelta(seconds=60))
        start.wait()
        got = [s.add("counter", amount) for _ in range(5)]
        with lock:
            results.extend((value, amount) for value in got)
        s.close()

    threads = [threading.Thread(target=adder, args=(a,)) for a in amounts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 5 * len(amounts)
    # each add is a step from (result - amount) to result; the adds took effect in one order
    # exactly when these steps form one walk from 0 that takes every step (an Euler path)
    steps: dict[int, list[int]] = {}
    for value, amount in results:
        steps.setdefault(value - amount, []).append(value)
    walk, stack = [], [0]
    while stack:
        if steps.get(stack[-1]):
            stack.append(steps[stack[-1]].pop())
        else:
            walk.append(stack.pop())
    assert len(walk) == len(results) + 1, f"the adds fit no one order: {sorted(results)}"
    total = walk[0]
    s = plugdist.open_store(url, timedelta(seconds=10))
    assert total == 5 * sum(amounts)
    assert s.get("counter") == str(total).encode()
    assert s.add("counter", 0) == total
    s.close()

def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


@pytest.mark.timeout(90)
def test_tls_with_client_certificates(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """etcd serving https and asking for a client certificate (--client-cert-auth): the store
    connects with the URL's CA, certificate and key; without a certificate it is refused."""
    import shutil
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make certificates with")
    from plugdist_etcd.testing import EtcdCluster
    d = str(tmp_path)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca",
             "-keyout", f"{d}/ca.key", "-out", f"{d}/ca.pem")
    with open(f"{d}/san.cnf", "w") as f:
        f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,"
                "clientAuth\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                 "-keyout", f"{d}/{name}.key", "-out", f"{d}/{name}.csr")
        _openssl("x509", "-req", "-in", f"{d}/{name}.csr", "-CA", f"{d}/ca.pem", "-CAkey",
                 f"{d}/ca.key", "-CAcreateserial", "-days", "1", "-extfile", f"{d}/san.cnf",
                 "-out", f"{d}/{name}.pem")
    cluster = EtcdCluster(1, f"{d}/data", client_tls=(f"{d}/server.pem", f"{d}/server.key",
                                                       f"{d}/ca.pem"))
    with cluster:
        url = cluster.url("tls", cacert=f"{d}/ca.pem", cert=f"{d}/client.pem",
                          key=f"{d}/client.key")
        assert url.startswith("etcds://")
        s = plugdist.open_store(url, timedelta(seconds=10))
        s.set("k", "v")
        assert s.get("k") == b"v" and s.add("n", 3) == 3
        s.close()
        with pytest.raises(DistStoreError, match="no etcd endpoint"):
            plugdist.open_store(cluster.url("tls", cacert=f"{d}/ca.pem"), timedelta(seconds=2))


def test_an_unauthenticated_remote_etcd_says_its_membership_is_exposed() -> None:
    """The core's membership keys are plain keys in etcd: a store reached beyond loopback with
    neither a user nor a client certificate says so (resilient groups then stay off unless
    turned on explicitly, with one warning); with authentication, or on loopback, it does not.
    No etcd is contacted (ttl=0: no job lease)."""
    import warnings

    from plugdist._world import groups

    remote = EtcdStore(["10.255.255.1:2379"], "job", ttl=0)
    why = remote.membership_exposure()
    assert why is not None and "without authentication" in why and "10.255.255.1" in why
    assert EtcdStore(["127.0.0.1:2379"], "job", ttl=0).membership_exposure() is None
    assert EtcdStore(["10.255.255.1:2379"], "job", ttl=0, user="job",
                     password="x").membership_exposure() is None
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert groups._store_exposed(remote, "auto") is True      # off by default
        assert groups._store_exposed(remote, "on") is False       # on when asked for
    assert len(seen) == 1 and "resilient groups are off" in str(seen[0].message)
