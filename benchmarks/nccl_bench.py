"""Benchmark: all_reduce on GPUs through plugdist-nccl, against torch's own NCCL.

Needs a GPU per rank, or ``PLUGDIST_TEST_RANKS_PER_GPU=2`` to put both ranks on one GPU (each
then gets its own NCCL_HOSTID; set NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_SOCKET_IFNAME=lo
so the two talk over loopback sockets). One world (2 ranks; ``-n``) runs three sides,
interleaved chunk by chunk: plugdist's frontend on plugdist's NCCL group, torch.distributed over
that same group (``plugdist_nccl``, the bridge) and torch.distributed over a torch NCCL group of
the same ranks.
Each timed call is the op plus ``torch.cuda.synchronize()``, so times are host-observed
latencies.

    python benchmarks/nccl_bench.py -b 8 -e 64M -f 8
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from bridge_bench import _interleaved, _iters, _parse_size, _sizes


def allreduce_rank(rank: int, n: int, sizes: list[int]) -> list[dict[str, Any]]:
    import plugdist
    import torch
    import torch.distributed as tdist
    from plugdist.testing.checks import check_device

    dev = check_device()
    assert dev is not None, "run with the nccl backend"
    torch_nccl = tdist.new_group(backend="nccl")

    def timed(op: Any) -> Any:
        def call() -> None:
            op()
            torch.cuda.synchronize(dev)
        return call

    rows = []
    for nbytes in sizes:
        t = torch.ones(max(1, nbytes // 4), device=dev)
        res = _interleaved({"plugdist": timed(lambda t=t: plugdist.all_reduce(t)),
                            "torch_nccl": timed(lambda t=t: tdist.all_reduce(t, group=torch_nccl)),
                            "bridge": timed(lambda t=t: tdist.all_reduce(t))},
                           _iters(nbytes), lambda: tdist.barrier(group=torch_nccl))
        rows.append({"bytes": nbytes, **res})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-b", "--minbytes", default="8")
    p.add_argument("-e", "--maxbytes", default="64M")
    p.add_argument("-f", "--stepfactor", type=int, default=8)
    p.add_argument("-n", "--nproc", type=int, default=2,
                   help="ranks (1: no transport, so the host-side cost of each path shows)")
    args = p.parse_args(argv)
    import nccl_bench  # ranks import this module by its real name
    from plugdist.testing import run_world

    sizes = _sizes(_parse_size(args.minbytes), _parse_size(args.maxbytes), args.stepfactor)
    rows = run_world(nccl_bench.allreduce_rank, args.nproc, backend="nccl", args=(sizes,),
                     timeout=900)[0]
    print(f"all_reduce, {args.nproc} rank(s): plugdist's frontend on plugdist-nccl, torch over "
          "plugdist_nccl (bridge), torch's own NCCL; best chunk's median per op, op + synchronize")
    print(f"{'size(B)':>10} {'plugdist(us)':>13} {'bridge(us)':>11} {'torch(us)':>10} "
          f"{'plugdist/torch':>15}")
    for r in rows:
        print(f"{r['bytes']:>10} {1e6 * r['plugdist']:>13.1f} {1e6 * r['bridge']:>11.1f} "
              f"{1e6 * r['torch_nccl']:>10.1f} {r['ratio']:>14.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
