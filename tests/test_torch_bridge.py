"""plugdist backends inside torch.distributed (``plugdist_*``), and plugdist's world seen by torch.

Real worlds: every op, torch's DDP and FSDP2, DeviceMesh, over plugdist_gloo, plugdist_toy and
plugdist_mpi (under mpiexec), each compared with torch's own Gloo in the same world on the same
inputs. Bodies in tests/_torch_bridge_workers.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import _torch_bridge_workers as workers
import pytest
from plugdist.testing import run_world
from plugdist.testing.harness import free_port, mpiexec_path

HERE = Path(__file__).parent


def _failures(results: list[dict[str, str | None]]) -> dict[str, str]:
    return {f"rank {r} {name}": err for r, res in enumerate(results)
            for name, err in res.items() if err is not None}


@pytest.mark.timeout(300)
def test_torch_first_world_of_2() -> None:
    """torch alone over plugdist_gloo/plugdist_toy: every op, DDP (plain, bucket views, no_sync,
    find_unused_parameters), FSDP2, DeviceMesh (2,), device maps (mixed ones too); then
    plugdist's world shared with torch, destroyed, opted out of, and re-initialized."""
    ports = [free_port() for _ in range(10)]
    results = run_world(workers.torch_first_suite, 2, timeout=280, args=(ports,))
    assert len(results[0]) > 60 and results[0].keys() == results[1].keys()
    assert not _failures(results), "\n".join(f"--- {k}\n{v}" for k, v in _failures(results).items())


@pytest.mark.timeout(240)
def test_every_op_in_a_world_of_3() -> None:
    results = run_world(workers.ops_suite, 3, timeout=220, args=(free_port(),))
    assert len(results[0]) > 50
    assert not _failures(results), "\n".join(f"--- {k}\n{v}" for k, v in _failures(results).items())


@pytest.mark.timeout(180)
def test_device_mesh_2x2() -> None:
    results = run_world(workers.mesh_2d_suite, 4, timeout=160, args=(free_port(),))
    assert all(res == {"DeviceMesh (2, 2)": None} for res in results), _failures(results)


@pytest.mark.timeout(300)
@pytest.mark.skipif(
    shutil.which(mpiexec_path()) is None or importlib.util.find_spec("mpi4py") is None,
    reason="needs mpi4py and mpiexec: pip install 'plugdist-mpi[mpich]'")
def test_mpi_world_shared_with_torch() -> None:
    results = run_world(workers.mpi_suite, 2, backend="mpi", timeout=280, group_timeout=60)
    assert len(results[0]) > 50
    assert not _failures(results), "\n".join(f"--- {k}\n{v}" for k, v in _failures(results).items())


@pytest.mark.timeout(120)
def test_dead_peer_fails_torch_wait_within_the_group_timeout() -> None:
    results = run_world(workers.dead_peer, 2, timeout=100, args=(free_port(),),
                        expect_errors=True)
    out = results[0].value
    assert results[0].ok and out is not None, results[0]
    for (backend, op), (message, seconds) in out.items():
        limit = 3 if backend == "plugdist_toy" else 5
        assert message != "no error", out
        assert seconds < limit + 5, f"{backend} {op}: error after {seconds:.1f}s: {message}"
        for part in ("rank 0", f"op {op}", "backend"):
            assert part in message, f"{backend}: {message!r} lacks {part!r}"
        # what torch's own test_barrier_timeout_* matches in a timeout's message
        assert re.search(" (Timed out|closed|timeout) ", message), message


@pytest.mark.timeout(120)
def test_barrier_timeout_reads_like_torchs() -> None:
    results = run_world(workers.barrier_timeout, 2, timeout=100, args=(free_port(),))
    assert set(results[0]) == {"plugdist_gloo", "plugdist_toy"}, results[0]
    for backend, message in results[0].items():
        assert message.startswith("DistTimeoutError: [rank 0, group "), message
        assert re.search(" (Timed out|closed|timeout) ", message), message
        assert "op barrier" in message and f"backend '{backend[9:]}'" in message, message


@pytest.mark.timeout(120)
def test_debug_detail_checks_bridged_groups(tmp_path: Path) -> None:
    env = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL", "PLUGDIST_FLIGHT_RECORDER_DIR": str(tmp_path)}
    results = run_world(workers.detail_suite, 2, timeout=100, args=(free_port(),), env=env)
    assert all(len(res) == 4 for res in results) and not _failures(results), _failures(results)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("launcher_name", ["plugdist-run", "torchrun"])
def test_script_launched_by_either_launcher_sees_torch_world(tmp_path: Path,
                                                              launcher_name: str) -> None:
    """The same script, calling only plugdist.init_process_group, under either launcher
    (torchrun: plugdist's env:// joins torch's agent store)."""
    launcher = Path(sys.executable).with_name(launcher_name)
    proc = subprocess.run([str(launcher), "--standalone", "--nproc-per-node", "2",
                           str(HERE / "torch_scripts" / "sampler_script.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got == {"rank": rank, "world": 2, "indices": list(range(rank, 10, 2)), "sum": 3.0,
                       "backend": "plugdist_gloo", "torch_after_destroy": False}, got


# -- in one process -----------------------------------------------------------------------------
def _python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120)


def _slurm_job_with_a_free_port(monkeypatch: pytest.MonkeyPatch) -> str:
    """A Slurm job id whose derived store port is free now: a fixed id's port can be held by a
    store another test (in another pytest worker) serves on a port derived alike."""
    from plugdist._world.rendezvous import _job_port

    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    for job in range(7, 1000):
        monkeypatch.setenv("SLURM_JOB_ID", str(job))
        with socket.socket() as s:
            try:
                s.bind(("", _job_port()))
            except OSError:
                continue
        return str(job)
    raise AssertionError("no Slurm job id with a free derived port")


def test_torch_env_rendezvous_uses_launcher_variables_only_without_rank(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's env:// (wrapped on ``import torch``): RANK set wins over a launcher's variables;
    neither gives torch's own error; a launcher's variables alone give rank, world and (one
    host) master."""
    job = _slurm_job_with_a_free_port(monkeypatch)
    code = (
        "import importlib, os, torch, torch.distributed as d\n"
        "rdzv = importlib.import_module('torch.distributed.rendezvous')\n"
        "assert rdzv._rendezvous_handlers['env'].plugdist_fallback\n"
        "from plugdist.testing.harness import free_port\n"
        "os.environ.update(RANK='0', WORLD_SIZE='1', MASTER_ADDR='127.0.0.1',\n"
        "                  MASTER_PORT=str(free_port()), PMI_RANK='3', PMI_SIZE='4')\n"
        "d.init_process_group('gloo')\n"
        "print('set', d.get_rank(), d.get_world_size(), 'LOCAL_RANK' in os.environ)\n"
        "d.destroy_process_group()\n"
        "for k in ('RANK', 'WORLD_SIZE', 'PMI_RANK', 'PMI_SIZE', 'MASTER_ADDR', 'MASTER_PORT'):\n"
        "    del os.environ[k]\n"
        "try:\n"
        "    d.init_process_group('gloo')\n"
        "except ValueError as e:\n"
        "    print('none', e)\n"
        "launchers = {\n"
        "    'mpiexec': dict(PMI_RANK='0', PMI_SIZE='1', MPI_LOCALRANKID='0',\n"
        "                    MPI_LOCALNRANKS='1'),\n"
        "    'mpirun': dict(OMPI_COMM_WORLD_RANK='0', OMPI_COMM_WORLD_SIZE='1',\n"
        "                  OMPI_COMM_WORLD_LOCAL_RANK='0', OMPI_COMM_WORLD_LOCAL_SIZE='1'),\n"
        "    'srun': dict(SLURM_PROCID='0', SLURM_NTASKS='1', SLURM_LOCALID='0',\n"
        f"                 SLURM_NTASKS_PER_NODE='1', SLURM_JOB_ID='{job}')}}\n"
        "for name, variables in launchers.items():\n"
        "    os.environ.update(variables)\n"
        "    d.init_process_group('gloo')\n"
        "    print(name, d.get_rank(), d.get_world_size(), os.environ['RANK'],\n"
        "          os.environ['MASTER_ADDR'])\n"
        "    d.destroy_process_group()\n"
        "    for k in [*variables, 'RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE',\n"
        "              'MASTER_ADDR', 'MASTER_PORT']:\n"
        "        del os.environ[k]\n")
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "TMPDIR")
           or not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "PMI_", "MPI_",
                                "OMPI_", "SLURM_", "PMIX_"))}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "set 0 1 False", proc.stdout
    assert lines[1].startswith("none ") and "RANK expected, but not set" in lines[1], proc.stdout
    assert lines[2:] == [f"{name} 0 1 0 127.0.0.1" for name in ("mpiexec", "mpirun", "srun")], \
        proc.stdout


def test_import_torch_registers_names_without_importing_plugins() -> None:
    code = ("import sys, torch, torch.distributed as d\n"
            "print(sorted(n for n in d.Backend.backend_list if n.startswith('plugdist_')))\n"
            "mine = ('plugdist', 'plugdist_gloo', 'plugdist_mpi', 'plugdist_toy', 'mpi4py')\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in mine))\n")
    proc = _python(code)
    assert proc.returncode == 0, proc.stderr
    names, imported = proc.stdout.splitlines()
    assert {"plugdist_gloo", "plugdist_toy", "plugdist_mpi"} <= set(eval(names))
    assert eval(imported) == []
    off = _python(code, {"PLUGDIST_TORCH_BACKENDS": "0"})
    assert off.returncode == 0 and off.stdout.splitlines()[0] == "[]", off.stdout + off.stderr


def test_explicit_registration_of_a_runtime_backend() -> None:
    code = ("import torch, torch.distributed as d, plugdist\n"
            "from plugdist_toy import ToyProcessGroup\n"
            "plugdist.Backend.register_backend('mytoy', ToyProcessGroup)\n"
            "from plugdist._torch.bridge import register\n"
            "print(register(['mytoy']), register(['mytoy']))\n"
            "d.init_process_group('plugdist_mytoy', store=d.HashStore(), rank=0, world_size=1)\n"
            "t = torch.ones(2); d.all_reduce(t, op=d.ReduceOp.AVG); print(t.tolist())\n"
            "d.destroy_process_group()\n")
    proc = _python(code, {"PLUGDIST_TORCH_BACKENDS": "0"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["['plugdist_mytoy'] ['plugdist_mytoy']", "[1.0, 1.0]"]


def test_entry_point_turns_any_failure_into_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    import _plugdist_torch_autoload as autoload

    def broken_metadata(**_kwargs: object) -> None:
        raise OSError("unreadable metadata")

    monkeypatch.setattr(autoload.importlib.metadata, "entry_points", broken_metadata)
    with pytest.warns(RuntimeWarning, match="unreadable metadata.*PLUGDIST_TORCH_BACKENDS=0"):
        autoload.autoload()



@pytest.mark.timeout(200)
def test_import_torch_survives_a_broken_plugin(broken_site: Path) -> None:
    code = ("import torch, torch.distributed as d\n"
            "print('plugdist_broken' in d.Backend.backend_list)\n"
            "try:\n"
            "    d.init_process_group('plugdist_broken', store=d.HashStore(), rank=0,\n"
            "                         world_size=1)\n"
            "except Exception as e:\n"
            "    print('ERR', type(e).__name__, e)\n")
    env = {"PYTHONPATH": f"{broken_site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = _python(code, env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("True\nERR "), proc.stdout
    assert "failed to load" in proc.stdout
    assert "plugdist_dependency_that_does_not_exist" in proc.stdout
