"""Rank-side bodies of tests/test_sync_batchnorm.py, run by plugdist.testing.run_world.

:func:`run_suite` runs every check inside one world and returns ``{check name: None or the error
text}``. Each check builds the same global batch on every rank (same seed), gives each rank its
own slice (of a different size on each rank, an empty one included), and compares what
SyncBatchNorm did on this rank with torch's BatchNorm run in this process on the whole batch.
The suite can run once more on a group of another backend built inside the same world (the toy
backend inside a Gloo world), which spares starting a world for it.
"""

from __future__ import annotations

import copy
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import plugdist as dist
import torch
import torch.nn.functional as F  # noqa: N812
from plugdist.nn import SyncBatchNorm
from plugdist.parallel import DistributedDataParallel as DDP
from plugdist.testing.checks import expect_error
from torch import nn

# per-rank batch sizes: all different, and a world where one rank's batch is empty
UNEVEN = {2: [3, 5], 3: [4, 1, 6]}
WITH_EMPTY = {2: [5, 0], 3: [3, 0, 4]}


def sliced(t: torch.Tensor, sizes: list[int], rank: int) -> torch.Tensor:
    start = sum(sizes[:rank])
    return t[start:start + sizes[rank]]


@dataclass
class Case:
    """One layer configuration: the torch BatchNorm class, its arguments, the input's shape
    after (N, C), and how to lay the input out."""

    bn: type[nn.Module]
    channels: int
    tail: tuple[int, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    input_dtype: torch.dtype = torch.float32
    channels_last: bool = False
    input_grad: bool = True
    tol: tuple[float, float] = (1e-4, 1e-5)  # rtol, atol


CASES = {
    "1d_on_2d_input": Case(nn.BatchNorm1d, 6, ()),
    "1d_on_3d_input_no_affine_cumulative": Case(nn.BatchNorm1d, 4, (7,),
                                                {"affine": False, "momentum": None}),
    "2d_channels_last": Case(nn.BatchNorm2d, 5, (4, 3), channels_last=True),
    "2d_no_bias_momentum_0.3": Case(nn.BatchNorm2d, 3, (2, 5), {"bias": False, "momentum": 0.3}),
    "2d_untracked": Case(nn.BatchNorm2d, 3, (4, 4), {"track_running_stats": False}),
    "2d_input_without_grad": Case(nn.BatchNorm2d, 4, (3, 3), input_grad=False),
    "3d_float64": Case(nn.BatchNorm3d, 3, (2, 3, 2), {"dtype": torch.float64},
                       input_dtype=torch.float64, tol=(1e-10, 1e-12)),
    "3d_channels_last": Case(nn.BatchNorm3d, 4, (2, 3, 2), channels_last=True),
    "2d_bfloat16_input": Case(nn.BatchNorm2d, 4, (3, 3), input_dtype=torch.bfloat16,
                              tol=(2e-2, 2e-2)),
    "2d_bfloat16_layer": Case(nn.BatchNorm2d, 4, (3, 3), {"dtype": torch.bfloat16},
                              input_dtype=torch.bfloat16, tol=(3e-2, 3e-2)),
}


def make_layers(case: Case, process_group: Any = None, seed: int = 0) -> tuple[nn.Module,
                                                                                 SyncBatchNorm]:
    """(torch's BatchNorm, plugdist's SyncBatchNorm) with the same non-trivial affine values."""
    ref = case.bn(case.channels, **case.kwargs)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    kwargs = {k: v for k, v in case.kwargs.items()}
    sync = SyncBatchNorm(case.channels, process_group=process_group, **kwargs)
    sync.load_state_dict(ref.state_dict())
    return ref, sync


def global_batch(case: Case, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (n, case.channels, *case.tail)
    # an offset and a scale per channel, so that mean and variance both matter
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 3 + 2
    grad = torch.randn(shape, generator=g, dtype=torch.float64)
    return x.to(case.input_dtype), grad.to(case.input_dtype)


def memory_format(case: Case, t: torch.Tensor) -> torch.memory_format:
    if not case.channels_last:
        return torch.contiguous_format
    return torch.channels_last if t.dim() == 4 else torch.channels_last_3d


def layout(t: torch.Tensor, case: Case) -> torch.Tensor:
    return t.contiguous(memory_format=memory_format(case, t))


def close(got: torch.Tensor | None, want: torch.Tensor | None, what: str,
          tol: tuple[float, float]) -> None:
    if got is None or want is None:
        if got is not want:
            raise AssertionError(f"{what}: got {got}, want {want}")
        return
    torch.testing.assert_close(got.detach(), want.detach().to(got.dtype), rtol=tol[0],
                               atol=tol[1], msg=lambda m: f"{what}: {m}")


def summed_over_ranks(t: torch.Tensor | None, group: Any = None) -> torch.Tensor | None:
    if t is None:
        return None
    t = t.detach().clone()
    dist.all_reduce(t, group=group)
    return t


def compare_steps(rank: int, case: Case, sizes: list[int], ref: nn.Module, sync: nn.Module,
                  steps: int = 3, group: Any = None, label: str = "") -> None:
    """``steps`` training steps of ``sync`` on this rank's slice against ``ref`` on the whole
    batch: outputs, input gradients, parameter gradients (summed over the group's ranks), the
    running statistics and num_batches_tracked."""
    for step in range(steps):
        what = f"{label} sizes {sizes} step {step}"
        x_all, g_all = global_batch(case, sum(sizes), seed=100 * step + len(sizes))
        x_ref = layout(x_all.clone(), case).requires_grad_(case.input_grad)
        x = layout(sliced(x_all, sizes, rank).clone(), case).requires_grad_(case.input_grad)
        for m in (ref, sync):
            m.zero_grad(set_to_none=True)
        out_ref = ref(x_ref)
        (out_ref.float() * g_all.float()).sum().backward()
        out = sync(x)
        (out.float() * sliced(g_all, sizes, rank).float()).sum().backward()

        close(out, sliced(out_ref, sizes, rank), f"{what}: output", case.tol)
        if case.channels_last and out.numel() and not out.is_contiguous(
                memory_format=memory_format(case, out)):
            raise AssertionError(f"{what}: a channels_last input gave output strides "
                                 f"{out.stride()}")
        if case.input_grad:
            close(x.grad, sliced(x_ref.grad, sizes, rank), f"{what}: input grad", case.tol)
        for name in ("weight", "bias"):
            close(summed_over_ranks(getattr(sync, name).grad if getattr(sync, name) is not None
                                    else None, group),
                  getattr(ref, name).grad if getattr(ref, name) is not None else None,
                  f"{what}: {name} grad summed over ranks", case.tol)
        for name in ("running_mean", "running_var"):
            close(getattr(sync, name), getattr(ref, name), f"{what}: {name}", case.tol)
        if ref.num_batches_tracked is not None and not torch.equal(sync.num_batches_tracked,
                                                                   ref.num_batches_tracked):
            raise AssertionError(f"{what}: num_batches_tracked {sync.num_batches_tracked} vs "
                                 f"{ref.num_batches_tracked}")


# -- checks ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Ctx:
    """Where a check runs: this rank, the world size, the group the layers synchronise over
    (None: the default group) and the backend of the groups a check builds (None: the
    default group's)."""

    rank: int
    ws: int
    group: Any = None
    backend: str | None = None


def check_matches_single_process(c: Ctx) -> None:
    for i, (name, case) in enumerate(CASES.items()):
        for sizes in (UNEVEN[c.ws], WITH_EMPTY[c.ws]):
            ref, sync = make_layers(case, process_group=c.group, seed=i)
            compare_steps(c.rank, case, sizes, ref, sync, group=c.group, label=name)


def check_eval_mode_is_local(c: Ctx) -> None:
    """Eval mode never communicates: each rank runs a different number of eval forwards, and
    the training steps around them still pair up."""
    case = CASES["2d_channels_last"]
    ref, sync = make_layers(case, process_group=c.group, seed=3)
    compare_steps(c.rank, case, UNEVEN[c.ws], ref, sync, steps=1, group=c.group,
                  label="before eval")
    sync.eval()
    for i in range(c.rank + 1):
        x, _ = global_batch(case, 2 + i, seed=50 + i)
        want = F.batch_norm(x, sync.running_mean, sync.running_var, sync.weight, sync.bias,
                            False, 0.0, sync.eps)
        close(sync(x), want, f"eval forward {i}", case.tol)
    sync.train()
    compare_steps(c.rank, case, UNEVEN[c.ws], ref, sync, steps=1, group=c.group,
                  label="after eval")

    # without running statistics, eval normalizes each rank's own batch, still locally
    untracked = SyncBatchNorm(3, track_running_stats=False, process_group=c.group).eval()
    for i in range(c.rank + 1):
        x = torch.randn(3 + i, 3, 2)
        close(untracked(x), F.batch_norm(x, None, None, untracked.weight, untracked.bias, True,
                                         0.0, untracked.eps), "untracked eval", case.tol)


def check_subgroups(c: Ctx) -> None:
    """A layer on a sub-group synchronises its members only; a non-member, and a group of one
    rank, normalize locally."""
    rank, ws = c.rank, c.ws
    members = [0, ws - 1]
    pair = dist.new_group(members, backend=c.backend)
    alone = dist.new_group([1], backend=c.backend)
    case = CASES["1d_on_3d_input_no_affine_cumulative"]
    sizes = [s if r in members else 0 for r, s in enumerate(UNEVEN[ws])]
    ref, original = make_layers(case, process_group=pair)
    sync = copy.deepcopy(original)  # a copy (an EMA model, say) shares the group
    if sync.process_group is not original.process_group:
        raise AssertionError("deepcopy copied the process group")
    if rank in members:
        compare_steps(rank, case, sizes, ref, sync, group=pair, label="pair")
    else:
        local = [0] * ws
        local[rank] = 4
        compare_steps(rank, case, local, ref, sync, group=dist.GroupMember.NON_GROUP_MEMBER,
                      label="non-member")
    if rank == 1:
        ref, sync = make_layers(case, process_group=alone)
        compare_steps(rank, case, [0, 5] + [0] * (ws - 2), ref, sync, group=alone,
                      label="group of one")
    dist.barrier(group=c.group)


def check_one_value_per_channel_is_an_error(c: Ctx) -> None:
    """One value per channel in the whole group cannot give a variance: every rank raises."""
    sync = SyncBatchNorm(4, process_group=c.group)
    x = torch.randn(1 if c.rank == c.ws - 1 else 0, 4)
    expect_error(ValueError, ("more than 1 value per channel across the group", "got 1",
                              f"rank {c.rank}", "model.eval()"), lambda: sync(x))


def ddp_model(bn: Callable[[int], nn.Module]) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), bn(4), nn.ReLU(),
                         nn.Conv2d(4, 5, 3), bn(5), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(5, 3),
                         nn.BatchNorm1d(3))


def run_ddp(c: Ctx, convert: Callable[[nn.Module], nn.Module], label: str,
            steps: int = 3) -> DDP:
    """DDP over a SyncBatchNorm model against the BatchNorm model on the whole batch. The
    per-rank loss is summed over its samples and divided by the global batch size, so the sum
    of the ranks' losses is the reference's mean loss; DDP averages, hence the reference's
    loss is divided by the world size too."""
    rank, ws = c.rank, c.ws
    torch.manual_seed(11)
    ref = ddp_model(nn.BatchNorm2d)
    local = convert(copy.deepcopy(ref))
    model = DDP(local, process_group=c.group)
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.2)
    for step in range(steps):
        sizes = (UNEVEN if step % 2 == 0 else WITH_EMPTY)[ws]
        what = f"{label} step {step} sizes {sizes}"
        g = torch.Generator().manual_seed(step)
        x_all = torch.randn(sum(sizes), 3, 5, 5, generator=g) + 1
        y_all = torch.randint(0, 3, (sum(sizes),), generator=g)
        opt.zero_grad()
        ropt.zero_grad()
        out = model(sliced(x_all, sizes, rank))
        (F.cross_entropy(out, sliced(y_all, sizes, rank), reduction="sum")
         / sum(sizes)).backward()
        (F.cross_entropy(ref(x_all), y_all, reduction="sum") / (sum(sizes) * ws)).backward()
        for (name, p), rp in zip(local.named_parameters(), ref.parameters(), strict=True):
            close(p.grad, rp.grad, f"{what}: grad of {name}", (1e-4, 1e-6))
        opt.step()
        ropt.step()
        for (name, t), rt in zip(local.state_dict().items(), ref.state_dict().values(),
                                   strict=True):
            close(t.float(), rt.float(), f"{what}: {name}", (1e-4, 1e-6))
    return model


def check_inside_ddp(c: Ctx) -> None:
    run_ddp(c, lambda m: SyncBatchNorm.convert_sync_batchnorm(m, c.group),
            "plugdist SyncBatchNorm")


def check_torch_sync_batchnorm_inside_ddp(c: Ctx) -> None:
    """torch.nn.SyncBatchNorm layers are adopted in place: same objects, same tensors, still
    torch's class, and synchronised."""
    layers: list[nn.Module] = []

    def convert(m: nn.Module) -> nn.Module:
        m = nn.SyncBatchNorm.convert_sync_batchnorm(m, c.group)  # None, or a plugdist group
        layers.extend((x, x.weight, x.running_mean) for x in m.modules()
                      if isinstance(x, nn.SyncBatchNorm))
        return m

    model = run_ddp(c, convert, "torch SyncBatchNorm")
    found = [m for m in model.module.modules() if isinstance(m, nn.SyncBatchNorm)]
    if len(found) != 3 or len(layers) != 3:
        raise AssertionError(f"expected 3 SyncBatchNorm layers, found {len(found)}")
    for m, (old, weight, running_mean) in zip(found, layers, strict=True):
        if m is not old or m.weight is not weight or m.running_mean is not running_mean:
            raise AssertionError("DDP replaced a torch.nn.SyncBatchNorm instead of adopting it")
        if not isinstance(m, SyncBatchNorm) or m.process_group is not c.group:
            raise AssertionError(f"{type(m)} was not adopted with its group")


class MySyncBN(nn.SyncBatchNorm):
    pass


def check_ddp_refuses_what_it_cannot_synchronise(c: Ctx) -> None:
    sub = nn.Sequential(nn.Linear(3, 4), MySyncBN(4))
    expect_error(TypeError, ("'1'", "MySyncBN", "plugdist.nn.SyncBatchNorm.convert_sync_batchnorm",
                             "DistributedDataParallel"), lambda: DDP(sub, process_group=c.group))
    foreign = nn.Sequential(nn.Linear(3, 4), nn.SyncBatchNorm(4, process_group="not a group"))
    expect_error(TypeError, ("'1'", "not a plugdist group",
                             "plugdist.nn.SyncBatchNorm.convert_sync_batchnorm"),
                 lambda: DDP(foreign, process_group=c.group))
    if type(foreign[1]) is not nn.SyncBatchNorm or type(sub[1]) is not MySyncBN:
        raise AssertionError("a refused layer was changed")


SUITE: dict[str, Callable[[Ctx], None]] = {
    "matches_single_process": check_matches_single_process,
    "eval_mode_is_local": check_eval_mode_is_local,
    "subgroups": check_subgroups,
    "one_value_per_channel_is_an_error": check_one_value_per_channel_is_an_error,
    "inside_ddp": check_inside_ddp,
    "torch_sync_batchnorm_inside_ddp": check_torch_sync_batchnorm_inside_ddp,
    "ddp_refuses_what_it_cannot_synchronise": check_ddp_refuses_what_it_cannot_synchronise,
}


def run_suite(rank: int, ws: int, also_on: tuple[str, ...] = ()) -> dict[str, str | None]:
    """Every check on the default group, then on a group of all ranks of each backend in
    ``also_on`` (results keyed ``"<backend>/<check>"``); in the same order on every rank. A
    failing check is reported, not fatal."""
    torch.set_num_threads(1)
    results: dict[str, str | None] = {}
    contexts = [("", Ctx(rank, ws))] + [
        (f"{b}/", Ctx(rank, ws, dist.new_group(backend=b), b)) for b in also_on]
    for prefix, ctx in contexts:
        for name, fn in SUITE.items():
            try:
                fn(ctx)
                results[prefix + name] = None
            except BaseException as exc:  # noqa: BLE001 - reported per check
                results[prefix + name] = "".join(traceback.format_exception(exc))[-3000:]
            dist.barrier()
    return results


def abandon(rank: int, ws: int) -> list[str] | None:
    """Rank 1 leaves after one forward: rank 0's backward, and its next forward, must fail
    within the group's timeout, saying which layer and pass, instead of hanging."""
    torch.set_num_threads(1)
    sync = SyncBatchNorm(3)
    out = sync(torch.randn(4, 3, 2, requires_grad=True))
    if rank != 0:
        return None  # leave: the harness tears this rank's group down and exits
    errors = []
    for step in (lambda: out.sum().backward(), lambda: sync(torch.randn(4, 3, 2))):
        try:
            step()
            errors.append("no error")
        except dist.DistError as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    return errors

