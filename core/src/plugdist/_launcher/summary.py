"""What a launch ended with: per-worker status, the run's result, and the failure summary."""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from plugdist._launcher.config import LaunchConfig

__all__ = ["Failure", "LaunchResult", "WorkerStatus", "exit_code_of", "extract_traceback",
           "format_summary", "signal_name"]

PROG = "plugdist-run"
_TB_HEAD = "Traceback (most recent call last):"
_TB_CHAIN = (
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause of the following exception:",
)


def exit_code_of(returncode: int | None) -> int:
    """Shell-style code: the exit status, or 128+signal (1 when unknown)."""
    if returncode is None:
        return 1
    return returncode if returncode >= 0 else 128 - returncode


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_returncode(rc: int | None) -> str:
    if rc is None:
        return "did not exit"
    if rc >= 0:
        return f"exit code {rc}"
    return f"killed by {signal_name(-rc)} (signal {-rc})"


@dataclass(frozen=True)
class WorkerStatus:
    """How one worker ended. ``returncode`` < 0 means killed by that signal number."""

    rank: int
    local_rank: int
    pid: int
    returncode: int | None
    failed: bool                  # failed on its own (not stopped by the launcher)
    stopped: bool                 # still running when the launcher began stopping workers
    stderr_tail: tuple[str, ...] = ()
    error_file: str | None = None
    error_message: str = ""
    error_traceback: tuple[str, ...] = ()
    replaced: bool = False        # --replace-failed started another worker in its place
    left_behind: bool = False     # died; with resilient groups the others went on without it

    @property
    def exit_code(self) -> int:
        return exit_code_of(self.returncode)

    def describe(self) -> str:
        return describe_returncode(self.returncode)

    def traceback(self) -> list[str]:
        """The error file's traceback if the worker wrote one, else the one on its stderr."""
        return list(self.error_traceback) or extract_traceback(self.stderr_tail)

    def cause(self) -> str:
        """How it ended, with the exception it raised when it raised one: a worker that raised
        and was then stopped reads "killed by SIGTERM (signal 15) while raising X: ..."."""
        tb = self.traceback()
        raised = next((line.strip() for line in reversed(tb) if line.strip()), "") if tb \
            else self.error_message
        if not raised:
            return self.describe()
        raised = raised if len(raised) <= 300 else raised[:297] + "..."
        if self.returncode is not None and self.returncode < 0:
            return f"{self.describe()} while raising {raised}"
        return f"{self.describe()}: {raised}"


@dataclass(frozen=True)
class Failure:
    """The first worker failure of a round, as every node learns it through the store."""

    rank: int
    local_rank: int
    node_rank: int
    host: str
    pid: int
    returncode: int | None
    attempt: int
    traceback: tuple[str, ...] = ()
    message: str = ""
    error_file: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "traceback": list(self.traceback)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Failure:
        return cls(**{**d, "traceback": tuple(d.get("traceback") or ())})

    def headline(self) -> str:
        return (f"rank {self.rank} (local rank {self.local_rank}, pid {self.pid}) on node "
                f"{self.node_rank} ({self.host}), attempt {self.attempt}: "
                f"{describe_returncode(self.returncode)}")


@dataclass(frozen=True)
class LaunchResult:
    """Outcome of :func:`launch`; ``exit_code`` is what ``plugdist-run`` exits with.

    ``workers`` are this node's workers of the last attempt; ``first_failure`` the run's first
    failure in its last failed round (on any node); ``reason`` why the run ended without one
    (a lost node, a rendezvous timeout)."""

    config: LaunchConfig
    exit_code: int
    workers: tuple[WorkerStatus, ...]
    received_signal: int | None = None
    leftovers: tuple[int, ...] = field(default=())   # ranks whose groups outlived them
    first_failure: Failure | None = None
    restarts: int = 0
    replacements: int = 0         # workers started by --replace-failed (--max-restarts counts both)
    node_rank: int = 0
    nnodes: int = 1
    reason: str = ""

    @property
    def failures(self) -> list[WorkerStatus]:
        """Workers whose failure ended the run: not replaced (--replace-failed), not left
        behind by resilient survivors."""
        return [w for w in self.workers if w.failed and not w.replaced and not w.left_behind]


def extract_traceback(lines: Sequence[str]) -> list[str]:
    """The last Python traceback in ``lines`` (with its chained causes), up to the end.

    Returns [] when there is none.
    """
    def head_before(end: int) -> int | None:
        for i in range(end - 1, -1, -1):
            if lines[i].rstrip().endswith(_TB_HEAD):
                return i
        return None

    start = head_before(len(lines))
    if start is None:
        return []
    while True:
        j = start - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        if j < 0 or lines[j].strip() not in _TB_CHAIN:
            break
        earlier = head_before(j)
        if earlier is None:
            break
        start = earlier
    return list(lines[start:])


def _clip(lines: list[str], head: int = 12, tail: int = 8) -> list[str]:
    if len(lines) <= head + tail + 1:
        return lines
    return [*lines[:head], f"... ({len(lines) - head - tail} lines omitted)", *lines[-tail:]]


def _worker_lines(w: WorkerStatus) -> list[str]:
    out = []
    if w.error_file and (w.error_message or w.error_traceback):
        out.append(f"    error file: {w.error_file}")
    tb = w.traceback()
    if tb:
        out.extend("    " + line for line in _clip(tb))
    elif w.error_message:
        out.append("    " + w.error_message)
    elif w.stderr_tail:
        out.append("    last stderr lines:")
        out.extend("    " + line for line in w.stderr_tail[-5:])
    else:
        out.append("    (no stderr output)")
    return out


def format_summary(result: LaunchResult) -> str:
    """The failure summary printed to stderr; '' when the run succeeded."""
    cfg = result.config
    where = f"run id {cfg.run_id}, node {result.node_rank} of {result.nnodes}"
    if cfg.max_restarts:
        used = result.restarts + result.replacements
        where += f", {used} of {cfg.max_restarts} {cfg.budget_words()} used"
    out: list[str] = []
    if result.received_signal is not None:
        done = ("forwarded it to the workers" if result.workers
                else "stopped waiting for the other nodes")
        out.append(f"{PROG}: received {signal_name(result.received_signal)}; {done} ({where})")
    failures = result.failures
    first = result.first_failure
    if first is not None and (not failures or first.node_rank != result.node_rank
                              or first.rank not in {w.rank for w in failures}):
        out.append(f"{PROG}: the run failed; first failure: {first.headline()}")
        if first.error_file:
            out.append(f"    error file (on {first.host}): {first.error_file}")
        if first.traceback:
            out.extend("    " + line for line in _clip(list(first.traceback)))
        elif first.message:
            out.append("    " + first.message)
    replaced = [w for w in result.workers if w.failed and w.replaced]
    if replaced:
        out.append(f"{PROG}: {len(replaced)} worker(s) died and were replaced while the others "
                   f"went on ({where}):")
        out.extend(f"  rank {w.rank} (local rank {w.local_rank}, pid {w.pid}): {w.cause()}"
                   for w in replaced)
    behind = [w for w in result.workers if w.left_behind]
    if behind:
        out.append(f"{PROG}: {len(behind)} worker(s) died and the others went on without them "
                   f"(resilient groups; {where}):")
        out.extend(f"  rank {w.rank} (local rank {w.local_rank}, pid {w.pid}): {w.cause()}"
                   for w in behind)
    if failures:
        out.append(f"{PROG}: {len(failures)} of {len(result.workers)} workers failed ({where})")
        ordered = sorted(failures, key=lambda w: (first is None or w.rank != first.rank, w.rank))
        for w in ordered:
            tag = "first failure: " if first is not None and w.rank == first.rank else ""
            how = w.cause() if w.returncode is not None and w.returncode >= 0 else w.describe()
            out.append(f"  {tag}rank {w.rank} (local rank {w.local_rank}, pid {w.pid}): {how}")
            out.extend(_worker_lines(w))
    if result.reason:
        out.append(f"{PROG}: {result.reason} ({where})")
    stopped = [w for w in result.workers if w.stopped and not w.failed]
    # a worker that exited with an error code while being stopped had failed on its own
    erred = [w for w in stopped if w.returncode is not None and w.returncode > 0]
    stopped = [w for w in stopped if w not in erred]
    if erred and out:
        out.append("  also failed meanwhile: " + "; ".join(
            f"rank {w.rank} (local rank {w.local_rank}): {w.cause()}" for w in erred))
    if stopped and out:
        out.append("  stopped by " + PROG + ": " + "; ".join(
            f"rank {w.rank} (local rank {w.local_rank}): {w.cause()}" for w in stopped))
    if result.leftovers:
        out.append(f"{PROG}: stopped processes left running by rank(s) "
                   f"{', '.join(map(str, result.leftovers))} after they exited")
    if out and result.exit_code != 0:
        cause = f" (from rank {first.rank})" if first is not None else ""
        out.append(f"{PROG}: exiting with code {result.exit_code}{cause}")
    return "\n".join(out)
