"""Stress loop: torch's own DDP, FSDP2 and DTensor over plugdist_gloo, plugdist_toy and
plugdist_mpi (Open MPI under ULFM) losing a rank per round, again and again: the worlds of
tests/test_torch_peer_death.py, each with a fresh seed.

Every world has ``--nproc`` ranks and two rounds; one round's victim is rank 0, the other's a
random rank, in a random order, each SIGKILLed at a random step and layer of a backward pass
(DTensor: between two redistributions); each round trains with a kind drawn from all of them
(DDP as trainers build it, with ``find_unused_parameters``, with ``static_graph``, with torch's
allreduce comm hook; FSDP2; DTensor). A world passes when no process died of a signal, every
survivor caught ``DistRankFailureError`` naming the dead rank in every round, torch's rank and
size followed each shrink, the fresh DDP's steps matched the local reference and the survivors'
parameters agree (``check_world`` in the test module). ``--load N`` runs N busy loops beside
the worlds: the slowed machine.

    python benchmarks/torch_peer_death_stress.py --worlds 20 --load 2

Prints one line per world and a summary per backend (worlds, kills, survivor rounds, signals,
failures, seconds a world); exit status 1 when any world failed.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = ("builtin", "unused", "static", "pyhook", "fsdp", "dtensor")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, default=20, help="worlds per backend")
    ap.add_argument("--backends", default="gloo,toy,mpi",
                    help="mpi runs only where Open MPI 5 is in .venv/ulfm (make venv)")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--load", type=int, default=0, help="busy loops beside the worlds")
    ap.add_argument("--seed", type=int, default=None, help="draws every world's plan")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    from test_torch_peer_death import SIGNAL_WORDS, World, busy_loops, check_world, run_world
    from test_ulfm import _libmpi, _prefix

    backends = args.backends.split(",")
    if "mpi" in backends and not ((_prefix() / "bin" / "mpiexec").exists()
                                  and _libmpi(_prefix()) is not None):
        print(f"skipping mpi: no Open MPI 5 in {_prefix()}")
        backends.remove("mpi")
    base = args.seed if args.seed is not None else random.randrange(1 << 30)
    rng = random.Random(base)
    print(f"--seed {base}, {args.nproc} ranks a world, {args.load} busy loops", flush=True)
    tally: dict[str, Counter[str]] = {b: Counter() for b in backends}
    seconds: dict[str, float] = dict.fromkeys(backends, 0.0)
    with busy_loops(args.load), tempfile.TemporaryDirectory() as scratch:
        for i in range(args.worlds):
            for backend in backends:
                other = rng.randrange(1, args.nproc)
                victims = [0, other - 1] if rng.random() < 0.5 else [other, 0]
                world = World(backend, args.nproc, victims, rng.sample(KINDS, 2),
                              rng.randrange(1 << 30))
                began = time.monotonic()
                run_world(world, Path(scratch) / f"{backend}-{i}")
                took = time.monotonic() - began
                seconds[backend] += took
                count = tally[backend]
                count["worlds"] += 1
                count["kills"] += len(victims)
                count["survivor rounds"] += sum(len(r["rounds"]) for r in world.results.values())
                if any(word in world.output for word in SIGNAL_WORDS):
                    count["signals"] += 1
                try:
                    check_world(world)
                    verdict = "ok"
                except AssertionError as err:
                    count["failed"] += 1
                    verdict = "FAILED: " + str(err).splitlines()[0]
                print(f"{backend:5} world {i:3} kinds {','.join(world.kinds):16} victims "
                      f"{victims} SEED={world.seed}: {verdict} ({took:.1f} s)", flush=True)
    print()
    print("| backend | worlds | kills | survivor rounds | signals | failed | s a world |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for backend in backends:
        c = tally[backend]
        print(f"| {backend} | {c['worlds']} | {c['kills']} | {c['survivor rounds']} | "
              f"{c['signals']} | {c['failed']} | {seconds[backend] / max(1, c['worlds']):.1f} |")
    return 1 if any(c["failed"] for c in tally.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
