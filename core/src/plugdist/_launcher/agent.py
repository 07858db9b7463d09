"""The agent: run this node's workers round after round until the run succeeds or gives up.

Each round: rendezvous (:mod:`.rendezvous`), start ``nproc_per_node`` workers, watch them every
``monitor_interval``. A worker that fails ends the round on every node; the world starts again
(round + 1, ``TORCHELASTIC_RESTART_COUNT`` + 1) while restarts are left. A lost node, or a node
waiting to join a world smaller than MAX, ends the round too, without using a restart.

With resilient groups on in the workers (each tells the launcher by creating its
``PLUGDIST_RESILIENT_MARK`` file: see :func:`.error_file.mark_resilient`), a
worker killed by a signal does not end the round: ``--replace-failed`` starts a replacement
that joins the running world while ``--max-restarts`` allows (replacements and restarts share
that budget), and otherwise the others go on without it (they shrink). A worker that exits
with an error code still ends the round: that is the program failing, not a rank lost. Where
the rendezvous store offers it (``Store.keep_node_wills``: etcd), the agent also keeps its
workers' wills alive with one renewal for the node.

Contract (POSIX): every worker runs in its own session, so a signal reaches its whole process
tree through ``killpg``. Stopping sends a signal (SIGTERM, or the one the launcher got), then
SIGKILL after ``grace_period``. A watchdog process holds a pipe from the launcher and SIGKILLs
every worker group still listed when that pipe closes, so no worker outlives the launcher, even
a launcher killed with SIGKILL.
"""

from __future__ import annotations

import collections
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Any

from plugdist._launch_protocol import (
    ERROR_FILE_VAR,
    PAGE_VAR,
    RESILIENT_MARK_VAR,
    read_error_file,
)
from plugdist._launcher.config import LaunchConfig
from plugdist._launcher.logs import Duplicate, Sink, plan_streams, pump
from plugdist._launcher.numa import cpus_for_workers, spawning_bound_to
from plugdist._launcher.rendezvous import (
    Assignment,
    RendezvousError,
    RendezvousInterrupted,
    StoreRendezvous,
)
from plugdist._launcher.summary import PROG, Failure, LaunchResult, WorkerStatus, exit_code_of
from plugdist.errors import (
    DistError,
    DistExcludedError,
    DistStoreError,
    LaunchError,
    WorldClosedError,
)

__all__ = ["Agent", "LaunchError"]

_TAIL_CHUNKS = 400          # stderr lines kept per worker for the failure summary
TOKEN_VAR = "PLUGDIST_STORE_TOKEN"
NODE_KEEPER_VAR = "PLUGDIST_NODE_KEEPER"   # "0": each worker renews its own will
# The watchdog: reads "+PGID"/"-PGID" lines; at EOF (the launcher is gone, however it ended)
# SIGKILLs the process groups still listed. Standard library only, started with -I -S: ~10 ms.
_WATCHDOG = (
    "import os, signal, sys\n"
    "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
    "live = set()\n"
    "for line in sys.stdin:\n"
    "    line = line.strip()\n"
    "    if line[:1] == '+': live.add(int(line[1:]))\n"
    "    elif line[:1] == '-': live.discard(int(line[1:]))\n"
    "for g in live:\n"
    "    try: os.killpg(g, signal.SIGKILL)\n"
    "    except OSError: pass\n"
)


def _round_news(rdzv: StoreRendezvous, a: Assignment) -> str | None:
    """How this round ended elsewhere (another node's outcome), or a membership change seen
    here (which ends the round for every node); None while the round goes on."""
    outcome = rdzv.outcome(a.round)
    if outcome:
        return outcome
    reason = rdzv.check(a)
    return rdzv.end_round(a, reason) if reason else None


def _live_groups(pgids: set[int]) -> set[int]:
    """Those of ``pgids`` that still hold a live (non-zombie) process: one pass over /proc."""
    if not pgids:
        return set()
    try:
        entries = os.listdir("/proc")
    except OSError:
        # No /proc (macOS): signal 0 tells whether the group exists, zombies included.
        live = set()
        for pgid in pgids:
            try:
                os.killpg(pgid, 0)
                live.add(pgid)
            except (ProcessLookupError, PermissionError):
                pass
        return live
    live = set()
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
        if len(fields) > 2 and fields[0] not in (b"Z", b"X") and int(fields[2]) in pgids:
            live.add(int(fields[2]))
            if live == pgids:
                break
    return live


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class _Watchdog:
    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        try:
            self.proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _WATCHDOG],
                                         stdin=subprocess.PIPE, start_new_session=True)
        except OSError:
            self.proc = None   # degrade: workers are still stopped on every orderly exit

    def tell(self, line: str) -> None:
        if self.proc is not None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write(line.encode() + b"\n")
                self.proc.stdin.flush()
            except OSError:
                pass

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.stdin is not None:
                try:
                    self.proc.stdin.close()
                except OSError:
                    pass
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class _Sleeper:
    """Sleeps that a signal cuts short, with no lock taken in a signal handler (a handler runs
    on the main thread, between any two bytecodes, so taking a lock there can deadlock): the
    interpreter's C-level handler writes to a pipe (``signal.set_wakeup_fd``) and a sleep is a
    ``select`` on it. Without ``install`` (not the main thread) it is a plain sleep."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._previous: int | None = None

    def install(self) -> None:
        self._previous = signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)

    def sleep(self, seconds: float) -> None:
        select.select([self._r], [], [], seconds)
        try:
            while os.read(self._r, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        if self._previous is not None:
            signal.set_wakeup_fd(self._previous)
            self._previous = None
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass


class _Worker:
    def __init__(self, rank: int, local_rank: int, proc: subprocess.Popen[bytes],
                 error_file: str, resilient_mark: str) -> None:
        self.rank = rank
        self.local_rank = local_rank
        self.proc = proc
        self.pgid = proc.pid          # start_new_session: the worker leads its own group
        self.error_file = error_file
        self.resilient_mark = resilient_mark  # created once it runs resilient groups
        self.returncode: int | None = None
        self.released = False         # the watchdog was told this group is gone
        self.failed = False
        self.stopped = False
        self.replaced = False         # not counted in the round's outcome: it was replaced, or
        self.replacement = False      # it is a replacement that found the run finished
        self.left_behind = False      # died; the others went on without it (no replacement)
        self.tail: collections.deque[bytes] = collections.deque(maxlen=_TAIL_CHUNKS)
        self.readers: list[threading.Thread] = []

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.proc.poll()
        return self.returncode

    def runs_resilient_groups(self) -> bool:
        """Whether this worker told us (through its mark) that it runs resilient groups: then
        it shrinks past a dead peer instead of failing with it."""
        return os.path.exists(self.resilient_mark)

    def drain(self, timeout: float) -> None:
        for t in self.readers:
            t.join(timeout=timeout)

    def status(self) -> WorkerStatus:
        text = b"".join(self.tail).decode("utf-8", "replace")
        err = read_error_file(self.error_file) if self.failed else None
        return WorkerStatus(
            rank=self.rank, local_rank=self.local_rank, pid=self.proc.pid,
            returncode=self.returncode, failed=self.failed, stopped=self.stopped,
            stderr_tail=tuple(text.splitlines()),
            error_file=self.error_file if err else None,
            error_message=err[0] if err else "", error_traceback=tuple(err[1]) if err else (),
            replaced=self.replaced, left_behind=self.left_behind)


def _ended_on(w: _Worker, error: type[BaseException]) -> bool:
    """Whether the exited worker ``w`` ended on an uncaught ``error``: its error file (a worker
    under ``plugdist.record``) or else the last line of its stderr (Python's own report)."""
    err = read_error_file(w.error_file)
    if err is not None:
        return err[0].startswith(f"{error.__name__}:")
    w.drain(2.0)
    lines = [x for x in b"".join(w.tail).decode("utf-8", "replace").splitlines() if x.strip()]
    return bool(lines) and re.match(rf"(\S+\.)?{error.__name__}: ", lines[-1]) is not None


def _choose_token(cfg: LaunchConfig) -> None:
    """Put the store's token where this launcher's stores and its workers read it (their
    environment; a secret never goes on a command line). One node: a fresh random one per run.
    Several: ``--rdzv-conf token_file=PATH`` or the launcher's own ``PLUGDIST_STORE_TOKEN`` /
    ``PLUGDIST_STORE_TOKEN_FILE``; ``token=`` (empty) turns it off. A run whose store listens
    beyond loopback with none of these is refused (RendezvousError saying how to give one)."""
    from plugdist.store._tokens import TOKEN_FILE_ENV, is_loopback, read_token_file, resolve_token
    if cfg.max_nodes == 1:
        os.environ.pop(TOKEN_FILE_ENV, None)
        os.environ[TOKEN_VAR] = os.urandom(16).hex()   # fresh per single-node run (CSPRNG)
        return
    try:
        if cfg.rdzv.token_file:
            read_token_file(cfg.rdzv.token_file)  # readable, and not empty: say so now
            os.environ.pop(TOKEN_VAR, None)
            os.environ[TOKEN_FILE_ENV] = cfg.rdzv.token_file
        elif cfg.rdzv.token == "":
            os.environ[TOKEN_VAR] = ""   # off, explicitly: the store then says so once
        chosen = resolve_token()[1]
    except DistStoreError as exc:
        raise RendezvousError(str(exc)) from exc
    if cfg.rdzv_backend == "c10d":
        host = cfg.rdzv_endpoint.rpartition(":")[0].strip("[]")
    elif cfg.rdzv_backend == "static":
        host = cfg.master_addr or "127.0.0.1"
    else:
        return  # a store plugin's (etcd): its own access control
    if not chosen and not is_loopback(host):
        raise RendezvousError(
            f"a run of several nodes serves its store on {host}, beyond loopback, where any "
            f"process that reaches the port could change the run: give every node the same "
            f"secret with --rdzv-conf token_file=PATH (a file only you can read, on every node) "
            f"or PLUGDIST_STORE_TOKEN / PLUGDIST_STORE_TOKEN_FILE in the launcher's "
            f"environment (docs/launcher.md shows Slurm, Kubernetes and mpiexec), or turn "
            f"tokens off explicitly with --rdzv-conf token=")


def _given_token(cfg: LaunchConfig) -> bytes | None:
    """The token the user gave the job (``--rdzv-conf token_file``, ``PLUGDIST_STORE_TOKEN`` or
    ``PLUGDIST_STORE_TOKEN_FILE``), read before :func:`_choose_token` gives a one-node run a
    fresh one that nobody else knows: the page asks for it beyond loopback. None if none (or
    unreadable: :func:`_choose_token` says why)."""
    from plugdist.store._tokens import read_token_file, resolve_token
    try:
        return read_token_file(cfg.rdzv.token_file) if cfg.rdzv.token_file \
            else resolve_token()[0]
    except DistStoreError:
        return None


class Agent:
    """One launch on this node. Not reusable; ``run`` must be called from one thread."""

    def __init__(self, config: LaunchConfig, stdout: IO[str], stderr: IO[str]) -> None:
        self.cfg = config
        self.out = Sink(stdout)
        self.err = Sink(stderr)
        self.workers: list[_Worker] = []
        self.signals: list[int] = []
        self.sleeper = _Sleeper()
        self.leftovers: list[int] = []
        self.watchdog: _Watchdog | None = None
        self.keeper: Any = None
        self.host = socket.gethostname()
        self._tmp: str | None = None
        self._change = ""           # the last membership change, for the summary
        self._keep_tmp = False      # a worker failed: its error file is named in the summary
        self.replacements = 0       # workers started by --replace-failed
        self._filtered: dict[str, tuple[str, tuple[bytes, ...]]] = {}
        self._cpus: list[Any] | None = None
        self.page: Any = None   # --page: a page.LivePage (imported only then: it imports the store)
        self._given_token = _given_token(config) if config.page is not None else None
        self.log_root = self._log_root()

    # -- set up --------------------------------------------------------------------------------
    def _log_root(self) -> str:
        cfg = self.cfg
        if cfg.log_dir is not None:
            root = os.path.join(cfg.log_dir, f"{cfg.run_id}_{os.urandom(4).hex()}")
        elif cfg.redirects.default or cfg.redirects.per_rank or cfg.tee.default \
                or cfg.tee.per_rank or cfg.duplicate_stdout_filters \
                or cfg.duplicate_stderr_filters:
            root = tempfile.mkdtemp(prefix=f"plugdist-run-{cfg.run_id}-")
            self.err.text(f"{PROG}: worker logs in {root} (pass --log-dir to choose)")
        else:
            root = self._tmp = tempfile.mkdtemp(prefix=f"plugdist-run-{cfg.run_id}-")
        return root

    def _keep_node_wills(self, rdzv: StoreRendezvous) -> Any:
        """This node's keeper of its workers' wills (``Store.keep_node_wills``) where the
        rendezvous store offers one (etcd) and ``PLUGDIST_NODE_KEEPER`` is not 0; else None
        (each worker renews its own will)."""
        if os.environ.get(NODE_KEEPER_VAR, "1") == "0":
            return None
        directory = tempfile.mkdtemp(prefix=f"plugdist-node-{self.cfg.run_id}-")
        try:
            return rdzv.store.keep_node_wills(directory)
        except NotImplementedError:
            pass
        except DistError as err:
            self.err.text(f"{PROG}: no keeper for this node's wills, each worker renews its "
                          f"own: {err}")
        os.rmdir(directory)
        return None

    def _on_signal(self, signum: int, frame: object) -> None:
        self.signals.append(signum)   # no lock here: the main thread may hold any of them

    def _base_env(self) -> dict[str, str]:
        base = dict(os.environ)
        if self.cfg.nproc_per_node > 1 and "OMP_NUM_THREADS" not in base:
            # As torchrun does: N workers each using every core would oversubscribe the node.
            base["OMP_NUM_THREADS"] = "1"
            self.err.text(f"{PROG}: setting OMP_NUM_THREADS=1 for each worker (set it "
                          "yourself to choose another value)")
        base.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        if self.cfg.replace_failed:
            base.setdefault("PLUGDIST_RESILIENCE", "1")  # the survivors must shrink, not die
        base.setdefault("PYTHONUNBUFFERED", "1")   # output is relayed line by line
        # a worker that crashes (SIGSEGV, SIGABRT from a heap check, ...) prints every thread's
        # Python stack first, so the summary's stderr tail shows where
        base.setdefault("PYTHONFAULTHANDLER", "1")
        if self.cfg.page is not None:
            base[PAGE_VAR] = "1"   # each worker reports its status to the page
        return base

    def _open_page(self, rdzv: StoreRendezvous) -> None:
        """--page: serve the live page and say where, before any worker starts."""
        if self.cfg.page is None:
            return
        from plugdist._launcher.page import LivePage
        self.page = LivePage(self, rdzv.store, self.cfg.page, self._given_token)
        self.page.start()
        how = (" (it needs the job's store token: header X-Plugdist-Token, or add "
               "?token=... yourself)" if self.page.needs_token else "")
        self.err.text(f"{PROG}: live page at {self.page.url}{how}")

    def _close_page(self, exit_code: int, reason: str) -> None:
        """Show the run's end on the page, keep serving it --page-linger seconds, stop it."""
        if self.page is None:
            return
        page, self.page = self.page, None
        page.finish(exit_code, reason)
        deadline = time.monotonic() + self.cfg.page_linger
        seen = len(self.signals)   # a signal (Ctrl-C) ends the wait
        while len(self.signals) == seen and time.monotonic() < deadline:
            self.sleeper.sleep(max(0.0, min(0.5, deadline - time.monotonic())))
        page.stop()

    # -- the run ---------------------------------------------------------------------------------
    def run(self) -> LaunchResult:
        cfg = self.cfg
        previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in cfg.signals_to_handle:
                previous[sig] = signal.signal(sig, self._on_signal)
            # a worker's exit wakes the monitor at once instead of at its next look (through
            # the sleeper's wakeup fd: the handler itself has nothing to do)
            previous[signal.SIGCHLD] = signal.signal(signal.SIGCHLD, lambda signum, frame: None)
            self.sleeper.install()
        rdzv: StoreRendezvous | None = None
        a: Assignment | None = None
        try:
            _choose_token(cfg)
            rdzv = StoreRendezvous(cfg, interrupted=lambda: bool(self.signals))
            self._open_page(rdzv)
            self.watchdog = _Watchdog()
            base = self._base_env()
            self.keeper = self._keep_node_wills(rdzv)
            if self.keeper is not None:
                base.update(self.keeper.env)
            while True:
                a = rdzv.next_round(a)
                if self.page is not None:
                    self.page.new_round(a)
                outcome = self._round(rdzv, a, base)
                result = self._after_round(rdzv, a, outcome)
                if result is not None:
                    rdzv.close(a.nnodes, a.round)
                    rdzv = None
                    return result
        except RendezvousInterrupted:
            self._stop(self.signals[0], mark=True)
            return self._result(128 + self.signals[0], a)
        except RendezvousError as exc:   # StoreLost included
            self._stop(signal.SIGTERM, mark=True)
            reason = f"{self._change}; then {exc}" if self._change else str(exc)
            return self._result(1, a, reason=reason)
        finally:
            # Reached on every path, including an exception while spawning: nothing survives.
            self._stop(signal.SIGTERM, mark=False)
            for w in self.workers:
                w.drain(2.0)
            if self.keeper is not None:
                self.keeper.close()
                shutil.rmtree(self.keeper.directory, ignore_errors=True)
            self._close_page(1, "the launcher stopped")   # not reached by _result: an error
            if rdzv is not None:
                rdzv.close()
            if self.watchdog is not None:
                self.watchdog.close()
            self.sleeper.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if self._tmp is not None and not self._keep_tmp:
                shutil.rmtree(self._tmp, ignore_errors=True)

    def _result(self, exit_code: int, a: Assignment | None, *, reason: str = "",
                first: Failure | None = None) -> LaunchResult:
        self._close_page(exit_code, reason)
        return LaunchResult(
            config=self.cfg, exit_code=exit_code,
            workers=tuple(w.status() for w in self.workers),
            received_signal=self.signals[0] if self.signals else None,
            leftovers=tuple(self.leftovers), first_failure=first,
            restarts=a.restart_count if a else 0, replacements=self.replacements,
            node_rank=a.node_rank if a else 0,
            nnodes=a.nnodes if a else self.cfg.max_nodes, reason=reason)

    def _round(self, rdzv: StoreRendezvous, a: Assignment, base: dict[str, str]) -> str:
        """Run one round's workers; returns 'succeeded', 'failed', 'signal' or the outcome
        another node (or a membership check) set."""
        self.workers = []
        self.leftovers = []
        self._spawn(a, base)
        multi = self.cfg.max_nodes > 1
        interval = self.cfg.monitor_interval.total_seconds()
        while True:
            if self.signals:
                return "signal"
            failed = [w for w in self.workers
                      if w.returncode is None and w.poll() is not None and w.returncode != 0]
            failed = [w for w in failed if not self._too_late(w)]
            failed = [w for w in failed if not self._survive(a, base, w)]
            if failed:
                self._keep_tmp = True
                for w in failed:
                    w.failed = True
                first = failed[0]
                first.drain(0.5)
                st = first.status()
                failure = Failure(rank=first.rank, local_rank=first.local_rank,
                                  node_rank=a.node_rank, host=self.host, pid=first.proc.pid,
                                  returncode=first.returncode, attempt=a.restart_count,
                                  traceback=tuple(st.traceback()[-60:]),
                                  message=st.error_message, error_file=st.error_file)
                rdzv.publish_failure(a, failure.to_dict())
                return rdzv.end_round(a, f"failed: rank {first.rank} on node {a.node_rank}")
            if all(w.returncode is not None for w in self.workers if not w.replaced):
                left = _live_groups({w.pgid for w in self.workers})
                self.leftovers = [w.rank for w in self.workers if w.pgid in left]
                return "succeeded"
            if multi:
                news = _round_news(rdzv, a)
                if news:
                    return news
            self.sleeper.sleep(interval)

    def _after_round(self, rdzv: StoreRendezvous, a: Assignment,
                     outcome: str) -> LaunchResult | None:
        """Stop what must stop; the run's result, or None to go on with the next round."""
        cfg = self.cfg
        if outcome == "signal":
            sig = self.signals[0]
            self._stop(sig, mark=True)
            if cfg.max_nodes > 1:
                try:
                    rdzv.end_round(a, f"membership: node {a.node_rank} ({self.host}) got "
                                      f"{signal.Signals(sig).name}")
                except RendezvousError:
                    pass
            return self._result(128 + sig, a)
        if outcome == "succeeded":
            self._stop(signal.SIGTERM, mark=False)   # leftovers in the workers' groups
            if cfg.max_nodes > 1:
                rdzv.mark_done(a)
                outcome = self._wait_for_others(rdzv, a)
                if outcome == "signal":
                    return self._result(128 + self.signals[0], a)
            if outcome == "succeeded":
                return self._result(0, a)
        self._stop(signal.SIGTERM, mark=True)
        if outcome.startswith("failed"):
            raw = rdzv.first_failure(a)
            first = Failure.from_dict(raw) if raw else None
            if self._budget_left(a) > 0:
                self.err.text(f"{PROG}: {outcome}; restarting the world "
                              f"({a.restart_count + self.replacements + 1} of {cfg.max_restarts} "
                              f"{cfg.budget_words()})")
                return None
            mine = [w for w in self.workers
                    if w.failed and not w.left_behind and not w.replaced]
            code = exit_code_of(mine[0].returncode) if mine else 1
            return self._result(code, a, first=first)
        # membership change: the world re-forms without using a restart
        self._change = outcome.removeprefix("membership: ")
        self.err.text(f"{PROG}: {self._change}; re-forming the world")
        return None

    def _wait_for_others(self, rdzv: StoreRendezvous, a: Assignment) -> str:
        interval = self.cfg.monitor_interval.total_seconds()
        while not rdzv.all_done(a):
            if self.signals:
                return "signal"
            news = _round_news(rdzv, a)
            if news:
                return news
            self.sleeper.sleep(interval)
        return "succeeded"

    # -- workers ---------------------------------------------------------------------------------
    def _spawn(self, a: Assignment, base: dict[str, str]) -> None:
        cfg = self.cfg
        attempt_dir = os.path.join(self.log_root, f"attempt_{a.round}")
        if cfg.virtual_local_rank:
            self._own_gpu(cfg.nproc_per_node - 1)   # refuse before any worker has started
        self._cpus = None
        if cfg.numa_binding is not None:
            try:
                self._cpus = cpus_for_workers(cfg.numa_binding, cfg.nproc_per_node)
            except (OSError, ValueError) as exc:
                raise LaunchError(f"--numa-binding {cfg.numa_binding}: {exc}") from exc
        self._filtered = {name: (os.path.join(attempt_dir, f"filtered_{name}.log"),
                                 tuple(n.encode() for n in needles))
                          for name, needles in (("stdout", cfg.duplicate_stdout_filters),
                                                ("stderr", cfg.duplicate_stderr_filters))
                          if needles}
        # every worker starts before any output is relayed: relaying threads would delay them
        started = [self._start(a, base, local_rank, os.path.join(attempt_dir, str(local_rank)))
                   for local_rank in range(cfg.nproc_per_node)]
        for worker, (out_plan, err_plan) in started:
            self._relay(worker, out_plan, err_plan)

    def _start(self, a: Assignment, base: dict[str, str], local_rank: int, rank_dir: str,
               replaces: int | None = None) -> tuple[_Worker, tuple[Any, Any]]:
        """Start one worker; ``replaces``: the rank of the dead worker it stands in for, started
        to join the running world. Its output is relayed by :meth:`_relay`."""
        cfg = self.cfg
        cmd = cfg.command()
        os.makedirs(rank_dir, exist_ok=True)
        out_plan, err_plan = plan_streams(cfg, local_rank, rank_dir)
        env = self._worker_env(a, local_rank, base, os.path.join(rank_dir, "error.json"))
        if replaces is not None:
            env.pop("RANK", None)   # the running world assigns the joiner's rank
            env.update(PLUGDIST_JOIN="1", PLUGDIST_REPLACES=str(replaces),
                       PLUGDIST_REPLACEMENT=str(self.replacements))
        stdout: int | None = None            # straight to our stdout: the cheapest
        if cfg.duplicate_stdout_filters or out_plan.file or (out_plan.console
                                                              and cfg.rank_prefix):
            stdout = subprocess.PIPE
        elif not out_plan.console:
            stdout = subprocess.DEVNULL
        cpus = self._cpus
        rank = a.rank_offset + local_rank if replaces is None else replaces
        try:
            with spawning_bound_to(cpus[local_rank] if cpus else None):
                proc = subprocess.Popen(cmd, env=env, start_new_session=True,
                                        stdout=stdout, stderr=subprocess.PIPE)
        except OSError as exc:
            raise LaunchError(f"could not start rank {rank} (local rank {local_rank}) with "
                              f"{cmd[0]!r}: {exc}") from exc
        if self.watchdog is not None:
            self.watchdog.tell(f"+{proc.pid}")
        worker = _Worker(rank, local_rank, proc, env[ERROR_FILE_VAR], env[RESILIENT_MARK_VAR])
        self.workers.append(worker)
        return worker, (out_plan, err_plan)

    def _relay(self, w: _Worker, out_plan: Any, err_plan: Any) -> None:
        """Start the threads that relay ``w``'s output (console, files, the stderr tail)."""
        prefix = f"[rank {w.rank}] ".encode() if self.cfg.rank_prefix else b""
        for name, src, plan, console, tail in (
                ("stdout", w.proc.stdout, out_plan, self.out, None),
                ("stderr", w.proc.stderr, err_plan, self.err, w.tail)):
            if src is None:
                continue
            file = Sink(open(plan.file, "ab"), binary=True) if plan.file else None
            dup = None
            if name in self._filtered:
                # one O_APPEND handle per reader: each line is one write, so the ranks'
                # lines interleave whole
                path, needles = self._filtered[name]
                dup = Duplicate(Sink(open(path, "ab"), binary=True), needles)
            t = threading.Thread(
                target=pump, args=(src, console if plan.console else None, prefix, file, tail,
                                   dup),
                name=f"{PROG}-rank{w.rank}", daemon=True)
            t.start()
            w.readers.append(t)

    def _too_late(self, w: _Worker) -> bool:
        """A replacement that failed after every other worker had finished successfully: the
        run ended before it could join, which is not a failure of the run."""
        if not w.replacement:
            return False
        # the world said so itself (every member had left): the others may still be exiting,
        # and any of them that fails still fails the run
        world_closed = _ended_on(w, WorldClosedError)
        if not world_closed and any(o.returncode != 0 for o in self.workers
                                    if o is not w and not o.replaced and not o.left_behind):
            return False
        w.replaced = True
        self.err.text(f"{PROG}: the replacement for rank {w.rank} (pid {w.proc.pid}) found the "
                      f"run finished before it could join")
        return True

    def _budget_left(self, a: Assignment) -> int:
        """Restarts and replacements left: ``--max-restarts`` counts both."""
        return self.cfg.max_restarts - a.restart_count - self.replacements

    def _survive(self, a: Assignment, base: dict[str, str], w: _Worker) -> bool:
        """Whether the run goes on past ``w``'s failure: replaced (``--replace-failed``, budget
        left) or, with resilient groups on, left behind by the others (a worker killed by a
        signal, or one that left because the others excluded it, while another of this node's
        workers still runs)."""
        if self.cfg.replace_failed and self._budget_left(a) > 0:
            self._replace(a, base, w)
            return True
        lost = w.returncode is not None and (w.returncode < 0
                                             or w.returncode == DistExcludedError.exit_code)
        others = any(o.poll() is None and o.runs_resilient_groups()
                     for o in self.workers if o is not w)
        if not (lost and others):
            return False
        self._keep_tmp = True
        w.failed = w.left_behind = True
        w.drain(0.5)
        why = ("its replacements are used up (--max-restarts)" if self.cfg.replace_failed
               else "no replacement without --replace-failed")
        self.err.text(f"{PROG}: rank {w.rank} (local rank {w.local_rank}, pid {w.proc.pid}) "
                      f"{w.status().cause()}; the others go on without it ({why})")
        if self.watchdog is not None:
            self.watchdog.tell(f"-{w.pgid}")
        return True

    def _replace(self, a: Assignment, base: dict[str, str], dead: _Worker) -> None:
        """--replace-failed: report ``dead`` and start one worker that joins the running world
        in its place (the survivors admit it at a step boundary)."""
        self._keep_tmp = True
        dead.failed = dead.replaced = True
        dead.drain(0.5)
        self.replacements += 1
        st = dead.status()
        self.err.text(f"{PROG}: rank {dead.rank} (local rank {dead.local_rank}, pid "
                      f"{dead.proc.pid}) {st.cause()}; the others go on; starting a "
                      f"replacement that joins them ({self.replacements} of "
                      f"{self.cfg.max_restarts} {self.cfg.budget_words()})")
        for line in st.traceback()[-20:] or st.stderr_tail[-5:]:
            self.err.text("    " + line)
        if self.watchdog is not None:
            self.watchdog.tell(f"-{dead.pgid}")
        rank_dir = os.path.join(self.log_root, f"attempt_{a.round}",
                                f"{dead.local_rank}_replacement_{self.replacements}")
        worker, (out_plan, err_plan) = self._start(a, base, dead.local_rank, rank_dir,
                                                   replaces=dead.rank)
        worker.replacement = True
        self._relay(worker, out_plan, err_plan)

    def _worker_env(self, a: Assignment, local_rank: int, base: dict[str, str],
                    error_file: str) -> dict[str, str]:
        cfg = self.cfg
        rank = str(a.rank_offset + local_rank)
        env = dict(base)
        env.update(
            RANK=rank, LOCAL_RANK=str(local_rank), GROUP_RANK=str(a.node_rank),
            ROLE_RANK=rank, ROLE_NAME=cfg.role, ROLE_WORLD_SIZE=str(a.world_size),
            LOCAL_WORLD_SIZE=str(a.local_world_size), WORLD_SIZE=str(a.world_size),
            GROUP_WORLD_SIZE=str(a.nnodes), MASTER_ADDR=a.master_addr,
            MASTER_PORT=str(a.master_port), TORCHELASTIC_RUN_ID=cfg.run_id,
            TORCHELASTIC_RESTART_COUNT=str(a.restart_count),
            TORCHELASTIC_MAX_RESTARTS=str(cfg.max_restarts),
            # torch's own scripts would talk torch's store protocol to an agent store; ours is
            # a plugdist store, announced to plugdist as PLUGDIST_AGENT_STORE instead
            TORCHELASTIC_USE_AGENT_STORE="False",
            PLUGDIST_RUN_ID=cfg.run_id, PLUGDIST_LAUNCHED="1",
            PLUGDIST_AGENT_STORE=a.agent_store, PLUGDIST_RDZV_ROUND=str(a.round),
        )
        env[ERROR_FILE_VAR] = error_file
        env[RESILIENT_MARK_VAR] = os.path.join(os.path.dirname(error_file), "resilient")
        if cfg.virtual_local_rank:
            env["LOCAL_RANK"] = "0"
            env["CUDA_VISIBLE_DEVICES"] = self._own_gpu(local_rank)
        return env

    def _own_gpu(self, local_rank: int) -> str:
        """``--virtual-local-rank``: the one GPU a worker sees, taken from the launcher's own
        ``CUDA_VISIBLE_DEVICES`` list when it has one."""
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is None:
            return str(local_rank)
        devices = [d.strip() for d in visible.split(",")]
        if local_rank >= len(devices):
            raise LaunchError(f"--virtual-local-rank: local rank {local_rank} has no GPU in "
                              f"CUDA_VISIBLE_DEVICES={visible} ({len(devices)} listed); use "
                              f"--nproc-per-node {len(devices)} or list more devices")
        return devices[local_rank]

    def _stop(self, sig: int, *, mark: bool) -> None:
        """Send ``sig`` to every worker's process group; SIGKILL what outlives the grace period.

        Also reaps the workers. Idempotent: groups already empty are skipped. A further signal
        to the launcher while it waits skips the rest of the grace period.
        """
        def still_running(ws: list[_Worker]) -> list[_Worker]:
            groups = _live_groups({w.pgid for w in ws})
            return [w for w in ws if w.poll() is None or w.pgid in groups]

        live = still_running([w for w in self.workers if not w.released])
        for w in live:
            if mark and w.returncode is None:
                w.stopped = True
            _killpg(w.pgid, sig)
        seen_signals = len(self.signals)
        deadline = time.monotonic() + self.cfg.grace_period.total_seconds()
        while live and time.monotonic() < deadline and len(self.signals) == seen_signals:
            self.sleeper.sleep(0.01)
            live = still_running(live)
        for w in live:
            _killpg(w.pgid, signal.SIGKILL)
        for w in live:
            try:
                w.returncode = w.proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                pass  # stuck in the kernel (uninterruptible I/O); nothing more we can do
        for w in self.workers:
            if w.returncode is not None and not w.released and self.watchdog is not None:
                w.released = True
                self.watchdog.tell(f"-{w.pgid}")
