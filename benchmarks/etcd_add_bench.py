"""Contention on one etcd counter: ``--adds`` handles, spread over ``--procs`` processes, each
``add(key, 1)`` once at the same moment on a fresh single-member etcd.

Each process opens its handles and starts a thread per handle, which waits for the go; the
parent sends the go once every process is ready and times from it to the last add's return.
Reports the time, whether every value 1..N came back exactly once, and whether the etcd member
logged a panic (etcd before 3.5.5 crashes on a read-only transaction whose client went away:
docs/resilience.md).

    .venv/bin/python benchmarks/etcd_add_bench.py --adds 1024 --procs 4
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path


def adders(url: str, count: int) -> None:
    """A process of ``count`` handles: 'ready', then on a line from stdin each adds 1 once."""
    import plugdist
    stores = [plugdist.open_store(url, timedelta(seconds=300)) for _ in range(count)]
    go = threading.Event()
    got: list[int] = []
    lock = threading.Lock()

    def one(store: plugdist.Store) -> None:
        go.wait()
        value = store.add("counter", 1)
        with lock:
            got.append(value)

    threads = [threading.Thread(target=one, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    print("ready", flush=True)
    sys.stdin.readline()
    go.set()
    for t in threads:
        t.join(timeout=330)
    print(json.dumps({"got": got, "done": time.time()}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--adds", type=int, default=1024, help="handles adding at once")
    p.add_argument("--procs", type=int, default=4, help="processes they are spread over")
    args = p.parse_args()
    from plugdist_etcd.testing import EtcdCluster
    with tempfile.TemporaryDirectory(prefix="etcd-add-") as tmp, EtcdCluster(1, tmp) as cluster:
        url = cluster.url("addbench")
        share = [args.adds // args.procs + (i < args.adds % args.procs) for i in range(args.procs)]
        procs = [subprocess.Popen([sys.executable, __file__, "--child", url, str(n)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True) for n in share]
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        go = time.time()
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        outs = [json.loads(proc.stdout.readline()) for proc in procs if proc.stdout]
        for proc in procs:
            proc.wait(timeout=60)
        got = sorted(v for o in outs for v in o["got"])
        panics = (Path(tmp) / "m0.log").read_text(errors="replace").count('"level":"panic"')
        print(f"{args.adds} adds from {args.procs} processes: "
              f"{max(o['done'] for o in outs) - go:.2f} s, {len(got)} returned, "
              f"each of 1..{args.adds} once: {got == list(range(1, args.adds + 1))}, "
              f"etcd panics: {panics}", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        adders(sys.argv[2], int(sys.argv[3]))
    else:
        main()
