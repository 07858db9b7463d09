"""Hook specifications for ``plugdist.plugins`` (pluggy). Each docstring is the contract.

Hooks are always called with keyword arguments, so a spec can grow new arguments without
breaking plugins that do not take them. A plugin module listed under the ``plugdist.plugins``
entry-point group is registered the first time the core needs its plugins.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    import argparse

    from plugdist._backend.base import BackendBase
    from plugdist._debug_level import DebugLevel
    from plugdist._group.process_group import ProcessGroup
    from plugdist.store.api import Store

PROJECT = "plugdist"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

__all__ = ["hookspec", "hookimpl", "PROJECT"]


@hookspec
def plugdist_wrap_backend(backend: BackendBase, store: Store,
                          debug_level: DebugLevel) -> BackendBase | None:
    """Return a backend that wraps ``backend`` (a ``plugdist.backend.BackendWrapper`` around
    it: it forwards every hook and attribute), or None to leave it.

    Called on every member rank for each backend of every group (one per device type), after
    the backend exists and before the ProcessGroup over it is used. Wrappers chain: each plugin
    receives the backend returned by the one before. ``store`` is a store private to this
    group and backend (for side channels independent of the backend). A wrapper that overrides
    ``wrap_op`` sees every public op of the group (plugin API 2.0; it replaced
    ``plugdist_wrap_process_group``).
    """


@hookspec
def plugdist_group_created(group: ProcessGroup, global_ranks: tuple[int, ...],
                           backend: str) -> None:
    """Observe a new group (after wrapping). Must not run collectives."""


@hookspec
def plugdist_group_destroyed(group: ProcessGroup) -> None:
    """Observe a group being destroyed, before its backend is shut down."""


@hookspec
def plugdist_debug_level_changed(level: DebugLevel) -> None:
    """Observe a change of the debug level (from the environment or ``set_debug_level``)."""


@hookspec
def plugdist_ddp_constructed(module: Any, logging_data: dict[str, Any]) -> None:
    """Observe a DistributedDataParallel model after construction, with its logging data."""


@hookspec
def plugdist_ddp_iteration(module: Any, iteration: int, stats: dict[str, Any]) -> None:
    """Observe one DDP iteration's runtime statistics (times in ns) after backward finished."""


@hookspec
def plugdist_add_cli_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add subcommands to the ``plugdist`` command line (e.g. ``plugdist debug analyze``).
    A subparser must set ``func`` (``set_defaults(func=...)``) taking the parsed args and
    returning an exit code."""
