"""What observability costs: a small synchronous all_reduce loop over MPI, same run, same ranks.

Modes, run alternately in chunks (every rank runs the same chunk at the same time):

* ``mpi4py``      raw ``Allreduce`` on the same buffer (the floor);
* ``no hook``     ``run_blocking`` as it was before observability (:func:`before`): the
                  backend's lean route, looked up and called, with no observe check;
* ``off``         ``dist.all_reduce`` with nobody watching: the flight recorder off
                  (``TORCH_FR_BUFFER_SIZE=0``), no profiler; the hook is one check;
* ``recording``   ``dist.all_reduce`` with the flight recorder on (the default);
* ``profiling``   ``dist.all_reduce`` under ``torch.profiler.profile(record_shapes=True)``;
* ``async off``, ``async recording``: ``dist.all_reduce(t, async_op=True).wait()``, the
                  recorder off and on (an async op's entry is completed through its Work).

Then, on rank 0 alone, the same three plugdist modes on an in-process one-rank group whose lean
route does nothing: the CPU each mode costs per op, without the network's noise.

Prints µs per op on rank 0 — the best chunk (the one least disturbed by other load; the ratios
use it) and the median chunk — the ratios to ``no hook``, and what recording costs per op
(``recording`` - ``off``, best chunks; the same for async ops): the goals are the check
(in-process ``off`` - ``no hook``: over MPI ``off`` also pays the frontend) under 2% of the MPI
op, and recording at most 0.5 µs per op.

``--against PYTHON`` compares two installations in one run: this script runs under PYTHON (say,
the virtualenv of a checkout before a change) and under this interpreter, alternately,
``--repeat`` times each, and prints the best of each side's runs side by side.

    .venv/bin/python benchmarks/observability_bench.py            # starts mpiexec -n 2 itself
    .venv/bin/python benchmarks/observability_bench.py --iters 2000 --rounds 15 --numel 2
    .venv/bin/python benchmarks/observability_bench.py --against ../old/.venv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

MODES = ("mpi4py", "no hook", "off", "recording", "profiling", "async off", "async recording")


def before(pg: Any, op: str, *args: Any) -> None:
    """``ProcessGroup.run_blocking`` as it was before observability."""
    lean = pg._lean.get(op)
    if lean is None or not lean(pg, *args):
        pg._run_blocking_rest(op, args)


def set_recording(recorder: Any, on: bool) -> None:
    """Turn ``recorder`` on or off for every group now (an installation without ``switch``
    had ``on`` alone)."""
    switch = getattr(recorder, "switch", None)
    if switch is None:
        recorder.on = on
    else:
        switch(on)


def _under_mpi() -> bool:
    return any(k in os.environ for k in ("PMI_RANK", "OMPI_COMM_WORLD_RANK"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--iters", type=int, default=500, help="ops per chunk")
    parser.add_argument("--rounds", type=int, default=31, help="chunks per mode")
    parser.add_argument("--numel", type=int, default=2, help="float32 elements per all_reduce")
    parser.add_argument("--against", metavar="PYTHON",
                        help="another installation's interpreter: compare it with this one")
    parser.add_argument("--repeat", type=int, default=3,
                        help="runs of each side with --against (alternating)")
    parser.add_argument("--json", action="store_true", help="one JSON line of results")
    args = parser.parse_args()
    if args.against:
        compare(args)
        return
    if not _under_mpi():
        from plugdist.testing.harness import mpiexec_path

        env = {**os.environ, "TORCH_FR_BUFFER_SIZE": os.environ.get("TORCH_FR_BUFFER_SIZE", "2000"),
               "PLUGDIST_TORCH_WORLD": "0", "OMP_NUM_THREADS": "1"}
        sys.exit(subprocess.call([mpiexec_path(), "-n", str(args.nproc), sys.executable,
                                  *sys.argv], env=env))
    run(args)


def run(args: argparse.Namespace) -> None:
    import plugdist as dist
    import torch
    from plugdist._backend.reduce_op import ReduceOp
    from plugdist._observability.flight_recorder import recorder

    dist.init_process_group("mpi")
    pg = dist.group.WORLD
    rank = dist.get_rank()
    # the MPI plugin's communicator: the raw baseline on the same ranks (the group's backend
    # since plugin API 2; the group itself before)
    backend = pg.backend_for("cpu") if hasattr(pg, "backend_for") else pg
    comm = backend._comm
    from mpi4py import MPI

    t = torch.ones(args.numel)
    buf = t.numpy()
    total = ReduceOp.SUM

    def loop(mode: str) -> float:
        n = args.iters
        set_recording(recorder, mode.endswith("recording"))
        comm.Barrier()
        start = time.perf_counter()
        if mode == "mpi4py":
            for _ in range(n):
                comm.Allreduce(MPI.IN_PLACE, buf, MPI.SUM)
        elif mode == "no hook":
            for _ in range(n):
                before(pg, "all_reduce", t, total)
        elif mode == "profiling":
            with torch.profiler.profile(record_shapes=True):
                start = time.perf_counter()
                for _ in range(n):
                    dist.all_reduce(t)
                elapsed = time.perf_counter() - start
            set_recording(recorder, False)
            return elapsed / n * 1e6
        elif mode.startswith("async"):
            for _ in range(n):
                dist.all_reduce(t, async_op=True).wait()
        else:
            for _ in range(n):
                dist.all_reduce(t)
        elapsed = time.perf_counter() - start
        set_recording(recorder, False)
        return elapsed / n * 1e6

    for mode in MODES:  # warm up every path
        loop(mode)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            times[mode].append(loop(mode))
    if rank == 0:
        best = {m: min(v) for m, v in times.items()}
        med = {m: statistics.median(v) for m, v in times.items()}
        load = os.getloadavg()[0]
        local_best = local(args)
        if args.json:
            print(json.dumps({"mpi": best, "mpi_median": med, "local": local_best,
                              "load": load}), flush=True)
        else:
            print(f"all_reduce of {args.numel} float32, {args.nproc} ranks over MPI, "
                  f"{args.iters} ops x {args.rounds} chunks per mode (load average {load:.2f})")
            print(f"{'mode':<12}{'best us/op':>12}{'median':>10}{'best vs no hook':>17}")
            for m in MODES:
                print(f"{m:<12}{best[m]:>12.2f}{med[m]:>10.2f}"
                      f"{best[m] / best['no hook']:>17.3f}")
            print(f"dist.all_reduce, nobody watching: "
                  f"{100 * (best['off'] / best['no hook'] - 1):+.1f}% over the lean route "
                  f"called directly (the frontend and the observe check); recording "
                  f"costs {best['recording'] - best['off']:.2f} us/op over MPI "
                  f"({best['recording'] / best['off']:.3f}x off; goal <= 0.5 us); "
                  f"an async op's recording costs "
                  f"{best['async recording'] - best['async off']:.2f} us/op")
            print("in-process, an op that does nothing: best us/op " + ", ".join(
                f"{m} {v:.2f}" for m, v in local_best.items())
                + f"; the check costs "
                  f"{1000 * (local_best['off'] - local_best['no hook']):.0f} ns "
                  f"({100 * (local_best['off'] - local_best['no hook']) / best['off']:.1f}% "
                  f"of the MPI op, off; goal < 2%), recording "
                  f"{1000 * (local_best['recording'] - local_best['off']):.0f} ns "
                  f"(goal <= 500 ns)")
    comm.Barrier()
    dist.destroy_process_group()


def local(args: argparse.Namespace) -> dict[str, float]:
    """The CPU cost per op of each mode (best chunk, µs), on a group whose op does nothing."""
    import torch
    from plugdist import GroupOptions, ProcessGroup
    from plugdist._backend.reduce_op import ReduceOp
    from plugdist._observability.flight_recorder import recorder

    try:  # plugin API 2: a backend under the group; before it, the group was the backend
        from plugdist.backend import BackendBase
    except ImportError:
        BackendBase = None  # noqa: N806
    base: Any = ProcessGroup if BackendBase is None else BackendBase

    class Nothing(base):  # type: ignore[misc,valid-type]
        backend_name = "nothing"

        def native_all_reduce(self, *, tensor: torch.Tensor, op: ReduceOp) -> None:
            raise NotImplementedError

        def native_blocking(self, op: str, kwargs: dict) -> None:
            return None

        def native_all_reduce_blocking(self, *, tensor: torch.Tensor, op: ReduceOp) -> None:
            return None

    made = Nothing(0, 2, GroupOptions(group_name="local", global_ranks=(0, 1)))
    pg = made if BackendBase is None else ProcessGroup(made)
    recorder.add_group(pg, None, (0, 1), 0)
    t = torch.ones(args.numel)
    total = ReduceOp.SUM
    n = args.iters * 4

    def loop(mode: str) -> float:
        set_recording(recorder, mode == "recording")
        start = time.perf_counter()
        if mode == "no hook":
            for _ in range(n):
                before(pg, "all_reduce", t, total)
        else:
            for _ in range(n):
                pg.run_blocking("all_reduce", t, total)
        elapsed = time.perf_counter() - start
        set_recording(recorder, False)
        return elapsed / n * 1e6

    modes = ("no hook", "off", "recording")
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.rounds):
        for m in modes:
            times[m].append(loop(m))
    return {m: min(v) for m, v in times.items()}


def compare(args: argparse.Namespace) -> None:
    """This script under ``args.against`` ("old") and under this interpreter ("new"),
    alternately, ``args.repeat`` times each; the best of each side's runs, side by side."""
    sides = {"old": args.against, "new": sys.executable}
    best: dict[str, dict[str, dict[str, float]]] = {s: {"mpi": {}, "local": {}} for s in sides}
    loads = []
    for _ in range(args.repeat):
        for side, python in sides.items():
            cmd = [python, os.path.abspath(__file__), "--json", "--nproc", str(args.nproc),
                   "--iters", str(args.iters), "--rounds", str(args.rounds),
                   "--numel", str(args.numel)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            got = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
            loads.append(got["load"])
            for part in ("mpi", "local"):
                for mode, us in got[part].items():
                    held = best[side][part]
                    held[mode] = min(held.get(mode, us), us)
    print(f"all_reduce of {args.numel} float32; {args.repeat} runs of each side, alternating; "
          f"best chunk of all runs (load average {min(loads):.1f}-{max(loads):.1f})")
    print(f"{'':<26}{'old us/op':>10}{'new us/op':>10}")
    for part in ("mpi", "local"):  # over MPI, then in-process on an op that does nothing
        for mode in best["new"][part]:
            old = best["old"][part].get(mode)  # a mode the old version lacks: "-"
            print(f"{part + ' ' + mode:<26}{'-' if old is None else f'{old:.2f}':>10}"
                  f"{best['new'][part][mode]:>10.2f}")
        for side in sides:
            b = best[side][part]
            print(f"{part} recording cost, {side}: {b['recording'] - b['off']:.2f} us/op "
                  f"({b['recording'] / b['off']:.3f}x off)")
            if "async off" in b:
                print(f"{part} async recording cost, {side}: "
                      f"{b['async recording'] - b['async off']:.2f} us/op")


if __name__ == "__main__":
    main()
