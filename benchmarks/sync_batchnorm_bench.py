"""Benchmark: plugdist.nn.SyncBatchNorm against BatchNorm, in the same processes.

torch's own SyncBatchNorm cannot run on CPU (its kernels are CUDA-only, and it refuses CPU
inputs), so the torch.distributed figure here is what its algorithm would need at the least on
CPU: torch's BatchNorm2d plus the same two collectives, issued through torch.distributed over
torch's Gloo (an all-gather of 2C + 1 float64 numbers per rank in forward, an all-reduce of 2C
floats in backward). Variants, interleaved round by round on every rank:

    bn              torch.nn.BatchNorm2d, each rank alone (no communication)
    bn+torch_comm   BatchNorm2d plus those two collectives over torch.distributed (Gloo)
    bn+plugdist_comm  the same, the collectives over plugdist's group (what SyncBatchNorm's own
                    arithmetic costs is the difference between it and plugdist_sync)
    plugdist_sync   plugdist.nn.SyncBatchNorm over plugdist's group (--backend, default gloo)

A step is forward and backward of one layer on a (batch, C, H, W) channels_last input.

    python benchmarks/sync_batchnorm_bench.py                      # gloo, 2 ranks
    python benchmarks/sync_batchnorm_bench.py --channels 256 --size 14 --backend toy

Ranks are started here with env:// rendezvous (not under mpiexec). Prints the median wall time per
step on rank 0, the CPU time of rank 0's process per step (all threads; steadier on a busy
machine), and both ratios to bn+torch_comm.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import time
from datetime import timedelta
from typing import Any

VARIANTS = ("bn", "bn+torch_comm", "bn+plugdist_comm", "plugdist_sync")


def _worker(rank: int, args: argparse.Namespace, port: int, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(args.nproc))
    import plugdist
    import plugdist.nn
    import torch
    import torch.distributed as tdist

    torch.set_num_threads(args.threads)
    plugdist.init_process_group(args.backend, timeout=timedelta(seconds=300))
    tstore = tdist.TCPStore("127.0.0.1", port + 1, args.nproc, rank == 0,
                            timedelta(seconds=300))
    tdist.init_process_group("gloo", store=tstore, rank=rank, world_size=args.nproc)

    c = args.channels
    bn = torch.nn.BatchNorm2d(c)
    sync = plugdist.nn.SyncBatchNorm(c)
    x = torch.randn(args.batch, c, args.size, args.size).contiguous(
        memory_format=torch.channels_last).requires_grad_()
    grad = torch.randn_like(x)
    stats = torch.zeros(2 * c + 1, dtype=torch.float64)
    gathered = torch.empty(args.nproc * stats.numel(), dtype=torch.float64)
    sums = torch.zeros(2 * c)

    def step(variant: str) -> None:
        layer = sync if variant == "plugdist_sync" else bn
        comm = {"bn+torch_comm": tdist, "bn+plugdist_comm": plugdist}.get(variant)
        if comm is not None:
            comm.all_gather_into_tensor(gathered, stats)
        out = layer(x)
        out.backward(grad)
        if comm is not None:
            comm.all_reduce(sums)

    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for v in VARIANTS:
        for _ in range(args.warmup):
            step(v)
    for r in range(args.rounds):
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
        for v in order:
            tdist.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            for _ in range(args.iters):
                step(v)
            times[v].append((time.perf_counter() - t0) / args.iters)
            cpu[v].append((time.process_time() - c0) / args.iters)
    if rank == 0:
        queue.put((times, cpu))
    tdist.destroy_process_group()
    plugdist.destroy_process_group()


def _free_port() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with socket.socket() as s:  # the torch store takes port + 1
            try:
                s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--channels", type=int, default=64)
    parser.add_argument("--size", type=int, default=28)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, args, port, queue)) for r in range(args.nproc)]
    for p in procs:
        p.start()
    times, cpu = queue.get(timeout=600)
    for p in procs:
        p.join()
    base = statistics.median(times["bn+torch_comm"])
    cpu_base = statistics.median(cpu["bn+torch_comm"])
    print(f"SyncBatchNorm step (forward + backward), input ({args.batch}, {args.channels}, "
          f"{args.size}, {args.size}) channels_last, {args.nproc} ranks x {args.threads} thread, "
          f"plugdist backend {args.backend}; median of {args.rounds} rounds x {args.iters} steps")
    print(f"{'variant':<18}{'wall ms':>9}{'min':>8}{'max':>8}{'ratio':>7}"
          f"{'cpu ms':>9}{'ratio':>7}   (ratios to bn+torch_comm; cpu: rank 0's process)")
    for v in VARIANTS:
        med, cmed = statistics.median(times[v]), statistics.median(cpu[v])
        print(f"{v:<18}{med * 1e3:>9.3f}{min(times[v]) * 1e3:>8.3f}{max(times[v]) * 1e3:>8.3f}"
              f"{med / base:>6.2f}x{cmed * 1e3:>9.3f}{cmed / cpu_base:>6.2f}x")


if __name__ == "__main__":
    main()
