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

``--desync`` throws one rank of each world out of step at a random op, as the gloo plugin's old
sliced-wait bug did (``ddp_world_desync.py``): those worlds are expected to fail their checks,
and the question is only whether any rank dies of a signal (a heap check, SIGSEGV).

Prints one line per world (ok, or the failed checks / the world's error); exit status 1 when
any world failed (with ``--desync``: when any rank died of a signal).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from gloo_out_of_step import GLOO_SIZE_CHECK, crash_kind  # noqa: E402 - found through the path


def _crash(result: Any) -> str:
    """How a rank crashed ("" if it did not die of a signal that dumps core: the harness stops
    stragglers with SIGTERM); see ``gloo_out_of_step.crash_kind``."""
    if result.exitcode is None or result.exitcode >= 0 or not result.native_backtrace:
        return ""
    return crash_kind(result.exitcode, result.stderr_tail)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=50, help="runs of the 2- and the 3-rank world")
    ap.add_argument("--malloc-check", action="store_true",
                    help="the ranks use glibc's debugging malloc (libc_malloc_debug.so)")
    ap.add_argument("--desync", action="store_true",
                    help="throw one rank out of step at a random op (the old sliced-wait bug)")
    ap.add_argument("--seed", type=int, default=0, help="picks the rank and op with --desync")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "tests"))
    import _ddp_workers as workers
    import ddp_world_desync
    from plugdist.testing import WorldError, heap_check_env, run_world
    from test_ddp import THREE_RANK_CHECKS

    env = heap_check_env() if args.malloc_check else {}
    if args.malloc_check and not env:
        raise SystemExit("--malloc-check needs glibc's libc_malloc_debug.so (glibc 2.34+)")

    rng = random.Random(args.seed)
    failed = crashed = 0
    for i in range(args.runs):
        for size, checks in ((2, ()), (3, (THREE_RANK_CHECKS,))):
            began = time.monotonic()
            fn, fn_args, group_timeout = workers.run_suite, checks, 60.0
            if args.desync:
                # about 450 successful waits a rank in the 2-rank world, 250 in the 3-rank one;
                # a short group timeout: mismatched collectives end at it
                op, on_rank = rng.randrange(1, 450 if size == 2 else 250), rng.randrange(size)
                fn, fn_args, group_timeout = (ddp_world_desync.run_suite_out_of_step,
                                              (op, on_rank, *checks), 8.0)
            try:
                results = run_world(fn, size, backend="gloo", timeout=400,
                                    group_timeout=group_timeout, args=fn_args, env=env,
                                    crash_backtraces=True)
                bad = {rank: (r["failed"] if args.desync else
                              [name for name, error in r.items() if error])
                       for rank, r in enumerate(results)}
                status = "ok" if not any(bad.values()) else f"checks failed: {bad}"
            except WorldError as exc:
                kinds = {r.rank: _crash(r) for r in exc.results}
                unexplained = {rank: kind for rank, kind in kinds.items()
                               if kind not in ("", GLOO_SIZE_CHECK)}
                crashed += bool(unexplained)
                first, _, rest = str(exc).partition("\n")
                status = (f"CRASHED {unexplained}: {first}\n{rest}" if unexplained else
                          f"{first} {kinds}\n{rest}")
            if args.desync and not status.startswith("CRASHED"):
                status = status.splitlines()[0][:240]
            failed += status != "ok"
            print(f"run {i} world of {size}: {status} ({time.monotonic() - began:.1f} s)",
                  flush=True)
    print(f"{failed} of {2 * args.runs} worlds failed; in {crashed}, a rank crashed (a heap "
          f"check or a signal other than Gloo's size check)", flush=True)
    return 1 if crashed or (failed and not args.desync) else 0


if __name__ == "__main__":
    sys.exit(main())
