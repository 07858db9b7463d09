"""The blocking path: a synchronous op runs the backend's ``native_<op>_blocking`` (the hot
ops) or ``native_blocking`` with no Work when it can, and waits on a Work otherwise.

A one-rank backend records which path each call took; the MPI and Gloo plugins' own blocking
paths run across real processes in their conformance runs and error-path tests.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import plugdist as dist
import pytest
import torch
from plugdist import ReduceOp, Work
from plugdist._registry import BACKENDS, registry
from plugdist.backend import BackendBase


class Solo(BackendBase):
    """One rank: an all_reduce leaves the tensor as it is. Records the path of every call."""

    backend_name = "solo"

    def __init__(self, store: Any, rank: int, size: int, options: Any = None) -> None:
        super().__init__(rank, size, options)
        self.calls: list[tuple[str, ReduceOp]] = []

    def native_all_reduce(self, *, tensor: torch.Tensor, op: ReduceOp) -> Work:
        self.calls.append(("work", op))
        work = self.work("all_reduce")
        work.set_result([tensor])
        return work

    def native_all_reduce_blocking(self, *, tensor: torch.Tensor, op: ReduceOp) -> Any:
        self.calls.append(("blocking", op))
        return NotImplemented if tensor.dtype in (torch.float64, torch.int8) else None

    def native_broadcast(self, *, tensor: torch.Tensor, src: int) -> Work:
        self.calls.append(("work", "broadcast"))
        work = self.work("broadcast")
        work.set_result([tensor])
        return work

    def native_blocking(self, op: str, kwargs: dict[str, Any]) -> Any:
        self.calls.append(("blocking", op))
        return NotImplemented if kwargs.get("tensor", torch.empty(0)).dtype is torch.int8 else None


class Observed(Solo):
    """Sees every public op (``wrap_op``), as a wrapper does: the blocking path must not bypass
    it."""

    def wrap_op(self, op: str, args: dict[str, Any], run: Callable[[], Work]) -> Work:
        self.calls.append(("public", args["op"] if op == "all_reduce" else op))
        return run()


@contextlib.contextmanager
def world_of(backend: type[Solo]) -> Iterator[Solo]:
    """A one-rank default group of ``backend``, through the frontend; yields its backend."""
    dist.Backend.register_backend("solo", backend, devices=["cpu"])
    try:
        dist.init_process_group("solo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            yield dist.group.WORLD.backend_for("cpu")
        finally:
            dist.destroy_process_group()
    finally:
        registry.unregister(BACKENDS, "solo")


@pytest.fixture(params=[Solo, Observed])
def solo(request: pytest.FixtureRequest) -> Iterator[Solo]:
    with world_of(request.param) as pg:
        yield pg


def test_sync_all_reduce_blocks_without_a_work_async_gets_one(solo: Solo) -> None:
    t = torch.arange(4.0)
    assert dist.all_reduce(t) is None
    work = dist.all_reduce(t, async_op=True)
    assert work is not None and work.wait()
    sync_path = [("blocking", ReduceOp.SUM)] if type(solo) is Solo else \
        [("public", ReduceOp.SUM), ("work", ReduceOp.SUM)]
    public = [("public", ReduceOp.SUM)] if type(solo) is Observed else []
    assert solo.calls == sync_path + public + [("work", ReduceOp.SUM)]
    assert torch.equal(t, torch.arange(4.0))


def test_composed_reduction_and_declined_call_wait_on_a_work() -> None:
    with world_of(Solo) as solo:
        _composed_and_declined(solo)


def _composed_and_declined(solo: Solo) -> None:
    t = torch.arange(4.0)
    # AVG is not native here: a SUM through the generic hook, then a divide
    dist.all_reduce(t, op=ReduceOp.AVG)
    assert solo.calls == [("blocking", "all_reduce")]
    assert torch.equal(t, torch.arange(4.0))
    solo.calls.clear()
    # the lean hook declines (NotImplemented): the generic hook is asked next
    dist.all_reduce(torch.ones(2, dtype=torch.float64))
    assert solo.calls == [("blocking", ReduceOp.SUM), ("blocking", "all_reduce")]
    solo.calls.clear()
    dist.all_reduce(torch.ones(2, dtype=torch.int8))  # declined by both: through a Work
    assert solo.calls == [("blocking", ReduceOp.SUM), ("blocking", "all_reduce"),
                          ("work", ReduceOp.SUM)]


def test_bad_input_is_refused_before_the_backend_sees_it(solo: Solo) -> None:
    with pytest.raises(ValueError, match=r"rank 0.*all_reduce.*not contiguous"):
        dist.all_reduce(torch.ones(4, 4).t())
    with pytest.raises(ValueError, match=r"all_reduce.*BAND"):
        dist.all_reduce(torch.ones(2), op=ReduceOp.BAND)
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        dist.all_reduce([1.0])  # type: ignore[arg-type]
    assert [c for c in solo.calls if c[0] != "public"] == []


def test_timeout_error_reads_like_a_works() -> None:
    pg = Solo(None, 0, 1)
    err = pg.timeout_error("all_reduce", 2.5)
    assert isinstance(err, dist.DistTimeoutError)
    assert str(err) == str(pg.work("all_reduce").timeout_error(2.5))
    assert "[rank 0, group '0', backend 'solo', op all_reduce] Timed out waiting 2500ms" \
        in str(err)


def test_other_sync_ops_take_native_blocking_async_and_composed_ones_a_work(solo: Solo) -> None:
    t = torch.arange(3.0)
    dist.broadcast(t, src=0)
    dist.broadcast(t, src=0, async_op=True).wait()
    observed = type(solo) is Observed
    sync = [("public", "broadcast"), ("work", "broadcast")] if observed else \
        [("blocking", "broadcast")]
    public = [("public", "broadcast")] if observed else []
    assert solo.calls == sync + public + [("work", "broadcast")]
    solo.calls.clear()
    # composed for this backend (from all_reduce): the composition's own ops make Works
    out = torch.empty(3)
    dist.reduce_scatter_tensor(out, t)
    assert torch.equal(out, t) and ("blocking", "reduce_scatter_tensor") not in solo.calls
    assert ("work", ReduceOp.SUM) in solo.calls


def test_a_declined_or_failed_blocking_call_leaves_no_intent_behind() -> None:
    with world_of(Solo) as solo:
        dist.broadcast(torch.zeros(2, dtype=torch.int8), src=0)  # declined: through a Work
        assert solo.calls == [("blocking", "broadcast"), ("work", "broadcast")]
        with pytest.raises(ValueError, match="not contiguous"):
            dist.broadcast(torch.ones(4, 4).t(), src=0)
        solo.calls.clear()
        # the next op of this thread is not mistaken for the synchronous one that failed
        work = dist.group.WORLD.broadcast(torch.ones(2))
        assert work.wait() and solo.calls == [("work", "broadcast")]


class Lean(Solo):
    """Overrides every lean hook; one rank, so each op is a copy (or nothing). The native ops
    (needed: lean hooks serve native ops only) are never reached in these tests."""

    def _unreached(self, **kwargs: Any) -> Work:
        raise AssertionError("the lean hooks should have run this op")

    native_reduce = native_all_gather_into_tensor = native_reduce_scatter_tensor = _unreached
    native_all_to_all_single = _unreached

    def native_broadcast_blocking(self, *, tensor: torch.Tensor, src: int) -> Any:
        self.calls.append(("lean", "broadcast"))

    def native_reduce_blocking(self, *, tensor: torch.Tensor, dst: int, op: ReduceOp) -> Any:
        self.calls.append(("lean", "reduce"))

    def native_all_gather_into_tensor_blocking(self, *, output: torch.Tensor,
                                               tensor: torch.Tensor) -> Any:
        self.calls.append(("lean", "all_gather_into_tensor"))
        output.copy_(tensor.reshape(output.shape))

    def native_reduce_scatter_tensor_blocking(self, *, output: torch.Tensor, input: torch.Tensor,
                                              op: ReduceOp) -> Any:
        self.calls.append(("lean", "reduce_scatter_tensor"))
        output.copy_(input.reshape(output.shape))

    def native_all_to_all_single_blocking(self, *, output: torch.Tensor,
                                          input: torch.Tensor) -> Any:
        self.calls.append(("lean", "all_to_all_single"))
        output.copy_(input)


def test_hot_sync_ops_take_their_lean_hooks() -> None:
    with world_of(Lean) as pg:
        assert set(dist.group.WORLD._lean) == {"all_reduce", "broadcast", "reduce",
                                       "all_gather_into_tensor", "reduce_scatter_tensor",
                                       "all_to_all_single"}
        t = torch.arange(6.0).reshape(3, 2)
        out = torch.empty(3, 2)
        dist.broadcast(t, src=0)
        dist.reduce(t, dst=0, op=ReduceOp.MAX)
        dist.all_gather_into_tensor(out, t)
        assert torch.equal(out, t)
        out.zero_()
        dist.reduce_scatter_tensor(out, t)
        assert torch.equal(out, t)
        out.zero_()
        dist.all_to_all_single(out, t)
        assert torch.equal(out, t)
        assert pg.calls == [("lean", op) for op in (
            "broadcast", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
            "all_to_all_single")]
        pg.calls.clear()
        # off the lean routes' narrow case: the general route validates (and does) the rest
        dist.all_to_all_single(out, t, [3], [3])  # explicit splits
        dist.reduce(t, dst=0, op=ReduceOp.AVG)    # not native: SUM, then a divide
        assert pg.calls == [("blocking", "all_to_all_single"), ("blocking", "reduce")]


def test_lean_routes_refuse_what_the_public_op_refuses() -> None:
    with world_of(Lean) as pg:
        t = torch.ones(4)
        cases = [
            (lambda: dist.broadcast(t, src=1), ValueError, "src=1 is not a member"),
            (lambda: dist.group.WORLD.run_blocking("broadcast", t, 1), ValueError,
             "src=1 is not a rank"),
            (lambda: dist.group.WORLD.run_blocking("reduce", t, -1), ValueError,
             "dst=-1 is not a rank"),
            (lambda: dist.all_gather_into_tensor(torch.empty(5), t), ValueError,
             "output must hold world_size x input"),
            (lambda: dist.all_gather_into_tensor(torch.empty(4, dtype=torch.int64), t),
             ValueError, "dtypes differ"),
            (lambda: dist.reduce_scatter_tensor(torch.empty(2), t), ValueError,
             "input must hold world_size x output"),
            (lambda: dist.broadcast(torch.ones(4, 4).t(), src=0), ValueError, "not contiguous"),
            (lambda: dist.reduce(torch.ones(2), dst=0, op=ReduceOp.BAND), ValueError, "BAND"),
            (lambda: dist.broadcast(torch.ones(2, dtype=torch.cfloat).conj(), src=0), ValueError,
             "resolve_conj"),
            (lambda: dist.all_gather_into_tensor(torch.ones(4, dtype=torch.cfloat).conj(),
                                                 torch.ones(4, dtype=torch.cfloat)), ValueError,
             "output is a lazily conjugated"),
        ]
        for call, exc, text in cases:
            with pytest.raises(exc, match=text):
                call()
        assert not [c for c in pg.calls if c[0] == "lean"], pg.calls
