"""``plugdist-bench``: nccl-tests-style collective sweeps, compared in the same run.

    plugdist-bench --backend gloo --op all_reduce --nproc 2 -b 8 -e 64M -f 4 --compare torch

Each rank is pinned to one CPU (rank r to CPU r mod the CPU count; every thread of the process)
with one torch thread. For each size, plugdist and the comparison (torch.distributed on the same
backend, or raw mpi4py on the same buffers) are timed in alternating chunks inside the same
processes, so machine drift hits both alike; which side goes first alternates too. A time is the
lowest of 8 chunk medians of per-op latency on rank 0 (noise on a shared machine comes in
stretches; the quietest chunk of each side is reported). The ratio is the median over the 8
back-to-back chunk pairs of plugdist / comparison, which cancels drift the two minima need not
share. Bandwidths follow nccl-tests (algbw = bytes / time; busbw = algbw x the op's bus factor).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

__all__ = ["main", "parser", "parse_size", "pin_process"]

_BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}
_DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64")


def parse_size(text: str) -> int:
    """'8', '64K', '1M', '2G' -> bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def _sizes(begin: int, end: int, factor: int) -> list[int]:
    out, s = [], begin
    while s <= end:
        out.append(s)
        s *= factor
    return out


_CHUNKS = 8  # alternations of plugdist and the comparison per size


def _iters(nbytes: int) -> int:
    """Ops per side for one size: ~40 MB moved, at least 3 per chunk (a median needs them)."""
    return max(3 * _CHUNKS, min(600, int(40e6 / (nbytes + 20_000))))


COMPLETIONS = ("blocking", "work", "future")

# async_op=True twins of _ops's calls, for either API: (module, buffers, group) -> Work
_ASYNC: dict[str, Callable[[Any, Any, Any], Any]] = {
    "all_reduce": lambda d, buf, g: d.all_reduce(buf[0], group=g, async_op=True),
    "broadcast": lambda d, buf, g: d.broadcast(buf[0], 0, group=g, async_op=True),
    "reduce": lambda d, buf, g: d.reduce(buf[0], 0, group=g, async_op=True),
    "all_gather": lambda d, buf, g: d.all_gather_into_tensor(buf[1], buf[0], group=g,
                                                             async_op=True),
    "reduce_scatter": lambda d, buf, g: d.reduce_scatter_tensor(buf[1], buf[0], group=g,
                                                                async_op=True),
    "all_to_all": lambda d, buf, g: d.all_to_all_single(buf[1], buf[0], group=g, async_op=True),
}


def _ops(op: str, dist: Any, completion: str = "blocking") -> Callable[[Any, Any], None]:
    """A closure running one ``op`` on tensors prepared for it, for either API (same names):
    a blocking call, or (``completion``) an async op waited on through its Work (``work``) or
    its future (``future``)."""
    if completion != "blocking":
        start = _ASYNC[op]
        if completion == "work":
            return lambda buf, group: start(dist, buf, group).wait()
        return lambda buf, group: start(dist, buf, group).get_future().wait()
    if op == "all_reduce":
        return lambda buf, group: dist.all_reduce(buf[0], group=group)
    if op == "broadcast":
        return lambda buf, group: dist.broadcast(buf[0], 0, group=group)
    if op == "reduce":
        return lambda buf, group: dist.reduce(buf[0], 0, group=group)
    if op == "all_gather":
        return lambda buf, group: dist.all_gather_into_tensor(buf[1], buf[0], group=group)
    if op == "reduce_scatter":
        return lambda buf, group: dist.reduce_scatter_tensor(buf[1], buf[0], group=group)
    if op == "all_to_all":
        return lambda buf, group: dist.all_to_all_single(buf[1], buf[0], group=group)
    raise ValueError(f"unknown op {op!r}; choose from {sorted(_BUS_FACTOR)}")


def _buffers(op: str, count: int, dtype: Any, n: int, device: Any = None) -> tuple[Any, Any]:
    import torch

    kw = dict(dtype=dtype, device=device)
    if op == "all_gather":
        return torch.ones(count, **kw), torch.empty(count * n, **kw)
    if op == "reduce_scatter":
        per = max(1, count // n)
        return torch.ones(per * n, **kw), torch.empty(per, **kw)
    if op == "all_to_all":
        per = max(1, count // n)
        return torch.ones(per * n, **kw), torch.empty(per * n, **kw)
    return torch.ones(count, **kw), None


def _synchronized(fn: Callable[[Any, Any], None]) -> Callable[[Any, Any], None]:
    """``fn`` timed to completion: CUDA ops return once queued, so wait for the device."""
    import torch

    def run(buf: Any, group: Any) -> None:
        fn(buf, group)
        torch.cuda.synchronize()

    return run


def _mpi4py_op(op: str, completion: str = "blocking") -> Callable[[Any, Any], None]:
    """Raw mpi4py on numpy views of the same buffers (made once per size, outside the timing):
    the blocking call, or for an async ``completion`` its non-blocking twin, then ``Wait``."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if completion != "blocking":
        root = comm.Get_rank() == 0
        start: dict[str, Callable[[Any], Any]] = {
            "all_reduce": lambda arr: comm.Iallreduce(MPI.IN_PLACE, arr[0], op=MPI.SUM),
            "broadcast": lambda arr: comm.Ibcast(arr[0], root=0),
            "reduce": lambda arr: comm.Ireduce(MPI.IN_PLACE if root else arr[0],
                                               arr[0] if root else None, op=MPI.SUM, root=0),
            "all_gather": lambda arr: comm.Iallgather(arr[0], arr[1]),
            "reduce_scatter": lambda arr: comm.Ireduce_scatter_block(arr[0], arr[1], op=MPI.SUM),
            "all_to_all": lambda arr: comm.Ialltoall(arr[0], arr[1]),
        }
        begin = start[op]
        return lambda arr, _g: begin(arr).Wait()
    if op == "all_reduce":
        return lambda arr, _g: comm.Allreduce(MPI.IN_PLACE, arr[0], op=MPI.SUM)
    if op == "broadcast":
        return lambda arr, _g: comm.Bcast(arr[0], root=0)
    if op == "reduce":  # in place on the root, as plugdist's reduce
        if comm.Get_rank() == 0:
            return lambda arr, _g: comm.Reduce(MPI.IN_PLACE, arr[0], op=MPI.SUM, root=0)
        return lambda arr, _g: comm.Reduce(arr[0], None, op=MPI.SUM, root=0)
    if op == "all_gather":
        return lambda arr, _g: comm.Allgather(arr[0], arr[1])
    if op == "reduce_scatter":
        return lambda arr, _g: comm.Reduce_scatter_block(arr[0], arr[1], op=MPI.SUM)
    if op == "all_to_all":
        return lambda arr, _g: comm.Alltoall(arr[0], arr[1])
    raise ValueError(f"unknown op {op!r}")


def pin_process(rank: int) -> None:
    """Pin every thread of this process to CPU ``rank`` (mod the CPUs it may use).

    Every thread, not just the caller: the harness built plugdist's group (and its backend
    threads) before this runs, while the comparison's threads start later and would inherit a
    main-thread-only pin, timing the two sides under different placements."""
    cpus = sorted(os.sched_getaffinity(0))
    mine = {cpus[rank % len(cpus)]}
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:  # no procfs: pin what we can
        threads = [0]
    for tid in threads:
        try:
            os.sched_setaffinity(tid, mine)
        except OSError:  # the thread has ended meanwhile
            pass


def bench_rank(rank: int, world_size: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Runs on every rank (plugdist already initialized by the harness); rank 0's rows matter."""
    import torch

    import plugdist as dist
    from plugdist.testing.checks import check_device

    if cfg["pin"]:
        pin_process(rank)
    torch.set_num_threads(1)
    dtype = getattr(torch, cfg["dtype"])
    device = check_device()  # this rank's GPU for a CUDA-only backend, else None
    ours = _ops(cfg["op"], dist, cfg["completion"])
    theirs = None
    if cfg["compare"] == "torch":
        import torch.distributed as tdist

        tdist.init_process_group(cfg["backend"], init_method=f"tcp://127.0.0.1:{cfg['torch_port']}",
                                 rank=rank, world_size=world_size, timeout=timedelta(minutes=5))
        theirs = _ops(cfg["op"], tdist, cfg["completion"])
    elif cfg["compare"] == "mpi4py":
        theirs = _mpi4py_op(cfg["op"], cfg["completion"])
    if device is not None:
        ours = _synchronized(ours)
        theirs = _synchronized(theirs) if theirs is not None else None
    rows = []
    for nbytes in cfg["sizes"]:
        count = max(1, nbytes // torch.tensor([], dtype=dtype).element_size())
        buf = _buffers(cfg["op"], count, dtype, world_size, device)
        iters = max(cfg["iters"], 3 * _CHUNKS) if cfg["iters"] else _iters(nbytes)
        samples: dict[str, list[float]] = {"ours": [], "theirs": []}
        impls: list[tuple[str, Callable[[Any, Any], None], Any]] = [("ours", ours, buf)]
        if theirs is not None:
            their_buf = (tuple(None if b is None else b.numpy() for b in buf)
                         if cfg["compare"] == "mpi4py" else buf)
            impls.append(("theirs", theirs, their_buf))
        for _name, fn, b in impls:  # warm-up
            for _ in range(3):
                fn(b, None)
        chunk = iters // _CHUNKS
        for i in range(_CHUNKS):
            for name, fn, b in (impls if i % 2 == 0 else impls[::-1]):  # neither always first
                dist.barrier()
                times = []
                for _ in range(chunk):
                    t0 = time.perf_counter()
                    fn(b, None)
                    times.append(time.perf_counter() - t0)
                samples[name].append(statistics.median(times))
        # the best chunk's median: on a shared machine, noise comes in stretches that can cover
        # a whole chunk of one side; the quietest stretch compares like with like
        row = {"bytes": nbytes, "count": count, "ours": min(samples["ours"])}
        if theirs:
            row["theirs"] = min(samples["theirs"])
            # each chunk of ours ran right before one of theirs, under the same machine state:
            # the median of those paired ratios cancels drift that the two minima may not share
            row["ratio"] = statistics.median(
                o / t for o, t in zip(samples["ours"], samples["theirs"], strict=True))
        rows.append(row)
    if cfg["compare"] == "torch":
        import torch.distributed as tdist

        tdist.destroy_process_group()
    return rows


def _format(rows: list[dict[str, Any]], cfg: dict[str, Any], n: int) -> str:
    bus = _BUS_FACTOR[cfg["op"]](n)
    head = (f"{'size(B)':>12} {'count':>10} {'type':>9} {'time(us)':>10} "
            f"{'algbw(GB/s)':>12} {'busbw(GB/s)':>12}")
    if cfg["compare"]:
        head += f" {cfg['compare'] + '(us)':>12} {'ratio':>7}"
    lines = [f"# plugdist-bench: op={cfg['op']} backend={cfg['backend']} nproc={n} "
             f"dtype={cfg['dtype']} completion={cfg['completion']} "
             f"pinned={cfg['pin']} (per-op latency on rank 0, best of "
             f"{_CHUNKS} chunk medians; ratio = median over chunks of plugdist / "
             f"{cfg['compare'] or '-'}, each pair timed back to back)", head]
    for r in rows:
        t = r["ours"]
        algbw = r["bytes"] / t / 1e9
        line = (f"{r['bytes']:>12} {r['count']:>10} {cfg['dtype']:>9} {t * 1e6:>10.1f} "
                f"{algbw:>12.3f} {algbw * bus:>12.3f}")
        if "theirs" in r:
            line += f" {r['theirs'] * 1e6:>12.1f} {r['ratio']:>7.3f}"
        lines.append(line)
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    """plugdist-bench's command line; every option says what it does in ``--help``."""
    p = argparse.ArgumentParser(
        prog="plugdist-bench", description=__doc__.split("\n\n")[0].replace("``", ""),
        epilog="Sizes take K, M and G suffixes (powers of 1024). Prints one row per size: "
               "plugdist's per-op latency on rank 0, algbw and busbw (as nccl-tests), and with "
               "--compare the comparison's latency and the ratio plugdist / comparison.")
    p.add_argument("--backend", default="gloo",
                   help="plugdist backend to time (default gloo); an installed plugin's name")
    p.add_argument("--op", default="all_reduce", choices=sorted(_BUS_FACTOR),
                   help="the collective to time (default all_reduce)")
    p.add_argument("--nproc", type=int, default=2,
                   help="ranks on this host (default 2): one process each, started by "
                        "mpiexec -n for a backend that launches that way (mpi)")
    p.add_argument("-b", "--minbytes", default="8",
                   help="smallest size in bytes of each rank's input tensor (default 8)")
    p.add_argument("-e", "--maxbytes", default="64M",
                   help="largest size in bytes of each rank's input tensor (default 64M)")
    p.add_argument("-f", "--stepfactor", type=int, default=4,
                   help="multiply the size by this from one row to the next (default 4)")
    p.add_argument("--dtype", default="float32", choices=_DTYPES,
                   help="element type of the tensors (default float32)")
    p.add_argument("--compare", choices=["torch", "mpi4py"], default=None,
                   help="also time torch.distributed on the same backend (torch) or raw mpi4py "
                        "on the same buffers (mpi4py, with --backend mpi), interleaved with "
                        "plugdist in the same processes; default: plugdist alone")
    p.add_argument("--completion", choices=COMPLETIONS, default="blocking",
                   help="how each op is completed, on both sides: a blocking call (default), "
                        "or async_op=True then the Work's wait() (work) or get_future().wait() "
                        "(future); raw mpi4py then runs the non-blocking call and Wait()")
    p.add_argument("--iters", type=int, default=0,
                   help="ops per side for every size (default: ~40 MB moved, at least 24)")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="do not pin rank r to CPU r (by default each rank is pinned, with one "
                        "torch thread)")
    p.add_argument("--timeout", type=float, default=1800.0,
                   help="seconds for the whole sweep before the ranks are stopped (default 1800)")
    p.add_argument("--plot", default=None, metavar="PNG",
                   help="also write the latencies as a PNG (against size, log axes; with "
                        "--compare, both sides): needs pip install 'plugdist[plots]'")
    return p


def plot(rows: list[dict[str, Any]], cfg: dict[str, Any], n: int, path: str) -> Any:
    """The sweep's latencies against size as a PNG at ``path``; returns the figure."""
    from plugdist._tools.plots import latency_plot
    sizes = [r["bytes"] for r in rows]
    series = {f"plugdist ({cfg['backend']})": (sizes, [r["ours"] * 1e6 for r in rows])}
    if cfg["compare"]:
        name = "torch.distributed" if cfg["compare"] == "torch" else "mpi4py"
        series[f"{name} ({cfg['backend']})"] = (sizes, [r["theirs"] * 1e6 for r in rows])
    return latency_plot(path, f"{cfg['op']}, {n} ranks, {cfg['dtype']} (plugdist-bench)",
                        series)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.plot:
        from plugdist._tools.plots import require
        try:
            require()   # before the sweep, not after it
        except RuntimeError as err:
            print(f"plugdist-bench: --plot: {err}", file=sys.stderr)
            return 1
    from plugdist.testing.harness import WorldError, free_port, run_world

    cfg = {"op": args.op, "backend": args.backend, "dtype": args.dtype, "compare": args.compare,
           "pin": args.pin, "torch_port": free_port(), "iters": args.iters,
           "completion": args.completion,
           "sizes": _sizes(parse_size(args.minbytes), parse_size(args.maxbytes), args.stepfactor)}
    # under ``python -m plugdist._tools.bench`` this module is __main__; ranks import by real name
    from plugdist._tools import bench
    # torch's own default group is the comparison: plugdist's world must not take its place
    try:
        results = run_world(bench.bench_rank, args.nproc, backend=args.backend, args=(cfg,),
                            timeout=args.timeout, env={"PLUGDIST_TORCH_WORLD": "0"})
    except WorldError as err:  # a rank failed: the others were stopped within seconds
        print(f"plugdist-bench: {err}", file=sys.stderr)
        return 1
    print(_format(results[0], cfg, args.nproc))
    if args.plot:
        plot(results[0], cfg, args.nproc, args.plot)
        print(f"# plot: {args.plot}")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
