"""One world of torch's own training over ``plugdist_<BACKEND>`` that loses a rank per round,
without plugdist's resilient comm hook: what a trainer's script written for torch sees.

Run by plugdist-run (gloo, toy) or ``mpiexec --with-ft ulfm`` (mpi), from
tests/test_torch_peer_death.py and benchmarks/torch_peer_death_stress.py. Every rank follows
the same plan, drawn from ``SEED``: in round i, the rank whose current rank is ``VICTIMS[i]``
SIGKILLs itself inside the backward pass of a random step, at a random layer (a hook on that
layer's output gradient), while training with ``KINDS[i]``:

- ``builtin``: ``DistributedDataParallel(model)`` as trainers build it (the reducer's own
  all_reduce of each bucket, read by torch's C++);
- ``unused``: the same with ``find_unused_parameters=True``;
- ``static``: the same with ``static_graph=True``;
- ``pyhook``: with torch's own ``allreduce_hook`` registered as comm hook;
- ``fsdp``: FSDP2's ``fully_shard`` on every Linear and the root;
- ``dtensor``: a DTensor on a DeviceMesh of the world, redistributed step after step
  (functional collectives), the victim dying between two of them.

Every survivor must catch ``DistRankFailureError`` naming the dead rank (anything else is
recorded as it is), then calls ``plugdist.shrink_group()`` and checks that torch agrees with
plugdist on rank and size (``get_rank``, ``get_world_size``, ``group.WORLD``, its ranks, a
``DistributedSampler`` built now), then trains ``STEPS_AFTER`` steps with a fresh DDP and
checks each against the same steps computed locally over every rank's batch (so the gradients
were averaged over the new world). Each survivor writes ``RESULT_DIR/survivor-<launch
rank>.json``.

``TORCH_ONLY=1``: the script is torch's alone (``torch.distributed.init_process_group(
"plugdist_<BACKEND>")``, no plugdist world, so no resilient groups): one round, and each
survivor records the error it caught (the transport's) and ends.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import time
import traceback
from datetime import timedelta
from typing import Any

import plugdist as dist
import torch
import torch.distributed as tdist
from torch import nn

FEATURES = int(os.environ.get("HIDDEN", "64"))
LAYERS = 8
BATCH = 8
LR = 0.05


def build_net(state: dict[str, torch.Tensor] | None = None) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(FEATURES, FEATURES), nn.ReLU()]
    net = nn.Sequential(*layers, nn.Linear(FEATURES, 1))
    if state is not None:
        net.load_state_dict(state)
    return net


def batch(round_: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100_000 * round_ + 100 * step + rank)
    return torch.randn(BATCH, FEATURES, generator=gen), torch.randn(BATCH, 1, generator=gen)


def arm_kill(model: nn.Module, layer: int) -> None:
    """SIGKILL this process when backward reaches the output gradient of Linear ``layer``."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]

    def die_in_backward(_mod: nn.Module, _inp: Any, out: torch.Tensor) -> None:
        out.register_hook(lambda _grad: os.kill(os.getpid(), signal.SIGKILL))

    linears[layer % len(linears)].register_forward_hook(die_in_backward)


def wrapped(kind: str, net: nn.Module) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    if kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        return fully_shard(net)
    model = DDP(net, find_unused_parameters=kind == "unused", static_graph=kind == "static")
    if kind == "pyhook":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, default_hooks.allreduce_hook)
    return model


def train_until_failure(kind: str, state: dict[str, torch.Tensor], round_: int,
                        plan: dict[str, int], is_victim: bool) -> BaseException:
    """Train with ``kind`` until an error; the victim dies at ``plan``'s step and layer."""
    if kind == "dtensor":
        return dtensor_until_failure(plan, is_victim)
    model = wrapped(kind, build_net(state))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(100_000):
        if is_victim and step == plan["step"]:
            arm_kill(model, plan["layer"])
        x, y = batch(round_, step, tdist.get_rank())
        opt.zero_grad()
        try:
            nn.functional.mse_loss(model(x), y).backward()
        except BaseException as err:  # noqa: BLE001 - every kind of error is the finding
            return err
        opt.step()
    raise AssertionError("no error in 100000 steps")


def dtensor_until_failure(plan: dict[str, int], is_victim: bool) -> BaseException:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (tdist.get_world_size(),))
    for step in range(100_000):
        if is_victim and step == 10 * plan["step"] + plan["layer"]:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            full = distribute_tensor(torch.ones(16, FEATURES), mesh, [Shard(0)])
            float(full.redistribute(mesh, [Replicate()]).to_local().sum())
        except BaseException as err:  # noqa: BLE001
            return err
    raise AssertionError("no error in 100000 steps")


def torch_agrees() -> dict[str, Any]:
    """What torch says of the world, next to plugdist's."""
    from torch.utils.data.distributed import DistributedSampler

    sampler = DistributedSampler(list(range(100)), shuffle=False)
    return {"rank": dist.get_rank(), "size": dist.get_world_size(),
            "torch_rank": tdist.get_rank(), "torch_size": tdist.get_world_size(),
            "world_rank": tdist.group.WORLD.rank(), "world_size": tdist.group.WORLD.size(),
            "world_ranks": tdist.get_process_group_ranks(tdist.group.WORLD),
            "sampler": [sampler.num_replicas, sampler.rank]}


def train_checked(state: dict[str, torch.Tensor], round_: int, steps: int) -> tuple[
        dict[str, torch.Tensor], list[str]]:
    """``steps`` steps of a fresh DDP, each compared with the same step computed here over
    every rank's batch; returns the new state and what differed."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    size, rank = dist.get_world_size(), dist.get_rank()
    model = DDP(build_net(state))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    reference = build_net(state)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
    bad = []
    for step in range(steps):
        opt.zero_grad()
        x, y = batch(round_, 1000 + step, rank)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        ref_opt.zero_grad()
        for r in range(size):  # DDP averages the ranks' gradients: the mean of their losses
            x, y = batch(round_, 1000 + step, r)
            (nn.functional.mse_loss(reference(x), y) / size).backward()
        ref_opt.step()
        for (name, got), want in zip(model.module.named_parameters(), reference.parameters(),
                                     strict=True):
            if not torch.allclose(got, want, atol=1e-5, rtol=1e-4):
                bad.append(f"round {round_} step {step} {name}: differs from the local "
                           f"reference by {float((got - want).abs().max()):.3g}")
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}, bad


def write(launch_rank: int, result: dict[str, Any]) -> None:
    path = os.path.join(os.environ["RESULT_DIR"], f"survivor-{launch_rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


def torch_only(backend: str, kind: str, plan: dict[str, int], victim: int) -> None:
    tdist.init_process_group(f"plugdist_{backend}", timeout=timedelta(seconds=30))
    rank = tdist.get_rank()
    state = {k: v.clone() for k, v in build_net().state_dict().items()}
    err = train_until_failure(kind, state, 0, plan, rank == victim)
    write(rank, {"launch_rank": rank, "error_type": type(err).__name__,
                 "error": str(err)[:2000]})
    tdist.destroy_process_group()


def main() -> None:
    backend = os.environ["BACKEND"]
    victims = [int(v) for v in os.environ["VICTIMS"].split(",") if v]
    kinds = os.environ.get("KINDS", "builtin").split(",")
    rng = random.Random(int(os.environ.get("SEED", "0")))
    plans = [{"step": rng.randrange(1, 4), "layer": rng.randrange(LAYERS)} for _ in victims]
    if os.environ.get("TORCH_ONLY") == "1":
        torch_only(backend, kinds[0], plans[0], victims[0])
        return
    dist.init_process_group(backend, init_method=os.environ.get("INIT_METHOD") or None,
                            timeout=timedelta(seconds=60))
    launch_rank = dist.get_rank()
    state = {k: v.clone() for k, v in build_net().state_dict().items()}
    rounds: list[dict[str, Any]] = []
    for i, (victim, plan) in enumerate(zip(victims, plans, strict=True)):
        kind = kinds[i % len(kinds)]
        began = time.monotonic()
        err = train_until_failure(kind, state, i, plan, dist.get_rank() == victim)
        ranks = list(getattr(err, "ranks", ()))
        seen: dict[str, Any] = {
            "kind": kind, "victim": victim, "plan": plan, "error_type": type(err).__name__,
            "error": str(err)[:2000], "error_ranks": ranks, "failed_s": time.monotonic() - began}
        if not isinstance(err, dist.DistRankFailureError):
            seen["traceback"] = "".join(traceback.format_exception(err))[-4000:]
        dist.shrink_group()
        seen["after"] = torch_agrees()
        state, seen["bad"] = train_checked(state, i, int(os.environ.get("STEPS_AFTER", "3")))
        rounds.append(seen)
    digest = hashlib.sha1(b"".join(v.numpy().tobytes() for v in state.values())).hexdigest()
    write(launch_rank, {"launch_rank": launch_rank, "rounds": rounds, "sha1": digest,
                        "final": torch_agrees()})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
