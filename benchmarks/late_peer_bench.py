"""How long a wait lasts past a late peer: rank 1 joins each small ``all_reduce`` ``--late-ms``
late (it sleeps, then runs the op synchronously), while rank 0 issues the op at once with
``async_op=True`` and waits on it one of three ways:

* ``sync``    ``dist.all_reduce(t)`` (the blocking path: the calling thread tests MPI);
* ``work``    ``all_reduce(..., async_op=True).wait()`` (the Work's wait drives the backend);
* ``future``  ``all_reduce(..., async_op=True).get_future().wait()`` (torch's wait drives
              nothing: the backend's own thread must notice the op ended, as it must for
              torch's DDP and for comm hooks).

Prints, per way, the median and worst wait on rank 0 and the median excess over the peer's
actual delay (measured on rank 1 and sent along). The ways alternate round by round.

    .venv/bin/python benchmarks/late_peer_bench.py                  # mpi, 5 ms late
    .venv/bin/python benchmarks/late_peer_bench.py --late-ms 0.5 --backend gloo
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

WAYS = ("sync", "work", "future")


def bench_rank(rank: int, world_size: int, late_ms: float, rounds: int) -> dict[str, Any] | None:
    """One rank (plugdist's world already up); rank 0 returns each way's waits and excesses."""
    import plugdist as dist
    import torch

    t = torch.zeros(2)
    waits: dict[str, list[float]] = {w: [] for w in WAYS}
    excess: dict[str, list[float]] = {w: [] for w in WAYS}
    for i in range(rounds + 3):  # the first 3 rounds warm up
        for way in WAYS:
            dist.barrier()
            if rank == 1:
                start = time.perf_counter()
                time.sleep(late_ms / 1e3)
                t.fill_((time.perf_counter() - start) * 1e3)  # the delay as slept: sent along
                dist.all_reduce(t)
                continue
            t.zero_()
            start = time.perf_counter()
            if way == "sync":
                dist.all_reduce(t)
            else:
                work = dist.all_reduce(t, async_op=True)
                assert work is not None  # rank 0 is a member
                if way == "work":
                    work.wait()
                else:
                    work.get_future().wait()
            took = (time.perf_counter() - start) * 1e3
            if rank == 0 and i >= 3:
                waits[way].append(took)
                excess[way].append(took - t[0].item())
    return {"waits": waits, "excess": excess} if rank == 0 else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="mpi", help="plugdist backend (default mpi)")
    p.add_argument("--late-ms", type=float, default=5.0,
                   help="how late rank 1 joins each op, in ms (default 5)")
    p.add_argument("--rounds", type=int, default=50, help="timed rounds per way (default 50)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")
    args = p.parse_args(argv)
    # the ranks import bench_rank by module name, and this file runs as __main__: import it
    # as ``late_peer_bench`` (its directory is sys.path[0], which run_world hands to the ranks)
    import late_peer_bench
    from plugdist.testing.harness import WorldError, run_world

    try:
        results = run_world(late_peer_bench.bench_rank, 2, backend=args.backend,
                            args=(args.late_ms, args.rounds), timeout=args.timeout)
    except WorldError as err:
        print(f"late_peer_bench: {err}", file=sys.stderr)
        return 1
    got = results[0]
    print(f"{args.backend}, 2 ranks, rank 1 joins each 8-byte all_reduce {args.late_ms} ms late; "
          f"rank 0's wait in ms over {args.rounds} rounds per way")
    print(f"{'way':<8}{'median':>9}{'worst':>9}{'excess (median)':>17}")
    for way in WAYS:
        w, e = got["waits"][way], got["excess"][way]
        print(f"{way:<8}{statistics.median(w):>9.3f}{max(w):>9.3f}{statistics.median(e):>17.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
