"""The conformance checks: what every backend must do, checked on every rank.

:func:`run_checks` runs inside each rank of a world (after ``init_process_group``) and returns
``{check name: None | failure text}``. Expected values are computed locally with plain torch ops
(never with plugdist's own composition), from values every rank can derive for every other rank.
Checks must raise the same way on every rank (no rank-dependent early exit), or the others would
block in a collective until the group's timeout.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import os
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch

import plugdist as dist
from plugdist import ReduceOp
from plugdist._backend.work import Work

__all__ = ["CHECKS", "run_checks", "check_names", "gpu_shortfall", "check_device", "assign_gpu",
           "RANKS_PER_GPU_ENV"]

# Ranks of a CUDA-only backend that may share one GPU (default 1). Set by the GPU check to run
# world size 2 on a one-GPU machine; each sharing rank then gets its own NCCL_HOSTID, since NCCL
# refuses two ranks on one device of one host ("Duplicate GPU detected").
RANKS_PER_GPU_ENV = "PLUGDIST_TEST_RANKS_PER_GPU"

CHECKS: dict[str, Callable[[int, int], None]] = {}

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
          torch.int32, torch.int64, torch.bool, torch.complex64]
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int8, torch.uint8, torch.int32, torch.int64]


def check(fn: Callable[[int, int], None]) -> Callable[[int, int], None]:
    CHECKS[fn.__name__.removeprefix("check_")] = fn
    return fn


def check_names() -> list[str]:
    return list(CHECKS)


def cuda_only(device_types: Sequence[str]) -> bool:
    """Whether a backend with these device types handles CUDA tensors and not CPU ones (its
    ranks then need one GPU each)."""
    return "cuda" in device_types and "cpu" not in device_types


def _ranks_per_gpu() -> int:
    raw = os.environ.get(RANKS_PER_GPU_ENV, "1").strip() or "1"
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{RANKS_PER_GPU_ENV}={raw!r} must be a positive integer")
    return int(raw)


def gpu_shortfall(backend: str, device_types: Sequence[str], world_size: int) -> str | None:
    """Why ``world_size`` ranks of a backend with these device types cannot run here (one GPU
    each, or ``PLUGDIST_TEST_RANKS_PER_GPU`` per GPU), or None."""
    if not cuda_only(device_types):
        return None
    gpus, per_gpu = torch.cuda.device_count(), _ranks_per_gpu()
    if world_size <= gpus * per_gpu:
        return None
    return (f"backend {backend!r} needs one GPU per rank: world size {world_size}, {gpus} GPU(s) "
            f"here" + (f", {per_gpu} ranks each" if per_gpu > 1 else ""))


def check_device() -> torch.device | None:
    """Where the checks create tensors: None (torch's default, the CPU), or for a backend that
    handles only CUDA, this rank's GPU (``LOCAL_RANK`` modulo the GPU count), which is then
    also made the current device. When ranks share a GPU (``PLUGDIST_TEST_RANKS_PER_GPU``), each
    gets its own ``NCCL_HOSTID`` (read by NCCL when the rank's first communicator is built)."""
    if not cuda_only(_world().capabilities().device_types):
        return None
    return assign_gpu(int(os.environ.get("LOCAL_RANK", dist.get_rank())), dist.get_world_size())


def assign_gpu(local_rank: int, world_size: int) -> torch.device:
    """Make GPU ``local_rank`` modulo the GPU count current and return it; with more ranks than
    GPUs and ``PLUGDIST_TEST_RANKS_PER_GPU`` above 1, give this rank its own ``NCCL_HOSTID``.
    Needs no plugdist world (for scripts that only use torch.distributed)."""
    gpus = torch.cuda.device_count()
    device = torch.device("cuda", local_rank % gpus)
    torch.cuda.set_device(device)
    if world_size > gpus and _ranks_per_gpu() > 1:
        tag = f"-plugdist-rank{local_rank}"
        host = os.environ.get("NCCL_HOSTID") or socket.gethostname()
        if not host.endswith(tag):
            os.environ["NCCL_HOSTID"] = host + tag
    return device


def _world() -> dist.ProcessGroup:
    world = dist.group.WORLD
    if world is None:
        raise AssertionError("the checks run inside an initialized world")
    return world


def _async(work: Work | None) -> Work:
    """The Work an ``async_op=True`` call returned (a member's call never returns None)."""
    if work is None:
        raise AssertionError("async_op=True must return a Work")
    return work


def settle(work: Any) -> None:
    """Wait on ``work`` and, on a GPU, let the host wait for the current stream too: a CUDA
    backend's ``wait()`` only orders the current stream after the op (as torch's NCCL backend
    does), so completion may be asserted only after that stream finished."""
    assert work.wait() is True, "Work.wait() returns True on success"
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()


def run_checks(rank: int, world_size: int, only: list[str] | None = None) -> dict[str, str | None]:
    """Run every check (or ``only`` those) on this rank; a failure is recorded, not raised.
    Tensors the checks create without a device land on :func:`check_device`."""
    out: dict[str, str | None] = {}
    device = check_device()
    # the default device of every tensor factory call inside the checks
    with device if device is not None else contextlib.nullcontext():
        for name, fn in CHECKS.items():
            if only and name not in only:
                continue
            try:
                fn(rank, world_size)
                out[name] = None
            except Exception:  # noqa: BLE001 - every check's failure is reported separately
                out[name] = f"rank {rank}: " + traceback.format_exc(limit=6)
    return out


# -- values every rank can compute for every rank ------------------------------------------------
def value(rank: int, dtype: torch.dtype, n: int = 5, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
    """Rank ``rank``'s input: small exact integers (safe for fp16/bf16 and PRODUCT)."""
    base = torch.arange(n, dtype=torch.int64)
    if dtype is torch.bool:
        return ((base + rank) % 2 == 0)
    if op is ReduceOp.PRODUCT:
        raw = (base + rank) % 2 + 1
    elif op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
        raw = (base * 3 + rank * 5) % 16
    else:
        raw = (base + 1) * (rank + 1) % 7 + rank
    if dtype.is_complex:
        return torch.complex(raw.float(), -raw.float()).to(dtype)
    return raw.to(dtype)


def expected(op: ReduceOp, tensors: list[torch.Tensor]) -> torch.Tensor:
    dtype = tensors[0].dtype
    wide = torch.complex128 if dtype.is_complex else \
        (torch.float64 if dtype.is_floating_point else torch.int64)
    stacked = torch.stack([t.to(wide) if dtype is not torch.bool else t for t in tensors])
    if op in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR):
        fn = {ReduceOp.BAND: operator.and_, ReduceOp.BOR: operator.or_,
              ReduceOp.BXOR: operator.xor}[op]
        return functools.reduce(fn, tensors)
    if op is ReduceOp.SUM:
        res = stacked.sum(0)
    elif op is ReduceOp.AVG:
        res = stacked.sum(0) / len(tensors)
    elif op is ReduceOp.PRODUCT:
        res = stacked.prod(0)
    elif op is ReduceOp.MIN:
        res = stacked.amin(0)
    else:
        res = stacked.amax(0)
    return res.to(dtype)


def ops_for(dtype: torch.dtype) -> list[ReduceOp]:
    if dtype is torch.bool:
        return [ReduceOp.BAND, ReduceOp.BOR]
    if dtype.is_complex:
        return [ReduceOp.SUM, ReduceOp.AVG]
    if dtype.is_floating_point:
        return [ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX]
    return [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.BAND,
            ReduceOp.BOR, ReduceOp.BXOR]


def same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if got.dtype != want.dtype or got.shape != want.shape:
        raise AssertionError(f"{what}: got {got.dtype}{list(got.shape)}, "
                             f"want {want.dtype}{list(want.shape)}")
    if want.dtype.is_floating_point or want.dtype.is_complex:
        ok = torch.allclose(got.to(torch.complex128 if want.dtype.is_complex else torch.float64),
                            want.to(torch.complex128 if want.dtype.is_complex else torch.float64),
                            rtol=1e-2 if want.dtype in (torch.float16, torch.bfloat16) else 1e-6)
    else:
        ok = torch.equal(got, want)
    if not ok:
        raise AssertionError(f"{what}: got {got.tolist()}, want {want.tolist()}")


def expect_error(exc_type: type[BaseException], fragments: str | Sequence[str],
                 fn: Callable[[], Any]) -> str:
    """Call ``fn``; it must raise ``exc_type`` whose message mentions every fragment (case
    ignored). Returns the message."""
    wanted = [fragments] if isinstance(fragments, str) else list(fragments)
    try:
        fn()
    except exc_type as err:
        text = str(err)
        missing = [f for f in wanted if f.lower() not in text.lower()]
        if missing:
            raise AssertionError(f"error {err!r} does not mention {missing}") from err
        return text
    raise AssertionError(f"expected {exc_type.__name__} mentioning {wanted}, nothing raised")


def run(work_or_none: Any, async_op: bool) -> None:
    """Check what a collective returned: its Work for ``async_op`` (waited on here, and
    successful), else None."""
    if async_op:
        assert work_or_none is not None, "async_op=True must return a Work"
        settle(work_or_none)
        assert work_or_none.is_completed() and work_or_none.is_success()
    else:
        assert work_or_none is None, "a blocking collective returns None"


# -- the checks ------------------------------------------------------------------------------------
@check
def check_init_state(rank: int, ws: int) -> None:
    assert dist.is_initialized()
    assert dist.get_rank() == rank and dist.get_world_size() == ws
    assert isinstance(dist.get_backend(), str) and dist.get_backend()
    assert dist.group.WORLD is not None and dist.group.WORLD.size() == ws
    assert dist.get_process_group_ranks(dist.group.WORLD) == list(range(ws))


def _all_reduce_value(rank: int, dtype: torch.dtype, op: ReduceOp) -> None:
    dist.all_reduce(value(rank, dtype), op=op)


@check
def check_all_reduce(rank: int, ws: int) -> None:
    refused = _world().capabilities().refused_reduce_ops
    for dtype in DTYPES:
        for op in ops_for(dtype):
            if op in refused:  # a backend may refuse a reduction, clearly and before sending
                expect_error(ValueError, op.name,
                             functools.partial(_all_reduce_value, rank, dtype, op))
                continue
            for async_op in (False, True):
                t = value(rank, dtype, op=op)
                run(dist.all_reduce(t, op=op, async_op=async_op), async_op)
                want = expected(op, [value(r, dtype, op=op) for r in range(ws)])
                same(t, want, f"all_reduce {dtype} {op} async={async_op}")


@check
def check_parameters(rank: int, ws: int) -> None:
    """Ops that write in place into their input, on tensors that require grad (model
    weights), natively or composed alike, as torch's accept them."""
    ops = [ReduceOp.SUM, ReduceOp.MAX, ReduceOp.AVG, ReduceOp.PRODUCT]
    refused = _world().capabilities().refused_reduce_ops
    for op in (op for op in ops if op not in refused):
        p = torch.nn.Parameter(value(rank, torch.float32, op=op))
        dist.all_reduce(p, op=op)
        want = expected(op, [value(r, torch.float32, op=op) for r in range(ws)])
        same(p.detach(), want, f"all_reduce of a Parameter {op}")
        p = torch.nn.Parameter(value(rank, torch.float32, op=op))
        dist.reduce(p, dst=0, op=op)
        if rank == 0:
            same(p.detach(), want, f"reduce of a Parameter {op}")
    p = torch.nn.Parameter(value(rank, torch.float32))
    dist.broadcast(p, src=0)
    same(p.detach(), value(0, torch.float32), "broadcast of a Parameter")


@check
def check_all_reduce_shapes(rank: int, ws: int) -> None:
    scalar = torch.tensor(float(rank + 1))
    dist.all_reduce(scalar)
    same(scalar, torch.tensor(float(ws * (ws + 1) // 2)), "0-dim all_reduce")
    empty = torch.empty(0)
    dist.all_reduce(empty)
    assert empty.numel() == 0
    big = torch.full((3, 4, 5), float(rank))
    dist.all_reduce(big, op=ReduceOp.MAX)
    same(big, torch.full((3, 4, 5), float(ws - 1)), "3-d all_reduce MAX")


@check
def check_sparse_all_reduce(rank: int, ws: int) -> None:
    """A sparse COO all_reduce (SUM) gives the dense one's sum on every rank, from ranks whose
    non-zeros differ in rows and count (one rank has none); other reductions and ops refuse a
    sparse tensor, naming the op."""
    device = check_device()

    def local(dtype: torch.dtype, empty: bool = False) -> torch.Tensor:
        idx = torch.tensor([[rank % 3, 2, 2, rank + 3], [0, 1, 1, rank % 2]])
        vals = torch.tensor([1, 2, 3, rank + 1], dtype=dtype)
        if empty:
            idx, vals = idx[:, :0], vals[:0]
        return torch.sparse_coo_tensor(idx, vals, (ws + 3, 2), device=device)

    for dtype in (torch.float32, torch.int64):
        for async_op in (False, True):
            for empty in (False, rank == ws - 1):
                s = local(dtype, empty)
                want = s.to_dense()
                dist.all_reduce(want)
                run(dist.all_reduce(s, async_op=async_op), async_op)
                assert s.is_sparse, "all_reduce made a sparse tensor dense"
                same(s.to_dense(), want, f"sparse all_reduce {dtype} async={async_op}")
    s = local(torch.float32)
    expect_error(ValueError, ["all_reduce", "SUM", "MAX"],
                 lambda: dist.all_reduce(s, op=ReduceOp.MAX))
    expect_error(ValueError, ["broadcast", "sparse_coo", "to_dense()"],
                 lambda: dist.broadcast(s, src=0))
    expect_error(ValueError, ["all_gather", "sparse_coo"],
                 lambda: dist.all_gather([s] * ws, s))


@check
def check_broadcast(rank: int, ws: int) -> None:
    for dtype in DTYPES:
        for src in range(ws):
            for async_op in (False, True):
                t = value(rank, dtype)
                run(dist.broadcast(t, src=src, async_op=async_op), async_op)
                same(t, value(src, dtype), f"broadcast {dtype} from {src}")
    scalar = torch.tensor(rank * 1.5)
    dist.broadcast(scalar, src=ws - 1)
    same(scalar, torch.tensor((ws - 1) * 1.5), "0-dim broadcast")


@check
def check_reduce(rank: int, ws: int) -> None:
    for dtype in (torch.float32, torch.int64, torch.bfloat16):
        for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.PRODUCT):
            for dst in range(ws):
                t = value(rank, dtype, op=op)
                dist.reduce(t, dst=dst, op=op)
                if rank == dst:
                    same(t, expected(op, [value(r, dtype, op=op) for r in range(ws)]),
                         f"reduce {dtype} {op} to {dst}")
    t = value(rank, torch.float32)
    work = _async(dist.reduce(t, dst=0, op=ReduceOp.AVG, async_op=True))
    work.wait()
    if rank == 0:
        same(t, expected(ReduceOp.AVG, [value(r, torch.float32) for r in range(ws)]), "reduce AVG")


@check
def check_all_gather(rank: int, ws: int) -> None:
    for dtype in DTYPES:
        for async_op in (False, True):
            outs = [torch.zeros(5, dtype=dtype) for _ in range(ws)]
            run(dist.all_gather(outs, value(rank, dtype), async_op=async_op), async_op)
            for r in range(ws):
                same(outs[r], value(r, dtype), f"all_gather {dtype} slot {r}")
    flat = torch.zeros(ws * 5, dtype=torch.float32)
    dist.all_gather_into_tensor(flat, value(rank, torch.float32))
    same(flat, torch.cat([value(r, torch.float32) for r in range(ws)]),
         "all_gather_into_tensor flat")
    stacked = torch.zeros(ws, 2, 3, dtype=torch.int32)
    mine = torch.full((2, 3), rank, dtype=torch.int32)
    work = _async(dist.all_gather_single(stacked, mine, async_op=True))
    work.wait()
    same(stacked, torch.stack([torch.full((2, 3), r, dtype=torch.int32) for r in range(ws)]),
         "all_gather_into_tensor stacked")


@check
def check_gather_scatter(rank: int, ws: int) -> None:
    for dtype in (torch.float32, torch.float16, torch.int64, torch.bool):
        for root in range(ws):
            gl = [torch.zeros(5, dtype=dtype) for _ in range(ws)] if rank == root else None
            dist.gather(value(rank, dtype), gather_list=gl, dst=root)
            if gl is not None:
                for r in range(ws):
                    same(gl[r], value(r, dtype), f"gather {dtype} slot {r}")
            out = torch.zeros(5, dtype=dtype)
            sl = [value(r + 10, dtype) for r in range(ws)] if rank == root else None
            dist.scatter(out, scatter_list=sl, src=root)
            same(out, value(rank + 10, dtype), f"scatter {dtype} from {root}")


@check
def check_reduce_scatter(rank: int, ws: int) -> None:
    for dtype in (torch.float32, torch.int32, torch.bfloat16):
        for op in ((ReduceOp.SUM, ReduceOp.MAX, ReduceOp.AVG) if dtype.is_floating_point
                   else (ReduceOp.SUM, ReduceOp.MIN)):
            inputs = [value(rank * ws + i, dtype, op=op) for i in range(ws)]
            out = torch.zeros(5, dtype=dtype)
            dist.reduce_scatter(out, inputs, op=op)
            same(out, expected(op, [value(r * ws + rank, dtype, op=op) for r in range(ws)]),
                 f"reduce_scatter {dtype} {op}")
            flat = torch.cat([value(rank * ws + i, dtype, op=op) for i in range(ws)])
            out2 = torch.zeros(5, dtype=dtype)
            work = _async(dist.reduce_scatter_tensor(out2, flat, op=op, async_op=True))
            work.wait()
            same(out2, expected(op, [value(r * ws + rank, dtype, op=op) for r in range(ws)]),
                 f"reduce_scatter_tensor {dtype} {op}")
            # entries of different sizes, as torch allows: entry i sized for rank i's output
            uneven = [value(rank * ws + i, dtype, n=i + 1, op=op) for i in range(ws)]
            mine = torch.zeros(rank + 1, dtype=dtype)
            dist.reduce_scatter(mine, uneven, op=op)
            same(mine, expected(op, [value(r * ws + rank, dtype, n=rank + 1, op=op)
                                     for r in range(ws)]), f"uneven reduce_scatter {dtype} {op}")


@check
def check_all_to_all(rank: int, ws: int) -> None:
    # rank r sends (j + 1) rows to rank j, each row tagged with sender and receiver
    ins = [torch.full((j + 1, 2), float(rank * 100 + j)) for j in range(ws)]
    outs = [torch.zeros(rank + 1, 2) for _ in range(ws)]
    dist.all_to_all(outs, ins)
    for j in range(ws):
        same(outs[j], torch.full((rank + 1, 2), float(j * 100 + rank)), f"all_to_all from {j}")
    # equal splits
    inp = torch.arange(ws * 3, dtype=torch.int64) + rank * 1000
    out = torch.zeros(ws * 3, dtype=torch.int64)
    dist.all_to_all_single(out, inp)
    want = torch.cat([torch.arange(rank * 3, rank * 3 + 3) + j * 1000 for j in range(ws)])
    same(out, want, "all_to_all_single equal splits")
    # uneven splits: rank r sends (r + j) % 3 + 1 rows to rank j
    in_splits = [(rank + j) % 3 + 1 for j in range(ws)]
    out_splits = [(j + rank) % 3 + 1 for j in range(ws)]
    inp = torch.cat([torch.full((s, 2), float(rank * 10 + j)) for j, s in enumerate(in_splits)])
    out = torch.zeros(sum(out_splits), 2)
    work = _async(dist.all_to_all_single(out, inp, out_splits, in_splits, async_op=True))
    work.wait()
    want = torch.cat([torch.full((s, 2), float(j * 10 + rank)) for j, s in enumerate(out_splits)])
    same(out, want, "all_to_all_single uneven splits")


@check
def check_barriers(rank: int, ws: int) -> None:
    dist.barrier()
    work = _async(dist.barrier(async_op=True))
    work.wait()
    dist.monitored_barrier(timeout=timedelta(seconds=30))
    dist.monitored_barrier(timeout=timedelta(seconds=30), wait_all_ranks=True)


@check
def check_point_to_point(rank: int, ws: int) -> None:
    if ws == 1:
        return
    right, left = (rank + 1) % ws, (rank - 1) % ws
    for dtype in (torch.float32, torch.bfloat16, torch.int8, torch.bool):
        out = value(rank, dtype)
        got = torch.zeros(5, dtype=dtype)
        sw = _async(dist.isend(out, dst=right, tag=3))
        rw = _async(dist.irecv(got, src=left, tag=3))
        sw.wait()
        rw.wait()
        same(got, value(left, dtype), f"isend/irecv ring {dtype}")
    # blocking send/recv in a fixed order: even ranks send first
    got = torch.zeros(4)
    if rank % 2 == 0:
        dist.send(torch.full((4,), float(rank)), dst=right)
        sender = dist.recv(got, src=left)
    else:
        sender = dist.recv(got, src=left)
        dist.send(torch.full((4,), float(rank)), dst=right)
    assert sender == left
    same(got, torch.full((4,), float(left)), "send/recv ring")
    # batch_isend_irecv
    got = torch.zeros(3, dtype=torch.int64)
    ops = [dist.P2POp(dist.isend, torch.full((3,), rank, dtype=torch.int64), right),
           dist.P2POp(dist.irecv, got, left)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    same(got, torch.full((3,), left, dtype=torch.int64), "batch_isend_irecv")


@check
def check_recv_any_source(rank: int, ws: int) -> None:
    if ws == 1:
        return
    pg = _world()
    if not pg.capabilities().any_source_recv:
        expect_error(RuntimeError, "any source", lambda: dist.recv(torch.zeros(1)))
        return
    if rank == 0:
        senders = set()
        for _ in range(ws - 1):
            t = torch.zeros(1)
            sender = dist.recv(t, tag=7)
            assert t.item() == sender * 2.0, (t.item(), sender)
            senders.add(sender)
        assert senders == set(range(1, ws)), senders
    else:
        dist.send(torch.tensor([rank * 2.0]), dst=0, tag=7)


@check
def check_object_collectives(rank: int, ws: int) -> None:
    objs = [{"rank": rank, "data": list(range(rank + 1))}, f"s{rank}", None]
    if rank != 0:
        objs = [None, None, None]
    dist.broadcast_object_list(objs, src=0)
    assert objs == [{"rank": 0, "data": [0]}, "s0", None], objs
    gathered: list[Any] = [None] * ws
    dist.all_gather_object(gathered, ("x" * rank, rank))
    assert gathered == [("x" * r, r) for r in range(ws)], gathered
    longer: list[Any] = ["spare"] * (ws + 1)  # as torch: the first slots filled, the rest kept
    dist.all_gather_object(longer, rank)
    assert longer == [*range(ws), "spare"], longer
    shared = [1]
    items: list[Any] = [shared, shared] if rank == 0 else [None, None]
    dist.broadcast_object_list(items, src=0)  # each item pickled on its own, as by torch
    assert items == [[1], [1]] and (items[0] is not items[1] or rank == 0), items
    if ws > 1:
        if rank == 0:
            dist.send_object_list([shared, shared], dst=1)
        elif rank == 1:
            pair: list[Any] = [None, None]
            dist.recv_object_list(pair, src=0)
            assert pair == [[1], [1]] and pair[0] is not pair[1], pair
    dst = ws - 1
    glist: list[Any] | None = [None] * ws if rank == dst else None
    dist.gather_object({"r": rank}, glist, dst=dst)
    if rank == dst:
        assert glist == [{"r": r} for r in range(ws)], glist
    out: list[Any] = [None]
    dist.scatter_object_list(out, [f"item{r}" for r in range(ws)] if rank == 0 else None, src=0)
    assert out == [f"item{rank}"], out
    if ws > 1:
        if rank == 0:
            dist.send_object_list([{"hello": 1}, [2, 3]], dst=1)
        elif rank == 1:
            got: list[Any] = [None, None]
            sender = dist.recv_object_list(got, src=0)
            assert sender == 0 and got == [{"hello": 1}, [2, 3]], (sender, got)


@check
def check_coalesced(rank: int, ws: int) -> None:
    ts = [torch.full((3,), float(rank)), torch.full((2, 2), rank, dtype=torch.int64),
          torch.full((1,), float(rank + 1))]
    dist.all_reduce_coalesced(ts)
    total = ws * (ws - 1) // 2
    same(ts[0], torch.full((3,), float(total)), "coalesced float")
    same(ts[1], torch.full((2, 2), total, dtype=torch.int64), "coalesced int")
    same(ts[2], torch.full((1,), float(total + ws)), "coalesced second float")
    outs = [[torch.zeros(2), torch.zeros(1, dtype=torch.int32)] for _ in range(ws)]
    dist.all_gather_coalesced(outs, [torch.full((2,), float(rank)),
                                     torch.tensor([rank], dtype=torch.int32)])
    for r in range(ws):
        same(outs[r][0], torch.full((2,), float(r)), "all_gather_coalesced[0]")
        same(outs[r][1], torch.tensor([r], dtype=torch.int32), "all_gather_coalesced[1]")


@check
def check_subgroups(rank: int, ws: int) -> None:
    evens = [r for r in range(ws) if r % 2 == 0]
    tail = list(range(max(0, ws - 2), ws))          # overlaps evens when ws > 2
    g_even = dist.new_group(evens)
    g_tail = dist.new_group(tail)
    for ranks, g in ((evens, g_even), (tail, g_tail)):
        if rank not in ranks:
            assert g is dist.GroupMember.NON_GROUP_MEMBER
            assert dist.get_rank(g) == -1 and dist.get_world_size(g) == -1
            assert dist.all_reduce(torch.ones(1), group=g) is None
            assert dist.broadcast(torch.ones(1), src=ranks[0], group=g) is None
            assert dist.barrier(group=g) is None
            continue
        assert dist.get_rank(g) == ranks.index(rank) and dist.get_world_size(g) == len(ranks)
        assert dist.get_process_group_ranks(g) == ranks
        assert dist.get_global_rank(g, 0) == ranks[0]
        assert dist.get_group_rank(g, rank) == ranks.index(rank)
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=g)
        same(t, torch.tensor([float(sum(ranks))]), f"subgroup {ranks} all_reduce")
        b = torch.tensor([float(rank)])
        dist.broadcast(b, src=ranks[-1], group=g)          # src is a GLOBAL rank
        same(b, torch.tensor([float(ranks[-1])]), f"subgroup {ranks} broadcast")
        outs = [torch.zeros(1, dtype=torch.int64) for _ in ranks]
        work = _async(dist.all_gather(outs, torch.tensor([rank]), group=g, async_op=True))
        work.wait()
        assert [int(o) for o in outs] == ranks
        objs: list[Any] = [None] * len(ranks)
        dist.all_gather_object(objs, rank, group=g)
        assert objs == ranks
        dist.barrier(group=g)
        outsider = next((r for r in range(ws) if r not in ranks), -5)
        expect_error(ValueError, "not a member", functools.partial(
            dist.broadcast, torch.zeros(1), src=outsider, group=g))
    mine, all_groups = dist.new_subgroups_by_enumeration([[r] for r in range(ws)])
    assert len(all_groups) == ws and dist.get_world_size(mine) == 1
    t = torch.tensor([3.0])
    dist.all_reduce(t, group=mine)
    same(t, torch.tensor([3.0]), "singleton subgroup")
    dist.barrier()


@check
def check_local_sync_groups(rank: int, ws: int) -> None:
    """Groups made by their members alone (``use_local_synchronization``), then one made by
    every rank: the latter pairs with the right peers only if the former left the call-order
    naming alone."""
    pair = [0, 1] if ws > 1 else [0]
    if rank in pair:
        first = dist.new_group(pair, use_local_synchronization=True)
        second = dist.new_group(pair, use_local_synchronization=True)  # same ranks, its own
        for g in (second, first):
            t = torch.tensor([float(rank + 1)])
            dist.all_reduce(t, group=g)
            same(t, torch.tensor([float(sum(pair) + len(pair))]), "local-sync group all_reduce")
        dist.destroy_process_group(second)
        dist.destroy_process_group(first)
    everyone = dist.new_group(list(range(ws)))
    t = torch.ones(1)
    dist.all_reduce(t, group=everyone)
    same(t, torch.tensor([float(ws)]), "group made by every rank after local-sync ones")
    dist.destroy_process_group(everyone)


@check
def check_subgroups_of_a_group(rank: int, ws: int) -> None:
    """``new_subgroups(group=G)`` splits G's ranks, called by G's members only."""
    if ws < 3:
        return
    members = list(range(1, ws))
    g = dist.new_group(members)
    if rank == 0:
        expect_error(ValueError, "not a member", functools.partial(
            dist.new_subgroups, 1, group=g))
    else:
        mine, subs = dist.new_subgroups(1, group=g)
        assert len(subs) == len(members) and dist.get_process_group_ranks(mine) == [rank]
        whole, subs = dist.new_subgroups(len(members), group=g)
        assert len(subs) == 1 and dist.get_process_group_ranks(whole) == members
        t = torch.ones(1)
        dist.all_reduce(t, group=whole)
        same(t, torch.tensor([float(len(members))]), "subgroup of a group all_reduce")
        expect_error(ValueError, "divide the group size", functools.partial(
            dist.new_subgroups, ws, group=g))
    t = torch.ones(1)
    dist.all_reduce(t, group=dist.new_group(list(range(ws))))  # names still in step
    same(t, torch.tensor([float(ws)]), "group made by every rank after subgroups of a group")


@check
def check_torch_keywords(rank: int, ws: int) -> None:
    """Smaller parts of torch.distributed's API: a barrier's timeout, gather_object's
    group_dst, get_pg_count, ProcessGroup.name(), Work.synchronize(), group_desc."""
    assert dist.barrier(timeout=timedelta(seconds=30)) is None
    _async(dist.barrier(async_op=True, timeout=timedelta(seconds=30))).wait()
    got: list[Any] | None = [None] * ws if rank == ws - 1 else None
    dist.gather_object(rank * 10, got, group_dst=ws - 1)
    if rank == ws - 1:
        assert got == [r * 10 for r in range(ws)], got
    world = _world()
    assert world.name() == world.backend_name and world.group_desc == "default_pg"
    _async(dist.all_reduce(torch.ones(1), async_op=True)).synchronize()  # exists, as torch's
    before = dist.get_pg_count()
    g = dist.new_group(list(range(ws)), group_desc="everyone")
    assert dist.get_pg_count() == before + 1 and g.group_desc == "everyone"
    mine, _ = dist.new_subgroups(1, group_desc="singles")
    assert mine.group_desc == "singles"
    mine, _ = dist.new_subgroups_by_enumeration([[r] for r in range(ws)], group_desc="each")
    assert mine.group_desc == "each" and dist.get_pg_count() == before + 1 + 2 * ws
    assert dist.new_group(list(range(ws))).group_desc == "undefined"


@check
def check_work_api(rank: int, ws: int) -> None:
    t = torch.ones(4)
    work = _async(dist.all_reduce(t, async_op=True))
    assert work.wait(timeout=timedelta(seconds=60)) is True  # with a timeout the host waits
    assert work.is_completed() and work.is_success() and work.exception() is None
    res = work.result()
    assert isinstance(res, list) and torch.equal(res[0], torch.full((4,), float(ws)))
    fut = _async(dist.all_reduce(torch.ones(2), async_op=True)).get_future()
    assert isinstance(fut, torch.futures.Future)
    got = fut.wait()
    assert torch.equal(got[0], torch.full((2,), float(ws))), got
    chained = _async(dist.all_reduce(torch.ones(2), async_op=True)).get_future().then(
        lambda f: f.value()[0] * 2)
    assert torch.equal(chained.wait(), torch.full((2,), 2.0 * ws))
    # polling alone completes a Work: no wait, no future asked for (collective and p2p)
    polled = [_async(dist.all_reduce(torch.ones(3), async_op=True))]
    if ws > 1:
        got_p2p = torch.zeros(1)
        polled += [_async(dist.isend(torch.full((1,), float(rank)), dst=(rank + 1) % ws)),
                   _async(dist.irecv(got_p2p, src=(rank - 1) % ws))]
    deadline = time.monotonic() + 60
    while not all(w.is_completed() for w in polled):
        assert time.monotonic() < deadline, "is_completed() never became True"
        time.sleep(0.001)
    assert torch.equal(polled[0].result()[0], torch.full((3,), float(ws)))
    if ws > 1:
        assert got_p2p.item() == float((rank - 1) % ws), got_p2p
    # the future of a Work already waited on (and, on a GPU, its stream finished) is done
    waited = _async(dist.all_reduce(torch.ones(1), async_op=True))
    settle(waited)
    assert waited.get_future().done()
    assert torch.equal(waited.get_future().wait()[0], torch.full((1,), float(ws)))


@check
def check_error_paths(rank: int, ws: int) -> None:
    nc = torch.zeros(4, 4).t()
    expect_error(ValueError, "contiguous", lambda: dist.all_reduce(nc))
    expect_error(ValueError, "not a member", lambda: dist.broadcast(torch.zeros(1), src=ws))
    expect_error(ValueError, "BAND", lambda: dist.all_reduce(torch.zeros(2), op=ReduceOp.BAND))
    expect_error(ValueError, "complex", lambda: dist.all_reduce(
        torch.zeros(2, dtype=torch.complex64), op=ReduceOp.MAX))
    expect_error(ValueError, "one per rank", lambda: dist.all_gather([torch.zeros(1)] * (ws + 1),
                                                                    torch.zeros(1)))
    expect_error(ValueError, "must match", lambda: dist.all_gather([torch.zeros(2)] * ws,
                                                                  torch.zeros(1)))
    expect_error(ValueError, "world_size x input", lambda: dist.all_gather_into_tensor(
        torch.zeros(ws * 2 + 1), torch.zeros(2)))
    expect_error(ValueError, "split_sizes", lambda: dist.all_to_all_single(
        torch.zeros(ws), torch.zeros(ws), [ws + 1] + [0] * (ws - 1), None))
    expect_error(TypeError, "torch.Tensor",
                 lambda: dist.all_reduce([1.0, 2.0]))  # type: ignore[arg-type]
    expect_error(ValueError, "own rank", lambda: dist.send(torch.zeros(1), dst=rank))
    # the world must still work after refused calls
    t = torch.ones(1)
    dist.all_reduce(t)
    same(t, torch.tensor([float(ws)]), "all_reduce after errors")
