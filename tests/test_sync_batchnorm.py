"""plugdist.nn.SyncBatchNorm: on real worlds against torch's BatchNorm on the whole batch, and
in this process for what needs no world (conversion, errors, the no-world fallback).

Each world (Gloo with 2 and 3 ranks, MPI under mpiexec with 2 and 3) runs every check of
tests/_sync_batchnorm_workers.py once on its default group; Gloo's 3-rank world runs them again
on a group of the toy send/recv-only backend (whose collectives the core composes). Each test
below asserts that one check passed on every rank.
"""

from __future__ import annotations

import copy

import _sync_batchnorm_workers as workers
import plugdist
import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from plugdist import Capabilities
from plugdist.nn import SyncBatchNorm
from plugdist.nn.sync_batchnorm import _comm_device, adopt_torch_sync_batchnorms
from plugdist.testing import run_world
from plugdist.testing.harness import WorldError
from torch import nn

WORLD_TIMEOUT = 180
# (backend, ranks, backends of further groups the same world runs the suite on)
WORLDS = [(b, n, also) for b, n, also in (("gloo", 2, ()), ("gloo", 3, ("toy",)), ("mpi", 2, ()),
                                           ("mpi", 3, ()))
          if plugdist.is_backend_available(b)]
# what each test reads: (world, result key prefix); the toy backend's run shares Gloo's world
RUNS = [(w, "") for w in WORLDS] + [(w, f"{b}/") for w in WORLDS for b in w[2]
                                    if plugdist.is_backend_available(b)]
_worlds: dict[tuple, list[dict] | WorldError] = {}


def world_results(world: tuple) -> list[dict]:
    """Start each world once for the whole module (a fixture per run would start Gloo's
    3-rank world twice); a world that failed fails every test that reads it, without
    starting it again."""
    if world not in _worlds:
        backend, size, also = world
        also = tuple(b for b in also if plugdist.is_backend_available(b))
        try:
            _worlds[world] = run_world(workers.run_suite, size, backend=backend, args=(also,),
                                       timeout=WORLD_TIMEOUT, group_timeout=30)
        except WorldError as err:
            _worlds[world] = err
    found = _worlds[world]
    if isinstance(found, WorldError):
        raise found
    return found


@pytest.mark.timeout(WORLD_TIMEOUT + 60)
@pytest.mark.parametrize("check", list(workers.SUITE))
@pytest.mark.parametrize("run", RUNS, ids=lambda r: f"{r[1] or r[0][0] + '/'}{r[0][1]}ranks")
def test_world(run: tuple, check: str) -> None:
    world, prefix = run
    results = world_results(world)
    assert len(results) == world[1]
    key = prefix + check
    missing = [rank for rank, r in enumerate(results) if key not in r]
    assert not missing, f"{key} did not run on ranks {missing}"
    failures = {rank: r[key] for rank, r in enumerate(results) if r[key]}
    assert not failures, "\n".join(f"--- rank {rank}:\n{text}" for rank, text in failures.items())


@pytest.mark.timeout(90)
def test_a_rank_that_leaves_gives_an_error_not_a_hang() -> None:
    results = run_world(workers.abandon, 2, backend="gloo", timeout=60, group_timeout=5)
    assert results[1] is None
    backward, forward = results[0]
    for text, phase in ((backward, "backward"), (forward, "forward")):
        assert text.startswith("Dist"), text
        assert f"the {phase} pass's collective failed" in text and "rank 0" in text, text
        assert "SyncBatchNorm" in text and "same order" in text, text


# -- in this process: no world ---------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norms = nn.ModuleDict({"a": nn.BatchNorm1d(4, affine=False),
                                    "b": nn.BatchNorm1d(4, track_running_stats=False)})
        self.inorm = nn.InstanceNorm2d(3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norms["b"](self.norms["a"](x))


def nested() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm2d(3), nn.Sequential(nn.BatchNorm3d(2, momentum=None),
                                                           nn.BatchNorm2d(5, bias=False)),
                          Block(), nn.SyncBatchNorm(6, eps=1e-3))
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(0.5, 1.5)
        model[0].running_mean.fill_(0.25)
        model[0].num_batches_tracked.fill_(7)
    model[1].eval()
    return model


BN_ATTRS = ("num_features", "eps", "momentum", "affine", "track_running_stats", "training")


@pytest.mark.timeout(30)
def test_convert_round_trip_on_a_nested_model() -> None:
    model = nested()
    before = {name: m for name, m in model.named_modules()
              if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    tensors = {name: t for name, t in [*model.named_parameters(), *model.named_buffers()]}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    converted = SyncBatchNorm.convert_sync_batchnorm(model)

    assert converted is model
    after = dict(converted.named_modules())
    assert len(before) == 6
    for name, old in before.items():
        new = after[name]
        assert type(new) is SyncBatchNorm and new is not old, name
        assert new.process_group is None
        for attr in BN_ATTRS:
            assert getattr(new, attr) == getattr(old, attr), (name, attr)
        assert (new.bias is None) == (old.bias is None)
    assert type(after["2.inorm"]) is nn.InstanceNorm2d
    # the very same tensors, so an optimizer built before the conversion still trains it
    for name, t in [*converted.named_parameters(), *converted.named_buffers()]:
        assert t is tensors[name], name
    assert converted.state_dict().keys() == state.keys()

    # and back: a BatchNorm model loads the converted model's state, and vice versa
    plain = nested()
    plain.load_state_dict(converted.state_dict())
    for k, v in plain.state_dict().items():
        assert torch.equal(v, state[k]), k
    again = SyncBatchNorm.convert_sync_batchnorm(nested(), plugdist.GroupMember.NON_GROUP_MEMBER)
    again.load_state_dict(plain.state_dict())
    assert again[0].process_group is plugdist.GroupMember.NON_GROUP_MEMBER
    copied = copy.deepcopy(again)  # copies share the group: here the non-member marker
    assert copied[0].process_group is plugdist.GroupMember.NON_GROUP_MEMBER
    assert copied[0].weight is not again[0].weight
    assert torch.equal(copied[0].weight, again[0].weight)

    root = nn.BatchNorm1d(3)
    new_root = SyncBatchNorm.convert_sync_batchnorm(root)
    assert type(new_root) is SyncBatchNorm and new_root.weight is root.weight


@pytest.mark.timeout(30)
@pytest.mark.parametrize("momentum", [0.1, None])
def test_without_a_world_it_is_batch_norm(momentum: float | None) -> None:
    """No init_process_group: exactly torch's BatchNorm, bit for bit."""
    assert not plugdist.is_initialized()
    torch.manual_seed(0)
    ref = nn.BatchNorm2d(4, momentum=momentum)
    sync = SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm2d(4, momentum=momentum))
    sync.load_state_dict(ref.state_dict())
    for step in range(3):
        x = (torch.randn(5, 4, 3, 3) * 2 + 1).contiguous(memory_format=torch.channels_last)
        xs = [x.clone().requires_grad_() for _ in range(2)]
        outs = [m(t) for m, t in zip((ref, sync), xs, strict=True)]
        for out in outs:
            (out * torch.arange(out.numel()).view_as(out)).sum().backward()
        assert torch.equal(outs[0], outs[1]) and torch.equal(xs[0].grad, xs[1].grad), step
        assert outs[1].is_contiguous(memory_format=torch.channels_last)
    for (k, a), b in zip(ref.state_dict().items(), sync.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), k
    assert torch.equal(ref.weight.grad, sync.weight.grad)
    ref.eval()
    sync.eval()
    x = torch.randn(2, 4, 3, 3)
    assert torch.equal(ref(x), sync(x))


@pytest.mark.timeout(30)
def test_bad_input_names_the_fix() -> None:
    bn = SyncBatchNorm(3)
    with pytest.raises(ValueError, match=r"at least 2 dimensions.*1-D.*unsqueeze\(0\)"):
        bn(torch.randn(3))
    with pytest.raises(ValueError, match=r"expected 3 channels.*num_features=4.*movedim"):
        bn(torch.randn(2, 4, 5))
    with pytest.raises(TypeError, match=r"floating-point input.*int64.*input.float\(\)"):
        bn(torch.ones(2, 3, dtype=torch.int64))
    with pytest.raises(TypeError,
                       match=r"process_group must be a plugdist group.*plugdist.new_group"):
        SyncBatchNorm(3, process_group="world")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"process_group must be a plugdist group"):
        SyncBatchNorm.convert_sync_batchnorm(nn.BatchNorm1d(3), process_group=object())
    with pytest.raises(ValueError, match=r"LazyBatchNorm1d.*run one forward pass first"):
        SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.LazyBatchNorm1d()))


@pytest.mark.timeout(30)
def test_adopting_torch_sync_batchnorm_keeps_the_layer() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.SyncBatchNorm(4),
                          nn.Sequential(nn.Linear(4, 4), nn.SyncBatchNorm(4, momentum=None)))
    layers = [model[1], model[2][1]]
    tensors = [t for m in layers for t in (*m.parameters(), *m.buffers())]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert adopt_torch_sync_batchnorms(model, "[here]") == ["1", "2.1"]
    for name, layer in zip(("1", "2.1"), layers, strict=True):
        assert model.get_submodule(name) is layer
        assert isinstance(layer, SyncBatchNorm) and isinstance(layer, nn.SyncBatchNorm)
    assert [t for m in layers for t in (*m.parameters(), *m.buffers())] == tensors
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    # torch's SyncBatchNorm refuses CPU tensors once torch.distributed is initialized; the
    # adopted one normalizes them (here, with no world, as BatchNorm1d does)
    x = torch.randn(6, 3)
    ref = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Sequential(
        nn.Linear(4, 4), nn.BatchNorm1d(4, momentum=None)))
    ref.load_state_dict(state)
    assert torch.equal(model(x), ref(x))
    assert adopt_torch_sync_batchnorms(model, "[here]") == []

    # one layer it cannot adopt: none is changed
    mixed = nn.Sequential(nn.SyncBatchNorm(2), nn.SyncBatchNorm(2, process_group=object()))
    with pytest.raises(TypeError, match=r"\[here\] layer '1'.*not a plugdist group.*"
                                        r"convert_sync_batchnorm"):
        adopt_torch_sync_batchnorms(mixed, "[here]")
    assert type(mixed[0]) is nn.SyncBatchNorm


@pytest.mark.timeout(30)
def test_untracked_eval_uses_the_batch() -> None:
    sync = SyncBatchNorm(2, track_running_stats=False).eval()
    x = torch.randn(4, 2, 3)
    assert torch.equal(sync(x), F.batch_norm(x, None, None, sync.weight, sync.bias, True, 0.0,
                                             sync.eps))


class _GroupOn:
    """Only what ``_comm_device`` reads of a group: its backend's device types."""

    def __init__(self, *device_types: str) -> None:
        self.caps = Capabilities(native=frozenset(), device_types=device_types)

    def capabilities(self) -> Capabilities:
        return self.caps


@pytest.mark.timeout(30)
def test_statistics_travel_on_a_device_the_backend_handles() -> None:
    cpu, meta = torch.device("cpu"), torch.device("meta")
    assert _comm_device(_GroupOn("cpu"), cpu) == cpu
    assert _comm_device(_GroupOn("cpu"), meta) == cpu  # e.g. CUDA statistics over Gloo or MPI
    assert _comm_device(_GroupOn("cpu", "meta"), meta) == meta
    if torch.cuda.is_available():  # CPU statistics over NCCL go to the current GPU
        want = torch.device("cuda", torch.cuda.current_device())
        assert _comm_device(_GroupOn("cuda"), cpu) == want
