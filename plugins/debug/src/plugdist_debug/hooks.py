"""The plugin's pluggy hook implementations (entry point ``plugdist.plugins: debug``).

Thin on purpose: each hook hands over to the module that owns the concept.
"""

from __future__ import annotations

import argparse
from typing import Any

from plugdist import DebugLevel, Store
from plugdist.backend import BackendBase
from plugdist.hookspecs import hookimpl

from . import cli, ddp_logging
from .flight_recorder import install_signal_handler
from .verbosity import follow_debug_level
from .wrapper import DebugBackend

plugin_api = (2, 0)  # written for plugdist's plugin API 2.x (checked when the plugin loads)


@hookimpl
def plugdist_wrap_backend(backend: BackendBase, store: Store,
                          debug_level: DebugLevel) -> BackendBase | None:
    """At DETAIL, wrap ``backend`` in a DebugBackend; below it, leave it alone."""
    follow_debug_level(debug_level)
    if DebugLevel(debug_level) is not DebugLevel.DETAIL:
        return None
    install_signal_handler()
    return DebugBackend(backend, store)


@hookimpl
def plugdist_debug_level_changed(level: DebugLevel) -> None:
    follow_debug_level(level)


@hookimpl
def plugdist_ddp_constructed(module: Any, logging_data: dict[str, Any]) -> None:
    ddp_logging.log_construction(module, logging_data)


@hookimpl
def plugdist_ddp_iteration(module: Any, iteration: int, stats: dict[str, Any]) -> None:
    ddp_logging.log_iteration(module, iteration, stats)


@hookimpl
def plugdist_add_cli_commands(subparsers: argparse._SubParsersAction) -> None:
    cli.add_commands(subparsers)
