"""Structured logging: one event per line, bound to rank and group, quiet by default.

``get_logger(**bound)`` returns a structlog logger. Nothing is printed below WARNING unless
``PLUGDIST_LOG_LEVEL`` (DEBUG/INFO/WARNING/ERROR) or a plugin (plugdist-debug, at debug level
INFO and above, through ``set_log_level``) asks for more. Events go to stderr so they never mix
with a training script's stdout: ``key=value`` pairs, or one JSON object a line with
``PLUGDIST_LOG_FORMAT=json``.

:func:`lifecycle` emits the lifecycle events (group built, destroyed; op timed out or failed),
each with the global ``rank``, ``group``, ``group_rank`` and ``backend``.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

import structlog

__all__ = ["get_logger", "set_log_level", "lifecycle", "set_global_rank", "FORMAT_ENV"]

FORMAT_ENV = "PLUGDIST_LOG_FORMAT"

_configured = False
_lock = threading.Lock()
_LEVELS = {"DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING,
           "ERROR": logging.ERROR}


def _configure(level: int) -> None:
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.JSONRenderer(default=str)
            if os.environ.get(FORMAT_ENV, "").strip().lower() == "json" else
            structlog.processors.KeyValueRenderer(
                key_order=["timestamp", "level", "event", "rank", "group"], drop_missing=True),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def set_log_level(name: str) -> None:
    """Set the lowest level printed (DEBUG, INFO, WARNING, ERROR). Thread-safe."""
    global _configured
    level = _LEVELS.get(name.upper())
    if level is None:
        raise ValueError(f"unknown log level {name!r}; choose one of {sorted(_LEVELS)}")
    with _lock:
        _configure(level)
        _configured = True


def get_logger(**bound: Any) -> Any:
    """A structlog logger with ``bound`` (e.g. rank=0, group='world') on every event."""
    global _configured
    if not _configured:
        with _lock:
            if not _configured:
                _configure(_LEVELS.get(os.environ.get("PLUGDIST_LOG_LEVEL", "WARNING").upper(),
                                       logging.WARNING))
                _configured = True
    return structlog.get_logger("plugdist").bind(**bound)


_global_rank: int | None = None


def set_global_rank(rank: int) -> None:
    """This process's rank in the world, for :func:`lifecycle` events."""
    global _global_rank
    _global_rank = rank


def lifecycle(event: str, *, group: str, group_rank: int, backend: str,
              level: str = "info", **fields: Any) -> None:
    """One lifecycle event (``group_built``, ``group_destroyed``, ``op_timeout``, ``op_failed``,
    ...) with rank (global, when known), group, group rank and backend. Never raises."""
    try:
        log = get_logger(rank=_global_rank if _global_rank is not None else group_rank,
                         group=group)
        getattr(log, level)(event, group_rank=group_rank, backend=backend, **fields)
    except Exception:  # noqa: BLE001, S110 - a log line must not break the op it reports
        pass
