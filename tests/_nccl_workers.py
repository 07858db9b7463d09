"""Rank bodies for tests/test_nccl.py (module level, so the harness can import them by name).
They need a GPU per rank; each makes its GPU current first (``check_device``: ``LOCAL_RANK``
modulo the GPU count)."""

from __future__ import annotations

import plugdist as dist
import torch
from plugdist.testing.checks import check_device
from torch import nn


def _gpu() -> torch.device:
    device = check_device()
    assert device is not None, "the nccl backend handles CUDA tensors only"
    return device


def stream_ordering(rank: int, ws: int) -> list[str]:
    """The seed's example: an all_reduce consumed on another stream after ``wait()`` (which must
    not block the host) and that stream's ``wait_stream``; a long kernel queued first on the
    caller's stream must be ordered before the collective."""
    dev = _gpu()
    problems = []
    side = torch.cuda.Stream(dev)
    for size in (1, 1 << 20):
        big = torch.randn(2048, 2048, device=dev)
        out = torch.full((size,), float(rank + 1), device=dev)
        big = big @ big  # keeps the GPU busy so a missing dependency would show
        out.mul_(1.0)
        work = dist.all_reduce(out, async_op=True)
        work.wait()
        with torch.cuda.stream(side):
            side.wait_stream(torch.cuda.current_stream())
            out.add_(100)
        side.synchronize()
        want = ws * (ws + 1) / 2 + 100
        if not torch.all(out == want).item():
            problems.append(f"size {size}: got {out[:3].tolist()}, want {want}")
        if not work.is_completed():
            problems.append("is_completed() False after the stream synchronized")
    # the future completes (watchdog) and chains on the GPU's result
    t = torch.ones(8, device=dev)
    fut = dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0] * 2)
    got = fut.wait()
    if not torch.equal(got.cpu(), torch.full((8,), 2.0 * ws)):
        problems.append(f"future chain: got {got.tolist()}")
    return problems


def high_priority(rank: int, ws: int) -> tuple[int, float]:
    """A group built with is_high_priority_stream runs its ops on a high-priority stream."""
    from plugdist_nccl import NCCLOptions

    dev = _gpu()
    g = dist.new_group(list(range(ws)), pg_options=NCCLOptions(is_high_priority_stream=True))
    t = torch.ones(4, device=dev)
    dist.all_reduce(t, group=g)
    # a debug wrapper, if one is installed, forwards ``stream`` to the NCCL group
    return g.stream.priority, t.sum().item()


def ddp_one_rank(rank: int, ws: int) -> list[float]:
    """DDP on CUDA: gradients equal plain single-process training (world of one)."""
    from plugdist.parallel import DistributedDataParallel

    dev = _gpu()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).to(dev)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).to(dev)
    ref.load_state_dict(model.state_dict())
    ddp = DistributedDataParallel(model, device_ids=[dev.index])
    x, y = torch.randn(32, 8, device=dev), torch.randn(32, 2, device=dev)
    nn.functional.mse_loss(ddp(x), y).backward()
    nn.functional.mse_loss(ref(x), y).backward()
    return [float((a.grad - b.grad).abs().max()) for a, b in zip(model.parameters(),
                                                                  ref.parameters())]


def blocking_wait_timeout(rank: int, ws: int) -> str:
    """NCCL_BLOCKING_WAIT: rank 1 never joins the second all_reduce; rank 0's wait raises
    DistTimeoutError within the group timeout."""
    dev = _gpu()
    t = torch.ones(4, device=dev)
    dist.all_reduce(t)  # builds the communicator on both
    torch.cuda.synchronize()
    if rank == 1:
        import time
        time.sleep(8)
        return "slept"
    try:
        dist.all_reduce(t)
    except dist.DistTimeoutError as err:
        return f"timeout: {err}"
    return "no error"
