"""torch's own DDP, FSDP2 and DTensor over plugdist_gloo, plugdist_toy and plugdist_mpi (Open MPI
under ULFM) when a peer is SIGKILLed inside a backward pass, without plugdist's resilient comm
hook: what a trainer's script written for torch sees (worker:
launcher_scripts/torch_peer_death.py).

Each world loses a rank per round, the second round's victim being rank 0, at a random step and
layer drawn from a seed (printed with every failure, to rerun it). Every survivor must catch
``DistRankFailureError`` naming the dead rank (never a signal: the launcher's output is checked
for any), shrink, find torch's rank, size, ``group.WORLD`` and a new ``DistributedSampler`` in
agreement with plugdist's, and train on with a fresh DDP whose steps match the same steps
computed locally over every rank's batch. benchmarks/torch_peer_death_stress.py runs these
worlds again and again (figures in docs/resilience.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from plugdist.testing.harness import free_port
from test_ulfm import _libmpi, _prefix, needs_ulfm

pytestmark = pytest.mark.resilience

ROOT = Path(__file__).resolve().parents[1]
WORKER = str(ROOT / "tests" / "launcher_scripts" / "torch_peer_death.py")
# what a process that died of a signal leaves in the launcher's output (plugdist-run names the
# signal; faulthandler prints "Fatal Python error")
SIGNAL_WORDS = ("SIGSEGV", "SIGABRT", "SIGBUS", "SIGFPE", "SIGILL", "Segmentation fault",
                "Fatal Python error")


@dataclass
class World:
    """One run: how it was set up, the launcher's output and each survivor's result."""

    backend: str
    nproc: int
    victims: list[int]
    kinds: list[str]
    seed: int
    load: int = 0
    returncode: int | None = None
    output: str = ""
    results: dict[int, dict[str, Any]] = field(default_factory=dict)

    def describe(self) -> str:
        return (f"backend {self.backend}, {self.nproc} ranks, victims {self.victims}, kinds "
                f"{self.kinds}, SEED={self.seed}, {self.load} busy loops")


@contextlib.contextmanager
def busy_loops(count: int) -> Iterator[None]:
    """``count`` processes spinning on a CPU each, for as long as the block runs: the slowed
    machine (2 cores here). Each also ends when its parent does."""
    spin = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    sum(range(10**5))"
    hogs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(count)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def run_world(world: World, tmp: Path, timeout: float = 170.0) -> World:
    """Run ``world`` (plugdist-run for gloo and toy; Open MPI's ``mpiexec --with-ft ulfm`` for
    mpi, with the world's store served by this process, as a launcher serves it: under a bare
    mpiexec rank 0 serves it and takes it along when it dies). Fills in its outcome."""
    results = tmp / "results"
    results.mkdir(parents=True)
    env = dict(os.environ, BACKEND=world.backend, VICTIMS=",".join(map(str, world.victims)),
               KINDS=",".join(world.kinds), SEED=str(world.seed), RESULT_DIR=str(results),
               PLUGDIST_TORCH_WORLD="1", HIDDEN="32" if world.backend == "toy" else "64")
    store = None
    if world.backend == "mpi":
        from plugdist import TCPStore

        store = TCPStore("127.0.0.1", 0, None, is_master=True)
        prefix = _prefix()
        for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name, None)
        env.update(PATH=f"{prefix / 'bin'}{os.pathsep}{env['PATH']}",
                   MPI4PY_LIBMPI=str(_libmpi(prefix)), PLUGDIST_RESILIENCE="1",
                   PLUGDIST_AGENT_STORE=f"127.0.0.1:{store.port}", INIT_METHOD="env://")
        cmd = [str(prefix / "bin" / "mpiexec"), "--with-ft", "ulfm", "--oversubscribe",
               "--bind-to", "none", "-n", str(world.nproc), sys.executable, WORKER]
        if os.geteuid() == 0:
            cmd.insert(1, "--allow-run-as-root")
    else:
        cmd = [sys.executable, "-m", "plugdist_run", "--nproc-per-node", str(world.nproc),
               "--monitor-interval", "0.05", WORKER]
    try:
        with busy_loops(world.load):
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True,
                                    start_new_session=True)
            try:
                world.output, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every rank it started
                world.output, _ = proc.communicate()
                world.output += f"\n(still running after {timeout}s: killed)"
            world.returncode = proc.returncode
    finally:
        if store is not None:
            store.close()
    for f in results.glob("*.json"):
        found = json.loads(f.read_text())
        world.results[found["launch_rank"]] = found
    return world


def survivors(nproc: int, victims: list[int]) -> list[list[int]]:
    """The launch ranks alive after each round (ranks compacted in launch order: round i's
    victim is the one at index ``victims[i]``)."""
    alive, after = list(range(nproc)), []
    for victim in victims:
        alive = alive[:victim] + alive[victim + 1:]
        after.append(alive)
    return after


def check_world(world: World) -> None:
    """What every world must show; each failure names the world and shows the output's end."""
    where = f"({world.describe()})\n{_tail(world.output)}"
    for word in SIGNAL_WORDS:
        assert word not in world.output, f"a process died of a signal {where}"
    assert world.returncode == 0, f"exit status {world.returncode} {where}"
    alive_after = survivors(world.nproc, world.victims)
    assert sorted(world.results) == alive_after[-1], f"survivors {sorted(world.results)} {where}"
    for launch, result in world.results.items():
        for i, seen in enumerate(result["rounds"]):
            victim, size = world.victims[i], len(alive_after[i])
            rank = alive_after[i].index(launch)
            what = f"launch rank {launch}, round {i} ({seen['kind']}) {where}"
            assert seen["error_type"] == "DistRankFailureError", \
                f"{seen['error_type']}: {seen['error']}\n{seen.get('traceback', '')} {what}"
            assert seen["error_ranks"] == [victim] and f"rank {victim} " in seen["error"], \
                f"{seen['error_ranks']}: {seen['error']} {what}"
            assert seen["after"] == {
                "rank": rank, "size": size, "torch_rank": rank, "torch_size": size,
                "world_rank": rank, "world_size": size, "world_ranks": list(range(size)),
                "sampler": [size, rank]}, f"{seen['after']} {what}"
            assert seen["bad"] == [], f"{seen['bad']} {what}"
    assert len({r["sha1"] for r in world.results.values()}) == 1, f"parameters differ {where}"
    if world.backend != "mpi":  # plugdist-run names each victim, killed by SIGKILL
        for victim in _victims_by_launch_rank(world):
            assert f"rank {victim} (local rank {victim}, pid" in world.output and \
                "killed by SIGKILL" in world.output, f"rank {victim} {where}"


def _victims_by_launch_rank(world: World) -> list[int]:
    before = [list(range(world.nproc)), *survivors(world.nproc, world.victims)]
    return [before[i][v] for i, v in enumerate(world.victims)]


def _tail(output: str, lines: int = 60) -> str:
    kept = [ln for ln in output.splitlines() if "NBC_Progress" not in ln and ln.strip()]
    return "\n".join(kept[-lines:])


def _draw(nproc: int) -> tuple[int, list[int]]:
    """A seed, and victims by round: a random rank other than 0, then rank 0."""
    seed = random.randrange(1 << 30)
    return seed, [random.Random(seed).randrange(1, nproc), 0]


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("kinds", "load"), [
    (["builtin", "static"], 0),
    (["unused", "pyhook"], 2),   # the slowed machine: a busy loop on each core
    (["fsdp", "dtensor"], 0),
], ids=["ddp-static", "unused-pyhook-slowed", "fsdp-dtensor"])
def test_gloo(tmp_path: Path, kinds: list[str], load: int) -> None:
    seed, victims = _draw(4)
    check_world(run_world(World("gloo", 4, victims, kinds, seed, load), tmp_path))


@pytest.mark.timeout(200)
def test_toy(tmp_path: Path) -> None:
    """The backend with only send/recv: every collective torch asks for is composed."""
    seed, victims = _draw(4)
    check_world(run_world(World("toy", 4, victims, ["pyhook", "builtin"], seed), tmp_path))


@needs_ulfm
@pytest.mark.timeout(200)
def test_mpi_under_ulfm(tmp_path: Path) -> None:
    seed, victims = _draw(4)
    check_world(run_world(World("mpi", 4, victims, ["builtin", "fsdp"], seed), tmp_path))


@pytest.mark.timeout(120)
def test_a_torch_only_script_gets_an_error_never_a_signal(tmp_path: Path) -> None:
    """torch's own ``init_process_group("plugdist_gloo")``, no plugdist world (so no resilient
    groups): a peer SIGKILLed in backward is the transport's error on every survivor, caught in
    Python, and each exits cleanly."""
    seed = random.randrange(1 << 30)
    victim = random.Random(seed).randrange(3)
    results = tmp_path / "results"
    results.mkdir()
    env = dict(os.environ, BACKEND="gloo", VICTIMS=str(victim), KINDS="builtin", SEED=str(seed),
               RESULT_DIR=str(results), TORCH_ONLY="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), WORLD_SIZE="3")
    procs = [subprocess.Popen([sys.executable, WORKER], env=dict(env, RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(3)]
    outputs = [p.communicate(timeout=100)[0] for p in procs]
    where = f"(SEED={seed}, victim {victim})"
    for r, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == (-signal.SIGKILL if r == victim else 0), \
            f"rank {r} exited with {p.returncode} {where}:\n{out[-3000:]}"
    for r in range(3):
        if r != victim:
            found = json.loads((results / f"survivor-{r}.json").read_text())
            assert found["error_type"] in ("DistNetworkError", "DistRankFailureError"), \
                f"rank {r}: {found} {where}"


def test_a_failed_ops_future_is_torchs_error_and_backward_raises_plugdists() -> None:
    """The mechanism, in one process: outside a backward pass, the future of a failed op holds
    torch's own error (a C++ reader, ``collect_all``, sees an error, not a value), raised as
    torch's RuntimeError naming plugdist's; inside one, the future completes with the op's
    tensors and ``backward()`` raises plugdist's error itself, ranks included."""
    import torch
    from plugdist._backend.work import Work
    from plugdist._torch.bridge import BridgeWork
    from plugdist.errors import DistRankFailureError

    out = torch.ones(2)
    work = Work(op="all_reduce", rank=0, group="g", backend="test")
    fut = BridgeWork(work, [out]).get_future()
    work.set_exception(DistRankFailureError("rank 1 died", (1,)))
    with pytest.raises(RuntimeError, match="DistRankFailureError.*rank 1 died") as raised:
        torch.futures.collect_all([fut]).wait()[0].wait()
    assert not isinstance(raised.value, DistRankFailureError)

    work = Work(op="all_reduce", rank=0, group="g", backend="test")
    bridge = BridgeWork(work, [out])
    seen: dict[str, Any] = {}

    def fail_during_backward(grad: torch.Tensor) -> torch.Tensor:
        future = bridge.get_future()
        work.set_exception(DistRankFailureError("rank 1 died", (1,)))
        seen["value"] = future.wait()
        return grad

    x = torch.ones(2, requires_grad=True)
    x.register_hook(fail_during_backward)
    with pytest.raises(DistRankFailureError, match="rank 1 died") as caught:
        (x * 2).sum().backward()
    assert caught.value.ranks == (1,)
    assert seen["value"][0] is out
