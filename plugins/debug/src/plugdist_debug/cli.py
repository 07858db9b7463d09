"""The ``plugdist debug`` command group (added to ``plugdist`` through a hook)."""

from __future__ import annotations

import argparse
import sys

from .analyze import run

__all__ = ["add_commands"]


def _analyze(args: argparse.Namespace) -> int:
    text, code = run(args.dir, as_json=args.json)
    (sys.stdout if code != 2 else sys.stderr).write(text + "\n")
    return code


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    """``plugdist debug analyze DIR [--json]``."""
    debug = subparsers.add_parser("debug", help="TORCH_DISTRIBUTED_DEBUG tools (plugdist-debug)")
    debug.set_defaults(func=lambda _args: (debug.print_help(), 2)[1])
    sub = debug.add_subparsers(dest="debug_command", metavar="COMMAND")
    analyze = sub.add_parser(
        "analyze", help="read every rank's flight-recorder dump and say where the ranks diverge",
        description="Read rank_*.json flight-recorder dumps and report, per group, the first "
                    "mismatching collective, ranks that are behind, collectives that never "
                    "completed and ones that failed. Exit code: 0 nothing found, 1 divergence "
                    "found, 2 no readable dumps.")
    analyze.add_argument("dir", help="the dump directory (PLUGDIST_FLIGHT_RECORDER_DIR)")
    analyze.add_argument("--json", action="store_true", help="print the findings as JSON")
    analyze.set_defaults(func=_analyze)
