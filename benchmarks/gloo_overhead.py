"""What plugdist-gloo adds on top of torch's Gloo: all_reduce through a plugdist GlooProcessGroup
and through torch.distributed's own gloo group, in the same processes, in the same run.

    python benchmarks/gloo_overhead.py --nproc 2 --min-bytes 8 --max-bytes 64M --factor 4

Prints an nccl-tests-style table (size, time, algbw, busbw) for each, and the time ratio
plugdist / torch. Both sides are timed alternately, size by size, so machine noise hits both.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta
import torch


def _bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper()
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def bench_rank(rank: int, world: int, torch_port: int, sizes: list[int],
               min_seconds: float) -> list[tuple[int, float, float]]:
    import torch.distributed as tdist

    from plugdist.process_group import GroupOptions
    from plugdist.store import PrefixStore, TCPStore
    from plugdist_gloo import GlooProcessGroup

    timeout = timedelta(seconds=120)
    store = TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), world, rank == 0,
                     timeout=timeout)
    ours = GlooProcessGroup(PrefixStore("bench", store), rank, world,
                            GroupOptions(group_name="bench", timeout=timeout,
                                         global_ranks=tuple(range(world))))
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{torch_port}", rank=rank,
                             world_size=world, timeout=timeout)

    def run_ours(t: torch.Tensor) -> None:
        ours.all_reduce(t).wait()

    def run_torch(t: torch.Tensor) -> None:
        tdist.all_reduce(t)

    rows = []
    try:
        for size in sizes:
            t = torch.ones(max(1, size // 4), dtype=torch.float32)
            for run in (run_ours, run_torch):
                for _ in range(3):
                    run(t)
            # the iteration count must be the same on every rank: rank 0 picks it
            start = time.perf_counter()
            run_ours(t)
            one = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            ours.broadcast(one, src=0).wait()
            iters = max(5, min(2000, int(min_seconds / max(one.item(), 1e-6))))
            results = {}
            for _round in range(2):  # alternate twice so drift hits both sides
                for name, run in (("plugdist", run_ours), ("torch", run_torch)):
                    ours.barrier().wait()
                    start = time.perf_counter()
                    for _ in range(iters):
                        run(t)
                    took = (time.perf_counter() - start) / iters
                    results[name] = min(results.get(name, took), took)
            rows.append((t.numel() * 4, results["plugdist"], results["torch"]))
    finally:
        tdist.destroy_process_group()
        ours.shutdown()
        store.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--min-bytes", "-b", default="8")
    parser.add_argument("--max-bytes", "-e", default="64M")
    parser.add_argument("--factor", "-f", type=int, default=4)
    parser.add_argument("--min-seconds", type=float, default=0.2,
                        help="time each side at least this long per size")
    args = parser.parse_args(argv)

    from plugdist.testing import free_port, run_world

    sizes, size = [], _bytes(args.min_bytes)
    while size <= _bytes(args.max_bytes):
        sizes.append(size)
        size *= args.factor
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import gloo_overhead  # the ranks import this module by name

    per_rank = run_world(gloo_overhead.bench_rank, args.nproc, timeout=1800,
                         args=(free_port(), sizes, args.min_seconds))
    n = args.nproc
    bus = 2 * (n - 1) / n
    print(f"# all_reduce float32 SUM, {n} ranks, loopback; time = slowest rank; "
          f"torch {torch.__version__}")
    print(f"{'size(B)':>12} {'plugdist(us)':>13} {'algbw(GB/s)':>11} {'busbw':>7} "
          f"{'torch(us)':>11} {'algbw(GB/s)':>11} {'busbw':>7} {'ratio':>7}")
    for i, size in enumerate(sizes):
        nbytes = per_rank[0][i][0]
        ours = max(r[i][1] for r in per_rank)
        ref = max(r[i][2] for r in per_rank)
        print(f"{nbytes:>12} {ours * 1e6:>13.1f} {nbytes / ours / 1e9:>11.3f} "
              f"{nbytes / ours / 1e9 * bus:>7.3f} {ref * 1e6:>11.1f} {nbytes / ref / 1e9:>11.3f} "
              f"{nbytes / ref / 1e9 * bus:>7.3f} {ours / ref:>7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
