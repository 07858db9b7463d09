"""DDP logging through structlog, one event a line, each with rank and group.

* INFO and DETAIL: ``ddp_constructed`` once per DistributedDataParallel model, with its
  construction data (bucket cap and sizes, parameter dtypes, find_unused_parameters, world size,
  backend, ...).
* DETAIL: ``ddp_runtime_stats`` every ``PLUGDIST_DDP_LOG_EVERY`` iterations (default 100) with
  forward compute, backward compute, backward communication and their overlap, in ns (this
  iteration's and the running averages).

Unused-parameter errors naming the parameters come from the core's reducer at INFO and DETAIL.
Called from the plugin's hooks on the training thread.
"""

from __future__ import annotations

from typing import Any

from plugdist import DebugLevel, get_debug_level
from plugdist.backend import get_logger

from ._env import env_int
from .verbosity import follow_debug_level

__all__ = ["log_construction", "log_iteration", "EVERY_ENV"]

EVERY_ENV = "PLUGDIST_DDP_LOG_EVERY"
DEFAULT_EVERY = 100


def _every() -> int:
    return env_int(EVERY_ENV, DEFAULT_EVERY, 1, "a number of iterations")


def _logger(module: Any, rank: Any = None) -> Any:
    pg = getattr(module, "process_group", None)
    group = getattr(pg, "group_name", None)
    if rank is None:
        rank = pg.rank() if pg is not None else None
    return get_logger(rank=rank, group=group)


def log_construction(module: Any, logging_data: dict[str, Any]) -> None:
    """At INFO and DETAIL, log the model's construction data as one ``ddp_constructed`` event."""
    level = get_debug_level()
    if level < DebugLevel.INFO:
        return
    follow_debug_level(level)
    fields = {k: v for k, v in logging_data.items() if k not in ("event", "group")}
    _logger(module, fields.pop("rank", None)).info("ddp_constructed", **fields)


def log_iteration(module: Any, iteration: int, stats: dict[str, Any]) -> None:
    """At DETAIL, every N-th iteration, log its runtime statistics as ``ddp_runtime_stats``."""
    level = get_debug_level()
    if level < DebugLevel.DETAIL or iteration % _every():
        return
    follow_debug_level(level)
    fields = {k: v for k, v in stats.items() if k not in ("event", "rank", "group", "iteration")}
    _logger(module).info("ddp_runtime_stats", iteration=iteration, unit="ns", **fields)
