"""The real Lightning Trainer trains through a SIGKILLed rank on plugdist_lightning's
ResilientDDPStrategy under plugdist-run (3 workers, gloo, CPU).

Four worlds, the scenarios where the most can go wrong: rank 0 killed in its last backward of
an accumulated step and replaced (the survivors redo every micro-batch of the step; the joiner
gets the Lightning checkpoint over the group and is admitted at the next epoch boundary); the
last rank killed right after a step, as the others go into that step's checkpoint collectives,
no replacement (they agree again without it, the new world writes the checkpoint, and they finish
the run with the dead rank's shard of that epoch reported as skipped); and a fault-free run of
each as the reference for the final loss. Every check is benchmarks/trainer_faults.py's
:func:`check`, which runs the whole matrix (both victims, with and without replacement and
accumulation, for Lightning and Hugging Face) with the figures for docs/lightning.md.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("lightning", reason="needs the dev extras (lightning)")
pytest.importorskip("plugdist_lightning", reason="needs integrations/lightning installed")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import trainer_faults as tf  # noqa: E402

pytestmark = pytest.mark.resilience


@pytest.fixture(scope="module")
def reference_loss(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], float]:
    """The fault-free run's final loss, by gradient accumulation (run when first asked)."""
    return tf.References("lightning", tmp_path_factory.mktemp).loss


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario", [
    tf.Scenario(victim=0, replace=True, accumulate=2, where="backward"),
    tf.Scenario(victim=2, replace=False, accumulate=1, where="outside", kill_step=14),
], ids=["rank0-backward-replaced-accumulate2", "rank2-checkpoint-no-replacement"])
def test_a_killed_rank_does_not_end_a_lightning_run(
        tmp_path: Path, reference_loss: Callable[[int], float], scenario: tf.Scenario) -> None:
    run = tf.run("lightning", scenario, tmp_path)
    figures = tf.check(run, reference_loss(scenario.accumulate))
    assert "SIGKILL" in run.stderr and f"rank {scenario.victim}" in run.stderr
    if scenario.replace:
        assert "starting a replacement" in run.stderr and "kill_to_full_s" in figures
