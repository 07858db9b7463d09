"""Benchmark: torch.distributed over plugdist backends (``plugdist_*``), against torch's own Gloo.

Every comparison runs both sides in the same processes, interleaved chunk by chunk (alternating
which goes first) so that both see the same machine load; 2 ranks, 1 intra-op thread each, each
rank pinned to its own CPU (``--no-pin``: not).

    python benchmarks/bridge_bench.py                  # every part
    python benchmarks/bridge_bench.py --parts allreduce,overhead -e 1M

Parts:
  allreduce  torch.distributed.all_reduce over plugdist_mpi vs over torch's gloo, 8 B .. 64 MiB
             (mpiexec; torch's default group is plugdist's MPI world, gloo a torch subgroup);
             also plugdist's own all_reduce on that MPI group, async (Work + wait) and sync
  overhead   the bridge's own cost: torch.distributed.all_reduce over plugdist_gloo vs
             plugdist.all_reduce on the very same plugdist gloo group
  floor      the same on a one-rank group whose op does nothing (the CPU each route costs, free
             of gloo's own 30-60 us and its noise), with torch's floor beside it: torch's
             all_reduce on a Python group whose allreduce returns a finished Work at once
  ddp        torch DDP iteration on 8 x Linear(1024) + ReLU, batch 32: plugdist_mpi vs gloo
  fsdp       the same model under FSDP2 (fully_shard per Linear and the root)
  import     what the torch.backends entry point adds to ``import torch``

Times are the best chunk's median per op (or iteration); ratio is the median over chunks of
ours/theirs measured back to back (below 1: ours is faster).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

PARTS = ("allreduce", "overhead", "floor", "ddp", "fsdp", "import")
_CHUNKS = 6


def _sizes(lo: int, hi: int, factor: int) -> list[int]:
    out, n = [], lo
    while n < hi:
        out.append(n)
        n *= factor
    return out + [hi]


def _parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def _interleaved(sides: Mapping[str, Callable[..., Any]], iters: int, barrier: Callable[..., Any],
                 chunks: int = _CHUNKS) -> dict[str, Any]:
    """Per side: the best chunk's median time of one call; ratio of the first side to the
    second as the median of chunk-by-chunk ratios."""
    names = list(sides)
    for fn in sides.values():  # warm-up
        for _ in range(3):
            fn()
    med: dict[str, list[float]] = {n: [] for n in names}
    for c in range(chunks):
        for name in (names if c % 2 == 0 else names[::-1]):
            fn = sides[name]
            barrier()
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            med[name].append(statistics.median(times))
    out: dict[str, Any] = {n: min(v) for n, v in med.items()}
    if len(names) >= 2:
        out["ratio"] = statistics.median(a / b for a, b in zip(med[names[0]], med[names[1]],
                                                               strict=True))
    return out


def _iters(nbytes: int) -> int:
    return max(5, min(400, int(20e6 / max(nbytes, 1))))


# -- rank bodies (run by plugdist.testing.run_world) -------------------------------------------
def _pin(rank: int, pin: bool) -> None:
    """Pin every thread of this rank to CPU ``rank``, as plugdist-bench does (before the gloo
    group exists, so its threads inherit the pin): unpinned, the scheduler at times puts both
    ranks on one core, and then an op that polls (MPI) takes 50-85 us instead of 7-11 us for
    whole chunks at a time."""
    if pin:
        from plugdist._tools.bench import pin_process

        pin_process(rank)


def _async_all_reduce(t: Any) -> None:
    import plugdist

    work = plugdist.all_reduce(t, async_op=True)
    if work is None:
        raise RuntimeError("this rank is not in plugdist's default group")
    work.wait()


def allreduce_rank(rank: int, n: int, sizes: list[int], pin: bool = True) -> list[dict[str, Any]]:
    """Under mpiexec, plugdist's MPI world (the harness's init) is torch's default group."""
    import plugdist
    import torch
    import torch.distributed as tdist

    torch.set_num_threads(1)
    _pin(rank, pin)
    gloo = tdist.new_group(backend="gloo")
    rows = []
    for nbytes in sizes:
        t = torch.ones(max(1, nbytes // 4))
        # the same group through plugdist's own frontend: its async op (a Work, waited on) and
        # its synchronous one (no Work: the lean route)
        res = _interleaved({"plugdist_mpi": lambda t=t: tdist.all_reduce(t),
                            "gloo": lambda t=t: tdist.all_reduce(t, group=gloo),
                            "plugdist_async": lambda t=t: _async_all_reduce(t),
                            "plugdist_sync": lambda t=t: plugdist.all_reduce(t)},
                           _iters(nbytes), tdist.barrier)
        rows.append({"bytes": nbytes, **res})
    return rows


def overhead_rank(rank: int, n: int, sizes: list[int]) -> list[dict[str, Any]]:
    """plugdist's gloo world (the harness's init) is torch's default group: the same group
    called through torch (the bridge) and through plugdist's frontend."""
    import plugdist
    import torch
    import torch.distributed as tdist

    torch.set_num_threads(1)
    rows = []
    for nbytes in sizes:
        t = torch.ones(max(1, nbytes // 4))
        res = _interleaved({"torch_over_bridge": lambda t=t: tdist.all_reduce(t),
                            "plugdist": lambda t=t: plugdist.all_reduce(t),
                            "torch_async_wait": lambda t=t: tdist.all_reduce(
                                t, async_op=True).wait()},
                           4 * _iters(nbytes), plugdist.barrier)
        rows.append({"bytes": nbytes, **res})
    return rows


def overhead_in_process(sizes: list[int]) -> list[dict[str, Any]]:
    """The same comparison in a world of one (this process): no peer, no network, so what is
    left is the per-op cost of each route in Python and C++."""
    import plugdist
    import torch
    import torch.distributed as tdist

    torch.set_num_threads(1)
    plugdist.init_process_group("gloo", store=plugdist.HashStore(), rank=0, world_size=1)
    try:
        rows = overhead_rank(0, 1, sizes)
    finally:
        plugdist.destroy_process_group()
    if tdist.is_initialized():
        raise RuntimeError("torch's default group outlived plugdist's world")
    return rows


def floor_in_process(reps: int = 9, n: int = 20000) -> dict[str, float]:
    """µs per all_reduce of 2 floats, best of ``reps`` loops of ``n``, alternating, on one-rank
    groups in this process whose op does nothing: plugdist's ``run_blocking`` and
    ``plugdist.all_reduce``-style dispatch, torch over the bridge, torch over a bare Python group
    (torch's own cost of calling a Python backend)."""
    import torch
    import torch.distributed as tdist
    from plugdist import GroupOptions, ProcessGroup, ReduceOp
    from plugdist._torch.bridge import BridgeGroup
    from plugdist.backend import BackendBase
    from torch._C import _distributed_c10d as c10d

    class Nothing(BackendBase):
        backend_name = "nothing"

        def native_all_reduce(self, *, tensor: Any, op: Any) -> Any:
            raise NotImplementedError

        def native_blocking(self, op: str, kwargs: dict[str, Any]) -> None:
            return None

        def native_all_reduce_blocking(self, *, tensor: Any, op: Any) -> None:
            return None

    class Bare(c10d.ProcessGroup):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__(0, 1)
            done: torch.futures.Future = torch.futures.Future()
            done.set_result([])
            self.done = c10d._create_work_from_future(done)

        def allreduce(self, tensors: Any, opts: Any = None) -> Any:
            return self.done

        def getBackendName(self) -> str:  # noqa: N802
            return "bare"

    torch.set_num_threads(1)
    pg = ProcessGroup(Nothing(0, 1, GroupOptions(group_name="nothing", global_ranks=(0,))))
    bridge, bare, t, total = BridgeGroup(pg, "nothing", owned=False), Bare(), torch.ones(2), \
        ReduceOp.SUM
    sides: dict[str, Callable[[], Any]] = {
        "plugdist": lambda: pg.run_blocking("all_reduce", t, total),
        "torch_over_bridge": lambda: tdist.all_reduce(t, group=bridge),
        "torch_over_bare": lambda: tdist.all_reduce(t, group=bare)}
    best = {name: float("inf") for name in sides}
    for _ in range(reps):
        for name, fn in sides.items():
            start = time.perf_counter()
            for _ in range(n):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / n * 1e6)
    return best


def _reference_mlp(layers: int = 8, width: int = 1024) -> Any:
    import torch

    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*mods)


def training_rank(rank: int, n: int, kind: str, iters: int, chunks: int = 4,
                  pin: bool = True) -> dict[str, Any]:
    """DDP or FSDP2 iterations on the reference MLP over plugdist_mpi (torch's default group)
    and over a torch gloo group."""
    import torch
    import torch.distributed as tdist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    _pin(rank, pin)
    groups = {"plugdist_mpi": tdist.group.WORLD, "gloo": tdist.new_group(backend="gloo")}
    x, y = torch.randn(32, 1024), torch.randn(32, 1024)
    steps: dict[str, Callable[..., Any]] = {}
    for name, group in groups.items():
        model = _reference_mlp()
        if kind == "ddp":
            net = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
        else:
            mesh = DeviceMesh.from_group(group, "cpu")
            for layer in model:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            net = fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(net.parameters(), lr=1e-4)

        def step(net: Any = net, opt: Any = opt) -> None:
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(net(x), y).backward()
            opt.step()

        steps[name] = step
    # what no communication could beat: the same iteration on a plain model (no_ddp), in the
    # same interleaving; and one all_reduce of the whole gradient volume over each group
    plain = _reference_mlp()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=1e-4)

    def compute_only() -> None:
        plain_opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(plain(x), y).backward()
        plain_opt.step()

    steps["no_ddp"] = compute_only
    res = _interleaved(steps, iters, tdist.barrier, chunks=chunks)
    grads = torch.ones(sum(p.numel() for p in plain.parameters()))
    volume = _interleaved({name: lambda g=group: tdist.all_reduce(grads, group=g)
                           for name, group in groups.items()}, iters, tdist.barrier, chunks=chunks)
    res.update({f"all_reduce_{name}": volume[name] for name in groups})
    res["grad_bytes"] = grads.numel() * grads.element_size()
    return res


# -- import cost ----------------------------------------------------------------------------------
# run with PLUGDIST_TORCH_BACKENDS=0, so that import torch skipped the entry point
_ENTRY_COST = ("import os, time\n"
               "import torch\n"
               "del os.environ['PLUGDIST_TORCH_BACKENDS']\n"
               "t0 = time.perf_counter()\n"
               "import _plugdist_torch_autoload as a\n"
               "a.autoload()\n"
               "print(time.perf_counter() - t0)\n")


def import_cost(runs: int) -> dict[str, float]:
    """The entry point's own time (run by hand after ``import torch`` with the automatic run
    switched off), and ``import torch`` wall time with and without it (alternating)."""
    py = sys.executable
    off = {**os.environ, "PLUGDIST_TORCH_BACKENDS": "0"}
    entry = []
    for _ in range(runs):
        out = subprocess.run([py, "-c", _ENTRY_COST], env=off, capture_output=True, text=True,
                             check=True)
        entry.append(float(out.stdout.strip()))
    walls: dict[str, list[float]] = {"on": [], "off": []}
    for i in range(2 * runs):
        which = "on" if i % 2 == 0 else "off"
        env = {**os.environ} if which == "on" else off
        t0 = time.perf_counter()
        subprocess.run([py, "-c", "import torch"], env=env, check=True)
        walls[which].append(time.perf_counter() - t0)
    return {"entry_point_ms": 1e3 * statistics.median(entry),
            "import_torch_on_ms": 1e3 * statistics.median(walls["on"]),
            "import_torch_off_ms": 1e3 * statistics.median(walls["off"])}


# -- driver ---------------------------------------------------------------------------------------
def _table(rows: list[dict[str, Any]], ours: str, theirs: str) -> str:
    """speed-up: theirs / ours of the best chunks; paired: the same from the median of the
    back-to-back chunk ratios (steadier when the machine's load drifts)."""
    lines = [f"{'size(B)':>10} {ours + '(us)':>18} {theirs + '(us)':>14} {'speed-up':>9} "
             f"{'paired':>8}"]
    for r in rows:
        lines.append(f"{r['bytes']:>10} {1e6 * r[ours]:>18.1f} {1e6 * r[theirs]:>14.1f} "
                     f"{r[theirs] / r[ours]:>8.1f}x {1 / r['ratio']:>7.1f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("-b", "--minbytes", default="8")
    p.add_argument("-e", "--maxbytes", default="64M")
    p.add_argument("-f", "--stepfactor", type=int, default=4)
    p.add_argument("--train-iters", type=int, default=10, help="timed iterations per chunk")
    p.add_argument("--train-chunks", type=int, default=4,
                   help="interleaved chunks per side (more: steadier paired ratios under load)")
    p.add_argument("--import-runs", type=int, default=10)
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="do not pin rank r to CPU r (allreduce, ddp, fsdp; by default every "
                        "thread of each rank is pinned)")
    args = p.parse_args(argv)
    parts = args.parts.split(",")
    import bridge_bench  # ranks import this module by its real name
    from plugdist.testing import run_world

    sizes = _sizes(_parse_size(args.minbytes), _parse_size(args.maxbytes), args.stepfactor)
    if "allreduce" in parts:
        rows = run_world(bridge_bench.allreduce_rank, 2, backend="mpi", args=(sizes, args.pin),
                         timeout=1800)[0]
        print("torch.distributed.all_reduce over plugdist_mpi vs torch's gloo (2 ranks); the "
              "same MPI group through plugdist's frontend: async op + wait, and synchronous")
        table = _table(rows, "plugdist_mpi", "gloo").splitlines()
        print(table[0] + f" {'async(us)':>10} {'sync(us)':>9}")
        for line, r in zip(table[1:], rows, strict=True):
            print(f"{line} {1e6 * r['plugdist_async']:>10.1f} {1e6 * r['plugdist_sync']:>9.1f}",
                  flush=True)
    if "overhead" in parts:
        small = [s for s in sizes if s <= 64 << 10] or sizes[:1]
        rows = run_world(bridge_bench.overhead_rank, 2, backend="gloo", args=(small,),
                         timeout=1800)[0]
        for title, got in (("2 ranks", rows), ("1 rank, in this process: no network",
                                                overhead_in_process(small))):
            print(f"\nthe bridge's cost: torch.distributed.all_reduce over plugdist_gloo vs "
                  f"plugdist.all_reduce, same group ({title})")
            print(f"{'size(B)':>10} {'torch->bridge(us)':>18} {'async+wait(us)':>15} "
                  f"{'plugdist(us)':>13} {'bridge cost(us)':>16}")
            for r in got:
                print(f"{r['bytes']:>10} {1e6 * r['torch_over_bridge']:>18.1f} "
                      f"{1e6 * r['torch_async_wait']:>15.1f} {1e6 * r['plugdist']:>13.1f} "
                      f"{1e6 * (r['torch_over_bridge'] - r['plugdist']):>16.1f}", flush=True)
    if "floor" in parts:
        got = floor_in_process()
        print(f"\nwhat each route costs the CPU per all_reduce (1 rank, in this process, an op "
              f"that does nothing; best of 9 loops):\n  plugdist's run_blocking "
              f"{got['plugdist']:.2f} us; torch over the bridge {got['torch_over_bridge']:.2f} "
              f"us; torch over a bare Python group {got['torch_over_bare']:.2f} us\n  the "
              f"bridge adds {got['torch_over_bridge'] - got['plugdist']:.2f} us to plugdist's "
              f"own op, of which torch's floor (its all_reduce calling a Python group) is "
              f"{got['torch_over_bare']:.2f} us and the bridge's code "
              f"{got['torch_over_bridge'] - got['plugdist'] - got['torch_over_bare']:.2f} us",
              flush=True)
    for kind in ("ddp", "fsdp"):
        if kind in parts:
            res = run_world(bridge_bench.training_rank, 2, backend="mpi",
                            args=(kind, args.train_iters, args.train_chunks, args.pin),
                            timeout=1800)[0]
            print(f"\ntorch {kind.upper()} iteration, 8 x Linear(1024), batch 32, 2 ranks x 1 "
                  f"thread: plugdist_mpi {1e3 * res['plugdist_mpi']:.2f} ms, torch's gloo "
                  f"{1e3 * res['gloo']:.2f} ms; time ratio {res['plugdist_mpi'] / res['gloo']:.3f} "
                  f"(best), {res['ratio']:.3f} (paired)", flush=True)
            compute, volume = res["no_ddp"], res["all_reduce_plugdist_mpi"]
            print(f"  no communication (no_ddp): {1e3 * compute:.2f} ms; one all_reduce of the "
                  f"gradients ({res['grad_bytes'] / 2**20:.1f} MiB): plugdist_mpi "
                  f"{1e3 * volume:.2f} ms, gloo {1e3 * res['all_reduce_gloo']:.2f} ms\n"
                  f"  time ratio if communication were free: no_ddp / gloo = "
                  f"{compute / res['gloo']:.3f}; if it did not overlap the compute at all "
                  f"(2 ranks on 2 cores leave MPI's copies and sums no spare core): "
                  f"(no_ddp + all_reduce) / gloo = {(compute + volume) / res['gloo']:.3f}",
                  flush=True)
    if "import" in parts:
        res = import_cost(args.import_runs)
        print(f"\nimport torch: the plugdist entry point takes {res['entry_point_ms']:.2f} ms "
              f"(median of {args.import_runs}); import torch wall {res['import_torch_on_ms']:.0f} "
              f"ms with it, {res['import_torch_off_ms']:.0f} ms with PLUGDIST_TORCH_BACKENDS=0",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
