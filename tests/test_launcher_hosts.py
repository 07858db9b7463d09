"""plugdist-run across hosts, and plugdist scripts under other launchers (mpiexec, torchrun).

Hosts are two Linux network namespaces joined by a veth pair (``plugdist.testing.hosts``), made
and removed by the test. Each namespace runs its own plugdist-run with no --node-rank; they
meet at the first one's address.
Skipped, with the reason, where namespaces cannot be created (not root, no ``ip``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from plugdist.testing.hosts import Hosts

SCRIPTS = Path(__file__).parent / "launcher_scripts"
WORKER = str(SCRIPTS / "launcher_worker.py")
LAUNCHER = [sys.executable, "-m", "plugdist_run"]
VENV_BIN = Path(sys.executable).parent


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def _gloo() -> None:
    import plugdist
    if not plugdist.is_backend_available("gloo"):
        pytest.skip("plugdist-gloo is not installed")


# --------------------------------------------------------------------------- two hosts


def token_file(tmp_path: Path) -> str:
    """A secret in a file only its owner reads: how every node gets the store's token."""
    path = tmp_path / "store.token"
    path.write_text(os.urandom(32).hex() + "\n")
    path.chmod(0o600)
    return str(path)


def _finish(procs: list[subprocess.Popen[str]], timeout: float) -> list[tuple[str, str]]:
    try:
        return [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


@pytest.mark.timeout(150)
def test_ddp_across_two_hosts_matches_one_host(hosts: Hosts, tmp_path: Path) -> None:
    _gloo()
    train = str(SCRIPTS / "ddp_train.py")
    endpoint = f"{hosts.addr[0]}:29400"
    argv = [*LAUNCHER, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", endpoint, "--rdzv-id", "ddp",
            "--rdzv-conf", f"token_file={token_file(tmp_path)}", train, str(tmp_path),
            "two_hosts"]
    procs = [hosts.popen(h, argv) for h in (0, 1)]
    one = subprocess.Popen([*LAUNCHER, "--standalone", "--nproc-per-node", "4", train,
                            str(tmp_path), "one_host"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    results = _finish([*procs, one], 140)
    for p, (_, err) in zip([*procs, one], results, strict=True):
        assert p.returncode == 0, err
    two, single = read_json(tmp_path / "two_hosts.json"), read_json(tmp_path / "one_host.json")
    assert two["world"] == single["world"] == 4
    assert two["params"] == single["params"]


@pytest.mark.timeout(90)
def test_lost_host_then_the_world_reforms(hosts: Hosts, tmp_path: Path) -> None:
    """--nnodes 1:2 across the two hosts; SIGKILL the second host's launcher: the first sees
    the node lost, re-forms alone and finishes."""
    conf = (f"last_call_timeout=1,keep_alive_interval=0.2,keep_alive_max_attempt=5,"
            f"join_timeout=10,token_file={token_file(tmp_path)}")
    argv = [*LAUNCHER, "--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{hosts.addr[0]}:29401", "--rdzv-conf", conf,
            "--grace-period", "1", WORKER, str(tmp_path), "elastic", "4"]
    first = hosts.popen(0, argv)
    second = hosts.popen(1, argv)
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"w4.rank{r}.json").exists() for r in range(4)):
        if first.poll() is not None or time.monotonic() > deadline:
            _finish([first, second], 5)
            pytest.fail(f"no 4-rank world across the hosts: {first.communicate()}")
        time.sleep(0.05)
    w4 = [read_json(tmp_path / f"w4.rank{r}.json")["env"] for r in range(4)]
    assert {e["MASTER_ADDR"] for e in w4} <= set(hosts.addr)
    assert {e["PLUGDIST_AGENT_STORE"] for e in w4} == {f"{hosts.addr[0]}:29401"}
    second.kill()
    second.wait()
    _, err = first.communicate(timeout=40)
    assert first.returncode == 0, err
    assert "no heartbeat" in err and "re-forming the world" in err
    assert "lost node 0 (" in err or "lost node 1 (" in err
    for r in range(2):
        env = read_json(tmp_path / f"w2.rank{r}.json")["env"]
        assert (env["WORLD_SIZE"], env["GROUP_WORLD_SIZE"]) == ("2", "1")


# --------------------------------------------------------------------------- other launchers


def _mpiexec() -> str:
    path = shutil.which("mpiexec", path=str(VENV_BIN)) or shutil.which("mpiexec")
    if path is None:
        pytest.skip("mpiexec is not installed")
    return path


@pytest.mark.timeout(120)
def test_under_mpiexec_tutorial_mpi_call_and_gloo_without_rank(tmp_path: Path) -> None:
    """``init_process_group('mpi', rank=0, world_size=0)`` takes rank and world from MPI (even
    with a MASTER_ADDR in the environment); a gloo script with no RANK takes them from
    mpiexec's variables and finds LOCAL_RANK set."""
    import plugdist
    if not plugdist.is_backend_available("mpi"):
        pytest.skip("plugdist-mpi is not usable here")
    _gloo()
    mpiexec = _mpiexec()
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    mpi_out, gloo_out = tmp_path / "mpi", tmp_path / "gloo"
    mpi_out.mkdir()
    gloo_out.mkdir()
    procs = [
        subprocess.Popen([mpiexec, "-n", "3", sys.executable, str(SCRIPTS / "mpi_tutorial.py"),
                          str(mpi_out)], env={**env, "MASTER_ADDR": "10.255.255.1"},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
        subprocess.Popen([mpiexec, "-n", "3", sys.executable,
                          str(SCRIPTS / "gloo_allreduce.py"), str(gloo_out)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
    ]
    results = _finish(procs, 110)
    for p, (_, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err
    for rank in range(3):
        assert read_json(mpi_out / f"rank{rank}.json") == {
            "rank": rank, "world": 3, "sum": 6.0, "warned": rank != 0}
        assert read_json(gloo_out / f"rank{rank}.json") == {
            "rank": rank, "world": 3, "sum": 6.0, "launched": False,
            "local_rank": str(rank), "env_rank": str(rank), "store": "TCPStore:TCPStore"}


@pytest.mark.timeout(150)
def test_plain_torch_script_on_plugdist_backends_under_bare_mpiexec(tmp_path: Path) -> None:
    """``torch.distributed.init_process_group("plugdist_mpi")`` (and ``plugdist_gloo``) in a
    script that never imports plugdist, under ``mpiexec -n 3`` with nothing set: torch's env://
    takes rank, world size and master from mpiexec's variables."""
    import plugdist
    if not plugdist.is_backend_available("mpi"):
        pytest.skip("plugdist-mpi is not usable here")
    _gloo()
    mpiexec = _mpiexec()
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    script = str(Path(__file__).parent / "torch_scripts" / "torch_only_script.py")
    outs = {b: tmp_path / b for b in ("plugdist_mpi", "plugdist_gloo")}
    procs = []
    for backend, out in outs.items():
        out.mkdir()
        procs.append(subprocess.Popen([mpiexec, "-n", "3", sys.executable, script, backend,
                                       str(out)], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    results = _finish(procs, 140)
    for p, (_, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err
    for backend, out in outs.items():
        for rank in range(3):
            assert read_json(out / f"rank{rank}.json") == {
                "rank": rank, "world": 3, "sum": 6.0, "backend": backend,
                "sparse": [1.0, 1.0, 1.0, 3.0], "env_rank": str(rank),
                "local_rank": str(rank)}


@pytest.mark.timeout(120)
def test_plugdist_script_under_torchrun_uses_the_agent_store(tmp_path: Path) -> None:
    """torchrun serves its store at MASTER_PORT and says TORCHELASTIC_USE_AGENT_STORE=True: a
    plugdist script must connect to it, not try to serve a second one on that port."""
    _gloo()
    torchrun = shutil.which("torchrun", path=str(VENV_BIN))
    if torchrun is None:
        pytest.skip("torchrun is not installed next to this python")
    res = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2",
                          str(SCRIPTS / "gloo_allreduce.py"), str(tmp_path)],
                         capture_output=True, text=True, timeout=110)
    assert res.returncode == 0, res.stderr
    for rank in range(2):
        assert read_json(tmp_path / f"rank{rank}.json") == {
            "rank": rank, "world": 2, "sum": 3.0, "launched": True, "local_rank": str(rank),
            "env_rank": str(rank), "store": "PrefixStore:TorchStoreAdapter"}   # torchrun's


@pytest.mark.timeout(90)
def test_mpi_backend_under_plugdist_run_is_refused_not_split(tmp_path: Path) -> None:
    """plugdist-run starts separate processes, each an MPI world of one: the MPI backend must
    say so rather than let each run a training of its own."""
    import plugdist
    if not plugdist.is_backend_available("mpi"):
        pytest.skip("plugdist-mpi is not usable here")
    res = subprocess.run([*LAUNCHER, "--standalone", "--nproc-per-node", "2",
                          str(SCRIPTS / "mpi_tutorial.py"), str(tmp_path)],
                         capture_output=True, text=True, timeout=80)
    assert res.returncode == 1
    assert "MPI sees 1 process(es) in COMM_WORLD, but WORLD_SIZE=2" in res.stderr
    assert "mpiexec -n 2 python script.py" in res.stderr
    assert not list(tmp_path.glob("rank*.json"))


@pytest.mark.resilience
@pytest.mark.timeout(200)
def test_replace_failed_across_two_hosts(hosts: Hosts, tmp_path: Path) -> None:
    """2 hosts x 2 workers of examples/resilient_train.py under --replace-failed; the second
    host's first worker SIGKILLs itself: that host's launcher starts a replacement, which joins
    the running world across the hosts; the run ends with one set of parameters everywhere."""
    _gloo()
    example = str(Path(__file__).resolve().parents[1] / "examples" / "resilient_train.py")
    argv = [*LAUNCHER, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{hosts.addr[0]}:29402", "--rdzv-id", "ft", "--replace-failed",
            "--max-restarts", "1", "--monitor-interval", "0.05", example, "--steps", "30",
            "--hidden", "32", "--step-time", "0.05", "--kill-rank", "2", "--kill-at-step", "5",
            "--steps-after-full", "10", "--max-steps", "100000"]   # ends once the
    # replacement joined, however slow it is to start
    token = {"PLUGDIST_STORE_TOKEN": os.urandom(24).hex()}  # every node's, by environment
    procs = [hosts.popen(h, argv, token) for h in (0, 1)]
    results = _finish(procs, 180)
    for p, (_out, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err[-4000:]
    lines = [json.loads(x[x.index("{"):]) for out, _ in results for x in out.splitlines()
             if "{" in x]
    steps = [x for x in lines if "step" in x and "final" not in x]
    finals = [x for x in lines if x.get("final")]
    assert len(finals) == 4 and len({f["params_sha1"] for f in finals}) == 1, finals
    assert len({f["step"] for f in finals}) == 1 and finals[0]["step"] >= 30, finals
    assert [x["step"] for x in steps] == list(range(finals[0]["step"]))
    sizes = [x["world_size"] for x in steps]
    assert sizes[0] == 4 and 3 in sizes and sizes[-10:] == [4] * 10, sizes
    assert "starting a replacement" in results[1][1], results[1][1][-3000:]


class _Lines:
    """Collects a process's output lines on a thread of its own, so a test can wait for one."""

    def __init__(self, stream: Any) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            self.lines.append(line)

    def text(self) -> str:
        self._thread.join(10)
        return "".join(self.lines)

    def records(self) -> list[dict[str, Any]]:
        return [json.loads(x[x.index("{"):]) for x in list(self.lines) if "{" in x]


def _wait_for(what: str, ok: Callable[[], bool], timeout: float,
              procs: list[subprocess.Popen[str]]) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise AssertionError(f"never saw {what} (launchers' exit codes: "
                                 f"{[p.poll() for p in procs]})")
        time.sleep(0.05)


@pytest.mark.resilience
@pytest.mark.timeout(300)
def test_a_host_cut_off_by_a_partition_is_excluded_then_replaced(hosts: Hosts,
                                                                  tmp_path: Path) -> None:
    """2 hosts x 2 workers of examples/resilient_train.py under --replace-failed. The network
    between the hosts drops every packet (both ways) until the survivors on the first host
    have shrunk past the cut-off workers and trained on; then it heals. The cut-off workers
    learn that they were excluded and leave (exit 75), their launcher replaces them, the
    replacements join across the hosts, and the world is full again: one set of parameters
    everywhere, steps in order."""
    _gloo()
    example = str(Path(__file__).resolve().parents[1] / "examples" / "resilient_train.py")
    stop = tmp_path / "stop"
    # the launchers' own liveness outlasts the partition: the workers' resilience handles it
    conf = "keep_alive_interval=1,keep_alive_max_attempt=600"
    argv = [*LAUNCHER, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{hosts.addr[0]}:29403", "--rdzv-id", "cut", "--rdzv-conf", conf,
            "--replace-failed", "--max-restarts", "2", "--monitor-interval", "0.05", example,
            "--steps", "100000", "--max-steps", "100000", "--stop-file", str(stop),
            "--hidden", "32", "--step-time", "0.05"]
    env = {"PLUGDIST_HEARTBEAT_TIMEOUT": "3", "PLUGDIST_STORE_TOKEN": os.urandom(24).hex()}
    procs = [hosts.popen(h, argv, env) for h in (0, 1)]
    out = [_Lines(p.stdout) for p in procs]
    err = [_Lines(p.stderr) for p in procs]
    cut_at = healed_at = 0
    try:
        def sizes_since(n: int) -> list[int]:
            return [r["world_size"] for r in out[0].records()[n:] if "step" in r]

        _wait_for("a 4-rank step", lambda: 4 in sizes_since(0), 120, procs)
        cut_at = len(out[0].records())
        hosts.partition(True)
        _wait_for("the survivors training on as 2 ranks", lambda: 2 in sizes_since(cut_at),
                  60, procs)
        hosts.partition(False)
        healed_at = len(out[0].records())
        _wait_for("5 steps of the full world after the heal",
                  lambda: sizes_since(healed_at).count(4) >= 5, 120, procs)
        stop.touch()
        for p in procs:
            p.wait(60)
    finally:
        hosts.partition(False)
        for p in procs:
            if p.poll() is None:
                p.kill()
    texts = [e.text() for e in err]
    for o in out:
        o.text()  # its reader has taken every line (the last ones are the final records)
    for p, text in zip(procs, texts, strict=True):
        assert p.returncode == 0, text[-4000:]
    records = out[0].records() + out[1].records()
    steps = [r for r in out[0].records() if "step" in r and "final" not in r]
    assert [r["step"] for r in steps] == list(range(len(steps))), "steps out of order"
    finals = [r for r in records if r.get("final")]
    assert len(finals) == 4 and len({f["params_sha1"] for f in finals}) == 1, finals
    excluded = [r for r in out[1].records() if "excluded" in r]
    assert len(excluded) == 2, (excluded, texts[1][-3000:])
    assert texts[1].count("starting a replacement") == 2, texts[1][-3000:]
