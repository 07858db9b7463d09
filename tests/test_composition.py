"""The composition planner: which ops a backend gets from which primitives, and clear errors."""

import pytest
import torch
from plugdist import GroupOptions, ProcessGroup, ReduceOp
from plugdist._group.composition import plan
from plugdist._group.process_group import OPS
from plugdist._tools.cli import backend_table
from plugdist.backend import BackendBase, completed_work
from plugdist.errors import DistBackendError


def _backend(*native: str) -> type[BackendBase]:
    def hook(self, **kwargs):
        raise AssertionError("not called in these tests")
    attrs = {f"native_{op}": hook for op in native}
    return type("Partial", (BackendBase,), attrs)


def test_send_recv_alone_give_every_op() -> None:
    caps = _backend("send", "recv").static_capabilities()
    for op in OPS:
        how, _ = plan(caps, op, "cpu")
        assert how in ("native", "composed"), op


def test_all_reduce_alone_gives_reductions_and_barrier_but_not_p2p() -> None:
    caps = _backend("all_reduce").static_capabilities()
    assert plan(caps, "barrier", "cpu") == ("composed", frozenset({"all_reduce"}))
    assert plan(caps, "reduce", "cpu")[0] == "composed"
    assert plan(caps, "broadcast", "cpu")[0] == "composed"
    assert plan(caps, "reduce_scatter_tensor", "cpu")[0] == "composed"
    assert plan(caps, "gather", "cpu")[0] == "composed"   # all_reduce -> broadcast -> all_gather
    assert plan(caps, "send", "cpu")[0] == "unsupported"
    assert plan(caps, "all_to_all", "cpu")[0] == "unsupported"


def test_no_device_support_is_unsupported() -> None:
    caps = _backend("send", "recv").static_capabilities()
    assert plan(caps, "all_reduce", "cuda")[0] == "unsupported"


def test_unsupported_op_raises_naming_the_alternatives() -> None:
    cls = _backend("all_reduce")
    pg = ProcessGroup(cls(0, 2, GroupOptions(group_name="g", global_ranks=(0, 1))))
    with pytest.raises(DistBackendError) as info:
        pg.all_to_all([torch.zeros(1), torch.zeros(1)], [torch.zeros(1), torch.zeros(1)])
    msg = str(info.value)
    assert "all_to_all" in msg and "recv+send" in msg and "'g'" in msg and "rank 0" in msg


def test_info_table_marks_native_composed_unsupported() -> None:
    rows = dict(backend_table(_backend("all_reduce", "send", "recv")))
    assert rows["all_reduce"] == ["native", "-"]
    assert rows["all_gather"] == ["composed", "-"]
    assert rows["send"] == ["native", "-"]


class _GathersAsRank1Of2(BackendBase):
    """Rank 1 of 2 with all_gather alone and SUM its only reduction; the peer's all_gather
    input is ``PEER``'s entries, concatenated (a reduce_scatter composes from it)."""

    native_reduce_ops = frozenset({ReduceOp.SUM})
    PEER = [torch.tensor([2.0]), torch.tensor([3.0, 5.0])]

    def native_all_gather(self, *, output_tensors, tensor):
        output_tensors[0].copy_(torch.cat([t.reshape(-1) for t in self.PEER]))
        output_tensors[1].copy_(tensor)
        return completed_work(output_tensors)


@pytest.mark.parametrize(("op", "want"), [(ReduceOp.SUM, [7.0, 11.0]),
                                          (ReduceOp.PRODUCT, [12.0, 30.0])])
def test_uneven_reduce_scatter_composed_from_all_gather(op: ReduceOp, want: list[float]) -> None:
    """Entries of different sizes (entry r sized for rank r): this rank (1) gets the reduction
    of every rank's entry 1, through a composed all_reduce (SUM) or the gathered reduction of
    one the backend lacks (PRODUCT)."""
    pg = ProcessGroup(_GathersAsRank1Of2(1, 2, GroupOptions(group_name="g", global_ranks=(0, 1))))
    out = torch.zeros(2)
    pg.reduce_scatter(out, [torch.tensor([7.0]), torch.tensor([4.0, 6.0])], op=op).wait()
    assert out.tolist() == want
