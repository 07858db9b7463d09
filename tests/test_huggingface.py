"""Hugging Face Trainer and Accelerate on plugdist's torch backends, with the recipes of
docs/torch.md ("Hugging Face and Lightning"): a tiny random GPT-2 trained for a few steps over
``plugdist_gloo`` and ``plugdist_mpi`` ends with bitwise the parameters torch's own gloo gives
(one world of 2 ranks under a bare ``mpiexec``: tests/torch_scripts/hf_train.py). And torch's
env:// under a launcher, when a library has copied the launcher's rank into ``RANK`` itself but
set no master: plugdist's fallback supplies ``MASTER_ADDR``/``MASTER_PORT``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="needs the dev extras (transformers)")
pytest.importorskip("accelerate", reason="needs the dev extras (accelerate)")

import torch  # noqa: E402
from plugdist.testing.harness import free_port, mpiexec_path  # noqa: E402

HERE = Path(__file__).parent
WORLD = 2
RUNS = ("gloo", "plugdist_gloo", "plugdist_mpi")
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "PMI_", "MPI_", "OMPI_", "SLURM_", "PMIX_", "PLUGDIST_",
                 "TORCHELASTIC_", "ACCELERATE_")


def _offline_env(tmp_path: Path) -> dict[str, str]:
    """No launcher variables, no hub: everything Hugging Face would fetch or cache stays off."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARS)}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(tmp_path / "hf"),
               HF_HUB_DISABLE_TELEMETRY="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1")
    return env


@pytest.mark.timeout(300)
def test_trainer_and_accelerate_match_gloo_on_plugdist_backends(tmp_path: Path) -> None:
    import plugdist
    if not plugdist.is_backend_available("mpi"):
        pytest.skip("plugdist-mpi is not usable here (pip install 'plugdist-mpi[mpich]')")
    out = tmp_path / "out"
    out.mkdir()
    command = [mpiexec_path(), "-n", str(WORLD), sys.executable,
               str(HERE / "torch_scripts" / "hf_train.py"), str(out), str(free_port()),
               str(free_port())]
    job = subprocess.run(command, capture_output=True, text=True, timeout=280,
                         env=_offline_env(tmp_path), cwd=tmp_path)
    assert job.returncode == 0, job.stdout[-2000:] + job.stderr[-6000:]
    backends = {"gloo": "gloo", "plugdist_gloo": "plugdist_gloo", "plugdist_mpi": "plugdist_mpi"}
    for loop in ("accelerate", "trainer"):
        reference = None
        for run in RUNS:
            for rank in range(WORLD):
                saved = torch.load(out / f"{run}-{loop}-rank{rank}.pt")
                assert (saved["world"], saved["backend"]) == (WORLD, backends[run]), saved
                if reference is None:   # torch's gloo, rank 0
                    reference = saved["state"]
                    start = _initial_state()
                    moved = [k for k in start if not torch.equal(start[k], reference[k])]
                    assert moved, f"{loop}: training left every parameter where it started"
                    continue
                state = saved["state"]
                assert state.keys() == reference.keys()
                differ = [k for k in state if not torch.equal(state[k], reference[k])]
                assert not differ, f"{loop} over {run}, rank {rank}: not bitwise gloo's: {differ}"


def _initial_state() -> dict[str, torch.Tensor]:
    sys.path.insert(0, str(HERE / "torch_scripts"))
    try:
        from hf_train import tiny_gpt2
    finally:
        sys.path.remove(str(HERE / "torch_scripts"))
    return {k: v.detach().clone() for k, v in tiny_gpt2().state_dict().items()}


@pytest.mark.timeout(60)
def test_torch_env_fallback_fills_master_when_a_library_set_rank(tmp_path: Path) -> None:
    """As Accelerate does under a bare mpiexec: RANK and WORLD_SIZE copied from PMI_RANK and
    PMI_SIZE, no MASTER_*. torch's env:// (rank= and world_size= passed, as Accelerate passes
    them) gets MASTER_ADDR and the port plugdist derives for the job from plugdist's fallback;
    a RANK that disagrees with the launcher's is left to torch's own error."""
    code = (
        "import os, torch, torch.distributed as d\n"
        "os.environ.update(RANK='0', WORLD_SIZE='1')\n"
        "d.init_process_group('gloo', rank=0, world_size=1)\n"
        "t = torch.ones(2); d.all_reduce(t)\n"
        "from plugdist._world.rendezvous import _job_port\n"
        "print(os.environ['MASTER_ADDR'], os.environ['MASTER_PORT'] == str(_job_port()),\n"
        "      os.environ['LOCAL_RANK'], t.tolist())\n"
        "d.destroy_process_group()\n"
        "for k in ('MASTER_ADDR', 'MASTER_PORT'):\n"
        "    del os.environ[k]\n"
        "os.environ['RANK'] = '5'   # the script numbers its own world: no fallback\n"
        "try:\n"
        "    d.init_process_group('gloo')\n"
        "except ValueError as e:\n"
        "    print('refused', e)\n")
    env = _offline_env(tmp_path)
    env.update(PMI_RANK="0", PMI_SIZE="1", MPI_LOCALRANKID="0", MPI_LOCALNRANKS="1")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=50)
    assert proc.returncode == 0, proc.stderr
    first, second = proc.stdout.splitlines()
    assert first == "127.0.0.1 True 0 [1.0, 1.0]", proc.stdout
    assert second.startswith("refused ") and "MASTER_ADDR" in second, proc.stdout
