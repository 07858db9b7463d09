"""Debug levels: ``TORCH_DISTRIBUTED_DEBUG`` (OFF/INFO/DETAIL), overridden by ``PLUGDIST_DEBUG``.

The level is read once on first use and may be changed at runtime; plugins observe changes
through the ``plugdist_debug_level_changed`` hook, which the registry calls as an observer of
this module (this module imports nothing of plugdist's, so the hook specs can name its enum).
DETAIL is carried out by a plugin that implements ``plugdist_wrap_backend`` (the
``plugdist-debug`` distribution).
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable

__all__ = ["DebugLevel", "get_debug_level", "set_debug_level", "set_debug_level_from_env"]


class DebugLevel(enum.IntEnum):
    OFF = 0
    INFO = 1
    DETAIL = 2


_level: DebugLevel | None = None
_observers: list[Callable[[DebugLevel], None]] = []


def _parse(value: str, source: str) -> DebugLevel:
    try:
        return DebugLevel[value.strip().upper()]
    except KeyError:
        raise ValueError(
            f"{source}={value!r} is not a debug level; use OFF, INFO or DETAIL") from None


def _from_env() -> DebugLevel:
    for var in ("PLUGDIST_DEBUG", "TORCH_DISTRIBUTED_DEBUG"):
        value = os.environ.get(var)
        if value:
            return _parse(value, var)
    return DebugLevel.OFF


def get_debug_level() -> DebugLevel:
    """The current level (from the environment on first call)."""
    global _level
    if _level is None:
        _level = _from_env()
    return _level


def set_debug_level(level: DebugLevel | str) -> None:
    """Set the level for this process; groups created afterwards follow it."""
    global _level
    _level = _parse(level, "level") if isinstance(level, str) else DebugLevel(level)
    for observer in _observers:
        observer(_level)


def observe(observer: Callable[[DebugLevel], None]) -> None:
    """Call ``observer(level)`` after every :func:`set_debug_level`, on the caller's thread."""
    _observers.append(observer)


def set_debug_level_from_env() -> None:
    """Re-read ``PLUGDIST_DEBUG`` / ``TORCH_DISTRIBUTED_DEBUG``."""
    set_debug_level(_from_env())
