"""Composing the ops a backend lacks from the ones it has.

Runs against the backend (:class:`~plugdist._backend.base.BackendBase`, or any
:class:`~plugdist._backend.group.GroupLike` with its ``native_*`` hooks): the ProcessGroup hands
each validated op to :func:`run_op` with the backend of the op's device type, and every op a
recipe issues is that backend's native hook (or another recipe), never the group's public op.

Each op has an ordered list of recipes, each naming the ops it needs. :func:`plan` decides, per
device, how every op runs: native ops first; then, repeatedly, an op whose recipe needs only ops
already decided becomes composed from that recipe, until nothing changes. A recipe therefore only
calls ops decided before it, so composition cannot cycle, and a backend with ``send``/``recv``
alone gets every op. Every recipe issues all its ops at once (nothing blocks) and finishes with a
future callback, so composed ops stay asynchronous.

A recipe never issues an op that reads what an earlier op of the same recipe writes: a backend
matches ops across ranks in issue order, but may run two issued ops at once (Gloo does), so a
dependent second step could read stale data. Dependent work happens in the final callback, on
local data only. Point-to-point messages sent by recipes use tags from ``COMPOSED_TAG`` upward,
which user code should leave alone.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from plugdist._backend.capabilities import Capabilities
from plugdist._backend.group import GroupLike
from plugdist._backend.reduce_op import ReduceOp, apply_local
from plugdist._backend.work import Work, gather_works
from plugdist.errors import DistBackendError

__all__ = ["compose", "plan", "reduce_by_gathering", "reduce_scatter_uneven", "COMPOSED_TAG"]

COMPOSED_TAG = 32700  # within MPI's guaranteed tag range (0..32767)


@dataclass(frozen=True)
class Recipe:
    needs: frozenset[str]
    run: Callable[[GroupLike, dict[str, Any]], Work]


def _ctx(pg: GroupLike, op: str) -> dict[str, Any]:
    return dict(op=op, rank=pg.rank(), group=pg.group_name, backend=pg.backend_name,
                timeout=pg.timeout, abort=getattr(pg, "abort_signal", None))


def _copy_into(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    for d, s in zip(dst, src, strict=True):
        if d.data_ptr() != s.data_ptr():
            d.copy_(s)


def _chunks(flat: torch.Tensor, n: int, shape: torch.Size) -> list[torch.Tensor]:
    """``n`` contiguous views of ``flat`` (contiguous), each reshaped to ``shape``."""
    return [c.view(shape) for c in flat.view(-1).chunk(n)] if flat.numel() else \
        [flat.new_empty(shape) for _ in range(n)]


def _row_views(t: torch.Tensor, splits: list[int]) -> list[torch.Tensor]:
    if t.dim() == 0:
        return [t.view(1)]
    return list(t.split(splits, dim=0))


# -- point-to-point based recipes ------------------------------------------------------------
def _p2p_exchange(pg: GroupLike, sends: dict[int, torch.Tensor],
                  recvs: dict[int, torch.Tensor], tag: int) -> list[Work]:
    # sends first: a simple backend may complete sends eagerly and park each receive
    works = [_do(pg, "send", tensor=t.contiguous(), dst=peer, tag=tag) for peer, t in sends.items()]
    works += [_do(pg, "recv", tensor=t, src=peer, tag=tag) for peer, t in recvs.items()]
    return works


def _broadcast_p2p(pg, kw):
    me, src, t = pg.rank(), kw["src"], kw["tensor"]
    peers = [r for r in range(pg.size()) if r != me]
    if me == src:
        works = _p2p_exchange(pg, {r: t for r in peers}, {}, COMPOSED_TAG)
    else:
        works = _p2p_exchange(pg, {}, {src: t}, COMPOSED_TAG)
    return gather_works(works, [t], **_ctx(pg, "broadcast"))


def _broadcast_allreduce(pg, kw):
    t = kw["tensor"]
    if pg.rank() != kw["src"]:
        t.zero_()
    return _do(pg, "all_reduce", tensor=t, op=ReduceOp.SUM)


def _gathered_reduce(pg, op_name, tensor, red):
    bufs = [torch.empty_like(tensor) for _ in range(pg.size())]
    work = _do(pg, "all_gather", output_tensors=bufs, tensor=tensor)
    return work.then(lambda _v: apply_local(red, bufs), op=op_name)


def _all_reduce_allgather(pg, kw):
    t = kw["tensor"]
    w = _gathered_reduce(pg, "all_reduce", t, kw["op"])
    return w.then(lambda r: [t.copy_(r)])


def _reduce_allreduce(pg, kw):
    t = kw["tensor"]
    buf = t if pg.rank() == kw["dst"] else t.clone()
    return _do(pg, "all_reduce", tensor=buf, op=kw["op"]).then(lambda _v: [t])


def _reduce_p2p(pg, kw):
    t, dst, n = kw["tensor"], kw["dst"], pg.size()
    if pg.rank() != dst:
        works = _p2p_exchange(pg, {dst: t}, {}, COMPOSED_TAG + 1)
        return gather_works(works, [t], **_ctx(pg, "reduce"))
    bufs = {r: torch.empty_like(t) for r in range(n) if r != dst}
    works = _p2p_exchange(pg, {}, bufs, COMPOSED_TAG + 1)

    def finish(_v):
        parts = [t if r == dst else bufs[r] for r in range(n)]
        t.copy_(apply_local(kw["op"], parts))
        return [t]

    return gather_works(works, None, **_ctx(pg, "reduce")).then(finish)


def _all_gather_into(pg, kw):
    outs, t = kw["output_tensors"], kw["tensor"]
    flat = torch.empty((pg.size() * t.numel(),), dtype=t.dtype, device=t.device)
    work = _do(pg, "all_gather_into_tensor", output=flat, tensor=t)

    def finish(_v):
        _copy_into(outs, _chunks(flat, pg.size(), t.shape))
        return outs

    return work.then(finish)


def _all_gather_bcast(pg, kw):
    outs, t, me = kw["output_tensors"], kw["tensor"], pg.rank()
    outs[me].copy_(t)
    works = [_do(pg, "broadcast", tensor=outs[r], src=r) for r in range(pg.size())]
    return gather_works(works, outs, **_ctx(pg, "all_gather"))


def _all_gather_p2p(pg, kw):
    outs, t, me = kw["output_tensors"], kw["tensor"], pg.rank()
    outs[me].copy_(t)
    peers = [r for r in range(pg.size()) if r != me]
    works = _p2p_exchange(pg, {r: t for r in peers}, {r: outs[r] for r in peers}, COMPOSED_TAG + 2)
    return gather_works(works, outs, **_ctx(pg, "all_gather"))


_ALL_GATHER_LIST = [
    Recipe(frozenset({"all_gather_into_tensor"}), _all_gather_into),
    Recipe(frozenset({"broadcast"}), _all_gather_bcast),
    Recipe(frozenset({"send", "recv"}), _all_gather_p2p),
]


def _into_tensor_from(recipe: Recipe) -> Recipe:
    def run(pg, kw):
        out, t = kw["output"], kw["tensor"]
        views = _chunks(out, pg.size(), t.shape)
        return recipe.run(pg, dict(output_tensors=views, tensor=t)).then(lambda _v: [out])
    return Recipe(recipe.needs, run)


def _all_gather_list_native(pg, kw):
    out, t = kw["output"], kw["tensor"]
    views = _chunks(out, pg.size(), t.shape)
    return _do(pg, "all_gather", output_tensors=views, tensor=t).then(lambda _v: [out])


def _gather_p2p(pg, kw):
    t, dst, me = kw["tensor"], kw["dst"], pg.rank()
    if me != dst:
        works = _p2p_exchange(pg, {dst: t}, {}, COMPOSED_TAG + 3)
        return gather_works(works, [], **_ctx(pg, "gather"))
    gl = kw["gather_list"]
    gl[me].copy_(t)
    works = _p2p_exchange(pg, {}, {r: gl[r] for r in range(pg.size()) if r != me}, COMPOSED_TAG + 3)
    return gather_works(works, gl, **_ctx(pg, "gather"))


def _gather_allgather(pg, kw):
    t, gl = kw["tensor"], kw["gather_list"]
    bufs = gl if gl is not None else [torch.empty_like(t) for _ in range(pg.size())]
    return _do(pg, "all_gather", output_tensors=bufs, tensor=t).then(
        lambda _v: gl if gl is not None else [])


def _scatter_p2p(pg, kw):
    t, src, me = kw["tensor"], kw["src"], pg.rank()
    if me != src:
        works = _p2p_exchange(pg, {}, {src: t}, COMPOSED_TAG + 4)
        return gather_works(works, [t], **_ctx(pg, "scatter"))
    sl = kw["scatter_list"]
    t.copy_(sl[me])
    works = _p2p_exchange(pg, {r: sl[r] for r in range(pg.size()) if r != me}, {}, COMPOSED_TAG + 4)
    return gather_works(works, [t], **_ctx(pg, "scatter"))


def _scatter_bcast(pg, kw):
    t, src, me = kw["tensor"], kw["src"], pg.rank()
    works = []
    for r in range(pg.size()):
        buf = kw["scatter_list"][r].clone() if me == src else torch.empty_like(t)
        works.append(_do(pg, "broadcast", tensor=buf, src=src))
        if r == me:
            mine = buf
    return gather_works(works, None, **_ctx(pg, "scatter")).then(lambda _v: [t.copy_(mine)])


def _reduce_scatter_via_tensor(pg, kw):
    out, inputs = kw["output"], kw["input_list"]
    flat = torch.cat([i.reshape(-1) for i in inputs])
    work = _do(pg, "reduce_scatter_tensor", output=out, input=flat, op=kw["op"])
    return work.then(lambda _v: [out])


def _reduce_scatter_allreduce(pg, kw):
    out, inputs = kw["output"], kw["input_list"]
    flat = torch.cat([i.reshape(-1) for i in inputs])
    return _do(pg, "all_reduce", tensor=flat, op=kw["op"]).then(
        lambda _v: [out.copy_(_chunks(flat, pg.size(), out.shape)[pg.rank()])])


def _rs_tensor_via_list(pg, kw):
    out, inp = kw["output"], kw["input"]
    views = _chunks(inp, pg.size(), out.shape)
    work = _do(pg, "reduce_scatter", output=out, input_list=views, op=kw["op"])
    return work.then(lambda _v: [out])


def _rs_tensor_allreduce(pg, kw):
    out, inp = kw["output"], kw["input"]
    flat = inp.clone()
    return _do(pg, "all_reduce", tensor=flat, op=kw["op"]).then(
        lambda _v: [out.copy_(_chunks(flat, pg.size(), out.shape)[pg.rank()])])


def _all_to_all_p2p(pg, kw):
    outs, ins, me = kw["output_tensors"], kw["input_tensors"], pg.rank()
    outs[me].copy_(ins[me])
    peers = [r for r in range(pg.size()) if r != me]
    works = _p2p_exchange(pg, {r: ins[r] for r in peers}, {r: outs[r] for r in peers},
                          COMPOSED_TAG + 5)
    return gather_works(works, outs, **_ctx(pg, "all_to_all"))


def _a2a_single_via_list(pg, kw):
    out, inp = kw["output"], kw["input"]
    outs = _row_views(out, kw["output_split_sizes"])
    ins = _row_views(inp, kw["input_split_sizes"])
    return _do(pg, "all_to_all", output_tensors=outs, input_tensors=ins).then(lambda _v: [out])


def _a2a_single_p2p(pg, kw):
    out, inp = kw["output"], kw["input"]
    outs = _row_views(out, kw["output_split_sizes"])
    ins = _row_views(inp, kw["input_split_sizes"])
    return _all_to_all_p2p(pg, dict(output_tensors=outs, input_tensors=ins)).then(lambda _v: [out])


def _a2a_list_via_single(pg, kw):
    outs, ins = kw["output_tensors"], kw["input_tensors"]
    if any(t.dim() == 0 or t.shape[1:] != ins[0].shape[1:] for t in [*outs, *ins]):
        raise _NotApplicable
    flat_in = torch.cat(ins)
    flat_out = torch.empty((sum(t.shape[0] for t in outs), *ins[0].shape[1:]),
                           dtype=ins[0].dtype, device=ins[0].device)
    work = _do(pg, "all_to_all_single", output=flat_out, input=flat_in,
                                       output_split_sizes=[t.shape[0] for t in outs],
                                       input_split_sizes=[t.shape[0] for t in ins])

    def finish(_v):
        _copy_into(outs, list(flat_out.split([t.shape[0] for t in outs])))
        return outs

    return work.then(finish)


def _barrier_allreduce(pg, kw):
    dev = pg.device_types[0]
    device = torch.device(dev, torch.cuda.current_device()) if dev == "cuda" else torch.device(dev)
    flag = torch.zeros(1, device=device)
    return _do(pg, "all_reduce", tensor=flag, op=ReduceOp.SUM).then(lambda _v: [], op="barrier")


class _NotApplicable(Exception):
    """A recipe that cannot handle these particular arguments; the next one is tried."""


RECIPES: dict[str, list[Recipe]] = {
    "send": [],
    "recv": [],
    "broadcast": [Recipe(frozenset({"send", "recv"}), _broadcast_p2p),
                  Recipe(frozenset({"all_reduce"}), _broadcast_allreduce)],
    "all_reduce": [Recipe(frozenset({"all_gather"}), _all_reduce_allgather)],
    "reduce": [Recipe(frozenset({"all_reduce"}), _reduce_allreduce),
               Recipe(frozenset({"send", "recv"}), _reduce_p2p)],
    "all_gather": _ALL_GATHER_LIST,
    "all_gather_into_tensor": [Recipe(frozenset({"all_gather"}), _all_gather_list_native)]
    + [_into_tensor_from(r) for r in _ALL_GATHER_LIST[1:]],
    "gather": [Recipe(frozenset({"send", "recv"}), _gather_p2p),
               Recipe(frozenset({"all_gather"}), _gather_allgather)],
    "scatter": [Recipe(frozenset({"send", "recv"}), _scatter_p2p),
                Recipe(frozenset({"broadcast"}), _scatter_bcast)],
    "reduce_scatter": [Recipe(frozenset({"reduce_scatter_tensor"}), _reduce_scatter_via_tensor),
                       Recipe(frozenset({"all_reduce"}), _reduce_scatter_allreduce)],
    "reduce_scatter_tensor": [Recipe(frozenset({"reduce_scatter"}), _rs_tensor_via_list),
                              Recipe(frozenset({"all_reduce"}), _rs_tensor_allreduce)],
    "all_to_all": [Recipe(frozenset({"all_to_all_single"}), _a2a_list_via_single),
                   Recipe(frozenset({"send", "recv"}), _all_to_all_p2p)],
    "all_to_all_single": [Recipe(frozenset({"all_to_all"}), _a2a_single_via_list),
                          Recipe(frozenset({"send", "recv"}), _a2a_single_p2p)],
    "barrier": [Recipe(frozenset({"all_reduce"}), _barrier_allreduce)],
}


@functools.lru_cache(maxsize=256)
def _plans(caps: Capabilities, device: str) -> dict[str, list[Recipe] | None]:
    """op -> None (native) or the usable recipes in preference order; missing ops: unsupported."""
    decided: dict[str, list[Recipe] | None] = {
        op: None for op in RECIPES if caps.is_native(op, device)}
    changed = True
    while changed:
        changed = False
        for op, recipes in RECIPES.items():
            if op in decided:
                continue
            usable = [r for r in recipes if r.needs <= decided.keys()]
            if usable:
                decided[op] = usable
                changed = True
    return decided


def plan(caps: Capabilities, op: str, device: str) -> tuple[str, frozenset[str]]:
    """How ``op`` runs on ``device``: ``("native", {})``, ``("composed", needs)`` or
    ``("unsupported", {})``. Used by ``plugdist info``."""
    plans = _plans(caps, device)
    if op not in plans:
        return "unsupported", frozenset()
    recipes = plans[op]
    return ("native", frozenset()) if recipes is None else ("composed", recipes[0].needs)


def is_available(caps: Capabilities, op: str, device: str) -> bool:
    return op in _plans(caps, device)


def _device_of(pg: GroupLike, kw: dict[str, Any]) -> str:
    for v in kw.values():
        if isinstance(v, torch.Tensor):
            return v.device.type
        if isinstance(v, list) and v and isinstance(v[0], torch.Tensor):
            return v[0].device.type
    return pg.device_types[0]


def native_hook(pg: GroupLike, op: str, device: str) -> Callable[..., Any] | None:
    """``pg``'s bound ``native_<op>`` when ``op`` is native on ``device``, else None."""
    return getattr(pg, "native_" + op) if pg.capabilities().is_native(op, device) else None


def run_op(pg: GroupLike, op: str, device: str, kwargs: dict[str, Any]) -> Work:
    """Run ``op`` as planned: the native hook, or composed. A native hook that returns
    ``NotImplemented`` (arguments it cannot handle) is composed from the other ops instead."""
    return run_planned(pg, native_hook(pg, op, device), op, device, kwargs)


def run_planned(pg: GroupLike, native: Callable[..., Any] | None, op: str, device: str,
                kwargs: dict[str, Any]) -> Work:
    """:func:`run_op` with its native hook already looked up (:func:`native_hook`)."""
    if native is not None:
        work = native(**kwargs)
        if work is not NotImplemented:
            return work  # type: ignore[no-any-return]
    return compose(pg, pg.capabilities(), op, device, kwargs)


def _do(pg: GroupLike, op_name: str, /, **kw: Any) -> Work:
    return run_op(pg, op_name, _device_of(pg, kw), kw)


def _fallback_recipes(caps: Capabilities, op: str, device: str) -> list[Recipe]:
    """For a native op that declined its arguments: recipes over the other available ops."""
    plans = _plans(caps, device)
    return [r for r in RECIPES[op] if op not in r.needs and r.needs <= plans.keys()]


def _requires_grad(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return v.requires_grad
    return isinstance(v, list) and any(isinstance(t, torch.Tensor) and t.requires_grad for t in v)


def _detach(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.detach()
    return [t.detach() if isinstance(t, torch.Tensor) else t for t in v]


def without_autograd(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with every tensor that requires grad (an ``nn.Parameter``) detached: the same
    memory, written in place by the recipes' local steps, which autograd refuses on such a leaf.
    Collectives are outside autograd, as torch's are."""
    if not any(_requires_grad(v) for v in kwargs.values()):
        return kwargs
    return {k: _detach(v) if _requires_grad(v) else v for k, v in kwargs.items()}


def compose(pg: GroupLike, caps: Capabilities, op: str, device: str,
            kwargs: dict[str, Any]) -> Work:
    """Run ``op`` from the first usable recipe for ``device`` (see :func:`plan`)."""
    kwargs = without_autograd(kwargs)
    planned = _plans(caps, device).get(op, [])
    recipes = _fallback_recipes(caps, op, device) if planned is None else planned
    for recipe in recipes:
        try:
            return recipe.run(pg, kwargs)
        except _NotApplicable:
            continue
    alternatives = " or ".join("+".join(sorted(r.needs)) for r in RECIPES[op]) or "nothing"
    raise DistBackendError(
        f"{pg.where(op)} is not supported for {device} tensors: the backend does not implement "
        f"it natively, nor what it can be composed from ({alternatives})")



def reduce_by_gathering(pg: GroupLike, caps: Capabilities, op: str, device: str,
                        kwargs: dict[str, Any]) -> Work:
    """A reduction the backend lacks (e.g. PRODUCT): all_gather the inputs, reduce locally."""
    red = kwargs["op"]
    kwargs = without_autograd(kwargs)
    if not is_available(caps, "all_gather", device):
        raise DistBackendError(
            f"{pg.where(op)} ReduceOp.{red.name} is not supported by backend {pg.backend_name!r} "
            f"and cannot be composed (it has no all_gather)")
    me = pg.rank()
    if op == "all_reduce":
        t = kwargs["tensor"]
        return _gathered_reduce(pg, op, t, red).then(lambda r: [t.copy_(r)])
    if op == "reduce":
        t, dst = kwargs["tensor"], kwargs["dst"]
        return _gathered_reduce(pg, op, t, red).then(
            lambda r: [t.copy_(r)] if me == dst else [t])
    out = kwargs["output"]
    if op == "reduce_scatter":
        inputs = kwargs["input_list"]
        src = torch.cat([i.reshape(-1) for i in inputs])
        start = sum(t.numel() for t in inputs[:me])
    else:
        src = kwargs["input"]
        start = me * out.numel()
    return _gathered_reduce(pg, op, src.contiguous(), red).then(
        lambda r: [out.copy_(r.reshape(-1)[start:start + out.numel()].view(out.shape))])


def is_uneven(kwargs: dict[str, Any]) -> bool:
    """Whether a reduce_scatter's ``input_list`` has an entry not shaped like ``output``
    (native hooks and the recipes get even lists only: :func:`reduce_scatter_uneven` takes
    the rest)."""
    shape = kwargs["output"].shape
    return any(t.shape != shape for t in kwargs["input_list"])


def reduce_scatter_uneven(pg: GroupLike, caps: Capabilities, device: str,
                          kwargs: dict[str, Any]) -> Work:
    """A reduce_scatter whose ``input_list`` entries differ in size (entry ``r`` sized as rank
    ``r``'s output): an all_reduce of the concatenated inputs, of which each rank keeps its
    share. Every rank sees the same sizes, so every rank takes this route."""
    if not is_available(caps, "all_reduce", device):
        raise DistBackendError(
            f"{pg.where('reduce_scatter')} input_list entries differ in size, which is composed "
            f"from all_reduce, and backend {pg.backend_name!r} cannot run all_reduce on {device} "
            f"tensors; pass entries of one size")
    kwargs = without_autograd(kwargs)
    out, inputs, me = kwargs["output"], kwargs["input_list"], pg.rank()
    flat = torch.cat([t.reshape(-1) for t in inputs])
    start = sum(t.numel() for t in inputs[:me])
    share = flat[start:start + out.numel()].view(out.shape)
    return _do(pg, "all_reduce", tensor=flat, op=kwargs["op"]).then(
        lambda _v: [out.copy_(share)], op="reduce_scatter")


__all__ += ["Recipe", "RECIPES"]
