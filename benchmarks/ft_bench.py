"""Fault-tolerant training against the classic restart, side by side in one run.

    python benchmarks/ft_bench.py                       # both parts
    python benchmarks/ft_bench.py --parts recovery --steps 300 --kill-at 170
    python benchmarks/ft_bench.py --parts vote --vote-steps 40

recovery: examples/resilient_train.py on 4 workers, rank 2 SIGKILLed at step --kill-at:
  (a) plugdist-run --max-restarts 1, checkpoint every 50 steps, every worker restarted
  (b) plugdist-run --replace-failed --max-restarts 1 (ResilientTraining): the others go on, a
      replacement joins
  (c) no failure
  Reported: wall time, the longest pause between two committed steps, steps redone (committed
  twice), and the replacement's time from the kill to the first step committed by 4 ranks again.
vote: the per-step cost of ResilientTraining's commit vote on the reference MLP
  (8 x Linear(1024, 1024) + ReLU, as benchmarks/ddp_bench.py), 2 ranks over gloo: the same
  DDP step with and without run_step, alternating blocks, medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "resilient_train.py")


def launch(label: str, steps: int, kill_at: int, *, extra: list[str], env: dict[str, str],
           script: list[str]) -> dict[str, float]:
    cmd = [sys.executable, "-m", "plugdist_run", "--nproc-per-node", "4",
           "--monitor-interval", "0.05", *extra, EXAMPLE, "--steps", str(steps), *script]
    if kill_at >= 0:
        cmd += ["--kill-rank", "2", "--kill-at-step", str(kill_at)]
    start = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                          env=dict(os.environ, PLUGDIST_TORCH_WORLD="0", **env))
    wall = time.time() - start
    if done.returncode != 0:
        raise RuntimeError(f"{label}: the run failed:\n{done.stderr[-3000:]}")
    lines = [json.loads(x[x.index("{"):]) for x in done.stdout.splitlines() if "{" in x]
    steps_seen = [x for x in lines if "step" in x and "final" not in x]
    times = [x["time"] for x in steps_seen]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    killed = [x["time"] for x in lines if "killed" in x]
    back = None
    if killed:  # the first step committed by 4 ranks after the world lost one (or restarted)
        after = [x for x in steps_seen if x["time"] > killed[0]]
        low = next((i for i, x in enumerate(after) if x["world_size"] < 4), 0)
        back_times = [x["time"] for x in after[low:] if x["world_size"] == 4]
        back = back_times[0] - killed[0] if back_times else None
    return {"wall": wall, "pause": max(gaps) if gaps else 0.0,
            "redone": len(steps_seen) - len({x["step"] for x in steps_seen}),
            "back": back if back is not None else float("nan")}


def recovery(steps: int, kill_at: int, step_time: float) -> None:
    extra_args = ["--step-time", str(step_time)]
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "ckpt.pt")
        runs = {
            "(a) restart + checkpoint/50": launch(
                "a", steps, kill_at, extra=["--max-restarts", "1"],
                env={"PLUGDIST_RESILIENCE": "0"},
                script=["--mode", "restart", "--checkpoint", ckpt, "--checkpoint-every", "50",
                        *extra_args]),
            "(b) --replace-failed": launch(
                "b", steps, kill_at, extra=["--replace-failed", "--max-restarts", "1"], env={},
                script=extra_args),
            "(c) no failure": launch("c", steps, -1, extra=[], env={}, script=extra_args),
        }
    print(f"\n# recovery: 4 workers over gloo, {steps} steps (+{step_time} s of compute each), "
          f"rank 2 SIGKILLed at step {kill_at}")
    print(f"{'run':<30} {'wall s':>7} {'longest pause s':>16} {'steps redone':>13} "
          f"{'kill -> 4 ranks again s':>24}")
    for name, r in runs.items():
        print(f"{name:<30} {r['wall']:>7.2f} {r['pause']:>16.2f} {r['redone']:>13d} "
              f"{r['back']:>24.2f}")
    b, c = runs["(b) --replace-failed"], runs["(c) no failure"]
    print(f"(b) / (c) wall: {b['wall'] / c['wall']:.3f}")


# -- the vote's cost ----------------------------------------------------------------------------
def vote_worker(steps: int, blocks: int) -> None:
    from datetime import timedelta

    import plugdist as dist
    import torch
    from plugdist.parallel import DistributedDataParallel, ResilientTraining

    dist.init_process_group("gloo", timeout=timedelta(seconds=120), torch_world=False)
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(8):
        layers += [torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
    model = DistributedDataParallel(torch.nn.Sequential(*layers))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    training = ResilientTraining(model, opt)
    x = torch.randn(64, 1024)

    def step() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()

    def plain() -> None:
        step()
        opt.step()

    for _ in range(3):
        plain()
    times: dict[str, list[float]] = {"plain": [], "committed": []}
    for _ in range(blocks):
        for mode in ("plain", "committed"):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                if mode == "plain":
                    plain()
                else:
                    training.run_step(step)
            times[mode].append((time.perf_counter() - t0) / steps)
    if dist.get_rank() == 0:
        print(json.dumps({k: statistics.median(v) for k, v in times.items()}), flush=True)
    dist.destroy_process_group()


def vote(steps: int, blocks: int) -> None:
    cmd = [sys.executable, "-m", "plugdist_run", "--nproc-per-node", "2", __file__,
           "--vote-worker", str(steps), str(blocks)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                          env=dict(os.environ, PLUGDIST_TORCH_WORLD="0",
                                   PLUGDIST_RESILIENCE="1"))
    found = [json.loads(x[x.index("{"):]) for x in done.stdout.splitlines() if "{" in x]
    if not found:
        raise RuntimeError(f"the vote run failed:\n{done.stderr[-3000:]}")
    r = found[0]
    print("\n# commit vote on the reference MLP (8 x Linear(1024, 1024) + ReLU, batch 64), "
          "2 ranks, gloo")
    print(f"plain DDP step {r['plain'] * 1e3:.2f} ms, with run_step {r['committed'] * 1e3:.2f} ms,"
          f" cost {(r['committed'] / r['plain'] - 1) * 100:+.2f}%")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--vote-worker":
        vote_worker(int(sys.argv[2]), int(sys.argv[3]))
        return
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="recovery,vote")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--kill-at", type=int, default=170)
    ap.add_argument("--step-time", type=float, default=0.02,
                    help="extra seconds per step standing in for compute (default 0.02)")
    ap.add_argument("--vote-steps", type=int, default=20)
    ap.add_argument("--vote-blocks", type=int, default=5)
    args = ap.parse_args()
    parts = args.parts.split(",")
    if "recovery" in parts:
        recovery(args.steps, args.kill_at, args.step_time)
    if "vote" in parts:
        vote(args.vote_steps, args.vote_blocks)


if __name__ == "__main__":
    main()
