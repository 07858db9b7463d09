"""The gloo plugin (plugdist-gloo) against real processes talking real Gloo over loopback.

Each world is started once and runs many checks; a rank function returns the list of checks
that failed (plus how many ran), so one failing dtype does not hide the others.
"""

from __future__ import annotations

import functools
import importlib.metadata
import operator
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import plugdist as dist
import pytest
import torch
from plugdist import ProcessGroup
from plugdist._backend.reduce_op import ReduceOp
from plugdist._group.process_group import OPS, GroupOptions
from plugdist._observability.flight_recorder import recorder
from plugdist.errors import DistError, DistNetworkError, DistTimeoutError
from plugdist.store import HashStore, PrefixStore, TCPStore
from plugdist.testing import free_port, run_world
from plugdist_gloo import GlooOptions, GlooProcessGroup

pytestmark = pytest.mark.skipif(not GlooProcessGroup.is_available()[0],
                                reason="torch built without Gloo")

R = ReduceOp
FLOAT_OPS = [R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX]
INT_OPS = [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR]

# dtype -> reductions checked. float8 and complex32 leave out AVG: the core divides in the
# tensor's own dtype, which torch cannot do for them (reported to the core).
REDUCE_MATRIX: dict[torch.dtype, list[ReduceOp]] = {
    torch.float32: FLOAT_OPS, torch.float64: FLOAT_OPS, torch.float16: FLOAT_OPS,
    torch.bfloat16: FLOAT_OPS,
    torch.float8_e4m3fn: [R.SUM, R.PRODUCT, R.MIN, R.MAX],
    torch.float8_e5m2: [R.SUM, R.MIN, R.MAX],
    torch.complex64: [R.SUM, R.AVG], torch.complex128: [R.SUM, R.AVG],
    torch.complex32: [R.SUM],
    torch.int8: INT_OPS, torch.uint8: INT_OPS, torch.int16: INT_OPS, torch.int32: INT_OPS,
    torch.int64: INT_OPS, torch.uint16: INT_OPS, torch.uint32: INT_OPS, torch.uint64: INT_OPS,
    torch.bool: INT_OPS,
}
# natively moved by Gloo, moved as bytes, viewed as reals, ...: one of each path at least
MOVE_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int16, torch.int64,
               torch.bool, torch.complex64, torch.complex128, torch.uint16, torch.uint64,
               torch.float8_e5m2]
SOME_DTYPES = [torch.float32, torch.bfloat16, torch.int16, torch.uint32, torch.bool,
               torch.complex64, torch.float8_e4m3fn]
N_ELEMS = 7


# -- reference data and results -----------------------------------------------------------------
def values(dtype: torch.dtype, seed: int, n: int = N_ELEMS) -> torch.Tensor:
    """Deterministic test data for ``seed``: small exact values, plus extremes for integers."""
    raw = [((3 * seed + 5 * i) % 9) for i in range(n)]
    if dtype is torch.bool:
        return torch.tensor([(seed + i) % 3 == 0 for i in range(n)])
    if dtype.is_complex:
        return torch.tensor([complex((v - 4) * 0.5, ((seed - i) % 5 - 2) * 0.5)
                             for i, v in enumerate(raw)],
                            dtype=torch.complex128).to(dtype)
    if dtype.is_floating_point:
        return torch.tensor([(v - 4) * 0.5 for v in raw], dtype=torch.float64).to(dtype)
    bits = dtype.itemsize * 8
    if dtype.is_signed:
        lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        data = [v - 4 for v in raw]
        if n >= 2:
            data[0], data[1] = hi - seed % 3, lo + seed % 3   # wrap SUM/PRODUCT
    else:
        hi = (1 << bits) - 1
        data = raw
        if n >= 2:
            data[0], data[1] = hi - seed % 3, seed % 3          # high bit set: MIN/MAX order
    if dtype is torch.uint64:
        return torch.tensor(data, dtype=torch.uint64)
    return torch.tensor(data, dtype=torch.int64).to(dtype)


def _wrap(v: int, dtype: torch.dtype) -> int:
    bits = dtype.itemsize * 8
    v %= 1 << bits
    if dtype.is_signed and v >= 1 << (bits - 1):
        v -= 1 << bits
    return v


def reduce_reference(op: ReduceOp, dtype: torch.dtype, parts: list[torch.Tensor]) -> torch.Tensor:
    """What reducing ``parts`` with ``op`` must give, computed in Python numbers."""
    cols = list(zip(*[_show(p) for p in parts], strict=True))
    if dtype is torch.bool:
        fn = {R.SUM: any, R.MAX: any, R.BOR: any, R.PRODUCT: all, R.MIN: all, R.BAND: all,
              R.BXOR: lambda c: functools.reduce(operator.xor, c)}[op]
        return torch.tensor([bool(fn(c)) for c in cols])
    binary = {R.SUM: operator.add, R.AVG: operator.add, R.PRODUCT: operator.mul,
              R.BAND: operator.and_, R.BOR: operator.or_, R.BXOR: operator.xor}
    out = []
    for c in cols:
        if op is R.MIN:
            v = min(c)
        elif op is R.MAX:
            v = max(c)
        else:
            v = functools.reduce(binary[op], c)
        if op is R.AVG:
            v = v / len(c)
        out.append(v)
    if dtype.is_complex:
        return torch.tensor(out, dtype=torch.complex128).to(dtype)
    if dtype.is_floating_point:
        return torch.tensor(out, dtype=torch.float64).to(dtype)
    return torch.tensor([_wrap(v, dtype) for v in out], dtype=torch.uint64 if dtype is torch.uint64
                        else torch.int64).to(dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def close(a: torch.Tensor, b: torch.Tensor, op: ReduceOp) -> bool:
    """Exact, except AVG (one rounding of a quotient) on floating types."""
    if op is not R.AVG:
        return same_bytes(a, b)
    wide = torch.complex128 if a.dtype.is_complex else torch.float64
    tol = 1e-2 if a.dtype.itemsize <= 2 or a.dtype is torch.complex32 else 1e-6
    return a.dtype == b.dtype and torch.allclose(a.to(wide), b.to(wide), rtol=tol, atol=tol)


class Checks:
    """Collects failures instead of stopping at the first, so a report shows all of them."""

    def __init__(self, rank: int) -> None:
        self.rank, self.count, self.failures = rank, 0, []

    def check(self, ok: bool, what: str, got: Any = None, want: Any = None) -> None:
        self.count += 1
        if not ok:
            self.failures.append(f"rank {self.rank}: {what}: got {got!r}, want {want!r}")

    def guard(self, what: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - reported as a failure of this check
            self.count += 1
            self.failures.append(f"rank {self.rank}: {what}: raised {type(exc).__name__}: {exc}")

    def result(self) -> dict[str, Any]:
        return {"count": self.count, "failures": self.failures}


def _show(t: torch.Tensor) -> Any:
    """``t`` as Python numbers (float8 and complex32 have no ``tolist`` of their own)."""
    if t.dtype.is_complex:
        return t.to(torch.complex128).tolist()
    if t.dtype.is_floating_point:
        return t.to(torch.float64).tolist()
    return t.tolist()


# -- the collectives world ----------------------------------------------------------------------
def collectives_world(rank: int, n: int) -> dict[str, Any]:
    pg = dist.group.WORLD
    c = Checks(rank)
    c.check(isinstance(pg.backend_for("cpu"), GlooProcessGroup), "default group's backend type",
            type(pg.backend_for("cpu")).__name__)
    caps = pg.capabilities()
    c.check(all(caps.is_native(op, "cpu") for op in OPS), "every op native on cpu",
            sorted(op for op in OPS if not caps.is_native(op, "cpu")), [])
    c.check(caps.any_source_recv, "any-source recv advertised")

    # all_reduce: every dtype x every reduction, all issued before any is waited on
    pending = []
    for dtype, reds in REDUCE_MATRIX.items():
        for red in reds:
            t = values(dtype, rank)
            pending.append((dtype, red, t, pg.all_reduce(t, op=red)))
    for dtype, red, t, work in pending:
        def verify(dtype=dtype, red=red, t=t, work=work) -> None:
            work.wait()
            want = reduce_reference(red, dtype, [values(dtype, r) for r in range(n)])
            c.check(close(t, want, red), f"all_reduce {dtype} {red.name}", _show(t), _show(want))
            c.check(work.result()[0] is t, f"all_reduce {dtype} {red.name} result is the tensor")
        c.guard(f"all_reduce {dtype} {red.name}", verify)

    # the Work contract, on one op
    t = torch.ones(3)
    w = pg.all_reduce(t)
    c.check(w.wait() is True, "wait() returns True")
    c.check(w.is_completed() and w.is_success() and w.exception() is None, "work state after wait",
            (w.is_completed(), w.is_success(), w.exception()))
    c.check(w.get_future().done() and w.get_future().value()[0] is t, "future holds the output")
    c.check(torch.equal(t, torch.full((3,), float(n))), "all_reduce ones", t.tolist())

    # observing an op (the flight recorder, on by default) makes no future
    seen: list[BaseException | None] = []
    w = pg.all_reduce(torch.ones(2))
    w.on_completion(seen.append)
    c.check(w.wait() is True and w.lazy_future is None, "an observed op made no future",
            w.lazy_future)
    c.check(seen == [None], "on_completion called back once, with no error", seen)
    w.on_completion(seen.append)  # already done: at once, on this thread
    c.check(seen == [None, None], "on_completion after completion", seen)
    last = recorder.snapshot()["entries"][-1]
    c.check((last["profiling_name"], last["state"]) == ("gloo:all_reduce", "completed"),
            "the recorder saw it complete", (last["profiling_name"], last["state"]))

    # 0-dim and empty tensors
    s = torch.tensor(rank + 1, dtype=torch.int16)
    pg.all_reduce(s).wait()
    c.check(s.item() == n * (n + 1) // 2, "0-dim int16 all_reduce", s.item())
    e = torch.empty(0)
    pg.all_reduce(e).wait()
    c.check(e.numel() == 0, "empty all_reduce")

    for dtype in SOME_DTYPES:
        c.guard(f"reductions {dtype}", lambda dtype=dtype: _other_reductions(pg, c, rank, n, dtype))
    for dtype in MOVE_DTYPES:
        c.guard(f"movement {dtype}", lambda dtype=dtype: _movement(pg, c, rank, n, dtype))
    for dtype in (torch.float32, torch.int16, torch.complex64):
        c.guard(f"p2p {dtype}", lambda dtype=dtype: _p2p(pg, c, rank, n, dtype))

    c.guard("lean blocking hooks", lambda: _lean_hooks(pg, c, rank, n))

    # the drop-in frontend reaches the same group
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    c.check(t.item() == n - 1, "dist.all_reduce MAX", t.item())
    work = dist.broadcast(torch.tensor([rank]), src=0, async_op=True)
    c.check(work.wait() is True, "dist.broadcast async wait")
    pg.barrier().wait()
    return c.result()


def _lean_hooks(pg: Any, c: Checks, rank: int, n: int) -> None:
    """Synchronous hot ops take the lean hooks (no GlooWork) and get every rank's answer,
    staged dtypes (bfloat16, bool) included."""
    c.check(set(pg._lean) == {"all_reduce", "broadcast", "reduce", "all_gather_into_tensor",
                              "reduce_scatter_tensor", "all_to_all_single"},
            "every hot op has a lean hook", sorted(pg._lean))
    t = values(torch.float32, rank)
    c.check(pg.backend_for("cpu").native_broadcast_blocking(tensor=t, src=n - 1) is None,
            "lean hook returns None")
    c.check(same_bytes(t, values(torch.float32, n - 1)), "lean broadcast", _show(t))
    for dtype in (torch.float32, torch.bfloat16, torch.int16, torch.bool):
        red = ReduceOp.MAX
        want = reduce_reference(red, dtype, [values(dtype, r) for r in range(n)])
        t = values(dtype, rank)
        dist.all_reduce(t, op=red)
        c.check(close(t, want, red), f"sync all_reduce {dtype}", _show(t), _show(want))
        t = values(dtype, rank)
        dist.reduce(t, dst=0, op=red)
        if rank == 0:  # elsewhere Gloo may use the tensor as scratch space, as torch's does
            c.check(close(t, want, red), f"sync reduce {dtype}", _show(t), _show(want))
        t = values(dtype, rank)
        dist.broadcast(t, src=0)
        c.check(same_bytes(t, values(dtype, 0)), f"sync broadcast {dtype}", _show(t))
        flat = torch.zeros(n * N_ELEMS, dtype=dtype)
        dist.all_gather_into_tensor(flat, values(dtype, rank))
        c.check(same_bytes(flat, torch.cat([values(dtype, r) for r in range(n)])),
                f"sync all_gather_into_tensor {dtype}", _show(flat))
        out = torch.zeros(N_ELEMS, dtype=dtype)
        dist.reduce_scatter_tensor(out, torch.cat([values(dtype, rank * n + j) for j in range(n)]),
                                   op=red)
        want = reduce_reference(red, dtype, [values(dtype, s * n + rank) for s in range(n)])
        c.check(close(out, want, red), f"sync reduce_scatter_tensor {dtype}", _show(out))
        src_rows = torch.cat([values(dtype, rank * 10 + j) for j in range(n)]).reshape(n, -1)
        got = torch.zeros_like(src_rows)
        dist.all_to_all_single(got, src_rows)
        want_rows = torch.cat([values(dtype, j * 10 + rank) for j in range(n)]).reshape(n, -1)
        c.check(same_bytes(got, want_rows), f"sync all_to_all_single {dtype}", _show(got))


def _other_reductions(pg: Any, c: Checks, rank: int, n: int, dtype: torch.dtype) -> None:
    reds = REDUCE_MATRIX[dtype]
    for red in reds:
        # reduce to the last rank
        t = values(dtype, rank)
        pg.reduce(t, dst=n - 1, op=red).wait()
        if rank == n - 1:
            want = reduce_reference(red, dtype, [values(dtype, r) for r in range(n)])
            c.check(close(t, want, red), f"reduce {dtype} {red.name}", _show(t), _show(want))
        # reduce_scatter, list form: rank r's output reduces everyone's input_list[r]
        out = torch.zeros(N_ELEMS, dtype=dtype)
        pg.reduce_scatter(out, [values(dtype, rank * n + j) for j in range(n)], op=red).wait()
        want = reduce_reference(red, dtype, [values(dtype, s * n + rank) for s in range(n)])
        c.check(close(out, want, red), f"reduce_scatter {dtype} {red.name}", _show(out),
                _show(want))
        # reduce_scatter_tensor
        out = torch.zeros(N_ELEMS, dtype=dtype)
        flat = torch.cat([values(dtype, rank * n + j) for j in range(n)])
        pg.reduce_scatter_tensor(out, flat, op=red).wait()
        c.check(close(out, want, red), f"reduce_scatter_tensor {dtype} {red.name}", _show(out),
                _show(want))


def _movement(pg: Any, c: Checks, rank: int, n: int, dtype: torch.dtype) -> None:
    name = str(dtype)
    t = values(dtype, rank)
    pg.broadcast(t, src=1).wait()
    c.check(same_bytes(t, values(dtype, 1)), f"broadcast {name}", _show(t))

    outs = [torch.zeros(N_ELEMS, dtype=dtype) for _ in range(n)]
    pg.all_gather(outs, values(dtype, rank)).wait()
    c.check(all(same_bytes(outs[j], values(dtype, j)) for j in range(n)), f"all_gather {name}")

    flat = torch.zeros(n, N_ELEMS, dtype=dtype)
    pg.all_gather_into_tensor(flat, values(dtype, rank)).wait()
    c.check(same_bytes(flat, torch.stack([values(dtype, j) for j in range(n)])),
            f"all_gather_into_tensor {name}")

    dst = n - 1
    gl = [torch.zeros(N_ELEMS, dtype=dtype) for _ in range(n)] if rank == dst else None
    w = pg.gather(values(dtype, rank), gl, dst=dst)
    w.wait()
    if rank == dst:
        c.check(all(same_bytes(gl[j], values(dtype, j)) for j in range(n)), f"gather {name}")
    else:
        c.check(w.result() == [], f"gather {name} result off dst", w.result())

    t = torch.zeros(N_ELEMS, dtype=dtype)
    sl = [values(dtype, 100 + j) for j in range(n)] if rank == 0 else None
    pg.scatter(t, sl, src=0).wait()
    c.check(same_bytes(t, values(dtype, 100 + rank)), f"scatter {name}", _show(t))

    outs = [torch.zeros(N_ELEMS, dtype=dtype) for _ in range(n)]
    pg.all_to_all(outs, [values(dtype, rank * n + j) for j in range(n)]).wait()
    c.check(all(same_bytes(outs[j], values(dtype, j * n + rank)) for j in range(n)),
            f"all_to_all {name}")

    # uneven sizes: rank s sends (s + j) % 2 + 1 rows to rank j
    def block(s: int, j: int) -> torch.Tensor:
        return values(dtype, 50 + s * n + j, 2 * ((s + j) % 2 + 1)).view(-1, 2)
    outs = [torch.zeros_like(block(j, rank)) for j in range(n)]
    pg.all_to_all(outs, [block(rank, j) for j in range(n)]).wait()
    c.check(all(same_bytes(outs[j], block(j, rank)) for j in range(n)),
            f"all_to_all uneven {name}", [_show(o) for o in outs])
    inp = torch.cat([block(rank, j) for j in range(n)])
    want = torch.cat([block(s, rank) for s in range(n)])
    out = torch.zeros_like(want)
    pg.all_to_all_single(out, inp, output_split_sizes=[(s + rank) % 2 + 1 for s in range(n)],
                         input_split_sizes=[(rank + j) % 2 + 1 for j in range(n)]).wait()
    c.check(same_bytes(out, want), f"all_to_all_single {name}", _show(out), _show(want))


def _p2p(pg: Any, c: Checks, rank: int, n: int, dtype: torch.dtype) -> None:
    right, left = (rank + 1) % n, (rank - 1) % n
    got = torch.zeros(N_ELEMS, dtype=dtype)
    works = [pg.recv(got, src=left, tag=5), pg.send(values(dtype, rank), dst=right, tag=5)]
    for w in works:
        w.wait()
    c.check(same_bytes(got, values(dtype, left)), f"ring send/recv {dtype}", _show(got))
    # any-source: rank 0 takes one message from every other rank, in whatever order they come
    if rank == 0:
        seen = set()
        for _ in range(n - 1):
            buf = torch.zeros(N_ELEMS, dtype=dtype)
            w = pg.recv(buf, src=None, tag=7)
            w.wait()
            src = w.source_rank()
            seen.add(src)
            c.check(0 < src < n and same_bytes(buf, values(dtype, 200 + src)),
                    f"any-source recv {dtype} from {src}", _show(buf))
        c.check(seen == set(range(1, n)), f"any-source senders {dtype}", seen)
    else:
        pg.send(values(dtype, 200 + rank), dst=0, tag=7).wait()
    pg.barrier().wait()


@pytest.mark.timeout(240)
def test_collectives_every_op_dtype_and_reduction() -> None:
    results = run_world(collectives_world, 3, backend="gloo", timeout=200, group_timeout=60)
    for r, res in enumerate(results):
        assert res["failures"] == [], f"rank {r}:\n" + "\n".join(res["failures"])
        assert res["count"] > 200, f"rank {r} ran only {res['count']} checks"


# -- failures: a silent rank, then a dead one ---------------------------------------------------
def _group(store: TCPStore, name: str, rank: int, n: int, seconds: float) -> ProcessGroup:
    opts = GroupOptions(group_name=name, timeout=timedelta(seconds=seconds),
                        global_ranks=tuple(range(n)))
    return ProcessGroup(GlooProcessGroup(PrefixStore(name, store), rank, n, opts))


def failure_world(rank: int, n: int) -> dict[str, Any]:
    store = TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), n, rank == 0,
                     timeout=timedelta(seconds=60))
    out: dict[str, Any] = {}
    # 1. rank 1 stays away from an all_reduce: rank 0 gets Gloo's timeout (3 s group timeout)
    pg = _group(store, "silent", rank, n, 3)
    pg.all_reduce(torch.ones(2)).wait()
    if rank == 0:
        w = pg.all_reduce(torch.ones(2))
        start = time.monotonic()
        try:
            w.wait(timedelta(seconds=60))  # longer than the group timeout: Gloo must end it
        except DistError as exc:
            out["silent"] = (type(exc).__name__, str(exc), time.monotonic() - start)
        out["silent_state"] = (w.is_completed(), w.is_success(), type(w.exception()).__name__)
        store.set("silent-done", b"1")
    else:
        store.wait(["silent-done"])
    pg.shutdown()
    # 1b. the same through the synchronous lean route (no Work to wait on): a broadcast
    pg = _group(store, "silent-sync", rank, n, 3)
    pg.all_reduce(torch.ones(2)).wait()
    if rank == 0:
        start = time.monotonic()
        try:
            pg.run_blocking("broadcast", torch.ones(2), 1)
            out["silent_sync"] = ("no error", "", 0.0)
        except DistError as exc:
            out["silent_sync"] = (type(exc).__name__, str(exc), time.monotonic() - start)
        store.set("silent-sync-done", b"1")
    else:
        store.wait(["silent-sync-done"])
    pg.shutdown()
    # 2. a fresh group; rank 1 dies after one op
    g = _group(store, "dying", rank, n, 10)
    g.all_reduce(torch.ones(2)).wait()
    if rank == 1:
        os._exit(3)
    start = time.monotonic()
    try:
        g.all_reduce(torch.ones(1000)).wait()
        out["dead"] = ("no error", "", 0.0)
    except DistError as exc:
        out["dead"] = (type(exc).__name__, str(exc), time.monotonic() - start)
    g.shutdown()
    store.close()
    return out


@pytest.mark.timeout(120)
def test_silent_rank_times_out_and_dead_rank_fails_fast() -> None:
    results = run_world(failure_world, 2, timeout=90, expect_errors=True)
    assert results[1].exitcode == 3, results[1]
    assert results[0].ok, results[0].error
    res = results[0].value
    kind, msg, elapsed = res["silent"]
    assert kind == "DistTimeoutError", msg
    assert "op all_reduce" in msg and "group 'silent'" in msg and "rank 0" in msg, msg
    assert elapsed < 30, f"a 3 s group timeout took {elapsed:.1f}s to fire"
    assert res["silent_state"] == (True, False, "DistTimeoutError")
    kind, msg, elapsed = res["silent_sync"]
    assert kind == "DistTimeoutError", msg
    assert "op broadcast" in msg and "group 'silent-sync'" in msg and "rank 0" in msg, msg
    assert elapsed < 30, f"a 3 s group timeout took {elapsed:.1f}s to fire"
    kind, msg, elapsed = res["dead"]
    assert kind in ("DistNetworkError", "DistTimeoutError"), (kind, msg)
    assert "op all_reduce" in msg and "group 'dying'" in msg, msg
    if kind == "DistNetworkError":
        assert "rank 1" in msg, msg  # the peer is named
    assert elapsed < 30, f"a dead peer took {elapsed:.1f}s to be noticed (group timeout 10 s)"


# -- 50 x create / shutdown ---------------------------------------------------------------------
def _resources() -> tuple[int, int, int]:
    return (len(os.listdir("/proc/self/fd")), threading.active_count(),
            len(os.listdir("/proc/self/task")))


def churn_world(rank: int, n: int, rounds: int) -> dict[str, Any]:
    store = TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), n, rank == 0,
                     timeout=timedelta(seconds=30))
    seen = []
    for i in range(rounds):
        opts = GroupOptions(group_name=f"churn{i}", timeout=timedelta(seconds=30),
                            global_ranks=tuple(range(n)))
        pg = ProcessGroup(GlooProcessGroup(PrefixStore(f"churn{i}", store), rank, n, opts))
        t = torch.full((4,), float(rank))
        pg.all_reduce(t).wait()
        if t.tolist() != [float(sum(range(n)))] * 4:
            raise AssertionError(f"round {i}: all_reduce gave {t.tolist()}")
        # p2p runs on helper threads: they must go away too
        if rank % 2:
            pg.recv(t, src=(rank - 1) % n).wait()
        else:
            pg.send(t, dst=(rank + 1) % n).wait()
        pg.shutdown()
        pg.shutdown()  # idempotent
        del pg
        if i in (1, rounds - 1):
            seen.append(_resources())
    store.close()
    return {"after_warmup": seen[0], "at_end": seen[1]}


@pytest.mark.timeout(150)
def test_create_shutdown_50_times_leaks_nothing() -> None:
    results = run_world(churn_world, 2, timeout=120, args=(50,))
    for r, res in enumerate(results):
        # A leaking group leaks at least a listening socket, a connection and Gloo's worker
        # threads each round: 48 rounds would add 48+ of each. The small slack absorbs the
        # TCPStore's connection pool, which opens/closes a socket as requests overlap.
        grown = [end - start for start, end in zip(res["after_warmup"], res["at_end"], strict=True)]
        assert max(grown) <= 2, (
            f"rank {r}: (fds, python threads, os threads) went from {res['after_warmup']} "
            f"to {res['at_end']} over 48 create/shutdown rounds")


# -- side by side with torch.distributed --------------------------------------------------------
def side_by_side_world(rank: int, n: int, torch_port: int) -> dict[str, Any]:
    import torch.distributed as tdist
    out: dict[str, Any] = {"torch_initialized_by_plugdist": tdist.is_initialized()}
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{torch_port}", rank=rank,
                             world_size=n, timeout=timedelta(seconds=60))
    try:
        a, b = torch.tensor([rank + 1.0]), torch.tensor([10.0 * (rank + 1)])
        w1 = dist.all_reduce(a, async_op=True)
        w2 = tdist.all_reduce(b, async_op=True)
        w1.wait()
        w2.wait()
        # a plugdist group made after torch's default group exists
        g = dist.new_group(list(range(n)))
        c = torch.tensor([rank], dtype=torch.int16)
        g.all_reduce(c, op=ReduceOp.MAX).wait()
        tdist.barrier()
        out.update(plugdist=a.item(), torch=b.item(), subgroup=c.item(),
                   torch_world=tdist.get_world_size(), plugdist_world=dist.get_world_size(),
                   ifname=os.environ.get("GLOO_SOCKET_IFNAME"))
    finally:
        tdist.destroy_process_group()
    return out


@pytest.mark.timeout(120)
def test_side_by_side_with_torch_distributed_over_socket_ifname() -> None:
    n = 2
    results = run_world(side_by_side_world, n, backend="gloo", timeout=90, args=(free_port(),),
                        env={"GLOO_SOCKET_IFNAME": "lo", "PLUGDIST_TORCH_WORLD": "0"},
                        group_timeout=60)
    total = n * (n + 1) / 2
    for r, res in enumerate(results):
        assert res == {"torch_initialized_by_plugdist": False, "plugdist": total,
                       "torch": 10 * total, "subgroup": n - 1, "torch_world": n,
                       "plugdist_world": n, "ifname": "lo"}, f"rank {r}: {res}"


# -- in one process -----------------------------------------------------------------------------
def test_registered_through_the_entry_point_only() -> None:
    from plugdist._registry import BACKENDS, registry
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=BACKENDS)}
    assert eps.get("gloo") == "plugdist_gloo:GlooProcessGroup"
    assert registry.load(BACKENDS, "gloo") is GlooProcessGroup
    assert GlooProcessGroup.is_available() == (True, "torch.distributed.ProcessGroupGloo")
    assert GlooProcessGroup.native_reduce_ops == frozenset(ReduceOp) - {ReduceOp.AVG}
    assert dist.get_default_backend_for_device("cpu") == "gloo"


@pytest.mark.timeout(60)
def test_store_bridge_serves_torch_cpp_callers() -> None:
    """torch's C++ PrefixStore over the bridge calls every method through torch's trampoline."""
    import torch.distributed as tdist
    from plugdist.store._for_torch import PlugdistStoreForTorch
    inner = HashStore(timeout=timedelta(seconds=300))
    bridge = PlugdistStoreForTorch(inner, timedelta(seconds=1))  # must outlive its C++ users
    p = tdist.PrefixStore("p", bridge)
    p.set("k", "v")
    assert p.get("k") == b"v" and inner.get("p/k") == b"v"
    assert (p.add("n", 3), p.add("n", 2)) == (3, 5)
    assert p.compare_set("c", "", "x") == b"x"
    assert p.compare_set("c", "x", "y") == b"y"
    assert p.compare_set("c", "zz", "w") == b"y"
    assert p.check(["k"]) and not p.check(["nope"])
    assert p.num_keys() == 3
    assert p.delete_key("k") and not p.delete_key("k")
    p.wait(["n"])
    with pytest.raises(DistTimeoutError, match="p/missing"):
        p.wait(["missing"], timedelta(seconds=0.1))
    with pytest.raises(DistTimeoutError, match="p/absent"):
        p.get("absent")  # bounded by the bridge's 1 s, not the store's 300 s
    assert inner.timeout == timedelta(seconds=300)  # a shared store's timeout is left alone


@pytest.mark.timeout(60)
def test_single_rank_group_and_shutdown() -> None:
    pg = ProcessGroup(GlooProcessGroup(HashStore(), 0, 1, GroupOptions(group_name="solo")))
    t = torch.tensor([3, 65535], dtype=torch.uint16)
    assert pg.all_reduce(t, op=ReduceOp.MAX).wait()
    assert t.tolist() == [3, 65535]
    pg.shutdown()
    with pytest.raises(DistError, match=r"group 'solo'.*op all_reduce.*shut down"):
        pg.all_reduce(t)


def test_bad_options_and_interfaces_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(TypeError, match="GlooOptions"):
        GlooProcessGroup(HashStore(), 0, 1, GroupOptions(group_name="x", backend_options={"a": 1}))
    with pytest.raises(ValueError, match="threads"):
        GlooOptions(threads=0)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuchif0")
    with pytest.raises(DistNetworkError, match=r"group 'bad'.*'nosuchif0'.*GLOO_SOCKET_IFNAME"):
        GlooProcessGroup(HashStore(), 0, 1, GroupOptions(group_name="bad"))
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    with pytest.raises(DistNetworkError, match="'nosuchif1'.*GlooOptions.interfaces"):
        GlooProcessGroup(HashStore(), 0, 1, GroupOptions(
            group_name="bad", backend_options=GlooOptions(interfaces=("nosuchif1",))))


@pytest.mark.timeout(60)
def test_rendezvous_timeout_names_missing_rank() -> None:
    opts = GroupOptions(group_name="lonely", timeout=timedelta(seconds=1))
    with pytest.raises(DistTimeoutError, match=r"group 'lonely'.*never arrived: \[1\]"):
        GlooProcessGroup(HashStore(), 0, 2, opts)


class _LateWork:
    """A torch work that completes just after a timed wait's deadline passed: the timed wait
    raises torch's "Operation timed out!", and ``is_completed`` is True by the time anyone looks
    (the race a loaded machine hits); its own outcome is ``error`` (None: it succeeded)."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.done = False

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self.done:
            self.done = True  # completes right after this wait gave up
            if timeout is not None:
                raise RuntimeError("Operation timed out!")
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self) -> bool:
        return self.done


@pytest.mark.timeout(10)
@pytest.mark.parametrize("monitored", [True, False])
def test_an_op_that_completes_as_a_timed_wait_gives_up_keeps_its_own_outcome(
        monitored: bool) -> None:
    """A timed wait's timeout is not the outcome of an op found completed right after it: taken
    as such, one rank raised from an op that succeeded everywhere and the ranks fell out of step
    (resilient groups slice every wait into timed waits, so it came up every thousand ops or so
    under load, and the DDP test world then ran mismatched collectives)."""
    from plugdist._backend.abort import AbortSignal
    from plugdist_gloo.work import wait_native

    signal = AbortSignal()
    signal.monitored = monitored
    limit = timedelta(seconds=30) if monitored else timedelta(seconds=0.01)
    assert wait_native(_LateWork(), limit, signal) == (True, None)
    failed = RuntimeError("Connection closed by peer")
    assert wait_native(_LateWork(failed), limit, signal) == (True, failed)


class _NeverDone:
    """A torch work that never completes; its timed ``wait`` keeps the timeouts it was given,
    and waits none of them (torch's counts whole milliseconds, 0 meaning no limit at all)."""

    def __init__(self) -> None:
        self.timeouts: list[timedelta] = []

    def wait(self, timeout: timedelta | None = None) -> bool:
        assert timeout is not None, "an untimed wait on an op that never completes"
        self.timeouts.append(timeout)
        if timeout < timedelta(milliseconds=1):
            raise AssertionError(f"torch waits {timeout} forever: it counts whole milliseconds")
        time.sleep(timeout.total_seconds() / 10)
        raise RuntimeError("Operation timed out!")

    def is_completed(self) -> bool:
        return False


@pytest.mark.timeout(10)
@pytest.mark.parametrize("monitored", [True, False])
def test_a_timed_wait_never_hands_torch_a_timeout_under_a_millisecond(monitored: bool) -> None:
    """The last slice of a sliced wait (resilient groups slice every wait) was often under a
    millisecond, which torch's ``Work.wait`` takes as no limit: a ``wait(timeout)`` on an op a
    peer never joined then lasted until Gloo's own timeout. So was a timeout under 1 ms."""
    from plugdist._backend.abort import AbortSignal
    from plugdist_gloo.work import wait_native

    signal = AbortSignal()
    signal.monitored = monitored
    for limit in (timedelta(microseconds=300), timedelta(seconds=0.2)):
        native = _NeverDone()
        finished, _ = wait_native(native, limit, signal)
        assert not finished
        assert native.timeouts and min(native.timeouts) >= timedelta(milliseconds=1), (
            native.timeouts)


def _tcp_pair() -> tuple[Any, Any]:
    import socket

    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
    return client, accepted


def test_an_abort_never_cuts_a_socket_that_took_a_cut_ones_descriptor_number() -> None:
    """The race the chaos soak found: an abort lists its group's descriptors, Gloo closes one,
    and the next group's socket (built on another thread meanwhile) gets its number. The cut
    checks the socket behind the number by inode and leaves the newcomer alone."""
    from plugdist_gloo.connections import _shut_down_if

    old, old_peer = _tcp_pair()
    fd, old_inode = old.fileno(), os.fstat(old.fileno()).st_ino
    old.close()
    new, new_peer = _tcp_pair()
    try:
        if new.fileno() != fd:
            pytest.skip("the kernel gave the new socket another descriptor number")
        assert not _shut_down_if(fd, old_inode)
        new.sendall(b"alive")
        assert new_peer.recv(5) == b"alive"   # untouched
        assert _shut_down_if(fd, os.fstat(fd).st_ino)
        assert new_peer.recv(5) == b""        # the peer sees the connection end
        assert new.fileno() == fd             # and the descriptor is still the owner's
    finally:
        for s in (new, new_peer, old_peer):
            s.close()
