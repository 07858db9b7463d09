"""Rank functions for tests/test_mpi.py: each runs inside one rank of a world started by
``mpiexec`` (through ``plugdist.testing.run_world``) with the ``mpi`` backend initialized.

:func:`mpi_checks` runs every check of this module on this rank and returns
``{check name: None | failure text}``, so one failing dtype never hides the others. Every rank
runs the same checks in the same order and raises (if at all) at the same points, so a failure
on one rank never leaves the others blocked in a collective.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import os
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import plugdist as dist
import torch
from plugdist import ProcessGroup
from plugdist._backend.reduce_op import ReduceOp
from plugdist._group.process_group import OPS, GroupOptions
from plugdist._observability.flight_recorder import recorder
from plugdist._world.state import world as _world
from plugdist.errors import DistBackendError, DistError, DistTimeoutError
from plugdist.store import HashStore, PrefixStore, TCPStore
from plugdist.testing.checks import expect_error, run
from plugdist_mpi import MPIProcessGroup

OPS_BLOCKING = frozenset(OPS) - {"send", "recv"}
LEAN_OPS = {"all_reduce", "broadcast", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
            "all_to_all_single"}

R = ReduceOp
FLOAT_OPS = [R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX]
INT_OPS = [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR]
REDUCE_MATRIX: dict[torch.dtype, list[ReduceOp]] = {
    torch.float32: FLOAT_OPS, torch.float64: FLOAT_OPS, torch.float16: FLOAT_OPS,
    torch.bfloat16: FLOAT_OPS, torch.float8_e4m3fn: [R.SUM, R.PRODUCT, R.MIN, R.MAX],
    torch.complex64: [R.SUM, R.AVG], torch.complex128: [R.SUM, R.AVG],
    torch.complex32: [R.SUM],
    torch.int8: INT_OPS, torch.uint8: INT_OPS, torch.int16: INT_OPS, torch.int32: INT_OPS,
    torch.int64: INT_OPS, torch.bool: INT_OPS,
}
MOVE_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
               torch.uint8, torch.int16, torch.int64, torch.bool, torch.complex64,
               torch.complex128, torch.complex32, torch.float8_e5m2, torch.uint16]
N = 7

CHECKS: dict[str, Callable[[int, int], None]] = {}


def check(fn: Callable[[int, int], None]) -> Callable[[int, int], None]:
    CHECKS[fn.__name__.removeprefix("check_")] = fn
    return fn


# wrong values found by same() in the running check: recorded rather than raised, so that a
# rank with a wrong result still issues the check's remaining collectives like the others
_mismatches: list[str] = []


def mpi_checks(rank: int, ws: int) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name, fn in CHECKS.items():
        _mismatches.clear()
        try:
            fn(rank, ws)
            out[name] = None
        except Exception:  # noqa: BLE001 - each check's failure is reported on its own
            out[name] = f"rank {rank}: {traceback.format_exc(limit=8)}"
        if _mismatches:
            out[name] = f"rank {rank}: " + "\n".join(_mismatches[:20]) + (out[name] or "")
    return out


# -- reference data ------------------------------------------------------------------------------
def values(dtype: torch.dtype, seed: int, op: ReduceOp = R.SUM, n: int = N) -> torch.Tensor:
    """Seed ``seed``'s data: small values whose reductions are exact in every dtype."""
    i = torch.arange(n, dtype=torch.int64)
    if dtype is torch.bool:
        return (i * 7 + seed * 3) % 5 < 2
    if op is R.PRODUCT:
        raw = ((i + seed) % 2 + 1).double()
    elif op in (R.BAND, R.BOR, R.BXOR):
        raw = ((i * 5 + seed * 3) % 16).double()
    elif dtype.is_floating_point and torch.finfo(dtype).bits == 8:
        raw = ((i * 3 + seed * 5) % 5 - 1).double()    # integers: partial sums stay exact
    elif dtype.is_floating_point or dtype.is_complex:
        raw = ((i * 3 + seed * 5) % 9) * 0.5 - 1.0     # halves and negatives
    else:
        raw = ((i * 3 + seed * 5) % 9 - (3 if dtype.is_signed else 0)).double()
    if dtype.is_complex:
        wide = torch.complex(raw, -raw / 2)
        return wide.to(torch.complex64).to(dtype) if dtype is torch.complex32 else wide.to(dtype)
    return raw.to(dtype)


def expected(op: ReduceOp, tensors: list[torch.Tensor]) -> torch.Tensor:
    dtype = tensors[0].dtype
    if dtype is torch.bool:
        as_int = torch.stack([t.to(torch.int64) for t in tensors])
        res = {R.SUM: as_int.sum(0) > 0, R.MAX: as_int.amax(0) > 0, R.BOR: as_int.amax(0) > 0,
               R.MIN: as_int.amin(0) > 0, R.PRODUCT: as_int.prod(0) > 0,
               R.BAND: as_int.amin(0) > 0, R.BXOR: as_int.sum(0) % 2 == 1}[op]
        return res
    if op in (R.BAND, R.BOR, R.BXOR):
        fn = {R.BAND: operator.and_, R.BOR: operator.or_, R.BXOR: operator.xor}[op]
        return functools.reduce(fn, tensors)
    wide_t = torch.complex128 if dtype.is_complex else (
        torch.float64 if dtype.is_floating_point else torch.int64)
    stacked = torch.stack([t.to(wide_t) for t in tensors])
    res = {R.SUM: lambda: stacked.sum(0), R.AVG: lambda: stacked.sum(0) / len(tensors),
           R.PRODUCT: lambda: stacked.prod(0), R.MIN: lambda: stacked.amin(0),
           R.MAX: lambda: stacked.amax(0)}[op]()
    if dtype is torch.complex32:
        return res.to(torch.complex64).to(dtype)
    return res.to(dtype)


def same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if got.dtype != want.dtype or got.shape != want.shape:
        _mismatches.append(f"{what}: got {got.dtype}{list(got.shape)}, "
                           f"want {want.dtype}{list(want.shape)}")
        return
    wide = torch.complex128 if want.dtype.is_complex else (
        torch.float64 if want.dtype.is_floating_point else torch.int64)
    if want.dtype.is_floating_point or want.dtype.is_complex:
        # every value above is exact in its dtype, so results must match exactly
        ok = torch.equal(got.to(wide), want.to(wide))
    else:
        ok = torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
    if not ok:
        _mismatches.append(f"{what}: got {got.to(wide).tolist()}, want {want.to(wide).tolist()}")


# -- checks ---------------------------------------------------------------------------------------
@check
def check_world_is_mpi(rank: int, ws: int) -> None:
    from mpi4py import MPI

    pg = dist.group.WORLD.backend_for("cpu")
    assert isinstance(pg, MPIProcessGroup), type(pg)
    assert (pg.rank(), pg.size()) == (MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size) == (rank, ws)
    level = os.environ.get("PLUGDIST_MPI_THREAD_LEVEL", "multiple")
    want = {"serialized": MPI.THREAD_SERIALIZED, "multiple": MPI.THREAD_MULTIPLE}[level]
    assert MPI.Query_thread() == want, (MPI.Query_thread(), level)
    # plugdist's MPICH default for MPI_Init only, or the user's choice, or neither (see IREDUCE
    # in test_mpi.py)
    from plugdist_mpi import _mpi

    var = "MPIR_CVAR_IREDUCE_INTRA_ALGORITHM"
    ours = _mpi.applied.get(var, "")
    assert (ours or os.environ.get(var, "")) == os.environ["PLUGDIST_TEST_IREDUCE"], ours
    assert not (ours and var in os.environ), "the default must not outlive MPI_Init"
    caps = pg.capabilities()
    assert all(caps.is_native(op, "cpu") for op in OPS), caps
    assert caps.any_source_recv and R.AVG not in caps.reduce_ops
    # the group has its own communicator: user traffic on COMM_WORLD cannot reach it
    assert MPI.Comm.Compare(pg.comm, MPI.COMM_WORLD) == MPI.CONGRUENT
    assert isinstance(_world.store, TCPStore), "rendezvous should serve a TCPStore from rank 0"
    _world.store.set(f"mpi-test/hello/{rank}", str(rank * 11))
    got = [_world.store.get(f"mpi-test/hello/{r}") for r in range(ws)]
    assert got == [str(r * 11).encode() for r in range(ws)], got


@check
def check_all_reduce_every_dtype_op(rank: int, ws: int) -> None:
    for dtype, ops in REDUCE_MATRIX.items():
        for op in ops:
            for async_op in (False, True):
                t = values(dtype, rank, op)
                ptr = t.data_ptr()
                run(dist.all_reduce(t, op=op, async_op=async_op), async_op)
                assert t.data_ptr() == ptr
                want = expected(op, [values(dtype, r, op) for r in range(ws)])
                same(t, want, f"all_reduce {dtype} {op} async={async_op}")


@check
def check_reduce_every_dtype_op_root(rank: int, ws: int) -> None:
    for dtype, ops in REDUCE_MATRIX.items():
        for op in ops:
            for dst in range(ws):
                async_op = (dst % 2 == 1)
                t = values(dtype, rank, op)
                run(dist.reduce(t, dst=dst, op=op, async_op=async_op), async_op)
                if rank == dst:
                    same(t, expected(op, [values(dtype, r, op) for r in range(ws)]),
                         f"reduce {dtype} {op} to {dst}")
                elif op is not R.AVG:
                    same(t, values(dtype, rank, op), f"reduce {dtype} {op}: non-root input kept")


@check
def check_reduce_scatter_both_forms(rank: int, ws: int) -> None:
    for dtype, ops in REDUCE_MATRIX.items():
        for op in ops:
            want = expected(op, [values(dtype, r * ws + rank, op) for r in range(ws)])
            # list form, separate tensors (staged), sync
            inputs = [values(dtype, rank * ws + i, op) for i in range(ws)]
            out = torch.zeros(N, dtype=dtype)
            run(dist.reduce_scatter(out, inputs, op=op), False)
            same(out, want, f"reduce_scatter list {dtype} {op}")
            # list form, chunks of one tensor (reduced in place), async
            flat = torch.cat(inputs)
            chunks = list(flat.chunk(ws))
            out = torch.zeros(N, dtype=dtype)
            run(dist.reduce_scatter(out, chunks, op=op, async_op=True), True)
            same(out, want, f"reduce_scatter chunks {dtype} {op}")
            # tensor form, async
            out = torch.zeros(N, dtype=dtype)
            run(dist.reduce_scatter_tensor(out, torch.cat(inputs), op=op, async_op=True), True)
            same(out, want, f"reduce_scatter_tensor {dtype} {op}")


@check
def check_reduce_scatter_output_inside_input(rank: int, ws: int) -> None:
    inp = torch.cat([values(torch.float32, rank * ws + i) for i in range(ws)])
    out = inp[rank * N:(rank + 1) * N]       # output aliases this rank's chunk of the input
    dist.reduce_scatter_tensor(out, inp)
    same(out, expected(R.SUM, [values(torch.float32, r * ws + rank) for r in range(ws)]),
         "reduce_scatter_tensor with aliased output")


@check
def check_broadcast_every_dtype(rank: int, ws: int) -> None:
    for dtype in MOVE_DTYPES:
        for src in range(ws):
            for async_op in (False, True):
                t = values(dtype, rank)
                run(dist.broadcast(t, src=src, async_op=async_op), async_op)
                same(t, values(dtype, src), f"broadcast {dtype} from {src}")
    scalar = torch.tensor(float(rank))
    dist.broadcast(scalar, src=ws - 1)
    same(scalar, torch.tensor(float(ws - 1)), "0-dim broadcast")
    empty = torch.empty(0, 3)
    dist.broadcast(empty, src=0)
    assert empty.shape == (0, 3)


@check
def check_all_gather_forms(rank: int, ws: int) -> None:
    for dtype in MOVE_DTYPES:
        for async_op in (False, True):
            outs = [torch.zeros(N, dtype=dtype) for _ in range(ws)]
            ptrs = [o.data_ptr() for o in outs]
            run(dist.all_gather(outs, values(dtype, rank), async_op=async_op), async_op)
            assert [o.data_ptr() for o in outs] == ptrs, "all_gather must fill the given tensors"
            for r in range(ws):
                same(outs[r], values(dtype, r), f"all_gather {dtype} slot {r}")
        flat = torch.zeros(ws * N, dtype=dtype)
        dist.all_gather_into_tensor(flat, values(dtype, rank))
        same(flat, torch.cat([values(dtype, r) for r in range(ws)]),
             f"all_gather_into_tensor {dtype}")
    # in place: the input is this rank's slot of the output (MPI_IN_PLACE)
    flat = torch.zeros(ws * 3)
    mine = flat[rank * 3:(rank + 1) * 3]
    mine.fill_(rank + 0.5)
    dist.all_gather_into_tensor(flat, mine)
    same(flat, torch.cat([torch.full((3,), r + 0.5) for r in range(ws)]),
         "in-place all_gather_into_tensor")
    outs = [torch.zeros(2) for _ in range(ws)]
    outs[rank].fill_(rank * 2.0)
    dist.all_gather(outs, outs[rank])
    same(torch.stack(outs), torch.stack([torch.full((2,), r * 2.0) for r in range(ws)]),
         "in-place all_gather list")
    # output list made of views of one tensor, in reverse order
    base = torch.zeros(ws, 4, dtype=torch.int64)
    views = [base[ws - 1 - r] for r in range(ws)]
    dist.all_gather(views, torch.full((4,), rank, dtype=torch.int64))
    same(base, torch.stack([torch.full((4,), ws - 1 - r, dtype=torch.int64) for r in range(ws)]),
         "all_gather into reversed views")


@check
def check_gather_scatter(rank: int, ws: int) -> None:
    for dtype in MOVE_DTYPES:
        for root in range(ws):
            async_op = root % 2 == 0
            gl = [torch.zeros(N, dtype=dtype) for _ in range(ws)] if rank == root else None
            run(dist.gather(values(dtype, rank), gather_list=gl, dst=root, async_op=async_op),
                   async_op)
            if rank == root:
                for r in range(ws):
                    same(gl[r], values(dtype, r), f"gather {dtype} slot {r} to {root}")
            out = torch.zeros(N, dtype=dtype)
            sl = [values(dtype, 10 + r) for r in range(ws)] if rank == root else None
            run(dist.scatter(out, scatter_list=sl, src=root, async_op=async_op), async_op)
            same(out, values(dtype, 10 + rank), f"scatter {dtype} from {root}")
    # root's own piece is its output tensor (MPI_IN_PLACE on the root)
    out = torch.full((3,), -1.0)
    sl = None
    if rank == 0:
        sl = [out if r == rank else torch.full((3,), float(r)) for r in range(ws)]
    if rank == 0:
        out.fill_(0.0)
    dist.scatter(out, scatter_list=sl, src=0)
    same(out, torch.full((3,), float(rank)), "scatter with root's piece in place")
    gl = [torch.zeros(2) for _ in range(ws)] if rank == ws - 1 else None
    mine = gl[rank] if gl else torch.zeros(2)
    mine.fill_(rank + 1.0)
    dist.gather(mine, gather_list=gl, dst=ws - 1)
    if gl:
        same(torch.stack(gl), torch.stack([torch.full((2,), r + 1.0) for r in range(ws)]),
             "gather with root's piece in place")


@check
def check_all_to_all_forms(rank: int, ws: int) -> None:
    for dtype in MOVE_DTYPES:
        # uneven list: rank r sends j + 1 rows (of seed r*100+j) to rank j
        ins = [values(dtype, rank * 100 + j, n=(j + 1) * 2).reshape(j + 1, 2) for j in range(ws)]
        outs = [torch.zeros(rank + 1, 2, dtype=dtype) for _ in range(ws)]
        run(dist.all_to_all(outs, ins, async_op=True), True)
        for j in range(ws):
            same(outs[j], values(dtype, j * 100 + rank, n=(rank + 1) * 2).reshape(rank + 1, 2),
                 f"all_to_all {dtype} from {j}")
        # uneven single, with a zero split: rank r sends (r + j) % 3 rows to j
        in_splits = [(rank + j) % 3 for j in range(ws)]
        out_splits = [(j + rank) % 3 for j in range(ws)]
        inp = torch.cat([values(dtype, rank * 10 + j, n=s * 3).reshape(s, 3)
                         for j, s in enumerate(in_splits)])
        out = torch.zeros(sum(out_splits), 3, dtype=dtype)
        dist.all_to_all_single(out, inp, out_splits, in_splits)
        want = torch.cat([values(dtype, j * 10 + rank, n=s * 3).reshape(s, 3)
                          for j, s in enumerate(out_splits)])
        same(out, want, f"all_to_all_single uneven {dtype}")
    # equal splits, and the same tensors on both sides of a list all_to_all (copied, not raced)
    inp = torch.arange(ws * 2, dtype=torch.int32) + rank * 100
    out = torch.zeros(ws * 2, dtype=torch.int32)
    dist.all_to_all_single(out, inp)
    same(out, torch.cat([torch.arange(rank * 2, rank * 2 + 2, dtype=torch.int32) + j * 100
                         for j in range(ws)]), "all_to_all_single equal")
    bufs = [torch.full((2,), float(rank * 10 + j)) for j in range(ws)]
    dist.all_to_all(bufs, bufs)
    want = torch.stack([torch.full((2,), float(j * 10 + rank)) for j in range(ws)])
    same(torch.stack(bufs), want, "all_to_all in place")
    expect_error(ValueError, ["rows hold"], lambda: dist.all_to_all_single(
        torch.zeros(ws, 2), torch.zeros(ws, 3)))


@check
def check_list_ops_staged(rank: int, ws: int) -> None:
    """The staging path list collectives take when MPI cannot address the tensors in place
    (a span over 2 GiB without MPI-4 large counts), forced on here."""
    from plugdist_mpi import dtypes

    dtypes.STAGE_ALWAYS = True
    try:
        for dtype in (torch.float32, torch.bfloat16, torch.bool, torch.complex128):
            outs = [torch.zeros(N, dtype=dtype) for _ in range(ws)]
            outs[rank].copy_(values(dtype, rank))
            dist.all_gather(outs, outs[rank])                    # in place, staged
            for r in range(ws):
                same(outs[r], values(dtype, r), f"staged all_gather {dtype} slot {r}")
            root = ws - 1
            gl = [torch.zeros(N, dtype=dtype) for _ in range(ws)] if rank == root else None
            dist.gather(values(dtype, rank), gather_list=gl, dst=root)
            if gl is not None:
                for r in range(ws):
                    same(gl[r], values(dtype, r), f"staged gather {dtype} slot {r}")
            out = torch.zeros(N, dtype=dtype)
            sl = [values(dtype, 50 + r) for r in range(ws)] if rank == 0 else None
            dist.scatter(out, scatter_list=sl, src=0)
            same(out, values(dtype, 50 + rank), f"staged scatter {dtype}")
            ins = [values(dtype, rank * 100 + j, n=j + 1) for j in range(ws)]
            outs = [torch.zeros(rank + 1, dtype=dtype) for _ in range(ws)]
            dist.all_to_all(outs, ins)
            for j in range(ws):
                same(outs[j], values(dtype, j * 100 + rank, n=rank + 1),
                     f"staged all_to_all {dtype} from {j}")
    finally:
        dtypes.STAGE_ALWAYS = False


@check
def check_point_to_point(rank: int, ws: int) -> None:
    right, left = (rank + 1) % ws, (rank - 1) % ws
    # a ring of 8 MiB messages: too big for an eager send, so this deadlocks unless sends and
    # receives really are non-blocking
    big_out = torch.full((2 * 1024 * 1024,), float(rank))
    big_in = torch.zeros(2 * 1024 * 1024)
    sw = dist.isend(big_out, dst=right, tag=5)
    rw = dist.irecv(big_in, src=left, tag=5)
    sw.wait()
    rw.wait()
    assert rw.source_rank() == left
    same(big_in[:4], torch.full((4,), float(left)), "8 MiB ring")
    assert bool((big_in == float(left)).all())
    # tags pick messages: receive tag 2 before tag 1 although they were sent the other way
    if rank == 0:
        for tag in (1, 2):
            dist.send(torch.full((3,), float(tag), dtype=torch.float64), dst=1, tag=tag)
    elif rank == 1:
        a, b = torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
        w2 = dist.irecv(b, src=0, tag=2)
        w1 = dist.irecv(a, src=0, tag=1)
        w2.wait()
        w1.wait()
        same(a, torch.full((3,), 1.0, dtype=torch.float64), "tag 1")
        same(b, torch.full((3,), 2.0, dtype=torch.float64), "tag 2")
    # every dtype as bytes
    for dtype in MOVE_DTYPES:
        got = torch.zeros(N, dtype=dtype)
        ws_ = dist.isend(values(dtype, rank), dst=right, tag=9)
        wr = dist.irecv(got, src=left, tag=9)
        ws_.wait()
        wr.wait()
        same(got, values(dtype, left), f"isend/irecv {dtype}")
    # any-source receive names the sender (as a global rank from recv, group rank on the Work)
    if rank == 0:
        senders = []
        for _ in range(ws - 1):
            t = torch.zeros(2)
            sender = dist.recv(t, tag=7)
            same(t, torch.full((2,), sender * 3.0), f"any-source payload from {sender}")
            senders.append(sender)
        assert sorted(senders) == list(range(1, ws)), senders
    else:
        dist.send(torch.full((2,), rank * 3.0), dst=0, tag=7)
    dist.barrier()


@check
def check_any_source_in_subgroup(rank: int, ws: int) -> None:
    # members in reverse order of global rank: group rank 0 is the highest global rank
    members = list(range(ws))[::-1]   # the frontend sorts ranks: the object API keeps order
    top = ws - 1
    store = PrefixStore("mpi-test/reversed", _world.store)
    pg = ProcessGroup(MPIProcessGroup(store, members.index(rank), ws, GroupOptions(
        group_name="reversed", global_ranks=tuple(members))))
    try:
        assert pg.rank() == members.index(rank)
        t = torch.tensor([float(rank)])
        pg.broadcast(t, src=0).wait()      # group rank 0 == global rank ws-1
        same(t, torch.tensor([float(top)]), "reversed group broadcast")
        if pg.rank() == 0:
            got = set()
            for _ in range(ws - 1):
                buf = torch.zeros(1, dtype=torch.int64)
                w = pg.recv(buf, None, tag=4)
                w.wait()
                # source_rank() is the sender's group rank
                assert int(buf.item()) == members[w.source_rank()], (buf, w.source_rank())
                got.add(w.source_rank())
            assert got == set(range(1, ws)), got
        else:
            pg.send(torch.tensor([rank], dtype=torch.int64), 0, tag=4).wait()
        pg.barrier().wait()
    finally:
        pg.shutdown()


@check
def check_members_only_construction(rank: int, ws: int) -> None:
    """Only the members build the group (MPI_Comm_create_group); the others carry on."""
    members = (0, ws - 1)
    if rank in members:
        store = PrefixStore("mpi-test/ends", _world.store)
        pg = ProcessGroup(MPIProcessGroup(store, members.index(rank), 2,
                                          GroupOptions(group_name="ends", global_ranks=members)))
        try:
            t = torch.tensor([rank + 1.0])
            pg.all_reduce(t).wait()
            same(t, torch.tensor([float(1 + ws)]), "ends all_reduce")
            outs = [torch.zeros(1) for _ in range(2)]
            pg.all_gather(outs, torch.tensor([float(rank)])).wait()
            assert [o.item() for o in outs] == [0.0, float(ws - 1)], outs
        finally:
            pg.shutdown()
    dist.barrier()
    # overlapping groups built through the frontend, then used with interleaved async ops
    g_lo, g_hi = dist.new_group(list(range(0, ws - 1)) or [0]), dist.new_group(list(range(1, ws)))
    works = []
    lo, hi = torch.tensor([float(rank)]), torch.tensor([float(rank)])
    if rank < ws - 1:
        works.append(dist.all_reduce(lo, group=g_lo, async_op=True))
    if rank >= 1:
        works.append(dist.all_reduce(hi, group=g_hi, async_op=True))
    for w in works:
        w.wait()
    if rank < ws - 1:
        same(lo, torch.tensor([float(sum(range(0, ws - 1)))]), "low group")
    if rank >= 1:
        same(hi, torch.tensor([float(sum(range(1, ws)))]), "high group")
    for g in (g_lo, g_hi):
        dist.destroy_process_group(g)


@check
def check_many_in_flight_in_order(rank: int, ws: int) -> None:
    tensors, works = [], []
    for i in range(60):
        t = torch.full((1 + (i * 37) % 3000,), float(rank + i))
        tensors.append(t)
        if i % 3 == 0:
            works.append(dist.broadcast(t, src=i % ws, async_op=True))
        else:
            works.append(dist.all_reduce(t, async_op=True))
    for w in reversed(works):       # waiting in any order is fine
        w.wait()
    for i, t in enumerate(tensors):
        want = float(i % ws + i) if i % 3 == 0 else float(sum(r + i for r in range(ws)))
        assert bool((t == want).all()), (i, t[:3], want)


@check
def check_threads_on_two_groups(rank: int, ws: int) -> None:
    ga, gb = dist.new_group(), dist.new_group()
    results: dict[str, Any] = {}

    def hammer(name: str, g: Any, base: float) -> None:
        """Synchronous ops (at THREAD_MULTIPLE tested without plugdist's lock) while the other
        thread's run too, and async ones that the progress thread may be testing meanwhile."""
        try:
            acc = []
            for i in range(40):
                t = torch.full((257,), base + i + rank)
                pending = dist.all_reduce(t.clone(), group=g, async_op=True) if i % 4 else None
                dist.all_reduce(t, group=g)
                b = torch.full((5,), base + rank)
                dist.broadcast(b, src=dist.get_global_rank(g, 0), group=g)
                assert b.tolist() == [base] * 5, b
                if pending is not None:
                    run(pending, True)
                acc.append(t[0].item())
            results[name] = acc
        except Exception as exc:  # noqa: BLE001
            results[name] = exc

    threads = [threading.Thread(target=hammer, args=("a", ga, 0.0)),
               threading.Thread(target=hammer, args=("b", gb, 1000.0))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not any(th.is_alive() for th in threads), "threads hung"
    for name, base in (("a", 0.0), ("b", 1000.0)):
        want = [float(sum(base + i + r for r in range(ws))) for i in range(40)]
        assert results[name] == want, (name, results[name])
    dist.destroy_process_group(ga)
    dist.destroy_process_group(gb)


@check
def check_work_api_and_callbacks(rank: int, ws: int) -> None:
    t = torch.ones(3)
    w = dist.all_reduce(t, op=R.AVG, async_op=True)   # SUM natively, then the core divides
    assert w.wait(timeout=timedelta(seconds=60)) is True
    same(t, torch.ones(3), "AVG")
    res = dist.all_reduce(torch.ones(2), async_op=True).get_future().then(
        lambda f: f.value()[0] * 3).wait()
    same(res, torch.full((2,), 3.0 * ws), "future.then")
    out = [torch.zeros(1) for _ in range(ws)]
    w = dist.all_gather(out, torch.tensor([float(rank)]), async_op=True)
    got = w.result()
    assert got is not None and [x.item() for x in got] == [float(r) for r in range(ws)]


@check
def check_work_outcome_and_future_in_any_order(rank: int, ws: int) -> None:
    # nobody waits: the progress thread completes the op; the future is made afterwards
    w = dist.all_reduce(torch.ones(2), async_op=True)
    deadline = time.monotonic() + 30
    while not w.is_completed():
        if time.monotonic() > deadline:
            raise AssertionError("an op nobody waits on never completed")
        time.sleep(0.001)
    assert w.is_success() and w.exception() is None
    fut = w.get_future()
    assert fut.done() and fut is w.get_future()
    same(fut.value()[0], torch.full((2,), float(ws)), "future made after completion")
    # the future is made first: its callback runs once the op completes
    seen: list[float] = []
    w = dist.all_reduce(torch.ones(2), async_op=True)
    w.get_future().add_done_callback(lambda f: seen.append(f.value()[0][0].item()))
    assert w.wait() is True
    deadline = time.monotonic() + 30
    while not seen and time.monotonic() < deadline:
        time.sleep(0.001)
    assert seen == [float(ws)], seen
    assert w.result()[0][0].item() == float(ws)


@check
def check_a_future_is_left_to_the_progress_thread_at_once(rank: int, ws: int) -> None:
    """Whoever waits on a future drives no MPI: making one for a running op marks it awaited,
    so the progress thread takes it up without leaving it to its issuer first (before, such a
    wait took a millisecond for an 8-byte op); the future then completes with the op."""
    if rank == 0:
        buf = torch.zeros(2)
        w = dist.irecv(buf, src=1, tag=23)
        fut = w.get_future()   # rank 1 sends only after the barrier below: still running
        assert not fut.done() and w._pending.awaited, (fut.done(), w._pending)
        dist.barrier()
        value = fut.wait()
        same(value[0], torch.full((2,), 23.0), "a receive awaited through its future")
        assert w.is_completed() and w.is_success()
    else:
        dist.barrier()
        if rank == 1:
            dist.send(torch.full((2,), 23.0), dst=0, tag=23)
    # a collective awaited through a future chained to it (DDP's comm hooks)
    got = dist.all_reduce(torch.ones(2), async_op=True).get_future().then(
        lambda f: f.value()[0] + 1).wait()
    same(got, torch.full((2,), ws + 1.0), "an all_reduce awaited through its future")
    dist.barrier()


@check
def check_observing_an_op_makes_no_future(rank: int, ws: int) -> None:
    """The flight recorder (on by default) follows an async op to its end through
    Work.on_completion, which MPIWork keeps without a torch future (a future costs
    microseconds per op)."""
    seen: list[BaseException | None] = []
    w = dist.all_reduce(torch.ones(2), async_op=True)
    w.on_completion(seen.append)
    assert w.wait() is True and w.lazy_future is None, w.lazy_future
    assert seen == [None], seen
    w.on_completion(seen.append)  # already done: at once, on this thread
    assert seen == [None, None], seen
    last = recorder.snapshot()["entries"][-1]
    assert (last["profiling_name"], last["state"]) == ("gloo:all_reduce", "completed"), last


@check
def check_wait_timeout_then_late_message(rank: int, ws: int) -> None:
    if rank == 0:
        buf = torch.zeros(2)
        w = dist.irecv(buf, src=1, tag=21)
        expect_error(DistTimeoutError, ["rank 0", "recv", " Timed out waiting "],
               lambda: w.wait(timeout=timedelta(seconds=0.3)))
        assert not w.is_completed()
        dist.barrier()
        w.wait()
        same(buf, torch.full((2,), 21.0), "late message still arrives")
    else:
        dist.barrier()          # rank 1 sends only after rank 0 timed out
        if rank == 1:
            dist.send(torch.full((2,), 21.0), dst=0, tag=21)
    dist.barrier()


@check
def check_sync_hot_ops_take_their_lean_hooks(rank: int, ws: int) -> None:
    """Each hot op's lean hook runs MPI on the calling thread (None, not NotImplemented: no Work)
    with every rank's answer, for predefined and user-defined (float16) MPI ops alike; cases it
    cannot do in place (no MPI spec made yet, overlapping tensors) it leaves to native_blocking,
    and the frontend still gets them right (or refuses them, naming the fix)."""
    group = dist.group.WORLD
    pg = group.backend_for("cpu")  # the backend: its lean hooks
    assert set(group._lean) == LEAN_OPS
    cases = [(torch.float32, R.SUM), (torch.int64, R.MAX), (torch.float16, R.SUM),
             (torch.bfloat16, R.MIN)]
    for dtype, op in cases:
        dist.all_reduce(torch.ones(3, dtype=dtype), op=op)  # the first one makes the MPI spec
        want = expected(op, [values(dtype, r, op) for r in range(ws)])
        t = values(dtype, rank, op)
        assert pg.native_all_reduce_blocking(tensor=t, op=op) is None, (dtype, op)
        same(t, want, f"lean all_reduce {dtype} {op.name}")
        for dst in range(ws):
            t = values(dtype, rank, op)
            assert pg.native_reduce_blocking(tensor=t, dst=dst, op=op) is None, (dtype, op)
            same(t, want if rank == dst else values(dtype, rank, op),
                 f"lean reduce {dtype} {op.name} to {dst}")
        out = torch.zeros(N, dtype=dtype)
        inp = torch.cat([values(dtype, rank * ws + i, op) for i in range(ws)])
        assert pg.native_reduce_scatter_tensor_blocking(output=out, input=inp, op=op) is None
        same(out, expected(op, [values(dtype, r * ws + rank, op) for r in range(ws)]),
             f"lean reduce_scatter_tensor {dtype} {op.name}")
        for src in range(ws):
            t = values(dtype, rank)
            assert pg.native_broadcast_blocking(tensor=t, src=src) is None
            same(t, values(dtype, src), f"lean broadcast {dtype} from {src}")
        flat = torch.zeros(ws * N, dtype=dtype)
        assert pg.native_all_gather_into_tensor_blocking(output=flat,
                                                         tensor=values(dtype, rank)) is None
        same(flat, torch.cat([values(dtype, r) for r in range(ws)]), f"lean all_gather {dtype}")
        # rows of 2 elements, 3 rows to each rank
        src_rows = torch.cat([values(dtype, rank * 10 + j, n=6) for j in range(ws)]).reshape(-1, 2)
        got = torch.zeros(ws * 3, 2, dtype=dtype)
        assert pg.native_all_to_all_single_blocking(output=got, input=src_rows) is None
        same(got, torch.cat([values(dtype, j * 10 + rank, n=6) for j in range(ws)]).reshape(-1, 2),
             f"lean all_to_all_single {dtype}")
    # in place: the input is this rank's slot of the output (MPI_IN_PLACE)
    flat = torch.zeros(ws * 3)
    flat[rank * 3:(rank + 1) * 3] = rank + 0.5
    assert pg.native_all_gather_into_tensor_blocking(
        output=flat, tensor=flat[rank * 3:(rank + 1) * 3]) is None
    same(flat, torch.arange(ws).repeat_interleave(3) + 0.5, "lean in-place all_gather")
    # declined, then done right through the frontend (native_blocking stages or refuses)
    a2a = torch.arange(ws * 2.0) + rank * 100
    assert pg.native_all_to_all_single_blocking(output=a2a, input=a2a) is NotImplemented
    dist.all_to_all_single(a2a, a2a)
    same(a2a, torch.cat([torch.arange(rank * 2.0, rank * 2 + 2) + j * 100 for j in range(ws)]),
         "all_to_all_single in place")
    # uint32 reductions are made nowhere else in this module: no MPI spec is cached yet
    fresh = torch.full((2,), rank + 1, dtype=torch.uint32)
    assert pg.native_all_reduce_blocking(tensor=fresh, op=R.MAX) is NotImplemented
    dist.all_reduce(fresh, op=R.MAX)
    assert fresh.tolist() == [ws, ws], fresh
    lazy = torch.full((2,), 1.0 + 2.0j).conj()  # its memory holds 1+2j
    assert lazy.is_conj() and lazy.is_contiguous()
    expect_error(ValueError, [f"rank {rank}", "broadcast", "resolve_conj"],
                 lambda: dist.broadcast(lazy, src=0))


@check
def check_lean_all_reduce_reuses_memory_rightly(rank: int, ws: int) -> None:
    """The lean all_reduce keeps its MPI arguments per (address, bytes, dtype, op): the same
    memory seen as another dtype, a shorter prefix of it, or reduced with another op, gets
    arguments of its own, and a tensor reduced again gets every rank's answer again."""
    pg = dist.group.WORLD.backend_for("cpu")
    mem = torch.zeros(4, dtype=torch.int32)
    for op in (R.SUM, R.MAX):
        dist.all_reduce(torch.ones(1, dtype=torch.int32), op=op)  # the MPI spec exists
        dist.all_reduce(torch.ones(1, dtype=torch.float32), op=op)
    for round_ in range(3):
        mem.fill_(rank + round_)
        assert pg.native_all_reduce_blocking(tensor=mem, op=R.SUM) is None
        want = sum(r + round_ for r in range(ws))
        assert mem.tolist() == [want] * 4, (round_, mem)
    mem.fill_(rank)
    assert pg.native_all_reduce_blocking(tensor=mem, op=R.MAX) is None
    assert mem.tolist() == [ws - 1] * 4, mem
    mem.fill_(rank + 1)
    head = mem[:2]  # the same address, fewer bytes: the rest stays this rank's
    assert pg.native_all_reduce_blocking(tensor=head, op=R.SUM) is None
    assert mem.tolist() == [ws * (ws + 1) // 2] * 2 + [rank + 1] * 2, mem
    floats = mem.view(torch.float32)  # the same bytes as another dtype
    floats.fill_(rank + 0.5)
    assert pg.native_all_reduce_blocking(tensor=floats, op=R.SUM) is None
    assert floats.tolist() == [sum(r + 0.5 for r in range(ws))] * 4, floats
    # the async all_reduce keeps its arguments in the same place: mixed with the lean one on
    # the same memory, each still reduces what it is given
    mem.fill_(rank)
    assert pg.native_all_reduce(tensor=head, op=R.SUM).wait()
    assert mem.tolist() == [ws * (ws - 1) // 2] * 2 + [rank] * 2, mem
    floats.fill_(rank + 0.25)
    assert pg.native_all_reduce(tensor=floats, op=R.MAX).wait()
    assert floats.tolist() == [ws - 0.75] * 4, floats
    mem.fill_(rank + 2)
    assert pg.native_all_reduce_blocking(tensor=mem, op=R.MAX) is None
    assert mem.tolist() == [ws + 1] * 4, mem


@check
def check_sync_ops_run_on_the_calling_thread(rank: int, ws: int) -> None:
    """Every collective the blocking path may take runs through native_blocking (None, not
    NotImplemented: no Work made) with every rank's answer, staging copies included."""
    group = dist.group.WORLD
    pg = group.backend_for("cpu")  # the backend: its native_blocking
    assert group._blocking_ops == OPS_BLOCKING
    t = torch.full((3,), float(rank))
    assert pg.native_blocking("broadcast", {"tensor": t, "src": ws - 1}) is None
    same(t, torch.full((3,), float(ws - 1)), "blocking broadcast")
    out = torch.empty(ws * 2, dtype=torch.int64)
    assert pg.native_blocking("all_gather_into_tensor",
                              {"output": out, "tensor": torch.full((2,), rank)}) is None
    same(out, torch.arange(ws).repeat_interleave(2), "blocking all_gather_into_tensor")
    outs = [torch.empty(2) for _ in range(ws)]
    assert pg.native_blocking("all_gather", {"output_tensors": outs,
                                             "tensor": torch.full((2,), float(rank))}) is None
    for r, o in enumerate(outs):
        same(o, torch.full((2,), float(r)), f"blocking all_gather from rank {r}")
    got = torch.empty(ws)
    assert pg.native_blocking("all_to_all_single", {
        "output": got, "input": torch.arange(ws, dtype=torch.float32) + 10 * rank,
        "output_split_sizes": [1] * ws, "input_split_sizes": [1] * ws}) is None
    same(got, torch.arange(ws, dtype=torch.float32) * 10 + rank, "blocking all_to_all_single")
    assert pg.native_blocking("barrier", {}) is None
    # the frontend's synchronous calls take this path and agree with the async ones
    b = torch.full((4,), float(rank))
    dist.broadcast(b, src=0)
    same(b, torch.zeros(4), "dist.broadcast")
    red = torch.empty(1)
    dist.reduce_scatter_tensor(red, torch.ones(ws))
    same(red, torch.full((1,), float(ws)), "dist.reduce_scatter_tensor")


@check
def check_stuck_peer_times_out(rank: int, ws: int) -> None:
    """A peer that does not show up gives DistTimeoutError (group creation, sync and async ops);
    when it shows up later, the op still completes."""
    store = PrefixStore("mpi-test/stuck", _world.store)
    if rank == 0:
        expect_error(DistTimeoutError, ["global ranks [1]", "create the group"],
               lambda: MPIProcessGroup(PrefixStore("lonely", store), 0, 2, GroupOptions(
                   group_name="lonely", global_ranks=(0, 1), timeout=timedelta(seconds=0.5))))
    if rank > 1:
        dist.barrier()
        return
    backend = MPIProcessGroup(PrefixStore("pair", store), rank, 2,
                              GroupOptions(group_name="pair", global_ranks=(0, 1)))
    # from now on every wait without its own timeout gives up after half a second
    backend.options = dataclasses.replace(backend.options, timeout=timedelta(seconds=0.5))
    pg = ProcessGroup(backend)
    try:
        if rank == 0:
            t = torch.ones(2)
            w1 = pg.all_reduce(t)
            expect_error(DistTimeoutError, ["rank 0", "all_reduce", "Timed out waiting 500ms"],
                   w1.wait)
            t2 = torch.ones(2)
            w2 = pg.all_reduce(t2)
            expect_error(DistTimeoutError, ["all_reduce"],
                   lambda: w2.wait(timeout=timedelta(seconds=0.2)))
            # the blocking path (no Work) gives up the same way; the progress thread adopts it
            t3 = torch.ones(2)
            expect_error(DistTimeoutError, ["rank 0", "all_reduce", "Timed out waiting 500ms"],
                   lambda: pg.run_blocking("all_reduce", t3))
            t4 = torch.zeros(3)
            expect_error(DistTimeoutError, ["rank 0", "broadcast", "Timed out waiting 500ms"],
                   lambda: pg.run_blocking("broadcast", t4, 1))
            store.set("go", b"1")
            w2.wait(timeout=timedelta(seconds=60))
            w1.wait(timeout=timedelta(seconds=60))
            same(t, torch.full((2,), 2.0), "late all_reduce")
            same(t2, torch.full((2,), 2.0), "late second all_reduce")
            deadline = time.monotonic() + 60
            while not torch.equal(t3, torch.full((2,), 2.0)) and time.monotonic() < deadline:
                time.sleep(0.01)
            same(t3, torch.full((2,), 2.0), "late blocking all_reduce, completed in the background")
            while not torch.equal(t4, torch.full((3,), 7.0)) and time.monotonic() < deadline:
                time.sleep(0.01)
            same(t4, torch.full((3,), 7.0), "late blocking broadcast, completed in the background")
        else:
            store.wait(["go"], timedelta(seconds=60))
            for _ in range(3):
                t = torch.ones(2)
                pg.all_reduce(t).wait(timeout=timedelta(seconds=60))
                same(t, torch.full((2,), 2.0), "late all_reduce on the slow rank")
            pg.broadcast(torch.full((3,), 7.0), 1).wait(timeout=timedelta(seconds=60))
    finally:
        pg.shutdown()
    dist.barrier()


@check
def check_mpi_errors_surface(rank: int, ws: int) -> None:
    # a message larger than the receiving tensor: MPI_ERR_TRUNCATE, raised as DistBackendError
    if rank == 0:
        dist.send(torch.arange(8, dtype=torch.float32), dst=1, tag=31)
        dist.send(torch.arange(2, dtype=torch.float32), dst=1, tag=32)
    elif rank == 1:
        expect_error(DistBackendError, ["rank 1", "recv", "mpi", "as large"],
               lambda: dist.recv(torch.zeros(4), src=0, tag=31))
        # a shorter message than the tensor: MPI allows it silently, plugdist does not
        expect_error(DistBackendError, ["received 8 bytes from rank 0", "holds 16"],
               lambda: dist.recv(torch.zeros(4), src=0, tag=32))
    dist.barrier()
    # refused before anything is sent, on every rank alike
    expect_error(ValueError, ["tag", "0..", "rank"],
           lambda: dist.isend(torch.zeros(1), dst=(rank + 1) % ws, tag=-3))
    odd = getattr(torch, "float8_e8m0fnu", None)  # a dtype MPI plugdist has no reduction for
    if odd is not None:
        expect_error(ValueError, ["cannot reduce", "float8_e8m0fnu", "rank"],
               lambda: dist.all_reduce(torch.zeros(2, dtype=odd)))
    # the world still works
    t = torch.ones(1)
    dist.all_reduce(t)
    same(t, torch.tensor([float(ws)]), "all_reduce after errors")


@check
def check_rank_size_mismatch(rank: int, ws: int) -> None:
    store = HashStore()
    expect_error(DistBackendError, ["MPI rank/size is", f"{rank}/{ws}", f"{(rank + 1) % ws}/{ws}"],
           lambda: MPIProcessGroup(store, (rank + 1) % ws, ws, None))
    expect_error(DistBackendError, ["MPI rank/size is", f"{rank}/{ws + 1}"],
           lambda: MPIProcessGroup(store, rank, ws + 1, None))
    expect_error(DistBackendError, ["global ranks", str(ws), "do not exist"],
           lambda: MPIProcessGroup(store, 0, 2,
                                   GroupOptions(group_name="x", global_ranks=(rank, ws))))
    expect_error(DistBackendError, ["global rank"],
           lambda: MPIProcessGroup(store, 0, 2, GroupOptions(group_name="y",
                                                             global_ranks=((rank + 1) % ws, rank))))


@check
def check_shutdown_fails_pending_ops(rank: int, ws: int) -> None:
    g = dist.new_group()
    buf = torch.zeros(1)
    w = dist.irecv(buf, src=None, group=g, tag=99)     # nobody ever sends this
    dist.destroy_process_group(g)
    expect_error(DistBackendError, ["shut down", "op recv", f"rank {rank}"],
           lambda: w.wait(timeout=timedelta(seconds=10)))
    assert w.is_completed() and not w.is_success()
    assert isinstance(w.exception(), DistBackendError)
    expect_error(DistBackendError, ["shut down", "op recv"], lambda: w.get_future().wait())
    expect_error(DistError, ["shut down"], lambda: g.all_reduce(torch.ones(1)))
    dist.barrier()


@check
def check_user_mpi_traffic_is_separate(rank: int, ws: int) -> None:
    from mpi4py import MPI

    if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        return  # user MPI calls racing plugdist's progress thread need THREAD_MULTIPLE
    comm = MPI.COMM_WORLD
    if rank == 1:
        comm.send("user message", dest=0, tag=0)        # on COMM_WORLD, tag 0
        dist.send(torch.tensor([42.0]), dst=0, tag=0)   # on plugdist's communicator
    elif rank == 0:
        t = torch.zeros(1)
        assert dist.recv(t, tag=0) == 1
        same(t, torch.tensor([42.0]), "plugdist message, not the user's")
        assert comm.recv(source=1, tag=0) == "user message"
    dist.barrier()


@check
def check_zz_reinit(rank: int, ws: int) -> None:
    """Last: leave the world, fail to rejoin with a wrong rank, rejoin through MPI."""
    dist.destroy_process_group()
    expect_error(DistBackendError, ["MPI rank/size is", f"{rank}/{ws}"],
           lambda: dist.init_process_group("mpi", store=HashStore(), rank=(rank + 1) % ws,
                                           world_size=ws))
    assert not dist.is_initialized()
    dist.init_process_group("mpi", timeout=timedelta(seconds=60))
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, op=R.MAX)
    same(t, torch.tensor([float(ws - 1)]), "all_reduce after re-init")
