"""Stress loop: the DDP test world (tests/_ddp_workers.py: every check on 2 Gloo ranks, those
where an odd world matters on 3), run again and again, under glibc's heap checks.

A heap corruption was seen once in that world with resilient groups on (``malloc_consolidate():
unaligned fastbin chunk detected``, no rank failing); this is the loop that looks for it
(docs/resilience.md). Each run starts fresh processes through ``plugdist.testing.run_world``
(TCPStore, so resilient groups are on by default: every wait is sliced). With
``--malloc-check`` the ranks run with glibc's debugging malloc (``heap_check_env``: a detected
corruption aborts the process at once, with glibc's message). A rank that crashes is reported
with every thread's Python stack and gdb's native backtrace from its core.

    python benchmarks/ddp_world_stress.py --runs 50 --malloc-check

Prints one line per world (ok, or the failed checks / the world's error); exit status 1 when
any world failed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=50, help="runs of the 2- and the 3-rank world")
    ap.add_argument("--malloc-check", action="store_true",
                    help="the ranks use glibc's debugging malloc (libc_malloc_debug.so)")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    import _ddp_workers as workers
    from plugdist.testing import WorldError, heap_check_env, run_world
    from test_ddp import THREE_RANK_CHECKS

    env = heap_check_env() if args.malloc_check else {}
    if args.malloc_check and not env:
        raise SystemExit("--malloc-check needs glibc's libc_malloc_debug.so (glibc 2.34+)")

    failed = 0
    for i in range(args.runs):
        for size, checks in ((2, ()), (3, (THREE_RANK_CHECKS,))):
            began = time.monotonic()
            try:
                results = run_world(workers.run_suite, size, backend="gloo", timeout=240,
                                    group_timeout=60, args=checks, env=env,
                                    crash_backtraces=True)
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
