"""Fault-tolerant training under plugdist-run --replace-failed, with real SIGKILLs.

Runs examples/resilient_train.py (through tests/launcher_scripts/ft_worker.py, which places the
kills) on 4 real workers, and checks what the issue promises: committed steps never repeat or
go back, the world goes 4 -> 3 -> 4, training ends at the requested step with identical
parameters everywhere, and the committed steps of an epoch use every sample at most once.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_ulfm import mpiexec, needs_ulfm

pytestmark = pytest.mark.resilience  # make test-resilience (see pyproject.toml's markers)

ROOT = Path(__file__).resolve().parents[1]
FT_WORKER = str(ROOT / "tests" / "launcher_scripts" / "ft_worker.py")
LAUNCHER = [sys.executable, "-m", "plugdist_run"]
AFTER_FULL = 10  # committed steps at full size that end a run (the example's --steps-after-full)


def run_training(tmp_path: Path, *, nproc: int = 4, steps: int = 30, replace: int = 2,
                 extra: list[str] | None = None, env: dict[str, str] | None = None,
                 timeout: float = 200) -> tuple[subprocess.CompletedProcess[str],
                                                list[dict[str, Any]], list[dict[str, Any]]]:
    samples = tmp_path / "samples"
    cmd = [*LAUNCHER, "--nproc-per-node", str(nproc), "--monitor-interval", "0.05"]
    if replace:
        cmd += ["--replace-failed", "--max-restarts", str(replace)]
    # the run goes on until its replacements joined and the full world trained 10 steps,
    # however long a new process takes to import torch on this machine
    cmd += [FT_WORKER, "--steps", str(steps), "--hidden", "32", "--step-time", "0.05",
            "--steps-after-full", str(AFTER_FULL), "--max-steps", "100000",
            "--sample-log", str(samples), *(extra or [])]
    full_env = dict(os.environ, PLUGDIST_TORCH_WORLD="0", **(env or {}))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
    # the launcher prefixes each line with "[rank N] "
    lines = [json.loads(x[x.index("{"):]) for x in done.stdout.splitlines() if "{" in x]
    records = [json.loads(x) for f in sorted(samples.glob("*.jsonl"))
               for x in f.read_text().splitlines()] if samples.exists() else []
    return done, lines, records


def check_run(done: subprocess.CompletedProcess[str], lines: list[dict[str, Any]],
              records: list[dict[str, Any]], steps: int, nproc: int) -> list[int]:
    """The checks every successful run must pass; returns the world size at each step. The run
    trains at least ``steps`` steps (more while a replacement is on its way)."""
    assert done.returncode == 0, f"launcher failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    log = f"\nlauncher's stderr:\n{done.stderr[-5000:]}"
    progress = [x for x in lines if "step" in x and "final" not in x]
    finals = [x for x in lines if x.get("final")]
    steps_seen = [x["step"] for x in progress]
    assert len(finals) == nproc, f"{finals}{log}"
    ends = {f["step"] for f in finals}
    assert len(ends) == 1 and ends.pop() >= steps, f"the ranks ended at steps {finals}{log}"
    assert steps_seen == list(range(finals[0]["step"])), \
        f"committed steps repeat or go back: {steps_seen}{log}"
    assert len({f["params_sha1"] for f in finals}) == 1, f"parameters differ: {finals}"
    # samples: within an epoch, no sample is used twice by committed steps
    by_epoch: dict[int, list[int]] = {}
    per_step: dict[int, int] = {}
    for r in records:
        by_epoch.setdefault(r["epoch"], []).extend(r["indices"])
        per_step[r["step"]] = per_step.get(r["step"], 0) + 1
    for epoch, used in by_epoch.items():
        assert len(used) == len(set(used)), f"epoch {epoch}: a sample was used twice"
    sizes = [x["world_size"] for x in progress]
    for step, size in enumerate(sizes):
        assert per_step.get(step) == size, (f"step {step} was committed by {per_step.get(step)}"
                                            f" ranks' records, the world had {size}")
    return sizes


def _went_down_and_up(sizes: list[int], full: int) -> bool:
    low = sizes.index(full - 1) if full - 1 in sizes else -1
    return sizes[0] == full and low > 0 and sizes[-AFTER_FULL:] == [full] * AFTER_FULL


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ddp", ["plugdist", "torch"])
def test_a_killed_worker_is_replaced_and_training_goes_on(tmp_path: Path, ddp: str) -> None:
    rng = random.Random()
    victim, at = rng.randrange(4), rng.randrange(3, 9)
    done, lines, records = run_training(
        tmp_path, steps=30, extra=["--ddp", ddp, "--kill-rank", str(victim),
                                   "--kill-at-step", str(at)])
    sizes = check_run(done, lines, records, 30, 4)
    assert _went_down_and_up(sizes, 4), f"world sizes {sizes} (rank {victim} killed at {at})"
    assert f"rank {victim}" in done.stderr and "SIGKILL" in done.stderr, done.stderr[-2000:]
    assert "starting a replacement" in done.stderr


@pytest.mark.timeout(300)
def test_two_failures_in_a_row(tmp_path: Path) -> None:
    done, lines, records = run_training(tmp_path, steps=30, replace=2,
                                        env={"FT_KILLS": "1:5,2:15"})
    sizes = check_run(done, lines, records, 30, 4)
    assert sizes[0] == 4 and 3 in sizes and sizes[-AFTER_FULL:] == [4] * AFTER_FULL, sizes
    assert done.stderr.count("starting a replacement") == 2


@pytest.mark.timeout(300)
def test_max_restarts_counts_replacements_then_the_others_go_on(tmp_path: Path) -> None:
    """--max-restarts 1: the first dead worker is replaced; the second is not (the budget is
    spent), and the three others train on to the end rather than the node stopping."""
    done, lines, records = run_training(tmp_path, steps=30, replace=1,
                                        env={"FT_KILLS": "1:5,2:15"},
                                        extra=["--max-steps", "60"])
    # the replacement joins the two left, unless the run reached --max-steps first
    end_size = len([x for x in lines if x.get("final")])
    sizes = check_run(done, lines, records, 30, end_size)
    assert sizes[0] == 4 and 3 in sizes and sizes[-1] == end_size in (2, 3), sizes
    assert done.stderr.count("starting a replacement") == 1, done.stderr[-3000:]
    assert "the others go on without it (its replacements are used up" in done.stderr
    assert "died and the others went on without them" in done.stderr


@pytest.mark.timeout(300)
@pytest.mark.parametrize("where", ["joiner_receive", "source_send"])
def test_a_failure_during_the_state_transfer(tmp_path: Path, where: str) -> None:
    """The joiner dies while receiving the state, or rank 0 dies while sending it: the others
    go on, a further replacement joins, and the run still ends identical everywhere."""
    done, lines, records = run_training(tmp_path, steps=30, replace=3,
                                        env={"FT_KILLS": "1:4", "FT_DIE": where})
    sizes = check_run(done, lines, records, 30, 4)
    assert sizes[-AFTER_FULL:] == [4] * AFTER_FULL, sizes
    assert done.stderr.count("starting a replacement") >= 2, done.stderr[-3000:]


@pytest.mark.timeout(200)
def test_falling_below_min_world_size_stops_with_a_clear_error(tmp_path: Path) -> None:
    """2 processes (no launcher: one that stops the others would hide the error), rank 1
    SIGKILLed at step 3 with min_world_size=2: rank 0 stops with BelowMinWorldSizeError."""
    from plugdist.testing.harness import free_port

    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE="2", PLUGDIST_TORCH_WORLD="0")
    procs = [subprocess.Popen([sys.executable, FT_WORKER, "--steps", "40", "--hidden", "32",
                               "--min-world-size", "2", "--kill-rank", "1",
                               "--kill-at-step", "3"],
                              env=dict(env, RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=150) for p in procs]
    assert procs[1].returncode == -9, outs[1][1][-2000:]
    assert procs[0].returncode == 1, outs[0][1][-3000:]
    err = outs[0][1]
    assert "BelowMinWorldSizeError" in err and "min_world_size=2" in err, err[-3000:]
    steps = [json.loads(x)["step"] for x in outs[0][0].splitlines() if '"step"' in x]
    assert steps == [0, 1, 2], "no step may commit once the world is too small"


@needs_ulfm
@pytest.mark.timeout(200)
def test_torch_ddp_over_mpi_goes_on_after_a_killed_rank(tmp_path: Path) -> None:
    """torch's DDP over plugdist_mpi, under Open MPI's mpiexec --with-ft ulfm: rank 2 is
    SIGKILLed at step 10; the 3 others shrink (MPI's native shrink) and train on to the end
    with identical parameters and the sample accounting intact. (MPI admits no replacement:
    grow is refused there, so the world stays at 3.)"""
    samples = tmp_path / "samples"
    done, _ = mpiexec(tmp_path, "", 4, timeout=150, program=[
        str(ROOT / "examples" / "resilient_train.py"), "--backend", "mpi", "--ddp", "torch",
        "--steps", "40", "--hidden", "32", "--kill-rank", "2", "--kill-at-step", "10",
        "--sample-log", str(samples)])
    lines = [json.loads(x[x.index("{"):]) for x in done.stdout.splitlines()
             if x.lstrip().startswith("{")]
    records = [json.loads(x) for f in sorted(samples.glob("*.jsonl"))
               for x in f.read_text().splitlines()]
    sizes = check_run(done, lines, records, 40, 3)
    assert sizes == [4] * 10 + [3] * 30, sizes


def test_exit_if_excluded_turns_exclusion_into_the_launchers_exit_code(
        capsys: pytest.CaptureFixture[str]) -> None:
    """The exit the trainer integrations take when the others excluded this process: the code
    plugdist-run replaces (as a decorator and as a context manager); other errors pass."""
    from plugdist import DistExcludedError
    from plugdist.parallel import exit_if_excluded

    @exit_if_excluded()
    def excluded() -> None:
        raise DistExcludedError("declared failed by the others")

    with pytest.raises(SystemExit) as leaving:
        excluded()
    assert leaving.value.code == DistExcludedError.exit_code == 75
    assert "exiting with 75 for plugdist-run to replace" in capsys.readouterr().err
    with pytest.raises(ValueError), exit_if_excluded():
        raise ValueError("not an exclusion")
    with exit_if_excluded():
        pass
