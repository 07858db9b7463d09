"""all_reduce through plugdist-mpi against raw mpi4py on the same buffers, in the same run.

    python benchmarks/mpi_bench.py                      # starts itself under mpiexec -n 2
    mpiexec -n 2 python benchmarks/mpi_bench.py -b 8 -e 64M -f 4 --dtype float32

Each rank is pinned to one CPU (rank r to the r-th CPU it may use) with one torch thread. For each
size, ``plugdist.all_reduce(t)`` (blocking form, through the frontend) and
``comm.Allreduce(MPI.IN_PLACE, t.numpy(), MPI.SUM)`` on a duplicate of COMM_WORLD are timed in
alternating chunks on the same tensor, so machine drift hits both alike. Times are medians of
per-op latencies on rank 0; algbw = bytes / time, busbw = algbw x 2(n-1)/n (nccl-tests);
ratio = plugdist time / mpi4py time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """'8', '64K', '1M' -> bytes."""
    text = text.strip().upper().removesuffix("B")
    if text and text[-1] in _UNITS:
        return int(float(text[:-1]) * _UNITS[text[-1]])
    return int(text)


def _under_mpiexec() -> bool:
    return any(v in os.environ for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"))


def _relaunch(args: argparse.Namespace) -> int:
    mpiexec = Path(sys.executable).with_name("mpiexec")
    cmd = [str(mpiexec) if mpiexec.exists() else "mpiexec", "-n", str(args.nproc),
           sys.executable, os.path.abspath(__file__), *sys.argv[1:]]
    return subprocess.call(cmd)


def _iters(nbytes: int) -> int:
    return max(8, min(800, int(60e6 / (nbytes + 20_000))))


def run(args: argparse.Namespace) -> None:
    import plugdist as dist
    import torch
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank, n = world.Get_rank(), world.Get_size()
    if args.pin:
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    torch.set_num_threads(1)
    dist.init_process_group("mpi")
    comm = world.Dup()        # raw mpi4py gets its own communicator, as plugdist's group has
    dtype = getattr(torch, args.dtype)
    esize = torch.empty(0, dtype=dtype).element_size()
    sizes, s = [], parse_size(args.minbytes)
    while s <= parse_size(args.maxbytes):
        sizes.append(s)
        s *= args.stepfactor

    def ours(t: torch.Tensor, _arr: object) -> None:
        dist.all_reduce(t)

    def theirs(_t: torch.Tensor, arr: object) -> None:
        comm.Allreduce(MPI.IN_PLACE, arr, op=MPI.SUM)

    rows = []
    for nbytes in sizes:
        count = max(1, nbytes // esize)
        t = torch.zeros(count, dtype=dtype)  # zeros stay zeros: no overflow over many rounds
        arr = t.view(torch.uint8).numpy() if dtype in (torch.float16, torch.bfloat16) else t.numpy()
        impls = [("ours", ours), ("theirs", theirs)]
        if dtype in (torch.float16, torch.bfloat16):
            impls = [("ours", ours)]  # MPI has no 16-bit float type to compare against
        samples: dict[str, list[float]] = {name: [] for name, _ in impls}
        for _name, fn in impls:
            for _ in range(3):
                fn(t, arr)
        iters = _iters(nbytes)
        chunk = max(2, iters // 4)
        for _ in range(4):
            for name, fn in impls:
                comm.Barrier()
                for _ in range(chunk):
                    t0 = time.perf_counter()
                    fn(t, arr)
                    samples[name].append(time.perf_counter() - t0)
        rows.append((nbytes, count, {k: statistics.median(v) for k, v in samples.items()}))
    dist.destroy_process_group()
    comm.Free()
    if rank == 0:
        print(_table(rows, args, n))
        sys.stdout.flush()


def _table(rows: list[tuple[int, int, dict[str, float]]], args: argparse.Namespace, n: int) -> str:
    bus = 2 * (n - 1) / n
    lines = [f"# plugdist-mpi all_reduce vs raw mpi4py: nproc={n} dtype={args.dtype} "
             f"pinned={args.pin} (median per-op latency on rank 0; ratio = plugdist / mpi4py)",
             f"{'size(B)':>12} {'count':>10} {'type':>9} {'time(us)':>10} {'algbw(GB/s)':>12} "
             f"{'busbw(GB/s)':>12} {'mpi4py(us)':>11} {'ratio':>7}"]
    for nbytes, count, t in rows:
        algbw = nbytes / t["ours"] / 1e9
        line = (f"{nbytes:>12} {count:>10} {args.dtype:>9} {t['ours'] * 1e6:>10.1f} "
                f"{algbw:>12.3f} {algbw * bus:>12.3f}")
        if "theirs" in t:
            line += f" {t['theirs'] * 1e6:>11.1f} {t['ours'] / t['theirs']:>7.3f}"
        lines.append(line)
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-b", "--minbytes", default="8")
    p.add_argument("-e", "--maxbytes", default="64M")
    p.add_argument("-f", "--stepfactor", type=int, default=4)
    p.add_argument("--dtype", default="float32",
                   choices=["float32", "float64", "int32", "int64", "float16", "bfloat16"])
    p.add_argument("-n", "--nproc", type=int, default=2, help="ranks, when not under mpiexec")
    p.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin ranks to CPUs")
    args = p.parse_args()
    if not _under_mpiexec():
        return _relaunch(args)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
