"""What ``plugdist-run --page`` costs training: step times with and without the page open.

    python benchmarks/page_overhead.py --nproc 3 --cycles 4 --phase 8

Runs examples/resilient_train.py under plugdist-run twice, for the same time: once without
``--page`` (the baseline: no reporter in the ranks), then once with it, where the page is in
turn closed and open for ``--phase`` seconds, ``--cycles`` times. Open means a viewer doing what
the page's script does (the page once, then ``api/state`` every second) and asking every rank
for its recent ops once a phase. Each committed step's time (from rank 0's lines) counts in the
phase it ended in. Prints the median and p90 step time of each, and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TRAIN = str(ROOT / "examples" / "resilient_train.py")


class Run:
    """One plugdist-run of the training; rank 0's committed steps as (commit time, seconds)."""

    def __init__(self, args: argparse.Namespace, page: bool, work: Path) -> None:
        self.stop = work / ("stop-page" if page else "stop-plain")
        cmd = [sys.executable, "-m", "plugdist_run", "--nproc-per-node", str(args.nproc),
               *(["--page", "0"] if page else []), TRAIN, "--steps", str(10 ** 9),
               "--hidden", str(args.hidden), "--step-time", str(args.step_time),
               "--stop-file", str(self.stop)]
        env = dict(os.environ, PLUGDIST_RESILIENCE="1", PLUGDIST_TORCH_WORLD="0")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env)
        self.steps: list[tuple[float, float]] = []
        self.err: list[str] = []
        self._last: float | None = None
        threading.Thread(target=self._read_out, daemon=True).start()
        threading.Thread(target=lambda: self.err.extend(self.proc.stderr or ()),
                         daemon=True).start()

    def _read_out(self) -> None:
        for line in self.proc.stdout or ():
            if '"step"' not in line or "final" in line:
                continue
            at = json.loads(line[line.index("{"):])["time"]
            if self._last is not None:
                self.steps.append((at, at - self._last))
            self._last = at

    def url(self) -> str:
        end = time.monotonic() + 120
        while time.monotonic() < end:
            found = re.search(r"live page at (http://\S+/)", "".join(self.err))
            if found:
                return found.group(1)
            time.sleep(0.1)
        raise SystemExit("no page address:\n" + "".join(self.err)[-2000:])

    def wait_steps(self, n: int) -> None:
        end = time.monotonic() + 300
        while len(self.steps) < n:
            if time.monotonic() > end or self.proc.poll() is not None:
                raise SystemExit("the training did not start:\n" + "".join(self.err)[-3000:])
            time.sleep(0.2)

    def finish(self) -> None:
        self.stop.touch()
        self.proc.wait(timeout=120)


def view(url: str, until: float) -> int:
    """Do what an open page does until ``until``; the requests made."""
    requests = 0
    urllib.request.urlopen(url, timeout=10).read()
    urllib.request.urlopen(url + "api/ops?ask=1", timeout=10).read()
    while time.time() < until:
        urllib.request.urlopen(url + "api/state", timeout=10).read()
        requests += 1
        time.sleep(max(0.0, min(1.0, until - time.time())))
    return requests


def summary(name: str, times: list[float]) -> str:
    ms = sorted(t * 1e3 for t in times)
    p90 = ms[int(0.9 * (len(ms) - 1))] if ms else float("nan")
    return (f"  {name:22} {len(ms):6} steps   median {statistics.median(ms):7.2f} ms   "
            f"p90 {p90:7.2f} ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=3)
    ap.add_argument("--cycles", type=int, default=4, help="closed/open pairs")
    ap.add_argument("--phase", type=float, default=8.0, help="seconds per phase")
    ap.add_argument("--step-time", type=float, default=0.01,
                    help="the example's stand-in for compute per step (s)")
    ap.add_argument("--hidden", type=int, default=64)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="plugdist-page-overhead-"))
    span = 2 * args.cycles * args.phase

    plain = Run(args, page=False, work=work)
    plain.wait_steps(20)
    t0 = time.time()
    time.sleep(span)
    plain.finish()
    baseline = [s for at, s in plain.steps if t0 <= at <= t0 + span]

    paged = Run(args, page=True, work=work)
    url = paged.url()
    paged.wait_steps(20)
    phases: list[tuple[str, float, float]] = []
    requests = 0
    for _ in range(args.cycles):
        start = time.time()
        time.sleep(args.phase)
        phases.append(("closed", start, time.time()))
        start = time.time()
        requests += view(url, start + args.phase)
        phases.append(("open", start, time.time()))
    paged.finish()
    by: dict[str, list[float]] = {"closed": [], "open": []}
    for at, seconds in paged.steps:
        for name, a, b in phases:
            if a <= at < b:
                by[name].append(seconds)

    print(f"# page_overhead: {args.nproc} ranks, --step-time {args.step_time}, hidden "
          f"{args.hidden}; {args.cycles} x ({args.phase:g} s closed, {args.phase:g} s open); "
          f"{requests} api/state requests while open")
    print(summary("without --page", baseline))
    print(summary("--page, page closed", by["closed"]))
    print(summary("--page, page open", by["open"]))
    med: dict[str, Any] = {k: statistics.median(v) for k, v in
                           (("plain", baseline), ("closed", by["closed"]),
                            ("open", by["open"]))}
    print(f"  ratios of medians: open/closed {med['open'] / med['closed']:.3f}, "
          f"closed/without {med['closed'] / med['plain']:.3f}, "
          f"open/without {med['open'] / med['plain']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
