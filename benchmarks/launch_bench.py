"""Launcher benchmark: plugdist-run against torchrun, side by side in one run.

Measures, for N = 2, 4, 8 workers on one node (``--standalone``):
  * ``--help``: the launcher's own start (no workers);
  * start: the whole command for N no-op workers (a script that imports nothing), from exec to
    exit: launcher start, rendezvous, N interpreters started and reaped;
  * restart: under ``--max-restarts 1``, rank 0 fails on attempt 0; the time from the moment it
    exits to the moment the last worker of attempt 1 has started (each worker writes a
    timestamp as its first statement), i.e. failure seen + world stopped + world started.

Workers import only the standard library, so the figures are the launchers' own costs. Median
of ``--repeat`` runs; ratios below 1 mean plugdist-run is faster.

    .venv/bin/python benchmarks/launch_bench.py
    .venv/bin/python benchmarks/launch_bench.py --sizes 2,4,8 --repeat 7
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NOOP = "pass\n"
# attempt 0: rank 0 writes the time it fails and exits 1 once every rank is up; attempt 1:
# every rank writes the time it started
FAILER = """\
import os, sys, time
t = time.time()
out, rank = sys.argv[1], os.environ["RANK"]
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
with open(os.path.join(out, f"start.{attempt}.{rank}"), "w") as f:
    f.write(repr(t))
if attempt == "0":
    world = int(os.environ["WORLD_SIZE"])
    if rank == "0":
        while len([n for n in os.listdir(out) if n.startswith("start.0.")]) < world:
            time.sleep(0.005)
        with open(os.path.join(out, "fail"), "w") as f:
            f.write(repr(time.time()))
        sys.exit(1)
    time.sleep(60)
"""


def launchers() -> dict[str, list[str]]:
    bin_dir = Path(sys.executable).parent
    out = {"plugdist-run": [sys.executable, "-m", "plugdist_run"]}
    torchrun = shutil.which("torchrun", path=str(bin_dir))
    if torchrun:
        out["torchrun"] = [torchrun]
    return out


def timed(cmd: list[str]) -> float:
    t = time.perf_counter()
    res = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         timeout=300)
    elapsed = time.perf_counter() - t
    if res.returncode != 0:
        raise RuntimeError(f"{cmd} failed ({res.returncode}):\n{res.stderr[-2000:]}")
    return elapsed


def restart_time(cmd: list[str], n: int, script: str) -> float:
    with tempfile.TemporaryDirectory() as out:
        res = subprocess.run([*cmd, "--standalone", "--nproc-per-node", str(n),
                              "--max-restarts", "1", "--monitor-interval", "0.1", script, out],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             timeout=300)
        if res.returncode != 0:
            raise RuntimeError(f"{cmd} restart run failed:\n{res.stderr[-2000:]}")
        failed = float(Path(out, "fail").read_text())
        starts = [float(Path(out, f"start.1.{r}").read_text()) for r in range(n)]
        return max(starts) - failed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="2,4,8")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    impls = launchers()
    env_note = f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}"
    with tempfile.TemporaryDirectory() as tmp:
        noop, failer = Path(tmp, "noop.py"), Path(tmp, "failer.py")
        noop.write_text(NOOP)
        failer.write_text(FAILER)
        rows: list[tuple[str, dict[str, float]]] = []
        help_times = {name: statistics.median(timed([*cmd, "--help"])
                                              for _ in range(args.repeat))
                      for name, cmd in impls.items()}
        rows.append(("--help", help_times))
        for n in sizes:
            rows.append((f"start N={n}", {
                name: statistics.median(
                    timed([*cmd, "--standalone", "--nproc-per-node", str(n), str(noop)])
                    for _ in range(args.repeat))
                for name, cmd in impls.items()}))
        for n in sizes:
            rows.append((f"restart N={n}", {
                name: statistics.median(restart_time(cmd, n, str(failer))
                                        for _ in range(args.repeat))
                for name, cmd in impls.items()}))
    names = list(impls)
    print(f"launch_bench: median of {args.repeat} runs, seconds ({env_note})")
    header = f"{'case':<14}" + "".join(f"{n:>14}" for n in names)
    if "torchrun" in impls:
        header += f"{'ratio':>10}"
    print(header)
    for case, times in rows:
        line = f"{case:<14}" + "".join(f"{times[n]:>14.3f}" for n in names)
        if "torchrun" in impls:
            line += f"{times['plugdist-run'] / times['torchrun']:>10.2f}"
        print(line)


if __name__ == "__main__":
    main()
