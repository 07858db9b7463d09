"""Benchmark: all_reduce on GPUs through plugdist-nccl, against torch's own NCCL.

Three sides in one world, interleaved chunk by chunk: plugdist's frontend on plugdist's NCCL
group (``plugdist``), torch.distributed over that same group (``plugdist_nccl``, the ``bridge``)
and torch.distributed over a torch NCCL group of the same ranks (``torch``). All synchronous
(``async_op=False``), each measured two ways:

- **op+sync**: the op then ``torch.cuda.synchronize()``, timed per call: the latency a caller
  sees;
- **host**: a burst of ops with no synchronize, timed on the host and divided by the burst: what
  one op costs the CPU (the GPU runs behind). This is plugdist's own cost, whatever the transport.

Needs a GPU per rank, or ``PLUGDIST_TEST_RANKS_PER_GPU=2`` to put both ranks on one GPU (each then
gets its own NCCL_HOSTID; set NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_SOCKET_IFNAME=lo so they
talk over loopback sockets). Then NCCL's socket transport dominates op+sync, which the output
says: judge plugdist's cost by the host column, or at ``-n 1``.

    python benchmarks/nccl_bench.py -n 1 -b 8 -e 64M -f 8
    python benchmarks/nccl_bench.py -n 2 --quick      # a few sizes, under a minute over sockets
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from bridge_bench import _parse_size, _sizes

SIDES = ("plugdist", "bridge", "torch")
_TRANSPORT_BOUND = 5.0  # op+sync above this many times the host cost: the transport dominates


def _measure(sides: dict[str, Callable[[], Any]], sync: Callable[[], None],
             barrier: Callable[[], None], chunks: int, calls: int,
             burst: int) -> dict[str, dict[str, float]]:
    """Per side: the best chunk's median op+sync time and the best chunk's host time per op."""
    for fn in sides.values():  # warm-up (connections, the first op's communicator)
        for _ in range(3):
            fn()
        sync()
    latency: dict[str, list[float]] = {n: [] for n in sides}
    host: dict[str, list[float]] = {n: [] for n in sides}
    names = list(sides)
    for c in range(chunks):
        for name in (names if c % 2 == 0 else names[::-1]):
            fn = sides[name]
            barrier()
            times = []
            for _ in range(calls):
                t0 = time.perf_counter()
                fn()
                sync()
                times.append(time.perf_counter() - t0)
            latency[name].append(statistics.median(times))
            barrier()
            t0 = time.perf_counter()
            for _ in range(burst):
                fn()
            host[name].append((time.perf_counter() - t0) / burst)
            sync()
    return {n: {"latency": min(latency[n]), "host": min(host[n])} for n in names}


def allreduce_rank(rank: int, n: int, sizes: list[int], quick: bool) -> list[dict[str, Any]]:
    import plugdist
    import torch
    import torch.distributed as tdist
    from plugdist.testing.checks import check_device

    dev = check_device()
    assert dev is not None, "run with the nccl backend"
    torch_nccl = tdist.new_group(backend="nccl")

    def sync() -> None:
        torch.cuda.synchronize(dev)

    def barrier() -> None:
        tdist.barrier(group=torch_nccl)

    rows = []
    for nbytes in sizes:
        t = torch.ones(max(1, nbytes // 4), device=dev)
        calls = 10 if quick else max(10, min(200, int(40e6 / max(nbytes, 1))))
        burst = 20 if quick else max(10, min(500, int(200e6 / max(nbytes, 1))))
        res = _measure({"plugdist": lambda t=t: plugdist.all_reduce(t),
                        "bridge": lambda t=t: tdist.all_reduce(t),
                        "torch": lambda t=t: tdist.all_reduce(t, group=torch_nccl)},
                       sync, barrier, chunks=2 if quick else 4, calls=calls, burst=burst)
        rows.append({"bytes": nbytes, **res})
    return rows


def report(rows: list[dict[str, Any]], nproc: int) -> str:
    lines = [f"all_reduce, {nproc} rank(s), async_op=False: plugdist's frontend on plugdist-nccl, "
             "torch over plugdist_nccl (bridge), torch's own NCCL",
             "op+sync: op then torch.cuda.synchronize, median us; host: us of CPU per op in a "
             "burst without synchronize; x = side / torch",
             f"{'size(B)':>10} | {'op+sync: plugdist':>17} {'bridge':>7} {'torch':>7} "
             f"{'p/t':>6} {'b/t':>6} | {'host: plugdist':>14} {'bridge':>7} {'torch':>7} "
             f"{'p/t':>6} {'b/t':>6}"]
    transport_bound = []
    for r in rows:
        lat = {s: 1e6 * r[s]["latency"] for s in SIDES}
        host = {s: 1e6 * r[s]["host"] for s in SIDES}
        lines.append(
            f"{r['bytes']:>10} | {lat['plugdist']:>17.1f} {lat['bridge']:>7.1f} "
            f"{lat['torch']:>7.1f} {lat['plugdist'] / lat['torch']:>5.2f}x "
            f"{lat['bridge'] / lat['torch']:>5.2f}x | {host['plugdist']:>14.1f} "
            f"{host['bridge']:>7.1f} {host['torch']:>7.1f} "
            f"{host['plugdist'] / host['torch']:>5.2f}x {host['bridge'] / host['torch']:>5.2f}x")
        if lat["torch"] > _TRANSPORT_BOUND * max(host.values()):
            transport_bound.append(r["bytes"])
    if transport_bound:
        lines.append(
            f"note: at {', '.join(map(str, transport_bound))} B, op+sync is over "
            f"{_TRANSPORT_BOUND:.0f}x every side's host cost: the transport (NCCL moving the "
            f"data{', here over sockets between ranks that share a GPU' if nproc > 1 else ''}) "
            f"dominates those rows, not plugdist; compare plugdist's own cost in the host "
            f"columns")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], nproc: int, path: str) -> Any:
    """The op+sync latencies of every side against size, as a PNG at ``path``."""
    from plugdist._tools.plots import latency_plot
    sizes = [r["bytes"] for r in rows]
    names = {"plugdist": "plugdist (plugdist-nccl)", "bridge": "torch over plugdist_nccl",
             "torch": "torch's own NCCL"}
    return latency_plot(path, f"all_reduce, {nproc} rank(s), op + cuda synchronize "
                              f"(benchmarks/nccl_bench.py)",
                        {names[s]: (sizes, [1e6 * r[s]["latency"] for r in rows])
                         for s in SIDES})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-b", "--minbytes", default="8")
    p.add_argument("-e", "--maxbytes", default="64M")
    p.add_argument("-f", "--stepfactor", type=int, default=8)
    p.add_argument("-n", "--nproc", type=int, default=1,
                   help="ranks (1: no transport, so each path's own cost shows in op+sync too)")
    p.add_argument("--quick", action="store_true",
                   help="8 B, 64 KiB and 4 MiB with few iterations: under a minute at -n 2 over "
                        "sockets")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="also write the op+sync latencies as a PNG (pip install "
                        "'plugdist[plots]')")
    args = p.parse_args(argv)
    if args.plot:
        from plugdist._tools.plots import require
        require()   # fail now, not after the sweep
    import nccl_bench  # ranks import this module by its real name
    from plugdist.testing import run_world

    sizes = [8, 64 << 10, 4 << 20] if args.quick else \
        _sizes(_parse_size(args.minbytes), _parse_size(args.maxbytes), args.stepfactor)
    started = time.monotonic()
    rows = run_world(nccl_bench.allreduce_rank, args.nproc, backend="nccl",
                     args=(sizes, args.quick), timeout=900)[0]
    print(report(rows, args.nproc))
    if args.plot:
        plot(rows, args.nproc, args.plot)
        print(f"plot: {args.plot}")
    print(f"({time.monotonic() - started:.0f} s in all)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
