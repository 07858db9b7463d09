"""The composition planner: which ops a backend gets from which primitives, and clear errors."""

import pytest
import torch
from plugdist import GroupOptions, ProcessGroup
from plugdist._group.composition import plan
from plugdist._group.process_group import OPS
from plugdist._tools.cli import backend_table
from plugdist.backend import BackendBase
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
