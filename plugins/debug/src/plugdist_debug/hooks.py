"""The plugin's pluggy hook implementations (entry point ``plugdist.plugins: debug``).

Thin on purpose: each hook hands over to the module that owns the concept.
"""

from __future__ import annotations

import argparse
from typing import Any

from plugdist import DebugLevel, ProcessGroup, Store
from plugdist.hookspecs import hookimpl

from . import cli, ddp_logging
from .flight_recorder import install_signal_handler
from .verbosity import follow_debug_level
from .wrapper import DebugProcessGroup

plugin_api = (1, 0)  # written for plugdist's plugin API 1.x (checked when the plugin loads)


@hookimpl
def plugdist_wrap_process_group(group: ProcessGroup, store: Store,
                                debug_level: DebugLevel) -> ProcessGroup | None:
    """At DETAIL, wrap ``group`` in a DebugProcessGroup; below it, leave it alone."""
    follow_debug_level(debug_level)
    if DebugLevel(debug_level) is not DebugLevel.DETAIL:
        return None
    install_signal_handler()
    return DebugProcessGroup(group, store)


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
