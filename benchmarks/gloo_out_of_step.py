"""Out-of-step collectives on torch's own Gloo (no plugdist): can they corrupt the heap?

Each world runs the same seeded random sequence of collectives on every rank (all-reduce of
float32 and int64, broadcast, all-gather, all-gather into one tensor, reduce-scatter,
all-to-all, barrier; 1 to 300,000 elements), except that the last rank skips one of them, so
from there on the ranks' collectives are mismatched, as they were when a rank took an op that
succeeded for a timeout (docs/resilience.md). Every rank runs under glibc's debugging malloc
(``plugdist.testing.heap_check_env``). Each rank ends in one of: ``raised`` (a timeout or a
closed connection: Gloo noticed), ``gloo size check`` (Gloo aborted the process on a message of
the wrong size), ``clean`` (the mismatched ops happened to fit), or a crash, which is what this
looks for: ``HEAP`` (glibc's heap check) or another signal.

    python benchmarks/gloo_out_of_step.py --runs 60 --size 2

Prints one line per world and the tally; exit status 1 when any rank crashed.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import re
import subprocess
import sys
from datetime import timedelta

KINDS = ("all_reduce", "all_reduce", "all_reduce", "all_reduce_int64", "broadcast", "all_gather",
         "all_gather_into_tensor", "reduce_scatter", "all_to_all_single", "barrier")
SIZES = (1, 3, 7, 64, 1000, 4096, 65536, 300000)
HEAP = "HEAP"
GLOO_SIZE_CHECK = "gloo size check"
_HEAP_MESSAGES = ("malloc", "free()", "double free", "corrupted", "chunk", "tcache")


def rank_main(rank: int, size: int, port: int, seed: int, skip: int, ops: int) -> None:
    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size,
                            timeout=timedelta(seconds=4))
    rng = random.Random(seed)
    sequence = [(rng.choice(KINDS), rng.choice(SIZES)) for _ in range(ops)]
    if rank == size - 1:
        del sequence[skip]
    done = 0
    try:
        for kind, n in sequence:
            if kind == "all_reduce":
                dist.all_reduce(torch.ones(n))
            elif kind == "all_reduce_int64":
                dist.all_reduce(torch.ones(n, dtype=torch.int64))
            elif kind == "broadcast":
                dist.broadcast(torch.ones(n), 0)
            elif kind == "all_gather":
                dist.all_gather([torch.empty(n) for _ in range(size)], torch.ones(n))
            elif kind == "all_gather_into_tensor":
                dist.all_gather_into_tensor(torch.empty(n * size), torch.ones(n))
            elif kind == "reduce_scatter":
                dist.reduce_scatter(torch.empty(n), [torch.ones(n) for _ in range(size)])
            elif kind == "all_to_all_single":
                dist.all_to_all_single(torch.empty(n * size), torch.ones(n * size))
            else:
                dist.barrier()
            done += 1
    except Exception as exc:  # noqa: BLE001 - the outcome this benchmark records
        print(f"rank {rank} raised at op {done}: {type(exc).__name__}: {str(exc)[:200]}",
              flush=True)
    dist.destroy_process_group()


def crash_kind(code: int, output: str) -> str:
    """How a process that printed ``output`` and exited with ``code`` crashed: ``HEAP``
    (glibc's heap check), ``GLOO_SIZE_CHECK`` (Gloo's abort on a message of the wrong size,
    which out-of-step collectives are expected to cause), ``signal N``; "" if it did not."""
    if any(m in output for m in _HEAP_MESSAGES):
        return HEAP
    if "match expected size" in output:  # Gloo's "Received data size doesn't match ..."
        return GLOO_SIZE_CHECK
    return f"signal {-code}" if code < 0 else ""


def outcome(code: int, output: str) -> str:
    crash = crash_kind(code, output)
    if crash:
        return crash
    if code != 0:
        return f"exit {code}"
    found = re.search(r" raised at op (\d+)", output)
    return f"raised at op {found.group(1)}" if found else "clean"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=60)
    ap.add_argument("--size", type=int, default=2, help="ranks per world")
    ap.add_argument("--ops", type=int, default=40, help="collectives per rank")
    ap.add_argument("--seed", type=int, default=1000)
    args = ap.parse_args()
    from plugdist.testing import free_port, heap_check_env

    env = {**os.environ, **heap_check_env()}
    tally: collections.Counter[str] = collections.Counter()
    for i in range(args.runs):
        seed = args.seed + i
        skip = random.Random(seed).randrange(args.ops - 1)
        port = free_port()
        procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), str(args.size),
                                   str(port), str(seed), str(skip), str(args.ops)],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True) for r in range(args.size)]
        ends = []
        for p in procs:
            try:
                output, _ = p.communicate(timeout=300)
            except subprocess.TimeoutExpired:
                p.kill()
                output = p.communicate()[0] + "\nhung: killed after 300 s"
            ends.append(outcome(p.returncode, output))
            if ends[-1] == HEAP or ends[-1].startswith("signal"):
                print(output[-4000:], flush=True)
        tally.update(e.split(" at op ")[0] for e in ends)
        print(f"world {i} (op {skip} skipped): " + " | ".join(ends), flush=True)
    print(dict(tally), flush=True)
    return 1 if tally[HEAP] or any(k.startswith("signal") for k in tally) else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        rank_main(*map(int, sys.argv[2:8]))
    else:
        sys.exit(main())
