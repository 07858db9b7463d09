"""Stress loop: the DDP test world (tests/_ddp_workers.py: every check on 2 Gloo ranks, those
where an odd world matters on 3), run again and again, under glibc's heap checks.

A heap corruption was seen once in that world with resilient groups on (``malloc_consolidate():
unaligned fastbin chunk detected``, no rank failing); this is the loop that looks for it
(docs/resilience.md). Each run starts fresh processes through ``plugdist.testing.run_world``
(TCPStore, so resilient groups are on by default: every wait is sliced). With
``--malloc-check`` the ranks run with glibc's debugging malloc (``libc_malloc_debug.so`` and
``MALLOC_CHECK_=3``: a detected corruption aborts the process at once, with glibc's message)
and may dump core into ``--dir``.

    python benchmarks/ddp_world_stress.py --runs 50 --malloc-check

Prints one line per world (ok, or the failed checks / the world's error); exit status 1 when
any world failed.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MALLOC_DEBUG = "/lib/x86_64-linux-gnu/libc_malloc_debug.so.0"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=50, help="runs of the 2- and the 3-rank world")
    ap.add_argument("--malloc-check", action="store_true",
                    help=f"the ranks use glibc's debugging malloc ({MALLOC_DEBUG})")
    ap.add_argument("--dir", default=".", help="the ranks' working directory (core dumps)")
    args = ap.parse_args()
    env = {}
    if args.malloc_check:
        if not Path(MALLOC_DEBUG).exists():
            raise SystemExit(f"--malloc-check needs glibc's {MALLOC_DEBUG} (glibc 2.34+)")
        env = {"LD_PRELOAD": MALLOC_DEBUG, "MALLOC_CHECK_": "3"}
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    os.chdir(args.dir)
    sys.path.insert(0, str(ROOT / "tests"))
    import _ddp_workers as workers
    from plugdist.testing import WorldError, run_world
    from test_ddp import THREE_RANK_CHECKS

    failed = 0
    for i in range(args.runs):
        for size, checks in ((2, ()), (3, (THREE_RANK_CHECKS,))):
            began = time.monotonic()
            try:
                results = run_world(workers.run_suite, size, backend="gloo", timeout=240,
                                    group_timeout=60, args=checks, env=env)
                bad = {rank: [name for name, error in r.items() if error]
                       for rank, r in enumerate(results)}
                status = "ok" if not any(bad.values()) else f"checks failed: {bad}"
            except WorldError as exc:
                status = f"world failed:\n{exc}"
            failed += status != "ok"
            print(f"run {i} world of {size}: {status} ({time.monotonic() - began:.1f} s)",
                  flush=True)
    print(f"{failed} of {2 * args.runs} worlds failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
