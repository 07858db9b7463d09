"""What one ``plugdist-run`` is asked to do: :class:`LaunchConfig` and its small parts.

Standard library only: the launcher never imports torch.
"""

from __future__ import annotations

import signal
import sys
from dataclasses import dataclass, field
from datetime import timedelta

__all__ = ["LaunchConfig", "RendezvousOptions", "Streams", "parse_streams", "parse_nnodes",
           "parse_signals", "parse_filters"]


@dataclass(frozen=True)
class Streams:
    """Which of a worker's streams a ``-r/--redirects`` or ``-t/--tee`` spec covers, per local
    rank: 0 none, 1 stdout, 2 stderr, 3 both (torchrun's values)."""

    default: int = 0
    per_rank: tuple[tuple[int, int], ...] = ()

    def of(self, local_rank: int) -> int:
        return dict(self.per_rank).get(local_rank, self.default)


def parse_streams(text: str, flag: str) -> Streams:
    """``"3"`` (every local rank) or ``"0:3,1:0"`` (per local rank; others 0)."""
    def value(v: str) -> int:
        if v.strip() not in ("0", "1", "2", "3"):
            raise ValueError(f"{flag}: {v.strip()!r} is not one of 0 (none), 1 (stdout), "
                             f"2 (stderr), 3 (both)")
        return int(v)
    text = text.strip()
    if ":" not in text:
        return Streams(default=value(text))
    pairs = []
    for item in text.split(","):
        rank, _, v = item.partition(":")
        if not rank.strip().isdigit():
            raise ValueError(f"{flag}: {item!r} should look like LOCAL_RANK:VALUE, e.g. 0:3,1:0")
        pairs.append((int(rank), value(v)))
    return Streams(per_rank=tuple(pairs))


def parse_filters(text: str) -> tuple[str, ...]:
    """``--duplicate-*-filters`` as torchrun reads them: comma-separated substrings, ``,,`` for
    a literal comma; empty text: no filter (nothing duplicated)."""
    if not text:
        return ()
    marker = "\x00"
    return tuple(item.replace(marker, ",") for item in text.replace(",,", marker).split(","))


def parse_nnodes(text: str) -> tuple[int, int]:
    """``"N"`` or ``"MIN:MAX"`` -> (min, max)."""
    lo, sep, hi = text.partition(":")
    try:
        mn, mx = int(lo), int(hi if sep else lo)
    except ValueError:
        raise ValueError(f"--nnodes: {text!r} is not N or MIN:MAX (e.g. 2, or 1:4)") from None
    if mn < 1:
        raise ValueError(f"--nnodes: the minimum must be >= 1, got {mn}")
    if mn > mx:
        raise ValueError(f"--nnodes {text}: MIN ({mn}) is greater than MAX ({mx})")
    return mn, mx


def parse_signals(text: str) -> tuple[int, ...]:
    """``"SIGTERM,SIGUSR1"`` -> signal numbers; an unknown name is an error."""
    out = []
    for name in (n.strip() for n in text.split(",")):
        if not name:
            continue
        full = name if name.startswith("SIG") else "SIG" + name
        sig = getattr(signal, full, None)
        if not isinstance(sig, signal.Signals) or full.startswith("SIG_"):
            raise ValueError(f"--signals-to-handle: unknown signal {name!r}")
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"--signals-to-handle: {full} cannot be caught")
        out.append(int(sig))
    return tuple(dict.fromkeys(out))


@dataclass(frozen=True)
class RendezvousOptions:
    """``--rdzv-conf`` keys. Timeouts as torchrun reads them (seconds on the command line).

    ``join_timeout``: how long a node waits for MIN nodes to join a round. ``last_call_timeout``:
    once MIN have joined (and fewer than MAX), how long more nodes may still join before the
    round closes. ``close_timeout``: how long a node that is done waits for the others to be done
    (the store's host keeps serving meanwhile). ``read_timeout``: one store operation.
    ``keep_alive_interval`` x ``keep_alive_max_attempt``: a node whose heartbeat stops for that
    long is taken as lost. ``token_file``: a file holding the store's shared secret for several
    nodes (the same secret on every node). ``token``: only ``token=`` (empty) is taken, turning
    tokens off; a secret on the command line is refused (every local user can read it).
    """

    join_timeout: timedelta = timedelta(seconds=600)
    last_call_timeout: timedelta = timedelta(seconds=30)
    close_timeout: timedelta = timedelta(seconds=30)
    read_timeout: timedelta = timedelta(seconds=60)
    keep_alive_interval: timedelta = timedelta(seconds=1)
    keep_alive_max_attempt: int = 3
    token: str | None = None
    token_file: str | None = None

    @classmethod
    def parse(cls, text: str) -> RendezvousOptions:
        """``"join_timeout=60,last_call_timeout=1"``; an unknown key names the known ones."""
        kw: dict[str, object] = {}
        known = [f for f in cls.__dataclass_fields__]
        for item in (i.strip() for i in text.split(",")):
            if not item:
                continue
            key, sep, value = item.partition("=")
            key = key.strip()
            if not sep:
                raise ValueError(f"--rdzv-conf: {item!r} should look like key=value")
            if key not in known:
                raise ValueError(f"--rdzv-conf: unknown key {key!r} (known: {', '.join(known)})")
            if key == "token":
                if value:
                    raise ValueError(
                        "--rdzv-conf token=SECRET would put the store's secret on the command "
                        "line, where every local user can read it: write it into a file only "
                        "you can read and pass --rdzv-conf token_file=PATH (or set "
                        "PLUGDIST_STORE_TOKEN_FILE or PLUGDIST_STORE_TOKEN in the environment); "
                        "token= (empty) turns tokens off")
                kw[key] = value
            elif key == "token_file":
                if not value:
                    raise ValueError("--rdzv-conf token_file= needs the path of a file holding "
                                     "the store's secret")
                kw[key] = value
            elif key == "keep_alive_max_attempt":
                kw[key] = int(value)
            else:
                try:
                    seconds = float(value)
                except ValueError:
                    raise ValueError(f"--rdzv-conf: {key}={value!r} is not a number of "
                                     f"seconds") from None
                if seconds <= 0:
                    raise ValueError(f"--rdzv-conf: {key} must be > 0, got {value}")
                kw[key] = timedelta(seconds=seconds)
        return cls(**kw)  # type: ignore[arg-type]


@dataclass(frozen=True)
class LaunchConfig:
    """What to start on this node. ``args`` are passed to the entrypoint untouched.

    ``node_rank`` None: assigned at rendezvous. ``master_addr``/``master_port`` None: picked by the
    launcher. ``rdzv_endpoint`` empty with the static backend: ``master_addr:master_port``.
    """

    entrypoint: str
    args: tuple[str, ...] = ()
    nproc_per_node: int = 1
    min_nodes: int = 1
    max_nodes: int = 1
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_backend: str = "static"
    rdzv_endpoint: str = ""
    run_id: str = "none"
    rdzv: RendezvousOptions = field(default_factory=RendezvousOptions)
    standalone: bool = False
    max_restarts: int = 0
    replace_failed: bool = False  # start one new worker for a dead one; the others go on
    monitor_interval: timedelta = timedelta(seconds=0.1)
    start_method: str = "spawn"
    role: str = "default"
    log_dir: str | None = None
    redirects: Streams = Streams()
    tee: Streams = Streams()
    rank_prefix: bool = True
    local_ranks_filter: frozenset[int] | None = None
    local_addr: str | None = None
    signals_to_handle: tuple[int, ...] = (int(signal.SIGTERM), int(signal.SIGINT),
                                          int(signal.SIGHUP), int(signal.SIGQUIT))
    grace_period: timedelta = timedelta(seconds=5)
    module: bool = False
    no_python: bool = False
    run_path: bool = False
    duplicate_stdout_filters: tuple[str, ...] = ()
    duplicate_stderr_filters: tuple[str, ...] = ()
    numa_binding: str | None = None
    virtual_local_rank: bool = False
    page: str | None = None      # --page [HOST:]PORT: serve the live page there
    page_linger: float = 0.0     # --page-linger: seconds the page shows the end state

    @property
    def nnodes(self) -> int:
        """The node count of a fixed-size run (MAX of MIN:MAX)."""
        return self.max_nodes

    def budget_words(self) -> str:
        """What ``--max-restarts`` counts: with ``--replace-failed``, replacements too."""
        return "restarts and replacements" if self.replace_failed else "restarts"

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1:
            raise ValueError(f"--nproc-per-node must be >= 1, got {self.nproc_per_node}")
        if self.min_nodes < 1 or self.min_nodes > self.max_nodes:
            raise ValueError(f"--nnodes {self.min_nodes}:{self.max_nodes}: need "
                             f"1 <= MIN <= MAX")
        if self.node_rank is not None and not 0 <= self.node_rank < self.max_nodes:
            raise ValueError(f"--node-rank must be in [0, {self.max_nodes - 1}] for --nnodes "
                             f"{self.max_nodes}, got {self.node_rank}")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ValueError(f"--master-port must be in [1, 65535], got {self.master_port}")
        if self.rdzv_backend not in ("static", "c10d") and not self.rdzv_endpoint:
            raise ValueError(f"--rdzv-backend {self.rdzv_backend} (a store scheme) needs "
                             f"--rdzv-endpoint")
        if self.rdzv_backend == "static" and self.min_nodes != self.max_nodes:
            raise ValueError(f"--nnodes {self.min_nodes}:{self.max_nodes} needs "
                             f"--rdzv-backend c10d (the static backend has a fixed node count)")
        if self.rdzv_backend == "c10d" and not self.rdzv_endpoint:
            raise ValueError("--rdzv-backend c10d needs --rdzv-endpoint HOST:PORT")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.monitor_interval <= timedelta(0):
            raise ValueError(f"--monitor-interval must be > 0, got "
                             f"{self.monitor_interval.total_seconds()}")
        if self.grace_period < timedelta(0):
            raise ValueError(f"--grace-period must be >= 0, got "
                             f"{self.grace_period.total_seconds()}")
        if self.numa_binding not in (None, "node", "socket", "exclusive", "core-complex"):
            raise ValueError(f"--numa-binding must be node, socket, exclusive or core-complex, "
                             f"got {self.numa_binding!r}")
        if sum((self.module, self.no_python, self.run_path)) > 1:
            raise ValueError("-m, --no-python and --run-path exclude each other: -m runs "
                             "`python -m MODULE`, --no-python runs a program, --run-path runs a "
                             "script in the launcher's interpreter")

    def command(self) -> list[str]:
        """The command line every worker on this node runs."""
        if self.no_python:
            return [self.entrypoint, *self.args]
        if self.module:
            return [sys.executable, "-m", self.entrypoint, *self.args]
        return [sys.executable, self.entrypoint, *self.args]
