"""``plugdist-run``: torchrun's launcher for plugdist (and torch.distributed) scripts.

    plugdist-run --standalone --nproc-per-node 4 train.py --lr 0.1
    plugdist-run --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d \\
                 --rdzv-endpoint 10.0.0.1:29400 train.py          # on each node
    plugdist-run --nnodes 1:4 --max-restarts 3 --rdzv-backend c10d --rdzv-endpoint ... train.py

Parts: :mod:`.arguments` (the command line), :mod:`.config` (what to run),
:mod:`.rendezvous` (nodes meeting, round by round, over one TCPStore), :mod:`.agent` (workers,
restarts, signals), :mod:`.logs` (console and log files), :mod:`.summary` (how it ended),
:mod:`.error_file` (``record``). See docs/launcher.md.

This package imports the standard library only (the store, when a launch needs it); it never
imports torch. ``plugdist-run`` reaches it without running ``plugdist/__init__.py`` (which
imports torch): see ``plugdist_run``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import IO

from plugdist._launch_protocol import read_error_file, record, write_error_file
from plugdist._launcher.agent import Agent, LaunchError
from plugdist._launcher.arguments import parse_args, split_argv
from plugdist._launcher.config import LaunchConfig, RendezvousOptions, Streams
from plugdist._launcher.rendezvous import Assignment, RendezvousError, free_port
from plugdist._launcher.summary import (
    PROG,
    Failure,
    LaunchResult,
    WorkerStatus,
    extract_traceback,
    format_summary,
)

__all__ = [
    "Assignment", "Failure", "LaunchConfig", "LaunchError", "LaunchResult", "RendezvousError",
    "RendezvousOptions", "Streams", "WorkerStatus", "extract_traceback", "format_summary",
    "free_port", "is_launched", "launch", "main", "parse_args", "read_error_file", "record",
    "split_argv", "write_error_file",
]

RUN_ID_VARS = ("PLUGDIST_RUN_ID", "TORCHELASTIC_RUN_ID")


def is_launched() -> bool:
    """True when this process was started by ``plugdist-run`` (or torchrun).

    The run-id variable is the proxy, as in ``torch.distributed.is_torchelastic_launched``.
    """
    return any(os.environ.get(name) is not None for name in RUN_ID_VARS)


def launch(config: LaunchConfig, *, stdout: IO[str] | None = None,
           stderr: IO[str] | None = None) -> LaunchResult:
    """Run ``config`` on this node and block until the run has ended (every round of it).

    Must be called from the main thread for signal forwarding (elsewhere, signals are left to
    the caller). Prints worker output and the failure summary to ``stdout``/``stderr``
    (default: this process's). Raises :class:`LaunchError` if a worker cannot be started;
    already started workers are stopped first.
    """
    if os.name != "posix":
        raise LaunchError(f"{PROG} needs a POSIX system (it signals process groups)")
    err = sys.stderr if stderr is None else stderr
    result = Agent(config, sys.stdout if stdout is None else stdout, err).run()
    summary = format_summary(result)
    if summary:
        from plugdist._launcher.logs import Sink
        Sink(err).text(summary)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``plugdist-run`` and ``python -m plugdist._launcher``: the exit code."""
    config = parse_args(argv)
    try:
        return launch(config).exit_code
    except LaunchError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
