"""Benchmark: plugdist DistributedDataParallel against torch.nn.parallel.DistributedDataParallel.

Both run in the same processes on the same model (by default 8 x Linear(1024, 1024) + ReLU,
batch 32, 2 ranks, 1 intra-op thread each): plugdist's DDP over ``--backend`` (gloo by default;
mpi starts the ranks with mpiexec), torch's DDP over torch's Gloo. Variants are interleaved
round by round (in alternating order) so that both see the same machine load; the figure per
variant is the median time per iteration (zero_grad, forward, loss, backward, SGD step) measured
on rank 0 after warm-up.

    python benchmarks/ddp_bench.py                       # defaults above
    python benchmarks/ddp_bench.py --iters 30 --rounds 5 --backend mpi

The ranks run under plugdist.testing.run_world: a rank that fails stops the run within seconds,
and the benchmark exits 1 with that rank's error.

Prints one line per variant (wall-clock median, min, max, and the CPU time of rank 0's process
per iteration, all threads: steadier than wall time on a busy machine), the plugdist/torch
ratios, and plugdist's measured communication/computation overlap (its runtime logging data).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

VARIANTS = ("no_ddp", "torch", "plugdist", "torch_view", "plugdist_view")


def build_model(layers: int, width: int) -> Any:
    import torch

    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods)


def bench_rank(rank: int, world_size: int, args: argparse.Namespace,
               torch_port: int) -> dict[str, Any] | None:
    """One rank (plugdist's group already initialized by run_world); rank 0 returns the data."""
    import torch
    import torch.distributed as tdist
    from plugdist.parallel import DistributedDataParallel as PDDP

    torch.set_num_threads(args.threads)
    tstore = tdist.TCPStore("127.0.0.1", torch_port, world_size, rank == 0,
                            timedelta(seconds=300))
    tdist.init_process_group("gloo", store=tstore, rank=rank, world_size=world_size)

    def make(variant: str) -> Any:
        model = build_model(args.layers, args.width)
        view = variant.endswith("_view")
        if variant == "no_ddp":
            return model, None
        if variant.startswith("torch"):
            return model, torch.nn.parallel.DistributedDataParallel(
                model, bucket_cap_mb=args.bucket_cap_mb, gradient_as_bucket_view=view)
        return model, PDDP(model, bucket_cap_mb=args.bucket_cap_mb, gradient_as_bucket_view=view)

    variants = [v for v in VARIANTS if v in args.variants]
    models = {v: make(v) for v in variants}
    x = torch.randn(args.batch, args.width)
    y = torch.randn(args.batch, args.width)
    times: dict[str, list[float]] = {v: [] for v in variants}
    cpu: dict[str, list[float]] = {v: [] for v in variants}

    def run(variant: str, iters: int, record: bool) -> None:
        model, ddp = models[variant]
        net = ddp if ddp is not None else model
        opt = opts[variant]
        for _ in range(iters):
            c0 = time.process_time()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(net(x), y)
            loss.backward()
            opt.step()
            if record:
                times[variant].append(time.perf_counter() - t0)
                cpu[variant].append(time.process_time() - c0)

    opts = {v: torch.optim.SGD(models[v][0].parameters(), lr=1e-4) for v in variants}
    for v in variants:
        run(v, args.warmup, record=False)
    for r in range(args.rounds):
        # alternate the order so that no variant always follows the same one
        for v in (variants if r % 2 == 0 else variants[::-1]):
            tdist.barrier()
            run(v, args.iters, record=True)
    overlap = {}
    for v in variants:
        ddp = models[v][1]
        if ddp is not None and v.startswith("plugdist"):
            data = ddp._get_ddp_logging_data()
            keys = ("avg_backward_compute_time", "avg_backward_comm_time",
                    "avg_backward_compute_comm_overlap_time", "bucket_sizes")
            overlap[v] = {k: data[k] for k in keys}
    tdist.destroy_process_group()
    return {"times": times, "cpu": cpu, "overlap": overlap} if rank == 0 else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def plot(med: dict[str, float], best: dict[str, float], cpu: dict[str, float],
         title: str, path: str) -> Any:
    """ms per iteration of each variant (wall median, wall best, rank 0's CPU) as a PNG."""
    from plugdist._tools.plots import bar_plot
    return bar_plot(path, title, ["wall, median", "wall, best", "CPU of rank 0"],
                    {v: [med[v], best[v], cpu[v]] for v in med}, "ms per iteration",
                    log=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="gloo",
                   help="plugdist backend under plugdist's DDP (default gloo; mpi runs the "
                        "ranks under mpiexec); torch's DDP always uses torch's gloo")
    p.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--layers", type=int, default=8, help="Linear+ReLU layers (default 8)")
    p.add_argument("--width", type=int, default=1024, help="features per layer (default 1024)")
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    p.add_argument("--bucket-cap-mb", type=float, default=25, help="DDP bucket size, both DDPs")
    p.add_argument("--warmup", type=int, default=5, help="untimed iterations per variant")
    p.add_argument("--iters", type=int, default=10, help="timed iterations per round")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per variant")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated subset of {','.join(VARIANTS)}")
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="seconds for the whole run before the ranks are stopped")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="also write ms/iter of each variant as a PNG (pip install "
                        "'plugdist[plots]')")
    args = p.parse_args(argv)
    if args.plot:
        from plugdist._tools.plots import require
        require()   # fail now, not after the run
    args.variants = args.variants.split(",")

    # the ranks import bench_rank by module name, and this file runs as __main__: import it
    # as ``ddp_bench`` (its directory is sys.path[0], which run_world hands to the ranks)
    import ddp_bench
    from plugdist.testing.harness import WorldError, run_world

    try:
        results = run_world(ddp_bench.bench_rank, args.nproc, backend=args.backend,
                            args=(args, _free_port()), timeout=args.timeout, group_timeout=300,
                            env={"PLUGDIST_TORCH_WORLD": "0"})  # torch DDP gets its own gloo
    except WorldError as err:
        print(f"ddp_bench: {err}", file=sys.stderr)
        return 1
    result = results[0]
    times, overlap = result["times"], result["overlap"]
    med = {v: statistics.median(ts) * 1e3 for v, ts in times.items() if ts}
    print(f"model {args.layers} x Linear({args.width}, {args.width}) + ReLU, batch {args.batch}, "
          f"{args.nproc} ranks x {args.threads} thread(s), backend {args.backend} (torch: gloo), "
          f"bucket_cap_mb {args.bucket_cap_mb}; median of {args.iters * args.rounds} iterations")
    cpu_med = {v: statistics.median(ts) * 1e3 for v, ts in result["cpu"].items() if ts}
    print(f"{'variant':<16}{'ms/iter':>10}{'min':>10}{'max':>10}{'cpu ms/iter':>14}")
    for v, m in med.items():
        ts = times[v]
        print(f"{v:<16}{m:>10.2f}{min(ts) * 1e3:>10.2f}{max(ts) * 1e3:>10.2f}{cpu_med[v]:>14.2f}")
    for ours, theirs in (("plugdist", "torch"), ("plugdist_view", "torch_view")):
        if ours in med and theirs in med:
            print(f"ratio {ours}/{theirs}: {med[ours] / med[theirs]:.3f} wall (median), "
                  f"{min(times[ours]) / min(times[theirs]):.3f} (best), "
                  f"{cpu_med[ours] / cpu_med[theirs]:.3f} cpu (rank 0 process, all threads)")
    for v, o in overlap.items():
        print(f"{v}: avg backward compute {o['avg_backward_compute_time'] / 1e6:.2f} ms, comm "
              f"{o['avg_backward_comm_time'] / 1e6:.2f} ms, overlap "
              f"{o['avg_backward_compute_comm_overlap_time'] / 1e6:.2f} ms, buckets "
              f"{o['bucket_sizes']} bytes")
    if args.plot:
        plot(med, {v: min(times[v]) * 1e3 for v in med}, cpu_med,
             f"DDP step, {args.layers} x Linear({args.width}), {args.nproc} ranks, backend "
             f"{args.backend} (benchmarks/ddp_bench.py)", args.plot)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
