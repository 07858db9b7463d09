"""Structured logging: one event per line, bound to rank and group, quiet by default.

``get_logger(**bound)`` returns a structlog logger. Nothing is printed below WARNING unless
``PLUGDIST_LOG_LEVEL`` (DEBUG/INFO/WARNING/ERROR) or a plugin (plugdist-debug, at debug level
INFO and above, through ``set_log_level``) asks for more. Events go to stderr so they never mix
with a training script's stdout.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

import structlog

__all__ = ["get_logger", "set_log_level"]

_configured = False
_lock = threading.Lock()
_LEVELS = {"DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING,
           "ERROR": logging.ERROR}


def _configure(level: int) -> None:
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
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
