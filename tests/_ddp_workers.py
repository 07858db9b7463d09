"""Rank-side bodies of the DDP tests (tests/test_ddp.py), run by plugdist.testing.run_world.

Each suite function runs many checks inside one world and returns ``{check name: None or the
error text}`` so that a failing check names itself without stopping the others. Every check
compares what DDP did on this rank with a single-process reference computed locally from the
same data: each rank's shard is run through a copy of the model in turn (starting from rank 0's
buffers, as DDP's per-forward broadcast does) and the gradients averaged.
"""

from __future__ import annotations

import copy
import functools
import traceback
from collections.abc import Callable
from typing import Any

import plugdist as dist
import torch
from plugdist._debug_level import DebugLevel, set_debug_level
from plugdist._registry import PluginNotFoundError, registry
from plugdist.errors import DistError
from plugdist.hookspecs import hookimpl
from plugdist.parallel import (
    BucketedReducer,
    DistributedDataParallel,
    GradBucket,
    fp16_compress_hook,
)
from plugdist.testing.checks import expect_error
from torch import nn

DDP = DistributedDataParallel
F = nn.functional


# -- models --------------------------------------------------------------------------------------
def mlp() -> nn.Module:
    # the middle weight is large enough to take the reducer's per-gradient copy path, the
    # others the batched one
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1024), nn.Tanh(),
                         nn.Linear(1024, 4))


def conv_bn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(),
                         nn.Conv2d(6, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))


class Tied(nn.Module):
    """Embedding and output projection share one weight; one block is applied twice."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 12)
        self.block = nn.Linear(12, 12)
        self.out = nn.Linear(12, 20, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens).mean(1)
        h = torch.tanh(self.block(torch.tanh(self.block(h))))
        return self.out(h)


class Mixed(nn.Module):
    """float32 layers around a float16 layer: two dtypes, so at least two buckets."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.h = nn.Linear(16, 16).half()
        self.b = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.h(torch.relu(self.a(x)).half()).float())


class Branchy(nn.Module):
    """``never`` is never used; ``extra`` only when asked (per rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 8)
        self.extra = nn.Linear(8, 8)
        self.never = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        h = torch.relu(self.body(x))
        if use_extra:
            h = h + self.extra(h)
        return self.head(h)


class Checkpointed(nn.Module):
    """One block run twice, each time under reentrant activation checkpointing: its gradient
    arrives in two nested backward passes."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.block = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def _block(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.block(h))

    def _block_and_head(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self._block(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = torch.relu(self.inp(x))
        h = checkpoint(self._block, h, use_reentrant=True)
        # every gradient hook of the last segment fires inside a nested backward
        return checkpoint(self._block_and_head, h, use_reentrant=True)


class Reordered(nn.Module):
    """Registered in one order, used in another: gradients arrive in neither registration
    order nor its reverse, which is what bucket rebuilding learns."""

    def __init__(self) -> None:
        super().__init__()
        self.second = nn.Linear(16, 16)
        self.first = nn.Linear(8, 16)
        self.third = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.third(torch.relu(self.second(torch.relu(self.first(x)))))


# -- data and the local reference ------------------------------------------------------------------
def batches(kind: str, steps: int, ws: int, per_rank: int, seed: int = 7) -> list[list[tuple]]:
    """``steps`` global batches, each as ``ws`` shards of ``(inputs, target)``; the same on
    every rank."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        n = ws * per_rank
        if kind == "image":
            x, y = torch.randn(n, 3, 6, 6, generator=g), torch.randint(0, 3, (n,), generator=g)
        elif kind == "tokens":
            x = torch.randint(0, 20, (n, 5), generator=g)
            y = torch.randint(0, 20, (n,), generator=g)
        else:
            width = {"mlp": 10, "mixed": 8, "branchy": 6, "reordered": 8}[kind]
            outs = {"mlp": 4, "mixed": 2, "branchy": 2, "reordered": 4}[kind]
            x, y = torch.randn(n, width, generator=g), torch.randn(n, outs, generator=g)
        out.append([(x[r * per_rank:(r + 1) * per_rank], y[r * per_rank:(r + 1) * per_rank])
                    for r in range(ws)])
    return out


def loss_for(kind: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if kind in ("image", "tokens"):
        return F.cross_entropy
    return lambda out, y: F.mse_loss(out.float(), y)


def reference_step(ref: nn.Module, opt: torch.optim.Optimizer, shards: list[tuple],
                   loss_fn: Callable, kwargs_for: Callable[[int], dict],
                   divisor: int | None = None) -> list[list[torch.Tensor]]:
    """One DDP step emulated in this process: every shard's gradient, averaged; returns the
    buffers each rank ends the step with."""
    n = divisor or len(shards)
    params = list(ref.parameters())
    start = [b.detach().clone() for b in ref.buffers()]
    acc: list[torch.Tensor | None] = [None] * len(params)
    rank_buffers = []
    for r, (x, y) in enumerate(shards):
        with torch.no_grad():
            for b, s in zip(ref.buffers(), start, strict=True):
                b.copy_(s)
        for p in params:
            p.grad = None
        loss_fn(ref(x, **kwargs_for(r)), y).backward()
        for i, p in enumerate(params):
            if p.grad is not None:
                part = p.grad / n
                acc[i] = part if acc[i] is None else acc[i] + part
        rank_buffers.append([b.detach().clone() for b in ref.buffers()])
    for p, g in zip(params, acc, strict=True):
        p.grad = g
    if rank_buffers:
        with torch.no_grad():
            for b, s in zip(ref.buffers(), rank_buffers[0], strict=True):
                b.copy_(s)
    opt.step()
    return rank_buffers


def assert_close_lists(got: list[torch.Tensor], want: list[torch.Tensor], what: str,
                       rtol: float, atol: float) -> None:
    if len(got) != len(want):
        raise AssertionError(f"{what}: {len(got)} tensors vs {len(want)}")
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if b is None or a is None:
            if a is not b:
                raise AssertionError(f"{what}[{i}]: one is None ({a is None}, {b is None})")
            continue
        torch.testing.assert_close(a.detach(), b.detach(), rtol=rtol, atol=atol,
                                   msg=lambda m, i=i: f"{what}[{i}]: {m}")


def make_pair(factory: Callable[[], nn.Module], rank: int) -> tuple[nn.Module, nn.Module]:
    """(this rank's model, the reference); ranks start from different weights on purpose, so
    that DDP's initial broadcast from rank 0 is checked too."""
    torch.manual_seed(1000 + rank)
    local = factory()
    torch.manual_seed(1000)
    ref = factory()
    return local, ref


def run_equivalence(rank: int, ws: int, factory: Callable[[], nn.Module], kind: str,
                    steps: int = 4, per_rank: int = 4, rtol: float = 1e-5, atol: float = 1e-6,
                    kwargs_for: Callable[[int], dict] = lambda r: {}, lr: float = 0.1,
                    set_to_none: bool = True, **ddp_kwargs: Any) -> DDP:
    local, ref = make_pair(factory, rank)
    ddp = DDP(local, **ddp_kwargs)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr)
    ropt = torch.optim.SGD(ref.parameters(), lr=lr)
    loss_fn = loss_for(kind)
    assert_close_lists(list(local.parameters()), list(ref.parameters()), "initial params", 0, 0)
    for step, shards in enumerate(batches(kind, steps, ws, per_rank)):
        opt.zero_grad(set_to_none=set_to_none)
        x, y = shards[rank]
        loss_fn(ddp(x, **kwargs_for(rank)), y).backward()
        grads = [p.grad.clone() if p.grad is not None else None for p in local.parameters()]
        opt.step()
        rank_buffers = reference_step(ref, ropt, shards, loss_fn, kwargs_for)
        assert_close_lists(grads, [p.grad for p in ref.parameters()], f"step {step} grads",
                           rtol, atol)
        assert_close_lists(list(local.parameters()), list(ref.parameters()),
                           f"step {step} params", rtol, atol)
        assert_close_lists(list(local.buffers()), rank_buffers[rank], f"step {step} buffers",
                           rtol, atol)
    return ddp


# -- suite plumbing --------------------------------------------------------------------------------
class Suite:
    def __init__(self) -> None:
        self.results: dict[str, str | None] = {}

    def run(self, name: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
            self.results[name] = None
        except BaseException as exc:  # noqa: BLE001 - reported per check
            self.results[name] = "".join(traceback.format_exception(exc))[-3000:]


def expect_raises(exc_type: type[BaseException], fn: Callable[[], Any], *needles: str) -> str:
    """``expect_error`` with the call first: the DDP checks read better that way."""
    return expect_error(exc_type, needles, fn)


# -- the checks ------------------------------------------------------------------------------------
def check_mlp_matches_big_batch(rank: int, ws: int) -> None:
    """N ranks x batch B for K steps == one process with batch N*B."""
    local, ref = make_pair(mlp, rank)
    ddp = DDP(local, bucket_cap_mb=0.001)  # several buckets
    opt, ropt = (torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.9) for m in (ddp, ref))
    for step, shards in enumerate(batches("mlp", 5, ws, 6)):
        opt.zero_grad()
        ropt.zero_grad()
        x, y = shards[rank]
        F.mse_loss(ddp(x), y).backward()
        opt.step()
        big_x = torch.cat([s[0] for s in shards])
        big_y = torch.cat([s[1] for s in shards])
        F.mse_loss(ref(big_x), big_y).backward()
        ropt.step()
        assert_close_lists(list(local.parameters()), list(ref.parameters()), f"step {step}",
                           rtol=1e-5, atol=1e-6)
    if len(ddp.bucket_indices()) < 2:
        raise AssertionError(f"expected several buckets, got {ddp.bucket_indices()}")


def check_conv_bn(rank: int, ws: int) -> None:
    run_equivalence(rank, ws, conv_bn, "image", per_rank=3, set_to_none=False)


def check_conv_bn_no_broadcast(rank: int, ws: int) -> None:
    """broadcast_buffers=False: each rank's BatchNorm statistics follow its own shards, from
    its own starting values (construction copies parameters only), and the end of join()
    leaves them alone too."""
    local, ref = make_pair(conv_bn, rank)
    with torch.no_grad():
        local[1].running_mean.fill_(float(rank + 1))
    ddp = DDP(local, broadcast_buffers=False)
    # every collective first, the checks at the end: a check failing on one rank only must
    # not leave the others waiting in a collective
    after_construction = local[1].running_mean.detach().clone()
    params_after_construction = [p.detach().clone() for p in local.parameters()]
    for shards in batches("image", 2, ws, 3):
        x, y = shards[rank]
        F.cross_entropy(ddp(x), y).backward()
    means = [torch.zeros(6) for _ in range(ws)]
    ddp.process_group.all_gather(means, local[1].running_mean.detach().clone()).wait()
    data = batches("image", ws, ws, 3, seed=9)
    with ddp.join():  # rank r has r + 1 batches
        for step in range(rank + 1):
            x, y = data[step][rank]
            F.cross_entropy(ddp(x), y).backward()
        own = [b.detach().clone() for b in local.buffers()]
    if not torch.equal(after_construction, torch.full((6,), float(rank + 1))):
        raise AssertionError(f"construction replaced this rank's buffers: running_mean "
                             f"{after_construction.tolist()}")
    assert_close_lists(params_after_construction, list(ref.parameters()),
                       "parameters after construction", 0, 0)
    if ws > 1 and torch.equal(means[0], means[1]):
        raise AssertionError("running stats agree across ranks without buffer broadcast")
    assert_close_lists(list(local.buffers()), own, "buffers after join", 0, 0)


def check_tied(rank: int, ws: int) -> None:
    ddp = run_equivalence(rank, ws, Tied, "tokens")
    n_tensors = ddp._get_ddp_logging_data()["num_parameter_tensors"]
    if n_tensors != 3:  # the shared emb/out weight once, block weight and bias
        raise AssertionError(f"tied weight counted {n_tensors} parameter tensors, expected 3")


def check_mixed_dtypes(rank: int, ws: int) -> None:
    ddp = run_equivalence(rank, ws, Mixed, "mixed", rtol=2e-3, atol=2e-3)
    dtypes = {buf.dtype for buf in ddp.reducer.bucket_buffers()}
    if dtypes != {torch.float16, torch.float32}:
        raise AssertionError(f"bucket dtypes {dtypes}")


def check_find_unused(rank: int, ws: int) -> None:
    """``extra`` is used only on the last rank; ``never`` on none: its .grad must stay None."""
    ddp = run_equivalence(rank, ws, Branchy, "branchy", find_unused_parameters=True,
                          kwargs_for=lambda r: {"use_extra": r == ws - 1})
    module = ddp.module
    if module.never.weight.grad is not None:
        raise AssertionError("a parameter unused on every rank got a gradient")
    if module.extra.weight.grad is None:
        raise AssertionError("a parameter used on one rank has no gradient")


def check_find_unused_as_view(rank: int, ws: int) -> None:
    run_equivalence(rank, ws, Branchy, "branchy", find_unused_parameters=True,
                    gradient_as_bucket_view=True, kwargs_for=lambda r: {"use_extra": r % 2 == 0})


def check_static_graph(rank: int, ws: int) -> None:
    ddp = run_equivalence(rank, ws, Branchy, "branchy", steps=5, static_graph=True)
    if ddp.module.never.weight.grad is not None:
        raise AssertionError("static_graph: an unused parameter got a gradient")
    if not ddp.reducer.has_rebuilt_buckets:
        raise AssertionError("static_graph: buckets were not rebuilt")


def check_static_graph_checkpointing(rank: int, ws: int) -> None:
    """Reentrant checkpointing of a block used twice: an error without static_graph, correct
    training with it (including its first iteration, reduced once the outer backward ends)."""
    torch.manual_seed(0)
    plain = DDP(Checkpointed())
    x, y = batches("branchy", 1, ws, 2)[0][rank]
    expect_raises(RuntimeError, lambda: F.mse_loss(plain(x), y).backward(), "twice",
                  "static_graph=True")
    plain.reducer.close()
    run_equivalence(rank, ws, Checkpointed, "branchy", steps=4, static_graph=True)


def check_no_sync(rank: int, ws: int) -> None:
    """Two local accumulations, then a synchronised one == the average of all micro-batches."""
    for as_view in (False, True):
        local, ref = make_pair(mlp, rank)
        ddp = DDP(local, gradient_as_bucket_view=as_view)
        micro = batches("mlp", 3, ws, 4, seed=11)
        with ddp.no_sync():
            for m in micro[:2]:
                x, y = m[rank]
                F.mse_loss(ddp(x), y).backward()
        # nothing was exchanged yet: the grads are this rank's own sums
        mine = [torch.zeros_like(p) for p in ref.parameters()]
        for m in micro[:2]:
            ref.zero_grad()
            F.mse_loss(ref(m[rank][0]), m[rank][1]).backward()
            mine = [a + p.grad for a, p in zip(mine, ref.parameters(), strict=True)]
        assert_close_lists([p.grad for p in local.parameters()], mine, "inside no_sync",
                           1e-5, 1e-6)
        x, y = micro[2][rank]
        F.mse_loss(ddp(x), y).backward()
        want = [torch.zeros_like(p) for p in ref.parameters()]
        for m in micro:
            for r in range(ws):
                ref.zero_grad()
                F.mse_loss(ref(m[r][0]), m[r][1]).backward()
                want = [a + p.grad / ws for a, p in zip(want, ref.parameters(), strict=True)]
        assert_close_lists([p.grad for p in local.parameters()], want,
                           f"after no_sync (gradient_as_bucket_view={as_view})", 1e-5, 1e-6)
    check_no_sync_find_unused(rank, ws)


def check_no_sync_find_unused(rank: int, ws: int) -> None:
    """find_unused_parameters: ``extra`` gets gradients only in the no_sync micro-batches, yet
    counts as used, so the synchronising backward averages its accumulated sums too; ``never``
    keeps no gradient."""
    local, ref = make_pair(Branchy, rank)
    ddp = DDP(local, find_unused_parameters=True)
    micro = batches("branchy", 3, ws, 4, seed=17)
    uses_extra = [True, True, False]
    with ddp.no_sync():
        for m, use_extra in zip(micro[:2], uses_extra[:2], strict=True):
            x, y = m[rank]
            F.mse_loss(ddp(x, use_extra=use_extra), y).backward()
    x, y = micro[2][rank]
    F.mse_loss(ddp(x, use_extra=uses_extra[2]), y).backward()
    want: list[torch.Tensor | None] = [None] * len(list(ref.parameters()))
    for m, use_extra in zip(micro, uses_extra, strict=True):
        for r in range(ws):
            ref.zero_grad(set_to_none=True)
            F.mse_loss(ref(m[r][0], use_extra=use_extra), m[r][1]).backward()
            want = [w if p.grad is None else p.grad / ws if w is None else w + p.grad / ws
                    for w, p in zip(want, ref.parameters(), strict=True)]
    assert_close_lists([p.grad for p in local.parameters()], want,
                       "no_sync with find_unused_parameters", 1e-5, 1e-6)


def check_bucket_view(rank: int, ws: int) -> None:
    """gradient_as_bucket_view: every .grad is a view into its bucket's flat buffer."""
    ddp = run_equivalence(rank, ws, mlp, "mlp", gradient_as_bucket_view=True, bucket_cap_mb=0.002)
    local = ddp.module
    buffers = ddp.reducer.bucket_buffers()
    params = list(local.parameters())

    def check_aliases(when: str) -> None:
        for b_index, indices in enumerate(ddp.bucket_indices()):
            buf = buffers[b_index]
            start, end = buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size()
            for i in indices:
                g = params[i].grad
                if g is None or not (start <= g.data_ptr() < end):
                    raise AssertionError(f"{when}: grad of parameter {i} is not in bucket "
                                         f"{b_index}'s buffer")
                if g.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr():
                    raise AssertionError(f"{when}: grad {i} has its own storage")

    check_aliases("after training")
    buffers = ddp.reducer.bucket_buffers()
    # zero_grad(set_to_none=False) keeps the views; the next backward reduces in place
    for p in params:
        p.grad.zero_()
    x, y = batches("mlp", 1, ws, 4, seed=3)[0][rank]
    F.mse_loss(ddp(x), y).backward()
    check_aliases("after an in-place zero_grad")
    marker = buffers[0].clone()
    with torch.no_grad():
        params[ddp.bucket_indices()[0][0]].grad.fill_(123.0)
    if torch.equal(marker, ddp.reducer.bucket_buffers()[0]):
        raise AssertionError("writing to .grad did not change the bucket")
    # gradients that exist when the buckets are regrouped move into the new buckets
    ddp = run_equivalence(rank, ws, Reordered, "reordered", gradient_as_bucket_view=True,
                          bucket_cap_mb=0.0004, set_to_none=False)
    params = list(ddp.module.parameters())
    buffers = ddp.reducer.bucket_buffers()
    if not ddp.reducer.has_rebuilt_buckets:
        raise AssertionError("Reordered model: buckets were not rebuilt")
    check_aliases("after regrouping with live gradients")


def check_rebuild(rank: int, ws: int) -> None:
    """Buckets are regrouped once, after the first iteration, in gradient-ready order."""
    local, ref = make_pair(Reordered, rank)
    # the order in which gradients become ready, seen without DDP
    ready: list[int] = []
    params = list(ref.parameters())
    handles = [p.register_post_accumulate_grad_hook(lambda _p, i=i: ready.append(i))
               for i, p in enumerate(params)]
    x, y = batches("reordered", 1, ws, 4)[0][0]
    F.mse_loss(ref(x), y).backward()
    for h in handles:
        h.remove()
    ref.zero_grad(set_to_none=True)

    seen: list[list[list[int]]] = []
    index_of = {id(p): i for i, p in enumerate(local.parameters())}

    def recording_hook(state: Any, bucket: GradBucket) -> torch.futures.Future:
        if bucket.index() == 0:
            seen.append([])
        seen[-1].append([index_of[id(p)] for p in bucket.parameters()])
        pg = ddp.process_group
        bucket.buffer().div_(pg.size())
        return pg.all_reduce(bucket.buffer()).get_future().then(lambda f: f.value()[0])

    ddp = DDP(local, bucket_cap_mb=0.0004)  # ~400 bytes: a bucket per layer or two
    ddp.register_comm_hook(None, recording_hook)
    initial = ddp.bucket_indices()
    flat_initial = [i for b in initial for i in b]
    if flat_initial != list(range(len(params) - 1, -1, -1)):
        raise AssertionError(f"initial buckets {initial} are not in reverse registration order")
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    rebuilt_at = []
    for step, shards in enumerate(batches("reordered", 4, ws, 4)):
        opt.zero_grad()
        x, y = shards[rank]
        out = ddp(x)
        if ddp.reducer.has_rebuilt_buckets and not rebuilt_at:
            rebuilt_at.append(step)
        F.mse_loss(out, y).backward()
        opt.step()
        reference_step(ref, ropt, shards, loss_for("reordered"), lambda r: {})
        assert_close_lists(list(local.parameters()), list(ref.parameters()), f"step {step}",
                           1e-5, 1e-6)
    if rebuilt_at != [1]:
        raise AssertionError(f"buckets rebuilt at steps {rebuilt_at}, expected [1]")
    final = ddp.bucket_indices()
    if [i for b in final for i in b] != ready:
        raise AssertionError(f"rebuilt buckets {final} do not follow the ready order {ready}")
    if final == initial:
        raise AssertionError("rebuilding did not change the buckets")
    if seen[0] != initial or any(s != final for s in seen[1:]):
        raise AssertionError(f"buckets reduced per iteration {seen}; expected {initial} then "
                             f"{final}")
    data = ddp._get_ddp_logging_data()
    if data["has_rebuilt_buckets"] != 1 or data["bucket_sizes"] != data["rebuilt_bucket_sizes"]:
        raise AssertionError(f"logging data does not show the rebuild: {data}")


def check_comm_hooks(rank: int, ws: int) -> None:
    for name, hook, tol in (("fp16", fp16_compress_hook, 2e-3), ("bf16", "bf16_compress", 2e-2),
                            ("allreduce", "allreduce", 1e-6)):
        local, ref = make_pair(mlp, rank)
        ddp = DDP(local, bucket_cap_mb=0.002)
        ddp.register_comm_hook(None, hook)
        shards = batches("mlp", 1, ws, 4)[0]
        x, y = shards[rank]
        F.mse_loss(ddp(x), y).backward()
        ropt = torch.optim.SGD(ref.parameters(), lr=0.0)
        reference_step(ref, ropt, shards, loss_for("mlp"), lambda r: {})
        assert_close_lists([p.grad for p in local.parameters()],
                           [p.grad for p in ref.parameters()], f"{name} hook", tol * 5, tol)
        if ddp._get_ddp_logging_data()["comm_hook"] != (hook if isinstance(hook, str)
                                                        else "fp16_compress_hook"):
            raise AssertionError("logging data does not name the comm hook")


def check_custom_hook_chain(rank: int, ws: int) -> None:
    """A custom hook's chained futures: the reducer writes the chain's final value back."""
    local, ref = make_pair(mlp, rank)
    ddp = DDP(local, bucket_cap_mb=0.002)
    calls: list[dict] = []

    def hook(state: dict, bucket: GradBucket) -> torch.futures.Future:
        pg = ddp.process_group
        grads, params = bucket.gradients(), bucket.parameters()
        shapes_ok = all(g.shape == p.shape for g, p in zip(grads, params, strict=True))
        calls.append(dict(index=bucket.index(), last=bucket.is_last(), n=len(params),
                          shapes_ok=shapes_ok,
                          views_ok=all(g.data_ptr() >= bucket.buffer().data_ptr() for g in grads)))
        fut = pg.all_reduce(bucket.buffer()).get_future()
        fut = fut.then(lambda f: f.value()[0] / pg.size())       # average
        return fut.then(lambda f: f.value() * state["scale"])    # then scale

    ddp.register_comm_hook({"scale": 3.0}, hook)
    expect_raises(RuntimeError, lambda: ddp.register_comm_hook(None, hook), "only be called once")
    shards = batches("mlp", 1, ws, 4)[0]
    F.mse_loss(ddp(shards[rank][0]), shards[rank][1]).backward()
    reference_step(ref, torch.optim.SGD(ref.parameters(), lr=0.0), shards, loss_for("mlp"),
                   lambda r: {})
    assert_close_lists([p.grad for p in local.parameters()],
                       [3.0 * p.grad for p in ref.parameters()], "custom hook", 1e-5, 1e-6)
    n_buckets = len(ddp.bucket_indices())
    if [c["index"] for c in calls] != list(range(n_buckets)):
        raise AssertionError(f"hook saw buckets {[c['index'] for c in calls]}")
    if [c["last"] for c in calls] != [i == n_buckets - 1 for i in range(n_buckets)]:
        raise AssertionError("is_last() is wrong")
    if not all(c["shapes_ok"] and c["views_ok"] for c in calls):
        raise AssertionError(f"GradBucket.gradients() do not match parameters: {calls}")
    if sum(c["n"] for c in calls) != len(list(local.parameters())):
        raise AssertionError("buckets do not cover every parameter")
    # a hook that does not communicate: the local gradient, untouched, comes back
    local2, _ = make_pair(mlp, rank)
    solo = DDP(local2)

    def local_only(state: Any, bucket: GradBucket) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    solo.register_comm_hook(None, local_only)
    x, y = shards[rank]
    F.mse_loss(solo(x), y).backward()
    check = copy.deepcopy(local2)
    check.zero_grad()
    F.mse_loss(check(x), y).backward()
    assert_close_lists([p.grad for p in local2.parameters()],
                       [p.grad for p in check.parameters()], "no-op hook", 1e-6, 1e-7)
    expect_raises(TypeError, lambda: DDP(mlp()).register_comm_hook(None, 42), "callable")


def _uneven_inputs(rank: int, ws: int, seed: int) -> tuple[Any, ...]:
    """For join(): (the local model, its reference, the local model in DDP with small buckets,
    each rank's batch count (2 + 2r), the batches, an SGD optimizer on the DDP's parameters)."""
    local, ref = make_pair(mlp, rank)
    ddp = DDP(local, bucket_cap_mb=0.002)
    counts = [2 + 2 * r for r in range(ws)]
    data = batches("mlp", max(counts), ws, 3, seed=seed)
    return local, ref, ddp, counts, data, torch.optim.SGD(ddp.parameters(), lr=0.1)


def check_join(rank: int, ws: int) -> None:
    """Rank r has 2 + 2r batches; join() keeps everyone in step, ends with equal models."""
    for divide_by_initial in (True, False):
        local, ref, ddp, counts, data, opt = _uneven_inputs(rank, ws, seed=5)
        with ddp.join(divide_by_initial_world_size=divide_by_initial):
            for step in range(counts[rank]):
                opt.zero_grad()
                x, y = data[step][rank]
                F.mse_loss(ddp(x), y).backward()
                opt.step()
        ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for step, shards in enumerate(data):
            active = [s for r, s in enumerate(shards) if step < counts[r]]
            reference_step(ref, ropt, active, loss_for("mlp"), lambda r: {},
                           divisor=ws if divide_by_initial else len(active))
        assert_close_lists(list(local.parameters()), list(ref.parameters()),
                           f"join (divide_by_initial_world_size={divide_by_initial})", 1e-5, 1e-6)
    # the model is usable normally after join
    x, y = data[0][rank]
    F.mse_loss(ddp(x), y).backward()
    check_join_no_sync(rank, ws)


def check_join_no_sync(rank: int, ws: int) -> None:
    """Gradient accumulation under join: every other step runs in no_sync; ranks that ran out
    still shadow those steps, and each synchronising step averages over the ranks training."""
    local, ref, ddp, counts, data, opt = _uneven_inputs(rank, ws, seed=21)
    with ddp.join(divide_by_initial_world_size=False):
        for step in range(counts[rank]):
            x, y = data[step][rank]
            if step % 2 == 0:
                with ddp.no_sync():
                    F.mse_loss(ddp(x), y).backward()
            else:
                F.mse_loss(ddp(x), y).backward()
                opt.step()
                opt.zero_grad()
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(0, max(counts), 2):
        active = [r for r in range(ws) if step < counts[r]]
        shards = [data[s][r] for s in (step, step + 1) for r in active]
        reference_step(ref, ropt, shards, loss_for("mlp"), lambda r: {}, divisor=len(active))
    assert_close_lists(list(local.parameters()), list(ref.parameters()), "join with no_sync",
                       1e-5, 1e-6)


def check_join_variants(rank: int, ws: int) -> None:
    """join() with rank 0 out of inputs from the start, combined with unused-parameter search,
    static graph (whose first iteration and bucket regrouping joined ranks must shadow in step)
    and a comm hook."""
    counts = [0] + [3 + r for r in range(1, ws)]
    variants: list[tuple[str, Callable[[], nn.Module], str, dict, Callable[[int], dict]]] = [
        ("find_unused", Branchy, "branchy", dict(find_unused_parameters=True),
         lambda r: {"use_extra": r % 2 == 1}),
        ("static_graph", Branchy, "branchy", dict(static_graph=True), lambda r: {}),
        ("fp16 hook", mlp, "mlp", dict(bucket_cap_mb=0.002), lambda r: {}),
    ]
    for label, factory, kind, kwargs, kwargs_for in variants:
        local, ref = make_pair(factory, rank)
        ddp = DDP(local, **kwargs)
        if label == "fp16 hook":
            ddp.register_comm_hook(None, "fp16_compress")
        data = batches(kind, max(counts), ws, 3, seed=13)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        with ddp.join():
            for step in range(counts[rank]):
                opt.zero_grad()
                x, y = data[step][rank]
                loss_for(kind)(ddp(x, **kwargs_for(rank)), y).backward()
                opt.step()
        ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for step, shards in enumerate(data):
            active = [(r, s) for r, s in enumerate(shards) if step < counts[r]]
            reference_step(ref, ropt, [s for _, s in active], loss_for(kind),
                           [kwargs_for(r) for r, _ in active].__getitem__, divisor=ws)
        tol = 2e-3 if label == "fp16 hook" else 1e-6
        assert_close_lists(list(local.parameters()), list(ref.parameters()), f"join + {label}",
                           tol * 5, tol)
        if label == "static_graph" and not ddp.reducer.has_rebuilt_buckets:
            raise AssertionError("join + static_graph: a joined rank never regrouped buckets")


def check_join_throw(rank: int, ws: int) -> None:
    local, _ = make_pair(mlp, rank)
    ddp = DDP(local)
    data = batches("mlp", 4, ws, 2)
    steps = 2 if rank == 0 else 4
    done = 0

    def train() -> None:
        nonlocal done
        with ddp.join(throw_on_early_termination=True):
            for step in range(steps):
                x, y = data[step][rank]
                F.mse_loss(ddp(x), y).backward()
                done += 1

    expect_raises(RuntimeError, train, "exhausted")
    if done != 2:
        raise AssertionError(f"rank {rank} ran {done} steps before the error, expected 2")


def check_unused_without_flag(rank: int, ws: int) -> None:
    """An unused parameter without find_unused_parameters: the next forward raises, naming it
    (names at debug level INFO, indices at OFF)."""
    for level in (DebugLevel.INFO, DebugLevel.OFF):
        set_debug_level(level)
        try:
            torch.manual_seed(0)
            ddp = DDP(Branchy())
            x, y = batches("branchy", 1, ws, 2)[0][rank]
            F.mse_loss(ddp(x), y).backward()
            msg = expect_raises(RuntimeError, functools.partial(ddp, x),
                                "find_unused_parameters=True", f"rank {rank}", "[2, 3, 4, 5]")
            if level is DebugLevel.INFO:
                for name in ("extra.weight", "extra.bias", "never.weight", "never.bias"):
                    if name not in msg:
                        raise AssertionError(f"INFO-level error does not name {name}: {msg}")
            elif "TORCH_DISTRIBUTED_DEBUG" not in msg or "never.weight" in msg:
                raise AssertionError(f"OFF-level error should give indices and the hint: {msg}")
            ddp.reducer.close()
        finally:
            set_debug_level(DebugLevel.OFF)


def check_mismatched_models(rank: int, ws: int) -> None:
    """The last rank builds a different model: every rank raises, naming parameter and ranks."""
    odd = rank == ws - 1
    bad = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 17 if odd else 16))
    expect_raises(DistError, lambda: DDP(bad), "'1.weight'", "rank 0: float32[16, 8]",
                  f"rank {ws - 1}: float32[17, 8]",
                  f"differs between rank 0 and rank(s) [{ws - 1}]")
    bad2 = nn.Sequential(nn.Linear(4, 4), *([nn.Linear(4, 4)] if odd else []))
    expect_raises(DistError, lambda: DDP(bad2),
                  f"Parameter counts per rank: {[2] * (ws - 1) + [4]}", "no such parameter")
    bad3 = nn.Sequential(nn.Linear(4, 4).double() if odd else nn.Linear(4, 4))
    expect_raises(DistError, lambda: DDP(bad3), f"rank {ws - 1}: float64[4, 4]")


def check_local_errors(rank: int, ws: int) -> None:
    """Errors raised before any communication (so ranks stay in step)."""
    frozen = nn.Linear(2, 2).requires_grad_(False)
    expect_raises(RuntimeError, lambda: DDP(frozen), "no parameter that requires a gradient")
    expect_raises(RuntimeError, lambda: DDP(nn.LazyLinear(3)), "uninitialized")
    expect_raises(ValueError, lambda: DDP(nn.Linear(2, 2), device_ids=[0]), "device_ids")
    expect_raises(ValueError, lambda: DDP(nn.Linear(2, 2), device_ids=[0, 1]), "single element")
    two = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    expect_raises(ValueError, lambda: DDP(two), "one device type")
    expect_raises(PluginNotFoundError, lambda: DDP(nn.Linear(2, 2), reducer="nope"), "nope")
    expect_raises(TypeError, lambda: DDP(nn.Linear(2, 2), process_group=object()), "ProcessGroup")
    ok = DDP(nn.Linear(2, 2), reducer=BucketedReducer)
    expect_raises(TypeError, lambda: __import__("pickle").dumps(ok), "cannot be pickled")


class _Recorder:
    def __init__(self) -> None:
        self.constructed: list[dict] = []
        self.iterations: list[tuple[int, dict]] = []

    @hookimpl
    def plugdist_ddp_constructed(self, module: Any, logging_data: dict) -> None:
        self.constructed.append(dict(logging_data))

    @hookimpl
    def plugdist_ddp_iteration(self, module: Any, iteration: int, stats: dict) -> None:
        self.iterations.append((iteration, dict(stats)))


def check_logging_and_hooks(rank: int, ws: int) -> None:
    rec = _Recorder()
    pm = registry.plugins()
    pm.register(rec, name=f"ddp-test-recorder-{id(rec)}")
    try:
        torch.manual_seed(0)
        ddp = DDP(mlp(), bucket_cap_mb=0.001)
        for shards in batches("mlp", 3, ws, 4):
            x, y = shards[rank]
            F.mse_loss(ddp(x), y).backward()
        with ddp.no_sync():
            F.mse_loss(ddp(x), y).backward()  # no synchronisation: no iteration event
    finally:
        pm.unregister(rec)
    if len(rec.constructed) != 1:
        raise AssertionError(f"plugdist_ddp_constructed called {len(rec.constructed)} times")
    data = rec.constructed[0]
    want = dict(world_size=ws, rank=rank, module_name="Sequential",
                backend_name=dist.get_backend(),
                bucket_cap_bytes=int(0.001 * 1024 * 1024), find_unused_parameters=0,
                gradient_as_bucket_view=0, static_graph=0, num_parameter_tensors=6,
                total_parameter_size_bytes=4 * sum(p.numel() for p in mlp().parameters()),
                parameter_dtypes="float32", has_rebuilt_buckets=0)
    bad = {k: (data.get(k), v) for k, v in want.items() if data.get(k) != v}
    if bad:
        raise AssertionError(f"logging data mismatches (got, want): {bad}")
    if sum(data["bucket_sizes"]) != want["total_parameter_size_bytes"]:
        raise AssertionError(f"bucket_sizes {data['bucket_sizes']}")
    if [i for i, _ in rec.iterations] != [1, 2, 3]:
        raise AssertionError(f"iteration events {[i for i, _ in rec.iterations]}")
    stats = rec.iterations[-1][1]
    for key in ("forward_compute_time", "backward_compute_time", "backward_comm_time",
                "backward_compute_comm_overlap_time", "avg_backward_comm_time"):
        if not isinstance(stats.get(key), int) or stats[key] < 0:
            raise AssertionError(f"stat {key} = {stats.get(key)!r}")
    if stats["backward_comm_time"] <= 0 or stats["forward_compute_time"] <= 0:
        raise AssertionError(f"times were not measured: {stats}")
    live = ddp._get_ddp_logging_data()
    if live["iteration"] != 3 or live["has_rebuilt_buckets"] != 1:
        raise AssertionError(f"live logging data: {live}")


class SparseEmbeddings(nn.Module):
    """An Embedding and an EmbeddingBag with sparse gradients, and a dense head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 6, sparse=True)
        self.bag = nn.EmbeddingBag(30, 6, mode="sum", sparse=True)
        self.head = nn.Linear(12, 3)

    def forward(self, tokens: torch.Tensor, bags: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.emb(tokens).mean(1), self.bag(bags)], 1))


_torch_gloo: list[Any] = []


def torch_gloo_group() -> Any:
    """torch's own Gloo over this world (built once, collectively, on first use)."""
    import torch.distributed as tdist

    if not _torch_gloo:
        _torch_gloo.append(tdist.new_group(backend="gloo"))
    return _torch_gloo[0]


def check_sparse_embedding_matches_torch(rank: int, ws: int) -> None:
    """Sparse gradients: the same model trained by plugdist's DDP and by torch's DDP over
    torch's Gloo, from the same start on the same per-rank data, ends with equal parameters."""
    ref_group = torch_gloo_group()
    torch.manual_seed(3)
    base = SparseEmbeddings()
    ours = DDP(copy.deepcopy(base))
    hooked = DDP(copy.deepcopy(base))
    hooked.register_comm_hook(None, "allreduce")  # the hook gets the sparse gradient itself
    theirs = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base),
                                                       process_group=ref_group)
    runs = [(m, torch.optim.SGD(m.parameters(), lr=0.5)) for m in (ours, hooked, theirs)]
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(5):
        # rank 0 leaves the embedding's upper rows untouched: the ranks' gradients differ in
        # their non-zero rows (and counts), as real batches do
        high = 20 if rank == 0 else 40
        tokens = torch.randint(0, high, (4, 3), generator=gen)
        bags = torch.randint(0, 30, (4, 2 + step % 2), generator=gen)
        target = torch.randint(0, 3, (4,), generator=gen)
        for model, opt in runs:
            opt.zero_grad()
            F.cross_entropy(model(tokens, bags), target).backward()
            if not model.module.emb.weight.grad.is_sparse:
                raise AssertionError("the embedding's gradient is no longer sparse")
            opt.step()
    for model in (ours, hooked):
        for (name, got), (_, want) in zip(model.module.named_parameters(),
                                          theirs.module.named_parameters(), strict=True):
            torch.testing.assert_close(got, want, msg=lambda m, name=name: f"{name}: {m}")
    sizes = ours.reducer.bucket_indices()
    sparse_buckets = [b for b in sizes if len(b) == 1 and b[0] in (0, 1)]
    if len(sparse_buckets) != 2:
        raise AssertionError(f"each sparse parameter needs a bucket of its own: {sizes}")


def check_sparse_embedding_variants(rank: int, ws: int) -> None:
    """Sparse gradients with find_unused_parameters, static_graph and join (uneven inputs: a
    joined rank contributes empty sparse gradients): the replicas stay equal."""
    for options in ({"find_unused_parameters": True}, {"static_graph": True}, {}):
        torch.manual_seed(5)
        model = DDP(SparseEmbeddings(), **options)
        opt = torch.optim.SGD(model.parameters(), lr=0.3)
        gen = torch.Generator().manual_seed(rank)
        with model.join():
            for _ in range(3 + rank):
                opt.zero_grad()
                tokens = torch.randint(0, 40, (2, 3), generator=gen)
                bags = torch.randint(0, 30, (2, 2), generator=gen)
                model(tokens, bags).square().mean().backward()
                opt.step()
        for name, p in model.module.named_parameters():
            top = p.detach().clone()
            dist.all_reduce(top, op=dist.ReduceOp.MAX)
            if not torch.equal(top, p.detach()):
                raise AssertionError(f"{options}: {name} differs between ranks")


SUITE: dict[str, Callable[[int, int], None]] = {
    "mlp_matches_big_batch": check_mlp_matches_big_batch,
    "conv_bn": check_conv_bn,
    "conv_bn_no_broadcast": check_conv_bn_no_broadcast,
    "tied": check_tied,
    "mixed_dtypes": check_mixed_dtypes,
    "find_unused": check_find_unused,
    "find_unused_as_view": check_find_unused_as_view,
    "static_graph": check_static_graph,
    "static_graph_checkpointing": check_static_graph_checkpointing,
    "no_sync": check_no_sync,
    "bucket_view": check_bucket_view,
    "rebuild": check_rebuild,
    "comm_hooks": check_comm_hooks,
    "custom_hook_chain": check_custom_hook_chain,
    "join": check_join,
    "join_variants": check_join_variants,
    "join_throw": check_join_throw,
    "unused_without_flag": check_unused_without_flag,
    "mismatched_models": check_mismatched_models,
    "local_errors": check_local_errors,
    "logging_and_hooks": check_logging_and_hooks,
    "sparse_embedding_matches_torch": check_sparse_embedding_matches_torch,
    "sparse_embedding_variants": check_sparse_embedding_variants,
}


def run_suite(rank: int, ws: int, names: list[str] | None = None) -> dict[str, str | None]:
    """Run the named checks (default: all) on this rank, in the same order on every rank."""
    torch.set_num_threads(1)
    suite = Suite()
    for name in names or list(SUITE):
        suite.run(name, lambda fn=SUITE[name]: fn(rank, ws))
        # a check that failed on one rank only could leave the others mid-collective: a
        # barrier with a short timeout turns that into clear per-check errors, not a hang
        dist.barrier()
    return suite.results


def abandon_backward(rank: int, ws: int) -> str | None:
    """Rank 0 trains alone after the others left: its backward must fail, not hang."""
    torch.manual_seed(0)
    ddp = DDP(mlp())
    if rank != 0:
        return None  # leave: the harness tears this rank's group down and exits
    x = torch.randn(4, 10)
    try:
        ddp(x).sum().backward()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        return f"{type(exc).__name__}: {exc}"
    return None
