"""Rank bodies for tests/test_reducer_device.py (module level, so the harness imports them)."""

from __future__ import annotations

import torch
from plugdist.parallel import DistributedDataParallel
from torch import nn


class Branchy(nn.Module):
    """``unused`` never takes part: find_unused_parameters must report it every iteration."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.unused = nn.Linear(6, 6), nn.Linear(6, 2), nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class Plain(Branchy):
    """Every parameter takes part."""

    def __init__(self) -> None:
        super().__init__()
        del self.unused


def bookkeeping_on_the_parameters_device(rank: int, ws: int) -> list[str]:
    """Trains with find_unused_parameters, static_graph and plain DDP while torch's default
    device is ``meta``: a tensor the reducer creates without naming the parameters' device lands
    on ``meta`` and the backend refuses it, so only allocations that follow the parameters pass.
    Returns the problems seen (an empty list on success)."""
    problems = []
    # (flag, model, whether buckets are regrouped: not with find_unused_parameters, as in torch)
    for kwargs, factory, rebuilds in (({"find_unused_parameters": True}, Branchy, False),
                                      ({"static_graph": True}, Branchy, True),
                                      ({}, Plain, True)):
        torch.manual_seed(0)
        model = factory()
        ddp = DistributedDataParallel(model, **kwargs)
        grads = []
        try:
            for step in range(3):
                g = torch.Generator().manual_seed(100 + step * ws + rank)
                x = torch.randn(8, 6, generator=g, device="cpu")
                y = torch.randn(8, 2, generator=g, device="cpu")
                ddp.zero_grad(set_to_none=True)
                torch.set_default_device("meta")
                try:
                    nn.functional.mse_loss(ddp(x), y).backward()
                finally:
                    torch.set_default_device(None)
            grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        except Exception as exc:  # noqa: BLE001 - reported to the test
            problems.append(f"{kwargs}: {type(exc).__name__}: {exc}"[:600])
            continue
        if rebuilds and not ddp.reducer.has_rebuilt_buckets:
            problems.append(f"{kwargs}: the bucket-rebuild agreement never ran")
        if len(grads) != 4:
            problems.append(f"{kwargs}: {len(grads)} gradients, want 4 (an unused layer has none)")
        if any(g.device.type != "cpu" for g in grads):
            problems.append(f"{kwargs}: gradients left the parameters' device")
    return problems
