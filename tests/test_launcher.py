"""plugdist-run: real launcher processes starting real workers (tests/launcher_scripts/).

Workers import only the standard library, except the one end-to-end test that runs a real
gloo all_reduce, so most launches cost little beyond the launcher's own start.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from plugdist._launcher import (
    LaunchConfig,
    extract_traceback,
    free_port,
    is_launched,
    parse_args,
    split_argv,
)

SCRIPTS = Path(__file__).parent / "launcher_scripts"
WORKER = str(SCRIPTS / "launcher_worker.py")
LAUNCHER = [sys.executable, "-m", "plugdist_run"]   # the console script's module: no torch


def launch(*args: str, timeout: float = 60, env: dict[str, str] | None = None,
           cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*LAUNCHER, *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=cwd)


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def wait_for(paths: list[Path], proc: subprocess.Popen[str], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"launcher exited early with {proc.returncode}:\n{out}\n{err}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"never appeared: {[str(p) for p in paths if not p.exists()]}")
        time.sleep(0.02)


def alive(pid: int, marker: str) -> bool:
    """Whether ``pid`` is still a live (non-zombie) process whose command line has ``marker``.

    The marker (the test's tmp_path) guards against the pid having been reused meanwhile.
    """
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    state = stat[stat.rfind(b")") + 2:].split()[0]
    return state not in (b"Z", b"X") and marker.encode() in cmdline


def pids(tmp_path: Path, pattern: str) -> list[int]:
    return [int(p.read_text()) for p in sorted(tmp_path.glob(pattern))]


def summary_of(stderr: str) -> str:
    """The launcher's failure summary: everything from its header line on."""
    lines = stderr.splitlines()
    heads = [i for i, line in enumerate(lines)
             if line.startswith("plugdist-run: ") and "workers failed" in line]
    assert heads, f"no failure summary in stderr:\n{stderr}"
    return "\n".join(lines[heads[-1]:])


pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(),
                                reason="the orphan checks read /proc (Linux)")


@pytest.fixture(autouse=True)
def _kill_leftovers(tmp_path: Path):
    """After each test (its assertions already made), SIGKILL any process it left behind.

    A launcher bug would otherwise leave sleeping workers around for minutes after a failure.
    """
    yield
    marker = str(tmp_path).encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "cmdline").read_bytes():
                    os.kill(int(entry.name), signal.SIGKILL)
            except OSError:
                pass


# --------------------------------------------------------------------------- in-process checks


@pytest.mark.timeout(30)
def test_the_default_run_id_is_one_per_job() -> None:
    """Several nodes agree on the run id without a flag: the scheduler's job id, or else a
    digest of what every node of the job is started with; another job on the same endpoint
    (another command or size, or another scheduler job) gets another id, so it never joins
    this one's rounds."""
    from plugdist._launcher.arguments import default_run_id

    def rid(nodes: int = 2, endpoint: str = "h:29400", cmd: tuple[str, ...] = ("t.py", "--lr=1"),
            env: dict[str, str] | None = None) -> str:
        return default_run_id(nodes, "c10d", endpoint, list(cmd), env or {})

    assert rid() == rid() and rid().startswith("cmd-") and rid() != "none"
    assert len({rid(), rid(nodes=3), rid(endpoint="h:29401"), rid(cmd=("t.py", "--lr=2"))}) == 4
    assert rid(env={"SLURM_JOB_ID": "4711", "SLURM_STEP_ID": "0"}) == "slurm-4711.0"
    assert rid(env={"SLURM_JOB_ID": "4711"}) != rid(env={"SLURM_JOB_ID": "4712"})
    assert rid(env={"PBS_JOBID": "12.pbs server"}) == "pbs-12.pbs_server"
    assert rid(env={"SLURM_STEP_ID": "0"}) == rid()  # a step id alone names no job
    assert len(rid(nodes=1)) == 12 and rid(nodes=1) != rid(nodes=1)


@pytest.mark.timeout(30)
def test_parse_args_and_validation(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = parse_args(["--nproc-per-node", "3", "--standalone", WORKER, "--", "-m", "--nnodes"])
    assert (cfg.nproc_per_node, cfg.nnodes, cfg.master_addr) == (3, 1, None)
    assert cfg.args == ("--", "-m", "--nnodes")       # everything after the script, untouched
    assert cfg.master_port is None and len(cfg.run_id) == 12 and cfg.standalone
    cfg = parse_args(["--nnodes=2", "--node_rank", "1", "--master-port", "1234", WORKER])
    assert (cfg.nnodes, cfg.node_rank, cfg.master_port) == (2, 1, 1234)
    assert cfg.run_id == parse_args(["--nnodes=2", "--node_rank", "0", "--master-port", "1234",
                                     WORKER]).run_id  # every node alike, no flag needed
    assert parse_args(["-m", "pkg.mod", "x"]).command()[1:] == ["-m", "pkg.mod", "x"]
    assert split_argv(["--run-id", "r", "--", "-x.py", "a"],
                      {"--run-id"}) == (["--run-id", "r"], ["-x.py", "a"])
    # torchrun's flags, both spellings, torchrun's values
    cfg = parse_args(["--nnodes", "1:3", "--rdzv_backend=c10d", "--rdzv-endpoint", "h:29400",
                      "--rdzv_id", "job7", "--rdzv-conf", "join_timeout=5,last_call_timeout=0.5",
                      "--max_restarts", "2", "--monitor-interval", "0.5", "--start_method",
                      "fork", "--role", "trainer", "--log_dir", "/tmp/x", "-r", "0:3,1:1",
                      "-t3", "--local-ranks-filter", "0,2", "--local_addr", "10.0.0.9",
                      "--signals-to-handle", "SIGUSR1,TERM", "--shutdown-timeout", "2",
                      "--no-rank-prefix", "--run-path", WORKER])
    assert (cfg.min_nodes, cfg.max_nodes, cfg.node_rank) == (1, 3, None)
    assert (cfg.rdzv_backend, cfg.rdzv_endpoint, cfg.run_id) == ("c10d", "h:29400", "job7")
    assert cfg.rdzv.join_timeout.total_seconds() == 5
    assert cfg.rdzv.last_call_timeout.total_seconds() == 0.5
    assert (cfg.max_restarts, cfg.monitor_interval.total_seconds(), cfg.role) == (2, 0.5,
                                                                                 "trainer")
    assert cfg.redirects.of(0) == 3 and cfg.redirects.of(1) == 1 and cfg.redirects.of(2) == 0
    assert cfg.tee.of(5) == 3 and cfg.local_ranks_filter == {0, 2}
    assert cfg.signals_to_handle == (signal.SIGUSR1, signal.SIGTERM)
    assert cfg.grace_period.total_seconds() == 2 and not cfg.rank_prefix and cfg.run_path
    assert parse_args(["--tee", "3", WORKER]).entrypoint == WORKER   # not a script named "3"
    assert parse_args(["--nproc-per-node", "cpu", WORKER]).nproc_per_node == os.cpu_count()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUDA_VISIBLE_DEVICES", "")
        with pytest.raises(SystemExit):
            parse_args(["--nproc-per-node", "gpu", WORKER])
        assert "no GPU found on this node" in capsys.readouterr().err
        mp.setenv("CUDA_VISIBLE_DEVICES", "0,1")
        assert parse_args(["--nproc-per-node", "gpu", WORKER]).nproc_per_node == 2
    env = {"PET_NPROC_PER_NODE": "3", "PET_MAX_RESTARTS": "4"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        cfg = parse_args([WORKER])
    assert (cfg.nproc_per_node, cfg.max_restarts) == (3, 4)

    bad = {
        ("--standalone", "--nnodes", "2", WORKER): "--standalone is for a single node",
        ("--standalone", "--master-port", "5", WORKER): "drop --master-addr/--master-port",
        ("--nnodes", "2", "--node-rank", "2", WORKER): "--node-rank must be in [0, 1]",
        ("--nproc-per-node", "0", WORKER): "--nproc-per-node must be >= 1",
        ("--nproc-per-node", "lots", WORKER): "not a number, auto, cpu, gpu or xpu",
        ("--grace-period", "-1", WORKER): "--grace-period must be >= 0",
        ("--nnodes", "3:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1", WORKER):
            "MIN (3) is greater than MAX (2)",
        ("--nnodes", "1:2", WORKER): "needs --rdzv-backend c10d",
        ("--nnodes", "two", WORKER): "is not N or MIN:MAX",
        ("--rdzv-backend", "c10d", WORKER): "needs --rdzv-endpoint",
        ("--rdzv-backend", "c10d", "--rdzv-endpoint", "nohostport", WORKER): "is not HOST:PORT",
        ("--rdzv_endpont", "h:1", WORKER): "unknown option --rdzv_endpont; did you mean "
                                           "--rdzv_endpoint?",
        ("--max-restart=2", WORKER): "did you mean --max-restarts?",
        ("--rdzv-conf", "join_timeot=3", WORKER): "unknown key 'join_timeot'",
        ("--rdzv-conf", "join_timeout=-3", WORKER): "join_timeout must be > 0",
        ("--tee", "4", WORKER): "'4' is not one of 0",
        ("--signals-to-handle", "SIGNOPE", WORKER): "unknown signal 'SIGNOPE'",
        ("--max-restarts", "-1", WORKER): "--max-restarts must be >= 0",
        ("--nproc-per-node", "2",): "missing the script",
        ("no_such_script.py",): "script 'no_such_script.py' not found",
    }
    for argv, message in bad.items():
        with pytest.raises(SystemExit) as exc:
            parse_args(list(argv))
        assert exc.value.code == 2
        assert message in capsys.readouterr().err, argv
    cfg = parse_args(["--duplicate_stdout_filters", "loss,a,,b", "--duplicate-stderr-filters",
                      "Error", "--logs_specs", "default", "--numa_binding", "core-complex",
                      "--virtual-local-rank", WORKER])
    assert cfg.duplicate_stdout_filters == ("loss", "a,b")
    assert cfg.duplicate_stderr_filters == ("Error",) and cfg.virtual_local_rank
    assert cfg.numa_binding == "core-complex"
    assert parse_args([WORKER]).duplicate_stdout_filters == ()
    assert parse_args([WORKER]).grace_period.total_seconds() == 5
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PET_VIRTUAL_LOCAL_RANK", "1")
        mp.setenv("PET_NUMA_BINDING", "socket")
        assert (parse_args([WORKER]).virtual_local_rank, parse_args([WORKER]).numa_binding) == (
            True, "socket")
        mp.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "12")   # torchrun's variable
        assert parse_args([WORKER]).grace_period.total_seconds() == 12
        assert parse_args(["--shutdown_timeout", "1", WORKER]).grace_period.total_seconds() == 1
        mp.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "soon")
        with pytest.raises(SystemExit):
            parse_args([WORKER])
        assert "TORCH_ELASTIC_SHUTDOWN_TIMEOUT='soon' is not a number" in capsys.readouterr().err
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ZE_AFFINITY_MASK", "0,1.0,1.1,3")       # Level Zero: devices 0, 1 and 3
        assert parse_args(["--nproc-per-node", "xpu", WORKER]).nproc_per_node == 3
        mp.setenv("ZE_AFFINITY_MASK", "")
        with pytest.raises(SystemExit):
            parse_args(["--nproc-per-node", "xpu", WORKER])
        assert "no Intel GPU found on this node" in capsys.readouterr().err
    for argv, message in {
        ("--logs-specs", "mine", WORKER): "does not load torchrun LogsSpecs classes",
        ("--rdzv_backend", "etcd-v2", "--rdzv-endpoint", "h:1", WORKER):
            "backends are static, c10d and every installed store scheme",
        ("--rdzv_backend", "tcp", WORKER): "--rdzv-backend tcp needs --rdzv-endpoint",
        ("--numa-binding", "nodes", WORKER): "'nodes' is not one of node, socket, exclusive",
    }.items():
        with pytest.raises(SystemExit):
            parse_args(list(argv))
        assert message in capsys.readouterr().err, argv
    with pytest.raises(ValueError, match="exclude each other"):
        LaunchConfig(entrypoint="x", module=True, no_python=True)


@pytest.mark.timeout(30)
def test_is_launched_and_traceback_extraction(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PLUGDIST_RUN_ID", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert not is_launched()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    assert is_launched()
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    monkeypatch.setenv("PLUGDIST_RUN_ID", "y")
    assert is_launched()

    lines = ["noise", "Traceback (most recent call last):", '  File "a.py", line 1',
             "KeyError: 1", "", "During handling of the above exception, another exception "
             "occurred:", "", "Traceback (most recent call last):", '  File "a.py", line 3',
             "ValueError: 2", "atexit noise"]
    assert extract_traceback(lines) == lines[1:]
    assert extract_traceback(["a", "b"]) == []
    assert extract_traceback(lines[7:]) == lines[7:]


# --------------------------------------------------------------------------- real launches


@pytest.mark.timeout(60)
def test_env_vars_args_and_tee(tmp_path: Path) -> None:
    args = ["--flag", "a b", "-m", "--", "--nproc-per-node", "9", ""]
    res = launch("--standalone", "--nproc-per-node", "3", "--run-id", "run-env",
                 "--role", "trainer", WORKER, str(tmp_path), "env", *args)
    assert res.returncode == 0, res.stderr
    ports, tokens = set(), set()
    for rank in range(3):
        info = read_json(tmp_path / f"rank{rank}.json")
        token = info["env"]["PLUGDIST_STORE_TOKEN"]
        assert token and len(token) >= 32          # a fresh secret for this run
        env = info["env"]
        assert env == {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "3",
                       "LOCAL_WORLD_SIZE": "3", "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
                       "ROLE_RANK": str(rank), "ROLE_NAME": "trainer", "ROLE_WORLD_SIZE": "3",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": env["MASTER_PORT"],
                       "PLUGDIST_RUN_ID": "run-env", "TORCHELASTIC_RUN_ID": "run-env",
                       "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
                       "TORCHELASTIC_ERROR_FILE": env["TORCHELASTIC_ERROR_FILE"],
                       "TORCHELASTIC_USE_AGENT_STORE": "False",
                       "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "PLUGDIST_LAUNCHED": "1",
                       "PLUGDIST_AGENT_STORE": env["PLUGDIST_AGENT_STORE"],
                       "PLUGDIST_RDZV_ROUND": "0", "PLUGDIST_STORE_TOKEN": token,
                       "OMP_NUM_THREADS": "1"}, rank
        assert env["TORCHELASTIC_ERROR_FILE"].endswith(f"/attempt_0/{rank}/error.json")
        assert env["PLUGDIST_AGENT_STORE"].startswith("127.0.0.1:")
        # one node: the store is bound to loopback only, not to every interface
        assert info["agent_store_listens_on"] == ["127.0.0.1"], info
        assert env["PLUGDIST_AGENT_STORE"] != f"127.0.0.1:{env['MASTER_PORT']}"
        tokens.add(token)
        assert info["argv"] == [str(tmp_path), "env", *args], rank
        ports.add(env["MASTER_PORT"])
        assert f"[rank {rank}] worker rank {rank} mode env up" in res.stdout.splitlines()
    assert len(ports) == 1 and int(ports.pop()) > 0   # one port, picked by --standalone
    assert len(tokens) == 1 and tokens.pop() != os.environ.get("PLUGDIST_STORE_TOKEN")


@pytest.mark.timeout(60)
def test_module_mode_no_tee_and_exit_code(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(SCRIPTS), "OMP_NUM_THREADS": "3"}
    env.pop("PLUGDIST_RUN_ID", None)
    res = launch("--nproc-per-node", "2", "--master-port", str(free_port()), "--no-rank-prefix",
                 "-m", "launcher_worker", str(tmp_path), "env", "exit=1:7", env=env)
    assert res.returncode == 7, res.stderr                 # the failed worker's exit code
    for rank in range(2):
        info = read_json(tmp_path / f"rank{rank}.json")
        assert info["argv"] == [str(tmp_path), "env", "exit=1:7"]
        assert info["env"]["RANK"] == str(rank) and info["env"]["WORLD_SIZE"] == "2"
        assert info["env"]["OMP_NUM_THREADS"] == "3"       # the user's choice is kept
        assert len(info["env"]["PLUGDIST_RUN_ID"]) == 12   # random id on a single node
        assert f"worker rank {rank} mode env up" in res.stdout.splitlines()   # no prefix
    summary = summary_of(res.stderr)
    assert "1 of 2 workers failed" in summary
    assert "rank 1 (local rank 1, pid" in summary and "exit code 7" in summary
    assert "exiting with code 7 (from rank 1)" in summary


@pytest.mark.timeout(60)
def test_failing_rank_stops_the_others(tmp_path: Path) -> None:
    marker = str(tmp_path)
    res = launch("--standalone", "--nproc-per-node", "3", "--grace-period", "1",
                 WORKER, marker, "fail")
    assert res.returncode == 1, res.stderr
    summary = summary_of(res.stderr)
    assert "1 of 3 workers failed" in summary
    assert "rank 1 (local rank 1, pid" in summary and "): exit code 1" in summary
    assert "Traceback (most recent call last):" in summary
    assert 'raise ValueError(f"boom from rank {rank}")' in summary
    assert "ValueError: boom from rank 1" in summary
    # rank 0 obeyed SIGTERM; rank 2 ignored it and got SIGKILL after the grace period
    assert "rank 0 (local rank 0): killed by SIGTERM (signal 15)" in summary
    assert "rank 2 (local rank 2): killed by SIGKILL (signal 9)" in summary
    assert "[rank 1] ValueError: boom from rank 1" in res.stderr   # tee'd live, prefixed
    workers, grandchildren = pids(tmp_path, "rank*.pid"), pids(tmp_path, "gc*.pid")
    assert len(workers) == 3 and len(grandchildren) == 1
    assert not [p for p in workers + grandchildren if alive(p, marker)]


@pytest.mark.timeout(60)
def test_rank_killed_by_signal(tmp_path: Path) -> None:
    marker = str(tmp_path)
    res = launch("--standalone", "--nproc-per-node", "2", WORKER, marker, "sigkill")
    assert res.returncode == 128 + signal.SIGKILL, res.stderr
    summary = summary_of(res.stderr)
    assert "rank 1 (local rank 1, pid" in summary
    assert "killed by SIGKILL (signal 9)" in summary
    assert "rank 0 (local rank 0): killed by SIGTERM" in summary
    assert not [p for p in pids(tmp_path, "rank*.pid") if alive(p, marker)]


@pytest.mark.timeout(60)
def test_a_crashed_worker_shows_where_it_crashed(tmp_path: Path) -> None:
    marker = str(tmp_path)
    res = launch("--standalone", "--nproc-per-node", "2", WORKER, marker, "segv")
    assert res.returncode == 128 + signal.SIGSEGV, res.stderr
    assert "killed by SIGSEGV (signal 11)" in summary_of(res.stderr)
    # the launcher turns Python's fault handler on: the worker printed its Python stack
    assert "[rank 1] Fatal Python error: Segmentation fault" in res.stderr, res.stderr
    assert "in crash_in_native_code" in res.stderr, res.stderr
    assert not [p for p in pids(tmp_path, "rank*.pid") if alive(p, marker)]


@pytest.mark.timeout(60)
def test_sigterm_to_launcher_leaves_no_process(tmp_path: Path) -> None:
    marker = str(tmp_path)
    proc = subprocess.Popen([*LAUNCHER, "--standalone", "--nproc-per-node", "2",
                             "--grace-period", "1", WORKER, marker, "hang"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for([tmp_path / f"{kind}{r}.pid" for kind in ("rank", "gc") for r in range(2)],
                 proc)
        workers, grandchildren = pids(tmp_path, "rank*.pid"), pids(tmp_path, "gc*.pid")
        assert all(alive(p, marker) for p in workers + grandchildren)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "received SIGTERM; forwarded it to the workers" in err
    for rank in range(2):   # the signal reached each worker, which ran its handler
        assert (tmp_path / f"rank{rank}.sigterm").read_text() == "got SIGTERM"
    # the grandchildren ignore SIGTERM: only the launcher's SIGKILL to the groups ends them
    assert not [p for p in workers + grandchildren if alive(p, marker)]


@pytest.mark.timeout(60)
def test_two_nodes_on_one_machine(tmp_path: Path) -> None:
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
              "--master-port", str(free_port()), "--run-id", "two-nodes"]
    nodes = [subprocess.Popen([*LAUNCHER, *common, "--node-rank", str(node), WORKER,
                               str(tmp_path), "rendezvous"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for node in (0, 1)]
    try:
        results = [p.communicate(timeout=50) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
    for p, (_out, err) in zip(nodes, results, strict=True):
        assert p.returncode == 0, err
    for rank in range(4):
        info = read_json(tmp_path / f"rank{rank}.json")
        env = info["env"]
        assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (str(rank), "4", "2")
        assert (env["LOCAL_RANK"], env["GROUP_RANK"]) == (str(rank % 2), str(rank // 2))
        assert env["GROUP_WORLD_SIZE"] == "2" and env["TORCHELASTIC_RUN_ID"] == "two-nodes"
        assert info["ranks"] == [0, 1, 2, 3], rank   # all four met at the one master address
    assert "[rank 3] worker rank 3 mode rendezvous up" in results[1][0]


@pytest.mark.timeout(90)
def test_gloo_all_reduce_end_to_end(tmp_path: Path) -> None:
    import plugdist
    if not plugdist.is_backend_available("gloo"):
        pytest.skip("plugdist-gloo is not installed")
    res = launch("--standalone", "--nproc-per-node", "2", str(SCRIPTS / "gloo_allreduce.py"),
                 str(tmp_path), timeout=80)
    assert res.returncode == 0, res.stderr
    for rank in range(2):
        assert read_json(tmp_path / f"rank{rank}.json") == {
            "rank": rank, "world": 2, "sum": 3.0, "launched": True, "local_rank": str(rank),
            "env_rank": str(rank), "store": "PrefixStore:TCPStore"}   # the launcher's store


# --------------------------------------------------------------------------- restarts, logs


@pytest.mark.timeout(90)
def test_restart_after_failure_and_summary_without(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    res = launch("--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                 "--log-dir", str(logs), "--rdzv-id", "rs", WORKER, str(tmp_path), "restart")
    assert res.returncode == 0, res.stderr
    for rank in range(2):
        for attempt in (0, 1):
            env = read_json(tmp_path / f"rank{rank}.attempt{attempt}.json")["env"]
            assert env["TORCHELASTIC_RESTART_COUNT"] == str(attempt)
            assert env["TORCHELASTIC_MAX_RESTARTS"] == "1"
    assert "restarting the world (1 of 1 restarts)" in res.stderr
    # per-attempt, per-rank files: both streams and rank 1's error file on attempt 0
    (root,) = logs.iterdir()
    assert root.name.startswith("rs_")
    stderr0 = (root / "attempt_0" / "1" / "stderr.log").read_text()
    assert "ValueError: rank 1 fails on attempt 0" in stderr0
    assert "worker rank 1 mode restart up" in (root / "attempt_0" / "1" / "stdout.log").read_text()
    assert "worker rank 1 mode restart up" in (root / "attempt_1" / "1" / "stdout.log").read_text()
    error = json.loads((root / "attempt_0" / "1" / "error.json").read_text())
    assert error["message"]["message"] == "ValueError: rank 1 fails on attempt 0"
    assert not (root / "attempt_1" / "1" / "error.json").exists()

    out = tmp_path / "no-restarts"
    out.mkdir()
    res = launch("--standalone", "--nproc-per-node", "2", "--max-restarts", "0",
                 WORKER, str(out), "restart")
    assert res.returncode == 1
    summary = summary_of(res.stderr)
    assert "first failure: rank 1 (local rank 1, pid" in summary
    assert "error file: " in summary and "error.json" in summary
    assert 'raise ValueError(f"rank {rank} fails on attempt {attempt}")' in summary
    assert "exiting with code 1 (from rank 1)" in summary
    assert not list(out.glob("*.attempt1.json"))


@pytest.mark.timeout(60)
def test_redirects_tee_filter_and_prefix(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    res = launch("--standalone", "--nproc-per-node", "3", "--log-dir", str(logs), "-r", "0:1",
                 "--local-ranks-filter", "0,1", "--no-rank-prefix", WORKER, str(tmp_path), "env")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert "worker rank 0 mode env up" not in lines          # rank 0's stdout: file only
    assert "worker rank 1 mode env up" in lines              # unprefixed
    assert "worker rank 2 mode env up" not in lines          # filtered off the console
    (root,) = logs.iterdir()
    for rank in range(3):
        text = (root / "attempt_0" / str(rank) / "stdout.log").read_text()
        assert text == f"worker rank {rank} mode env up\n"


# --------------------------------------------------------------------------- signals, orphans


@pytest.mark.timeout(60)
def test_sigusr1_is_forwarded(tmp_path: Path) -> None:
    proc = subprocess.Popen([*LAUNCHER, "--standalone", "--nproc-per-node", "2",
                             "--signals-to-handle", "SIGUSR1,SIGTERM", WORKER, str(tmp_path),
                             "usr1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for([tmp_path / f"rank{r}.pid" for r in range(2)], proc)
        proc.send_signal(signal.SIGUSR1)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGUSR1, err
    assert "received SIGUSR1; forwarded it to the workers" in err
    for rank in range(2):
        assert (tmp_path / f"rank{rank}.usr1").read_text() == "got SIGUSR1"


@pytest.mark.timeout(60)
def test_no_orphans_after_sigkill_of_the_launcher(tmp_path: Path) -> None:
    marker = str(tmp_path)
    proc = subprocess.Popen([*LAUNCHER, "--standalone", "--nproc-per-node", "2",
                             WORKER, marker, "hang"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for([tmp_path / f"{kind}{r}.pid" for kind in ("rank", "gc") for r in range(2)], proc)
    everyone = pids(tmp_path, "rank*.pid") + pids(tmp_path, "gc*.pid")
    assert all(alive(p, marker) for p in everyone)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while [p for p in everyone if alive(p, marker)] and time.monotonic() < deadline:
        time.sleep(0.05)
    # workers and the grandchildren that ignore SIGTERM: all gone with the launcher
    assert not [p for p in everyone if alive(p, marker)]


# --------------------------------------------------------------------------- rendezvous


@pytest.mark.timeout(30)
def test_busy_port_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        res = launch("--master-port", str(port), WORKER, str(tmp_path), "env")
    assert res.returncode == 1
    assert f"could not serve the rendezvous store on port {port}" in res.stderr
    assert "pick a free --master-port" in res.stderr
    assert not list(tmp_path.glob("rank*.json"))


def _wait_for_port(port: int, proc: subprocess.Popen[str], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"nothing listens on port {port}")
            time.sleep(0.02)


def _nodes(argvs: list[list[str]]) -> list[subprocess.Popen[str]]:
    return [subprocess.Popen([*LAUNCHER, *argv], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for argv in argvs]


def _finish(nodes: list[subprocess.Popen[str]], timeout: float) -> list[tuple[str, str]]:
    try:
        return [p.communicate(timeout=timeout) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()


@pytest.mark.timeout(60)
def test_c10d_nodes_without_node_rank(tmp_path: Path) -> None:
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "c10d"]
    nodes = _nodes([[*common, WORKER, str(tmp_path), "rendezvous"] for _ in range(2)])
    results = _finish(nodes, 50)
    for p, (_, err) in zip(nodes, results, strict=True):
        assert p.returncode == 0, err
    groups = set()
    for rank in range(4):
        info = read_json(tmp_path / f"rank{rank}.json")
        env = info["env"]
        assert (env["RANK"], env["WORLD_SIZE"], env["GROUP_WORLD_SIZE"]) == (str(rank), "4", "2")
        assert env["LOCAL_RANK"] == str(rank % 2)
        groups.add((env["GROUP_RANK"], info["pid"] and rank // 2))
        assert info["ranks"] == [0, 1, 2, 3], rank
    assert {g for g, _ in groups} == {"0", "1"}


@pytest.mark.timeout(90)
def test_etcd_rendezvous_two_agents(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """--rdzv-backend etcd: two launchers meet through a real etcd, and the workers' store is
    that etcd (no launcher hosts a store)."""
    pytest.importorskip("plugdist_etcd")
    etcd = request.getfixturevalue("etcd1")
    job = f"job{os.getpid()}"
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "etcd",
              "--rdzv-endpoint", ",".join(etcd.endpoints), "--rdzv-id", job]
    nodes = _nodes([[*common, str(SCRIPTS / "gloo_allreduce.py"), str(tmp_path)]
                    for _ in range(2)])
    results = _finish(nodes, 80)
    for p, (_, err) in zip(nodes, results, strict=True):
        assert p.returncode == 0, err
    for rank in range(2):
        assert read_json(tmp_path / f"rank{rank}.json") == {
            "rank": rank, "world": 2, "sum": 3.0, "launched": True, "local_rank": "0",
            "env_rank": str(rank), "store": "PrefixStore:EtcdStore"}   # the ranks' store: etcd
    from plugdist_etcd import EtcdStore
    rdzv = EtcdStore(etcd.endpoints, f"plugdist/{job}", ttl=0)
    assert rdzv.num_keys() > 0   # the launchers met there too
    rdzv.close()


@pytest.mark.timeout(60)
def test_static_nodes_claiming_one_node_rank(tmp_path: Path) -> None:
    common = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
              "--rdzv-conf", "join_timeout=20"]
    nodes = _nodes([[*common, WORKER, str(tmp_path), "env"] for _ in range(2)])
    results = _finish(nodes, 50)
    for p, (_, err) in zip(nodes, results, strict=True):
        assert p.returncode == 1, err
        assert "two nodes state --node-rank 0" in err
        assert "drop --node-rank and use --rdzv-backend c10d" in err
    assert not list(tmp_path.glob("rank*.json"))


@pytest.mark.timeout(90)
def test_elastic_world_reforms_after_a_node_is_lost(tmp_path: Path) -> None:
    """--nnodes 1:2: SIGKILL one launcher of a 2-node world; the other re-forms alone and
    finishes. With --nnodes 2, the survivor gives up within join_timeout naming the lost node."""
    # join_timeout: long enough for the second launcher to start on a loaded machine
    conf = "last_call_timeout=1,keep_alive_interval=0.2,keep_alive_max_attempt=5,join_timeout=15"
    for nnodes, expect in (("1:2", 0), ("2", 1)):
        out = tmp_path / nnodes.replace(":", "-")
        out.mkdir()
        port = free_port()
        common = ["--nnodes", nnodes, "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                  "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-conf", conf,
                  "--grace-period", "1", WORKER, str(out), "elastic", "2"]
        first = _nodes([common])[0]
        wait_for([out / "w1.rank0.json"] if nnodes == "1:2" else [], first)
        _wait_for_port(port, first)   # the first launcher serves the store: it must survive
        second = _nodes([common])[0]
        wait_for([out / "w2.rank0.json", out / "w2.rank1.json"], first)
        # the node that does not serve the store goes: the endpoint's host stays
        second.kill()
        second.wait()
        start = time.monotonic()
        _, err = first.communicate(timeout=40)
        assert first.returncode == expect, err
        assert "lost node 0 (" in err or "lost node 1 (" in err
        assert "no heartbeat for" in err
        if expect == 0:
            # admitted the late node into a world of 2, lost it, re-formed as 1, finished
            assert "waiting to join" in err and "re-forming the world" in err
            assert read_json(out / "w1.rank0.json")["env"]["PLUGDIST_RDZV_ROUND"] != "0"
        else:
            summary = err[err.index("rendezvous timed out"):]
            assert "1 of at least 2 nodes joined" in summary
            assert time.monotonic() - start < 45


@pytest.mark.timeout(90)
def test_c10d_restart_on_every_node_and_the_summary_elsewhere(tmp_path: Path) -> None:
    """A worker failing on one node restarts the world on both (--max-restarts 1); without
    restarts, the node where nothing failed names the first failure and where it happened."""
    for restarts in ("1", "0"):
        out = tmp_path / restarts
        out.mkdir()
        common = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                  "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--max-restarts", restarts,
                  WORKER, str(out), "restart"]
        nodes = _nodes([common, common])
        results = _finish(nodes, 60)
        if restarts == "1":
            for p, (_, err) in zip(nodes, results, strict=True):
                assert p.returncode == 0, err
            for rank in range(4):
                for attempt in (0, 1):
                    env = read_json(out / f"rank{rank}.attempt{attempt}.json")["env"]
                    assert env["TORCHELASTIC_RESTART_COUNT"] == str(attempt)
                    assert env["PLUGDIST_RDZV_ROUND"] == str(attempt)
            continue
        failing = read_json(out / "rank1.attempt0.json")["env"]["GROUP_RANK"]
        for p, (_, err) in zip(nodes, results, strict=True):
            assert p.returncode == 1, err
            assert "ValueError: rank 1 fails on attempt 0" in err
            assert "exiting with code 1 (from rank 1)" in err
        elsewhere = [err for _, err in results if "the run failed; first failure" in err]
        assert len(elsewhere) == 1
        assert "first failure: rank 1 (local rank 1, pid" in elsewhere[0]
        assert f"on node {failing} (" in elsewhere[0]
        assert "attempt 0: exit code 1" in elsewhere[0]


@pytest.mark.timeout(30)
def test_signal_while_waiting_for_other_nodes(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen([*LAUNCHER, "--nnodes", "2", "--rdzv-backend", "c10d",
                             "--rdzv-endpoint", f"127.0.0.1:{port}", WORKER,
                             str(tmp_path), "env"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # serving the store (its signal handlers are in by then), waiting for a second node that
    # never comes
    _wait_for_port(port, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=10)
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "received SIGINT; stopped waiting for the other nodes" in err


# --------------------------------------------------------------------------- env:// elsewhere


@pytest.mark.timeout(60)
@pytest.mark.parametrize("launcher_vars", [
    {"PMI_RANK": "0", "PMI_SIZE": "1", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1"},
    {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1",
     "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
     "OMPI_MCA_ess_base_jobid": "77"},
    {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0",
     "SLURM_NTASKS_PER_NODE": "1", "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0"},
], ids=["mpich", "openmpi", "slurm"])
def test_env_rendezvous_reads_other_launchers(launcher_vars: dict[str, str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """No RANK/WORLD_SIZE/MASTER_*: rank and world from mpiexec/mpirun/srun's variables, a
    master on this host (every rank is local), and LOCAL_RANK etc. set for the script."""
    from plugdist._world.rendezvous import env_rendezvous_handler
    before = dict(os.environ)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT", "PLUGDIST_AGENT_STORE", "TORCHELASTIC_USE_AGENT_STORE",
                "PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        # set, then delete: monkeypatch then restores the variable's absence too, undoing what
        # the handler sets for the script (RANK, WORLD_SIZE, ...)
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    for k, v in launcher_vars.items():
        monkeypatch.setenv(k, v)
    store, rank, world = env_rendezvous_handler("env://", timeout=timedelta(seconds=10))
    try:
        assert (rank, world) == (0, 1)
        store.set("k", b"v")
        assert store.get("k") == b"v"
        assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("0", "1")
        assert (os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"]) == ("0", "1")
        assert os.environ["MASTER_ADDR"] == "127.0.0.1"
        port = int(os.environ["MASTER_PORT"])
        assert 20000 <= port < 32768 and not 29400 <= port < 29600
    finally:
        store.close()
    monkeypatch.undo()
    assert dict(os.environ) == before   # nothing leaks into the other tests' environment


@pytest.mark.parametrize(("nodelist", "first"), [
    ("node07", "node07"), ("node[07-09,12],gpu1", "node07"), ("a,b[1-2]", "a"),
    ("rack[2-3]-n[01-04]", "rack2-n01"), ("n[001]", "n001"), ("x-[5,6]", "x-5")])
def test_slurm_first_host(nodelist: str, first: str) -> None:
    from plugdist._world.rendezvous import slurm_first_host
    assert slurm_first_host(nodelist) == first


def test_slurm_node_list_that_cannot_be_read_names_the_fix() -> None:
    from plugdist._world.rendezvous import RendezvousError, slurm_first_host
    with pytest.raises(RendezvousError, match="set MASTER_ADDR"):
        slurm_first_host("n[1-2")


_SLURM_RANK = """
import plugdist as dist, torch
dist.init_process_group("gloo")
t = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(t)
import os
print(os.environ["MASTER_ADDR"], os.environ["LOCAL_RANK"], t.item(), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.timeout(90)
def test_srun_across_hosts_meets_on_the_first_node() -> None:
    """srun's variables for 2 tasks on 2 nodes and no MASTER_*: every rank derives the master
    from the step's node list (its first node, "localhost" here standing for node 0) and the
    port from the job, and the two meet there for real."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                         "MASTER_PORT", "PLUGDIST_AGENT_STORE", "TORCHELASTIC_USE_AGENT_STORE")
            and not k.startswith(("PMI_", "OMPI_", "SLURM_"))}
    job = str(os.getpid())  # a port of its own per test run
    procs = [subprocess.Popen(
        [sys.executable, "-c", _SLURM_RANK], text=True, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**base, "SLURM_PROCID": str(r), "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
             "SLURM_NTASKS_PER_NODE": "1", "SLURM_JOB_ID": job, "SLURM_STEP_ID": "0",
             "SLURM_STEP_NODELIST": "localhost,node-b"}) for r in range(2)]
    outs = [p.communicate(timeout=80) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    assert [out.split() for out, _ in outs] == [["localhost", "0", "3.0"]] * 2


@pytest.mark.timeout(60)
def test_torch_store_client_behind_the_store_api() -> None:
    """torchrun's agent store is a torch TCPStore; plugdist reaches it through this adapter."""
    import torch.distributed as tdist
    from plugdist.errors import DistTimeoutError
    from plugdist.store import TorchStoreAdapter
    server = tdist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10),
                            wait_for_workers=False)
    store = TorchStoreAdapter(tdist.TCPStore("127.0.0.1", server.port, None, False,
                                            timedelta(seconds=10)))
    store.set("a", b"1")
    assert store.get("a") == b"1" and server.get("a") == b"1"
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5
    assert store.compare_set("a", b"1", b"2") == b"2"
    assert store.check(["a", "n"]) and not store.check(["missing"])
    assert store.delete_key("a") and not store.check(["a"])
    with pytest.raises(DistTimeoutError):
        store.wait(["never"], timedelta(milliseconds=200))
    store.close()


@pytest.mark.timeout(60)
def test_record_and_torchs_record_write_what_the_summary_reads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from plugdist._launcher import read_error_file, record
    from torch.distributed.elastic.multiprocessing.errors import record as torch_record
    for name, decorate in (("ours", record), ("torch", torch_record)):
        path = tmp_path / f"{name}.json"
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))

        @decorate
        def main() -> None:
            raise KeyError("no such shard")
        with pytest.raises(KeyError):
            main()
        got = read_error_file(str(path))
        assert got is not None, name
        message, tb = got
        assert "KeyError" in message and "no such shard" in message, name
        assert tb[0] == "Traceback (most recent call last):", name
        assert 'raise KeyError("no such shard")' in "\n".join(tb), name


@pytest.mark.timeout(60)
def test_the_launcher_never_imports_torch(tmp_path: Path) -> None:
    noop = tmp_path / "noop.py"
    noop.write_text("pass\n")
    code = ("import sys, plugdist_run\n"
            f"rc = plugdist_run.main(['--standalone', '--nproc-per-node', '2', {str(noop)!r}])\n"
            "print(rc, sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=50)
    assert res.stdout.strip() == "0 []", res.stderr


# --------------------------------------------------------------------------- torchrun's rarer flags


def _fake_sysfs(root: Path) -> Path:
    """Two NUMA nodes on one socket: node0 CPUs 0-3, node1 4-7; hardware-thread pairs (0,1),
    (2,3), ... (one physical core each); a last-level cache per node."""
    for node, cpus in ((0, "0-3"), (1, "4-7")):
        d = root / "devices/system/node" / f"node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
    for cpu in range(8):
        d = root / "devices/system/cpu" / f"cpu{cpu}"
        (d / "topology").mkdir(parents=True)
        (d / "topology/physical_package_id").write_text("0\n")
        pair = cpu - cpu % 2
        (d / "topology/thread_siblings_list").write_text(f"{pair},{pair + 1}\n")
        for index, (kind, level, shared) in enumerate((
                ("Instruction", 1, f"{pair},{pair + 1}"), ("Data", 1, f"{pair},{pair + 1}"),
                ("Unified", 3, f"{cpu - cpu % 4}-{cpu - cpu % 4 + 3}"))):
            c = d / "cache" / f"index{index}"
            c.mkdir(parents=True)
            (c / "type").write_text(kind + "\n")
            (c / "level").write_text(f"{level}\n")
            (c / "shared_cpu_list").write_text(shared + "\n")
    return root


def test_numa_binding_cpu_sets(tmp_path: Path) -> None:
    from plugdist._launcher.numa import cpus_for_workers
    sysfs, allowed = str(_fake_sysfs(tmp_path)), set(range(8))
    noproc = str(tmp_path / "noproc")       # no GPUs
    sets = {mode: cpus_for_workers(mode, 4, sysfs=sysfs, procfs=noproc, allowed=allowed)
            for mode in ("node", "socket", "exclusive", "core-complex")}
    assert sets["node"] == [{0, 1, 2, 3}, {0, 1, 2, 3}, {4, 5, 6, 7}, {4, 5, 6, 7}]
    assert sets["socket"] == [allowed] * 4
    assert sets["exclusive"] == [{0, 1}, {2, 3}, {4, 5}, {6, 7}]   # a physical core each
    assert sets["core-complex"] == [{0, 1, 2, 3}, {0, 1, 2, 3}, {4, 5, 6, 7}, {4, 5, 6, 7}]
    # only the launcher's own CPUs are handed out
    assert cpus_for_workers("node", 2, sysfs=sysfs, procfs=noproc,
                            allowed={1, 2, 5}) == [{1, 2}, {5}]
    assert cpus_for_workers("exclusive", 1, sysfs=sysfs, procfs=noproc,
                            allowed=allowed) == [{0, 1, 2, 3}]
    with pytest.raises(ValueError, match="NUMA node 0 has 2 physical cores for 3 workers"):
        cpus_for_workers("exclusive", 6, sysfs=sysfs, procfs=noproc, allowed=allowed)
    # GPUs: a worker goes to its local rank's GPU's node (numa_node -1: one-node machine, 0);
    # CUDA_VISIBLE_DEVICES picks from the GPUs in PCI order
    gpus = {"0000:1a:00.0": "1", "0000:3b:00.0": "0", "0000:8c:00.0": "-1"}
    for addr, node in gpus.items():
        (tmp_path / "proc/driver/nvidia/gpus" / addr).mkdir(parents=True)
        (tmp_path / "bus/pci/devices" / addr).mkdir(parents=True)
        (tmp_path / "bus/pci/devices" / addr / "numa_node").write_text(node + "\n")
    procfs = str(tmp_path / "proc")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        assert cpus_for_workers("node", 4, sysfs=sysfs, procfs=procfs, allowed=allowed) == [
            {4, 5, 6, 7}, {0, 1, 2, 3}, {0, 1, 2, 3}, {4, 5, 6, 7}]   # rank 3: no GPU, by block
        assert cpus_for_workers("exclusive", 3, sysfs=sysfs, procfs=procfs,
                                allowed=allowed) == [{4, 5, 6, 7}, {0, 1}, {2, 3}]
        mp.setenv("CUDA_VISIBLE_DEVICES", "2,0")
        assert cpus_for_workers("node", 2, sysfs=sysfs, procfs=procfs, allowed=allowed) == [
            {0, 1, 2, 3}, {4, 5, 6, 7}]
    # no NUMA information: one node holding every allowed CPU
    assert cpus_for_workers("node", 2, sysfs=str(tmp_path / "none"), procfs=noproc,
                            allowed={0, 1}) == [
        {0, 1}, {0, 1}]


@pytest.mark.timeout(60)
def test_numa_binding_virtual_local_rank_and_duplicate_filters(tmp_path: Path) -> None:
    from plugdist._launcher.numa import cpus_for_workers
    try:
        want = cpus_for_workers("exclusive", 2)
    except ValueError as exc:      # one physical core: nothing exclusive to hand out
        pytest.skip(str(exc))
    script = ('echo "keep rank=$RANK local=$LOCAL_RANK gpu=$CUDA_VISIBLE_DEVICES"; '
              'echo "other $RANK"; echo "a,b $RANK"; '
              'grep Cpus_allowed_list /proc/self/status; echo "err $RANK" >&2')
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "5,7"}
    # no --log-dir: the filtered files go to a temporary directory the launcher names; rank 1
    # is kept off the console, yet its matching lines are duplicated
    res = launch("--standalone", "--nproc_per_node", "2", "--virtual_local_rank",
                 "--numa-binding", "exclusive", "--duplicate-stdout-filters",
                 "keep,a,,b,Cpus_allowed", "--duplicate_stderr_filters", "err",
                 "--local-ranks-filter", "0", "--logs-specs", "default", "--no-python", "sh",
                 "-c", script, env=env)
    assert res.returncode == 0, res.stderr
    assert "[rank 0] keep rank=0 local=0 gpu=5" in res.stdout.splitlines()
    assert "[rank 1]" not in res.stdout
    (root,) = [line.split(" worker logs in ")[1].split(" (")[0]
               for line in res.stderr.splitlines() if " worker logs in " in line]
    out = (Path(root) / "attempt_0" / "filtered_stdout.log").read_text().splitlines()
    # each worker (and the grep it started) runs on its own share of the node's cores
    for rank in range(2):
        (line,) = [x for x in out if x.startswith(f"[rank {rank}] Cpus_allowed_list:")]
        listed = line.split(":", 1)[1].strip()
        got = {c for part in listed.split(",") for c in range(
            int(part.split("-")[0]), int(part.split("-")[-1]) + 1)}
        assert got == want[rank], (rank, line)
    assert sorted(x for x in out if "Cpus" not in x) == [
        "[rank 0] a,b 0", "[rank 0] keep rank=0 local=0 gpu=5",
        "[rank 1] a,b 1", "[rank 1] keep rank=1 local=0 gpu=7"]
    err = (Path(root) / "attempt_0" / "filtered_stderr.log").read_text().splitlines()
    assert sorted(err) == ["[rank 0] err 0", "[rank 1] err 1"]
    shutil.rmtree(root)
    # a GPU list too short for the workers is refused before any worker starts
    res = launch("--standalone", "--nproc-per-node", "2", "--virtual-local-rank", "--no-python",
                 "sh", "-c", "echo started", env={**os.environ, "CUDA_VISIBLE_DEVICES": "3"})
    assert res.returncode != 0 and "started" not in res.stdout
    assert "local rank 1 has no GPU in CUDA_VISIBLE_DEVICES=3" in res.stderr


@pytest.mark.resilience
@pytest.mark.timeout(120)
def test_with_resilient_groups_a_killed_worker_does_not_stop_the_others(tmp_path: Path) -> None:
    """PLUGDIST_RESILIENCE=1, no --replace-failed: rank 1 is SIGKILLed; the launcher leaves
    the other two running, they shrink and finish, the run exits 0, and the failure is named
    once, with its cause, in the launcher's lines."""
    env = dict(os.environ, PLUGDIST_RESILIENCE="1", VICTIM="1", PLUGDIST_TORCH_WORLD="0")
    res = launch("--standalone", "--nproc-per-node", "3", "--monitor-interval", "0.05",
                 str(SCRIPTS / "resilient_loop.py"), str(tmp_path), env=env, timeout=110)
    assert res.returncode == 0, res.stderr[-4000:]
    for rank in (0, 2):
        assert read_json(tmp_path / f"survivor{rank}.json") == {"size": 2, "sum": 2.0}
    launcher_lines = [x for x in res.stderr.splitlines() if x.startswith("plugdist-run:")]
    said = [x for x in launcher_lines if "rank 1 (local rank 1" in x]
    assert len(said) == 1 and "killed by SIGKILL" in said[0] \
        and "the others go on without it" in said[0], launcher_lines
    assert "died and the others went on without them" in res.stderr
    assert "SIGTERM" not in res.stderr, res.stderr[-3000:]
    # one failure, one warning per survivor (rank_failure); the failed ops are info
    warnings = [x for x in res.stderr.splitlines() if "level='warning'" in x]
    assert len(warnings) == 2 and all("rank_failure" in x for x in warnings), warnings


@pytest.mark.resilience
@pytest.mark.timeout(150)
def test_on_etcd_the_agent_keeps_its_workers_wills(tmp_path: Path,
                                                   request: pytest.FixtureRequest) -> None:
    """--rdzv-backend etcd with resilient groups: the agent holds one lease for its node's
    wills; the SIGKILLed worker's will is released by the agent (its process gone), once, and
    the others shrink and go on."""
    pytest.importorskip("plugdist_etcd")
    etcd = request.getfixturevalue("etcd1")
    env = dict(os.environ, PLUGDIST_RESILIENCE="1", VICTIM="1", PLUGDIST_TORCH_WORLD="0",
               PLUGDIST_LOG_LEVEL="INFO")
    res = launch("--nnodes", "1", "--nproc-per-node", "3", "--monitor-interval", "0.05",
                 "--rdzv-backend", "etcd", "--rdzv-endpoint", ",".join(etcd.endpoints),
                 "--rdzv-id", f"keeper{os.getpid()}", str(SCRIPTS / "resilient_loop.py"),
                 str(tmp_path), env=env, timeout=140)
    assert res.returncode == 0, res.stderr[-4000:]
    for rank in (0, 2):
        assert read_json(tmp_path / f"survivor{rank}.json") == {"size": 2, "sum": 2.0}
    released = [x for x in res.stderr.splitlines() if "node_will_released" in x]
    assert len(released) == 1 and "its process is gone" in released[0], res.stderr[-4000:]


@pytest.mark.resilience
@pytest.mark.timeout(120)
def test_a_rank_that_raised_is_reported_with_its_exception(tmp_path: Path) -> None:
    """With resilient groups on, a worker that raises (exit code 1) is the program failing:
    the run stops, and the summary names the exception, not a signal."""
    env = dict(os.environ, PLUGDIST_RESILIENCE="1", VICTIM="1", HOW="raise",
               PLUGDIST_TORCH_WORLD="0")
    res = launch("--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.05",
                 str(SCRIPTS / "resilient_loop.py"), str(tmp_path), env=env, timeout=110)
    assert res.returncode == 1, res.stderr[-4000:]
    first = [x for x in res.stderr.splitlines() if "first failure: rank 1" in x]
    assert first and "exit code 1: ValueError: rank 1 gives up at step 3" in first[0], \
        res.stderr[-4000:]
