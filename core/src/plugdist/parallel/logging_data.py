"""DDP logging data: what a model was built with, and how its iterations spent their time.

One :class:`DDPLogger` per DistributedDataParallel model. The reducer stamps the phases of each
iteration with ``time.perf_counter_ns``; at the end of every synchronised backward the logger
folds them into running averages and calls the ``plugdist_ddp_iteration`` pluggy hook. All
times are in nanoseconds. Not thread-safe on its own: the reducer calls it under its lock.
"""

from __future__ import annotations

import os
import time
import weakref
from typing import Any

from plugdist._debug_level import get_debug_level

__all__ = ["DDPLogger"]

_PHASES = ("forward_compute_time", "backward_compute_time", "backward_comm_time",
           "backward_compute_comm_overlap_time")


class DDPLogger:
    """Construction-time fields plus per-iteration runtime statistics of one DDP model."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {}
        self._owner: weakref.ReferenceType[Any] | None = None
        self._totals = dict.fromkeys(_PHASES, 0)
        self.iteration = 0
        self._forward_start = self._forward_end = 0
        self._backward_start = self._backward_compute_end = 0
        self._comm_start = self._comm_end = 0

    # -- construction -------------------------------------------------------------------------
    def set_construction_data(self, owner: Any, **fields: Any) -> None:
        """Record the model's configuration (called once by DDP after building its reducer)."""
        self._owner = weakref.ref(owner)
        self.data.update(fields)
        self.data.setdefault("master_addr", os.environ.get("MASTER_ADDR", "N/A"))
        self.data.setdefault("master_port", os.environ.get("MASTER_PORT", "N/A"))
        self.data["torch_distributed_debug"] = get_debug_level().name
        self.data["iteration"] = 0
        self.data["has_rebuilt_buckets"] = 0
        self.data["comm_hook"] = ""
        self.data["unused_parameter_size"] = 0
        for phase in _PHASES:
            self.data["avg_" + phase] = 0

    # -- runtime stamps (reducer side) -----------------------------------------------------------
    def forward_start(self) -> None:
        self._forward_start = time.perf_counter_ns()

    def forward_end(self) -> None:
        self._forward_end = time.perf_counter_ns()

    def backward_start(self) -> None:
        self._backward_start = time.perf_counter_ns()
        self._backward_compute_end = self._comm_start = self._comm_end = 0

    def comm_start(self) -> None:
        if not self._comm_start:
            self._comm_start = time.perf_counter_ns()

    def backward_compute_end(self) -> None:
        self._backward_compute_end = time.perf_counter_ns()

    def comm_end(self) -> dict[str, Any]:
        """Close the iteration: fold its times into the averages, notify plugins, return stats."""
        self._comm_end = time.perf_counter_ns()
        self.iteration += 1
        compute_end = self._backward_compute_end or self._comm_end
        comm_start = self._comm_start or compute_end
        times = {
            "forward_compute_time": max(0, self._forward_end - self._forward_start),
            "backward_compute_time": max(0, compute_end - self._backward_start),
            "backward_comm_time": max(0, self._comm_end - comm_start),
            "backward_compute_comm_overlap_time": max(0, compute_end - comm_start),
        }
        for phase, value in times.items():
            self._totals[phase] += value
            self.data["avg_" + phase] = self._totals[phase] // self.iteration
        self.data["iteration"] = self.iteration
        stats = {**times, **{"avg_" + p: self.data["avg_" + p] for p in _PHASES},
                 "iteration": self.iteration}
        self._notify(stats)
        return stats

    def _notify(self, stats: dict[str, Any]) -> None:
        owner = self._owner() if self._owner is not None else None
        if owner is None:
            return
        from plugdist._registry import registry  # late: keeps importing plugdist.parallel light

        hook = registry.plugins().hook.plugdist_ddp_iteration
        if hook.get_hookimpls():
            hook(module=owner, iteration=self.iteration, stats=stats)

    # -- queries -------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """A copy of every field, construction-time and runtime."""
        return dict(self.data)
