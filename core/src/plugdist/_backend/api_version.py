"""The plugin API's version, and what a plugin written for the previous one changes.

Standard library only, so the registry reads it without importing torch (plugdist-run's
launcher uses the registry with no torch loaded).
"""

from __future__ import annotations

__all__ = ["PLUGIN_API", "MIGRATION"]

PLUGIN_API: tuple[int, int] = (2, 0)

# what a backend written for plugin API 1 changes to run on plugin API 2 (the core's refusals
# of such a backend say it)
MIGRATION = (
    "subclass plugdist.backend.BackendBase instead of ProcessGroup (from plugdist.backend import "
    "BackendBase); keep the native_* hooks, the class attributes, __init__(store, rank, size, "
    "options) and its super().__init__(rank, size, options) as they are; declare plugin_api = "
    "(2, 0). A wrapper subclasses plugdist.backend.BackendWrapper and is returned by the "
    "plugdist_wrap_backend hook (docs/backends.md, 'Plugin API 2: what to change')")
