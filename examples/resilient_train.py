"""Fault-tolerant training: a rank dies, the others go on; a replacement joins with their state.

    plugdist-run --nproc-per-node 4 --replace-failed --max-restarts 3 \\
        examples/resilient_train.py --steps 300

Trains a small MLP on a fixed synthetic regression set with plugdist.parallel's
ResilientTraining: a step commits only when every rank finished its gradient synchronisation;
when a rank dies the survivors discard that step's gradients, shrink and redo it; the launcher
starts a replacement, which joins at a step boundary and receives the model and optimizer
state over the group. Rank 0 prints one JSON line per committed step,
``{"step", "world_size", "loss", "params_sha1", "time"}``; at the end every rank prints
``{"final": true, "rank", "step", "params_sha1", "redone", "eval_loss"}`` (``eval_loss``: the
model's loss on the whole data set).

Testing and benchmark knobs: ``--kill-rank R --kill-at-step S`` (that rank SIGKILLs itself
when it reaches step S; replacements never do), ``--ddp torch`` (torch's own DDP over
``plugdist_<backend>``), ``--sample-log DIR`` (each rank records the samples of its committed
steps), ``--step-time S`` (sleep S seconds per step, standing in for real compute),
``--mode restart --checkpoint FILE --checkpoint-every K`` (the classic way, for
comparison: no step commit; save every K steps, and after the launcher restarts every worker
resume from the last checkpoint; resilient groups stay off in that mode).

``--steps-after-full N``: after ``--steps``, go on until the world has had its full size (the
launch's ``WORLD_SIZE``) for the last N committed steps, so a run with failures ends only once
its replacements have joined, however long they take to start (``--max-steps`` bounds it).
Every rank decides this from the same committed world sizes, so all stop at the same step.
``--stop-file PATH``: once that file exists, stop as if ``--steps`` were reached (the rank that
sees it first asks the others through the step's vote: all stop at the same step).

A process that the others declared failed while it was alive (stopped, stalled) learns it at
its next step (``DistExcludedError``) and exits with that error's exit code, which
``plugdist-run`` treats as a lost rank: ``--replace-failed`` starts a new process in its place.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from datetime import timedelta
from typing import Any

import plugdist as dist
import torch
from plugdist.parallel import ElasticSampler, ResilientTraining
from torch import nn


def make_data(n: int = 4096, features: int = 32, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    w = torch.randn(features, 1, generator=g)
    y = torch.tanh(x @ w) + 0.05 * torch.randn(n, 1, generator=g)
    return x, y


def params_sha1(model: nn.Module) -> str:
    digest = hashlib.sha1()
    for p in model.parameters():
        digest.update(p.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def build_net(features: int, hidden: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                         nn.ReLU(), nn.Linear(hidden, 1))


def wrap(kind: str, net: nn.Module) -> nn.Module:
    """``net`` in DDP (its parameters stay the same objects, so an optimizer built on them
    before still holds them)."""
    if kind == "torch":
        import torch.distributed as tdist
        from plugdist.parallel import resilient_allreduce_hook
        from torch.nn.parallel import DistributedDataParallel as TorchDDP

        model = TorchDDP(net, process_group=tdist.group.WORLD)
        model.register_comm_hook(tdist.group.WORLD, resilient_allreduce_hook)
        return model
    from plugdist.parallel import DistributedDataParallel

    return DistributedDataParallel(net)


class _Plain:
    """--mode restart: a plain step (no vote, no recovery), for comparison."""

    def __init__(self, optimizer: torch.optim.Optimizer, sampler: ElasticSampler) -> None:
        self.optimizer, self.sampler = optimizer, sampler
        self.step, self.redone = 0, 0

    def run_step(self, fn: Any) -> Any:
        result = fn()
        self.optimizer.step()
        self.step += 1
        self.sampler.commit(dist.get_world_size())
        return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--ddp", choices=("plugdist", "torch"), default="plugdist")
    ap.add_argument("--batch-size", type=int, default=32, help="samples per rank per step")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--min-world-size", type=int, default=1)
    ap.add_argument("--step-time", type=float, default=0.0,
                    help="seconds of extra compute per step (sleep), to make steps realistic")
    ap.add_argument("--kill-rank", type=int, default=-1)
    ap.add_argument("--kill-at-step", type=int, default=-1)
    ap.add_argument("--sample-log", default=None)
    ap.add_argument("--mode", choices=("resilient", "restart"), default="resilient")
    ap.add_argument("--checkpoint", default=None)
    ap.add_argument("--checkpoint-every", type=int, default=50)
    ap.add_argument("--steps-after-full", type=int, default=0,
                    help="after --steps, train until the world had its full size (WORLD_SIZE "
                         "at launch) for this many committed steps in a row")
    ap.add_argument("--stop-file", default=None,
                    help="stop (at the same step on every rank) once this file exists")
    ap.add_argument("--max-steps", type=int, default=0,
                    help="stop here even if the world never returned to full size "
                         "(default: 10 x --steps)")
    args = ap.parse_args()

    joining = os.environ.get("PLUGDIST_JOIN") == "1"
    # the launch's world size, read before init_process_group: shrink and grow rewrite WORLD_SIZE
    full_size = int(os.environ.get("WORLD_SIZE", "1"))
    if args.mode == "resilient":
        os.environ.setdefault("PLUGDIST_RESILIENCE", "1")  # resilient groups (docs/resilience.md)
    # What needs no group comes first: from a joiner's init_process_group on, the members wait
    # for it (and a process's first optimizer alone takes seconds: it imports torch's compiler)
    x, y = make_data()
    net = build_net(x.shape[1], args.hidden)
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    # torch's DDP needs torch's default group: plugdist builds it over its own world
    dist.init_process_group(args.backend, timeout=timedelta(seconds=60),
                            torch_world=True if args.ddp == "torch" else None)
    model = wrap(args.ddp, net)
    sampler = ElasticSampler(len(x), args.batch_size, seed=1)
    training: Any = (ResilientTraining(model, optimizer, sampler=sampler,
                                       min_world_size=args.min_world_size)
                     if args.mode == "resilient" else _Plain(optimizer, sampler))
    if args.checkpoint and os.path.exists(args.checkpoint):
        state = torch.load(args.checkpoint, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        sampler.load_state_dict(state["sampler"])
        training.step = state["step"]
    victim = not joining and dist.get_rank() == args.kill_rank \
        and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
    samples_file = None
    if args.sample_log:
        os.makedirs(args.sample_log, exist_ok=True)
        samples_file = open(os.path.join(args.sample_log, f"{os.getpid()}.jsonl"), "a")

    used: list[int] = []  # this rank's samples in the step being tried

    def step() -> float:
        used[:] = sampler.indices()
        idx = torch.tensor(used, dtype=torch.long)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x[idx]), y[idx])
        loss.backward()
        if args.step_time:
            time.sleep(args.step_time)
        return float(loss.item())

    max_steps = args.max_steps or 10 * args.steps
    full_streak = 0  # committed steps in a row at full size; the same on every rank

    def done() -> bool:
        if training.step < args.steps and not training.stopping:
            return False
        return full_streak >= args.steps_after_full or training.step >= max_steps

    while not done():
        if victim and training.step == args.kill_at_step:
            print(json.dumps({"killed": dist.get_rank(), "time": time.time()}), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        epoch = sampler.epoch
        if args.stop_file and os.path.exists(args.stop_file):
            training.request_stop()
        try:
            loss = training.run_step(step)
        except dist.DistExcludedError as err:
            print(json.dumps({"excluded": os.getpid(), "why": str(err)}), flush=True)
            sys.exit(err.exit_code)   # plugdist-run starts a new process in this one's place
        full_streak = full_streak + 1 if dist.get_world_size() >= full_size else 0
        if samples_file is not None:
            samples_file.write(json.dumps({
                "step": training.step - 1, "epoch": epoch, "world_size": dist.get_world_size(),
                "indices": used, "rank": dist.get_rank(), "pid": os.getpid(),
                "params_sha1": params_sha1(model), "loss": loss, "time": time.time(),
                "threads": len(os.listdir("/proc/self/task"))}) + "\n")
            samples_file.flush()
        if dist.get_rank() == 0:
            print(json.dumps({"step": training.step - 1, "world_size": dist.get_world_size(),
                              "loss": round(loss, 6), "params_sha1": params_sha1(model),
                              "time": time.time()}), flush=True)
            if args.checkpoint and training.step % args.checkpoint_every == 0:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "sampler": sampler.state_dict(), "step": training.step},
                           args.checkpoint + ".tmp")
                os.replace(args.checkpoint + ".tmp", args.checkpoint)
    with torch.no_grad():   # the trained model on the whole set: compares runs
        eval_loss = float(nn.functional.mse_loss(net(x), y).item())
    print(json.dumps({"final": True, "rank": dist.get_rank(), "step": training.step,
                      "params_sha1": params_sha1(model), "redone": training.redone,
                      "eval_loss": round(eval_loss, 6)}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
