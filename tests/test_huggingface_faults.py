"""The real Hugging Face Trainer trains through a SIGKILLed rank on plugdist_transformers'
ResilientTrainer under plugdist-run (3 workers, gloo, CPU).

Four worlds: rank 0 killed in its last backward of an accumulated update step, no replacement
(the survivors redo the whole update step, finish the run, and report the dead rank's shard of
that epoch as skipped); the last rank killed as a step is logged, the others going into the
collectives of its log and checkpoint, and replaced (they redo the log and the save without it;
the joiner gets the model, optimizer, scheduler and TrainerState over the group at the next epoch
boundary); and a fault-free run of each as the reference for the final loss. With
tests/test_lightning.py (the other two combinations) rank 0 and another rank, with and without
replacement and accumulation, inside and outside the step, all run in the suite for one trainer
or the other; the whole matrix for both is benchmarks/trainer_faults.py, whose :func:`check`
these tests use.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="needs the dev extras (transformers)")
pytest.importorskip("accelerate", reason="needs the dev extras (accelerate)")
pytest.importorskip("plugdist_transformers", reason="needs integrations/transformers installed")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import trainer_faults as tf  # noqa: E402

pytestmark = pytest.mark.resilience


@pytest.fixture(scope="module")
def reference_loss(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], float]:
    """The fault-free run's final loss, by gradient accumulation (run when first asked)."""
    return tf.References("huggingface", tmp_path_factory.mktemp).loss


@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario", [
    tf.Scenario(victim=0, replace=False, accumulate=2, where="backward"),
    tf.Scenario(victim=2, replace=True, accumulate=1, where="outside", kill_step=14),
], ids=["rank0-backward-no-replacement-accumulate2", "rank2-logging-replaced"])
def test_a_killed_rank_does_not_end_a_hugging_face_run(
        tmp_path: Path, reference_loss: Callable[[int], float], scenario: tf.Scenario) -> None:
    run = tf.run("huggingface", scenario, tmp_path)
    figures = tf.check(run, reference_loss(scenario.accumulate))
    assert "SIGKILL" in run.stderr and f"rank {scenario.victim}" in run.stderr
    if scenario.replace:
        assert "starting a replacement" in run.stderr and "kill_to_full_s" in figures
