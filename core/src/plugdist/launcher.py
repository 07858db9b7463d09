"""``plugdist-run``: start N worker processes per node with torchrun-style environment variables.

    plugdist-run --standalone --nproc-per-node 4 train.py --lr 0.1
    plugdist-run --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 train.py
    python -m plugdist.launcher -m my_package.train

Each worker gets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
``GROUP_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``PLUGDIST_RUN_ID``,
``TORCHELASTIC_RUN_ID`` and ``PLUGDIST_LAUNCHED=1``, so ``init_process_group("gloo")`` with the
default ``env://`` rendezvous works unchanged. Rendezvous is static, as in
``torch.distributed.launch``: every node runs one launcher with the same ``--nnodes``,
``--nproc-per-node``, master address and port, and its own ``--node-rank``.

Contract (POSIX only):

* Every worker runs in its own session (``start_new_session``), so the launcher can signal a
  worker's whole process tree with ``killpg``. On Linux a worker also gets SIGKILL if the
  launcher itself dies abruptly (parent-death signal).
* SIGINT, SIGTERM and SIGHUP sent to the launcher are forwarded to every worker's process group;
  whatever is still running after the grace period gets SIGKILL. The launcher exits 128+signal.
* If a worker exits non-zero or is killed by a signal, the others get SIGTERM, then SIGKILL after
  the grace period. A summary on stderr names each failed rank, its exit status and its
  traceback (taken from the worker's captured stderr). The launcher exits with the first failed
  worker's exit code (128+signal if it was killed by a signal).
* When every worker exits 0, processes they left behind in their process groups are stopped the
  same way, so no exit path leaves orphans in the workers' groups. (A grandchild that starts its
  own session escapes this, as it would any process-group based launcher.)
* Worker output streams through live, line by line, prefixed ``[rank N]`` (``--no-tee``: stdout
  untouched, stderr unprefixed; stderr is always passed through the launcher so tracebacks can
  be summarised).
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import IO

__all__ = [
    "LaunchConfig",
    "LaunchError",
    "LaunchResult",
    "WorkerStatus",
    "extract_traceback",
    "format_summary",
    "free_port",
    "is_launched",
    "launch",
    "main",
    "parse_args",
]

RUN_ID_VARS = ("PLUGDIST_RUN_ID", "TORCHELASTIC_RUN_ID")
_PROG = "plugdist-run"
_FORWARDED_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")
_POLL_S = 0.05
_TAIL_CHUNKS = 400          # stderr lines kept per worker for the failure summary
_MAX_CHUNK = 1 << 16        # longest piece read at once, so one endless line cannot eat memory
_TB_HEAD = "Traceback (most recent call last):"
_TB_CHAIN = (
    "During handling of the above exception, another exception occurred:",
    "The above exception was the direct cause of the following exception:",
)


class LaunchError(RuntimeError):
    """The launcher could not start a worker."""


def is_launched() -> bool:
    """True when this process was started by ``plugdist-run`` (or torchrun).

    The run-id variable is the proxy, as in ``torch.distributed.is_torchelastic_launched``.
    """
    return any(os.environ.get(name) is not None for name in RUN_ID_VARS)


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class LaunchConfig:
    """What to start on this node. ``args`` are passed to the entrypoint untouched."""

    entrypoint: str
    args: tuple[str, ...] = ()
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    run_id: str = "none"
    grace_period: timedelta = timedelta(seconds=5)
    module: bool = False
    no_python: bool = False
    tee: bool = True

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1:
            raise ValueError(f"--nproc-per-node must be >= 1, got {self.nproc_per_node}")
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be >= 1, got {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, {self.nnodes - 1}] for --nnodes "
                             f"{self.nnodes}, got {self.node_rank}")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"--master-port must be in [1, 65535], got {self.master_port}")
        if self.grace_period < timedelta(0):
            raise ValueError(f"--grace-period must be >= 0, got {self.grace_period}")
        if self.module and self.no_python:
            raise ValueError("-m and --no-python exclude each other: -m runs `python -m MODULE`")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def global_rank(self, local_rank: int) -> int:
        return self.node_rank * self.nproc_per_node + local_rank

    def command(self) -> list[str]:
        """The command line every worker on this node runs."""
        if self.no_python:
            return [self.entrypoint, *self.args]
        if self.module:
            return [sys.executable, "-m", self.entrypoint, *self.args]
        return [sys.executable, self.entrypoint, *self.args]

    def worker_env(self, local_rank: int, base: Mapping[str, str]) -> dict[str, str]:
        """``base`` plus the variables a worker reads to join the world."""
        env = dict(base)
        env.update(
            RANK=str(self.global_rank(local_rank)),
            LOCAL_RANK=str(local_rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_WORLD_SIZE=str(self.nproc_per_node),
            GROUP_RANK=str(self.node_rank),
            GROUP_WORLD_SIZE=str(self.nnodes),
            MASTER_ADDR=self.master_addr,
            MASTER_PORT=str(self.master_port),
            PLUGDIST_RUN_ID=self.run_id,
            TORCHELASTIC_RUN_ID=self.run_id,
            PLUGDIST_LAUNCHED="1",
        )
        # Output is relayed line by line; a block-buffered child would make it arrive late.
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (bind port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _build_parser() -> tuple[argparse.ArgumentParser, set[str]]:
    """The option parser, and the option strings that take a value (for splitting argv)."""
    parser = argparse.ArgumentParser(
        prog=_PROG,
        usage=f"{_PROG} [options] script_or_module [args ...]",
        description="Start worker processes for plugdist (torchrun-style). Everything after "
                    "the script or module is passed to it untouched.",
    )
    takes_value: set[str] = set()

    def option(*names: str, **kw: object) -> None:
        parser.add_argument(*names, **kw)  # type: ignore[arg-type]
        if kw.get("action") is None:
            takes_value.update(names)

    option("--nproc-per-node", "--nproc_per_node", type=int, default=1, metavar="N",
           help="workers on this node (default 1)")
    option("--nnodes", type=int, default=1, metavar="M", help="number of nodes (default 1)")
    option("--node-rank", "--node_rank", type=int, default=0, metavar="K",
           help="this node's rank in [0, nnodes) (default 0)")
    option("--master-addr", "--master_addr", default=None, metavar="ADDR",
           help="address of the node running rank 0 (default 127.0.0.1)")
    option("--master-port", "--master_port", type=int, default=None, metavar="PORT",
           help="free port on the master node (default 29500)")
    option("--standalone", action="store_true",
           help="single node: master 127.0.0.1 and a free port picked by the launcher")
    option("--run-id", "--run_id", default=None, metavar="ID",
           help="run id given to workers as PLUGDIST_RUN_ID and TORCHELASTIC_RUN_ID "
                "(default: random on a single node, 'none' with --nnodes > 1)")
    option("--grace-period", "--grace_period", type=float, default=5.0, metavar="S",
           help="seconds between SIGTERM and SIGKILL when stopping workers (default 5)")
    option("--tee", action=argparse.BooleanOptionalAction, default=True,
           help="prefix each worker output line with [rank N] (default on)")
    option("-m", "--module", action="store_true",
           help="run the entrypoint as a module: python -m MODULE args")
    option("--no-python", "--no_python", action="store_true",
           help="run the entrypoint as an executable, without python in front")
    return parser, takes_value


def _split_argv(argv: Sequence[str], takes_value: set[str]) -> tuple[list[str], list[str]]:
    """Split into (launcher options, [entrypoint, *its args]).

    Done by hand because argparse's REMAINDER swallows a ``--`` that belongs to the script.
    """
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return list(argv[:i]), list(argv[i + 1:])
        if not arg.startswith("-") or arg == "-":
            return list(argv[:i]), list(argv[i:])
        i += 2 if arg in takes_value else 1
    return list(argv), []


def parse_args(argv: Sequence[str] | None = None) -> LaunchConfig:
    """Parse a ``plugdist-run`` command line. Bad input exits with status 2 and a message."""
    parser, takes_value = _build_parser()
    raw = list(sys.argv[1:] if argv is None else argv)
    own, rest = _split_argv(raw, takes_value)
    ns = parser.parse_args(own)
    if not rest:
        parser.error("missing the script (or, with -m, the module) to run")
    if ns.standalone:
        if ns.nnodes != 1 or ns.node_rank != 0:
            parser.error("--standalone is for a single node; drop --nnodes/--node-rank, or "
                         "drop --standalone and give --master-addr/--master-port")
        if ns.master_addr is not None or ns.master_port is not None:
            parser.error("--standalone picks 127.0.0.1 and a free port itself; drop "
                         "--master-addr/--master-port, or drop --standalone")
        master_addr, master_port = "127.0.0.1", free_port()
    else:
        master_addr = "127.0.0.1" if ns.master_addr is None else ns.master_addr
        master_port = 29500 if ns.master_port is None else ns.master_port
    run_id = ns.run_id
    if run_id is None:
        # Launchers on different nodes could not agree on a random id, so multi-node uses a
        # fixed one (as torchrun does); pass --run-id to tell runs apart.
        run_id = uuid.uuid4().hex[:12] if ns.nnodes == 1 else "none"
    entrypoint, args = rest[0], tuple(rest[1:])
    if not ns.module and not ns.no_python and not os.path.isfile(entrypoint):
        parser.error(f"script {entrypoint!r} not found (cwd {os.getcwd()}); pass -m to run a "
                     "module, or --no-python to run an executable")
    try:
        return LaunchConfig(
            entrypoint=entrypoint, args=args, nproc_per_node=ns.nproc_per_node,
            nnodes=ns.nnodes, node_rank=ns.node_rank, master_addr=master_addr,
            master_port=master_port, run_id=run_id,
            grace_period=timedelta(seconds=ns.grace_period), module=ns.module,
            no_python=ns.no_python, tee=ns.tee)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


# --------------------------------------------------------------------------- results


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

    @property
    def exit_code(self) -> int:
        """Shell-style code: the exit status, or 128+signal."""
        return _exit_code(self.returncode)

    def describe(self) -> str:
        rc = self.returncode
        if rc is None:
            return "did not exit"
        if rc >= 0:
            return f"exit code {rc}"
        return f"killed by {_signal_name(-rc)} (signal {-rc})"


@dataclass(frozen=True)
class LaunchResult:
    """Outcome of :func:`launch`; ``exit_code`` is what ``plugdist-run`` exits with."""

    config: LaunchConfig
    exit_code: int
    workers: tuple[WorkerStatus, ...]
    received_signal: int | None = None
    leftovers: tuple[int, ...] = field(default=())   # ranks whose groups outlived them

    @property
    def failures(self) -> list[WorkerStatus]:
        return [w for w in self.workers if w.failed]


def _exit_code(returncode: int | None) -> int:
    if returncode is None:
        return 1
    return returncode if returncode >= 0 else 128 - returncode


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


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


def format_summary(result: LaunchResult) -> str:
    """The failure summary printed to stderr; '' when every worker succeeded."""
    cfg = result.config
    where = f"run id {cfg.run_id}, node {cfg.node_rank} of {cfg.nnodes}"
    out: list[str] = []
    if result.received_signal is not None:
        out.append(f"{_PROG}: received {_signal_name(result.received_signal)}; forwarded it "
                   f"to the workers ({where})")
    failures = result.failures
    if failures:
        out.append(f"{_PROG}: {len(failures)} of {len(result.workers)} workers failed ({where})")
        for w in failures:
            out.append(f"  rank {w.rank} (local rank {w.local_rank}, pid {w.pid}): "
                       f"{w.describe()}")
            tb = extract_traceback(w.stderr_tail)
            if tb:
                out.extend("    " + line for line in _clip(tb))
            elif w.stderr_tail:
                out.append("    last stderr lines:")
                out.extend("    " + line for line in w.stderr_tail[-5:])
            else:
                out.append("    (no stderr output)")
    stopped = [w for w in result.workers if w.stopped and not w.failed]
    if stopped and (failures or result.received_signal is not None):
        out.append("  stopped by " + _PROG + ": " + "; ".join(
            f"rank {w.rank} (local rank {w.local_rank}): {w.describe()}" for w in stopped))
    if result.leftovers:
        out.append(f"{_PROG}: stopped processes left running by rank(s) "
                   f"{', '.join(map(str, result.leftovers))} after they exited")
    if out and result.exit_code != 0:
        cause = f" (from rank {failures[0].rank})" if failures else ""
        out.append(f"{_PROG}: exiting with code {result.exit_code}{cause}")
    return "\n".join(out)


# --------------------------------------------------------------------------- running


class _Sink:
    """A binary output shared by reader threads: whole writes under a lock, flushed at once.

    A broken destination (reader of our stdout went away) is dropped, never raised, so the
    workers' pipes keep draining and no worker blocks on a full pipe.
    """

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._binary: IO[bytes] | None = getattr(stream, "buffer", None)
        self._lock = threading.Lock()
        self._broken = False

    def write(self, data: bytes) -> None:
        with self._lock:
            if self._broken:
                return
            try:
                if self._binary is not None:
                    self._binary.write(data)
                    self._binary.flush()
                else:
                    self._stream.write(data.decode("utf-8", "replace"))
                    self._stream.flush()
            except (OSError, ValueError):
                self._broken = True

    def text(self, message: str) -> None:
        self.write((message + "\n").encode("utf-8", "replace"))


def _pump(src: IO[bytes], sink: _Sink, prefix: bytes,
          tail: collections.deque[bytes] | None) -> None:
    """Copy ``src`` to ``sink`` line by line until EOF (runs in a reader thread)."""
    at_line_start = True
    try:
        while True:
            chunk = src.readline(_MAX_CHUNK)
            if not chunk:
                break
            if tail is not None:
                tail.append(chunk)
            sink.write((prefix if at_line_start and prefix else b"") + chunk)
            at_line_start = chunk.endswith(b"\n")
        if prefix and not at_line_start:
            sink.write(b"\n")  # keep the next rank's prefixed line on a line of its own
    except (OSError, ValueError):
        pass
    finally:
        src.close()


def _set_parent_death_signal() -> Callable[[], None] | None:
    """A ``preexec_fn`` that gives the child SIGKILL when the launcher dies (Linux only)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()
    pr_set_pdeathsig = 1

    def preexec() -> None:
        prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:   # the launcher died before prctl took effect
            os._exit(1)
    return preexec


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group ``pgid``."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        # No /proc (macOS): signal 0 tells whether the group exists, zombies included.
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    members = []
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # Fields after the command name, which may itself contain spaces and parentheses.
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 2 and fields[0] not in (b"Z", b"X") and int(fields[2]) == pgid:
            members.append(int(name))
    return members


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class _Worker:
    def __init__(self, rank: int, local_rank: int, proc: subprocess.Popen[bytes]) -> None:
        self.rank = rank
        self.local_rank = local_rank
        self.proc = proc
        self.pgid = proc.pid          # start_new_session: the worker leads its own group
        self.returncode: int | None = None
        self.failed = False
        self.stopped = False
        self.tail: collections.deque[bytes] = collections.deque(maxlen=_TAIL_CHUNKS)
        self.readers: list[threading.Thread] = []

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.proc.poll()
        return self.returncode

    def status(self) -> WorkerStatus:
        text = b"".join(self.tail).decode("utf-8", "replace")
        return WorkerStatus(rank=self.rank, local_rank=self.local_rank, pid=self.proc.pid,
                            returncode=self.returncode, failed=self.failed,
                            stopped=self.stopped, stderr_tail=tuple(text.splitlines()))


class _Run:
    """One launch on this node. Not reusable; ``run`` must be called from one thread."""

    def __init__(self, config: LaunchConfig, stdout: IO[str], stderr: IO[str]) -> None:
        self.cfg = config
        self.out = _Sink(stdout)
        self.err = _Sink(stderr)
        self.workers: list[_Worker] = []
        self.signals: list[int] = []
        self.wake = threading.Event()
        self.leftovers: list[int] = []

    def _on_signal(self, signum: int, frame: object) -> None:
        self.signals.append(signum)
        self.wake.set()

    def run(self) -> LaunchResult:
        previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for name in _FORWARDED_SIGNALS:
                sig = getattr(signal, name, None)
                if sig is not None:
                    previous[sig] = signal.signal(sig, self._on_signal)
        exit_code = 1
        try:
            self._spawn()
            exit_code = self._monitor()
        finally:
            # Reached on every path, including an exception while spawning: nothing survives.
            self._stop(signal.SIGTERM, mark=False)
            for w in self.workers:
                for t in w.readers:
                    t.join(timeout=2.0)
            for sig, handler in previous.items():
                signal.signal(sig, handler)  # type: ignore[arg-type]
        return LaunchResult(config=self.cfg, exit_code=exit_code,
                            workers=tuple(w.status() for w in self.workers),
                            received_signal=self.signals[0] if self.signals else None,
                            leftovers=tuple(self.leftovers))

    def _spawn(self) -> None:
        cfg = self.cfg
        base = dict(os.environ)
        if cfg.nproc_per_node > 1 and "OMP_NUM_THREADS" not in base:
            # As torchrun does: N workers each using every core would oversubscribe the node.
            base["OMP_NUM_THREADS"] = "1"
            self.err.text(f"{_PROG}: setting OMP_NUM_THREADS=1 for each worker (set it "
                          "yourself to choose another value)")
        cmd = cfg.command()
        preexec = _set_parent_death_signal()
        for local_rank in range(cfg.nproc_per_node):
            rank = cfg.global_rank(local_rank)
            try:
                proc = subprocess.Popen(
                    cmd, env=cfg.worker_env(local_rank, base), start_new_session=True,
                    stdout=subprocess.PIPE if cfg.tee else None, stderr=subprocess.PIPE,
                    preexec_fn=preexec)
            except OSError as exc:
                raise LaunchError(f"could not start rank {rank} (local rank {local_rank}) "
                                  f"with {cmd[0]!r}: {exc}") from exc
            self.workers.append(_Worker(rank, local_rank, proc))
        # Reader threads start only after every fork: forking while threads run is unsafe
        # with a preexec_fn. The pipes hold the little output written in the meantime.
        for w in self.workers:
            prefix = f"[rank {w.rank}] ".encode() if cfg.tee else b""
            streams: list[tuple[IO[bytes] | None, _Sink, collections.deque[bytes] | None]] = [
                (w.proc.stdout, self.out, None), (w.proc.stderr, self.err, w.tail)]
            for src, sink, tail in streams:
                if src is None:
                    continue
                t = threading.Thread(target=_pump, args=(src, sink, prefix, tail),
                                     name=f"{_PROG}-rank{w.rank}", daemon=True)
                t.start()
                w.readers.append(t)

    def _monitor(self) -> int:
        """Wait until all workers exit, one fails, or a signal arrives; return the exit code."""
        while True:
            if self.signals:
                sig = self.signals[0]
                self._stop(sig, mark=True)
                return 128 + sig
            failed = []
            for w in self.workers:
                if w.returncode is None and w.poll() is not None and w.returncode != 0:
                    w.failed = True
                    failed.append(w)
            if failed:
                self._stop(signal.SIGTERM, mark=True)
                return _exit_code(failed[0].returncode)
            if all(w.returncode is not None for w in self.workers):
                for w in self.workers:
                    if _group_members(w.pgid):
                        self.leftovers.append(w.rank)
                return 0
            self.wake.wait(_POLL_S)
            self.wake.clear()

    def _stop(self, sig: int, *, mark: bool) -> None:
        """Send ``sig`` to every worker's process group; SIGKILL what outlives the grace period.

        Also reaps the workers. Idempotent: groups already empty are skipped. A further signal
        to the launcher while it waits skips the rest of the grace period.
        """
        live = [w for w in self.workers if w.poll() is None or _group_members(w.pgid)]
        if not live:
            return
        for w in live:
            if mark and w.returncode is None:
                w.stopped = True
            _killpg(w.pgid, sig)
        seen_signals = len(self.signals)
        deadline = time.monotonic() + self.cfg.grace_period.total_seconds()
        while time.monotonic() < deadline and len(self.signals) == seen_signals:
            live = [w for w in live if w.poll() is None or _group_members(w.pgid)]
            if not live:
                return
            self.wake.wait(_POLL_S)
            self.wake.clear()
        for w in live:
            _killpg(w.pgid, signal.SIGKILL)
        for w in live:
            try:
                w.returncode = w.proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                pass  # stuck in the kernel (uninterruptible I/O); nothing more we can do


def launch(config: LaunchConfig, *, stdout: IO[str] | None = None,
           stderr: IO[str] | None = None) -> LaunchResult:
    """Start the workers of ``config`` on this node and block until they have all ended.

    Must be called from the main thread for signal forwarding (elsewhere, signals are left to
    the caller). Prints worker output and the failure summary to ``stdout``/``stderr``
    (default: this process's). Raises :class:`LaunchError` if a worker cannot be started;
    already started workers are stopped first.
    """
    if os.name != "posix":
        raise LaunchError(f"{_PROG} needs a POSIX system (it signals process groups)")
    err = sys.stderr if stderr is None else stderr
    result = _Run(config, sys.stdout if stdout is None else stdout, err).run()
    summary = format_summary(result)
    if summary:
        _Sink(err).text(summary)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``plugdist-run`` and ``python -m plugdist.launcher``: the exit code."""
    config = parse_args(argv)
    try:
        return launch(config).exit_code
    except LaunchError as exc:
        print(f"{_PROG}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
