"""Training through a SIGKILLed rank with the real Lightning and Hugging Face trainers: the whole
matrix of scenarios, every invariant checked, and the pauses the survivors saw.

    python benchmarks/trainer_faults.py --trainer lightning     # or huggingface, or both
    python benchmarks/trainer_faults.py --trainer both --repeat 3 --json report.json
    python benchmarks/trainer_faults.py --overhead 3     # the cost when nothing fails

Each scenario is one run of tests/launcher_scripts/lightning_train.py or hf_train_faults.py on 3
workers under ``plugdist-run`` (gloo, CPU): the victim (rank 0, or the last rank) SIGKILLs itself at
a chosen committed step, in its last backward of the step (the others are in DDP's all_reduce), as
the step's first micro-batch starts, or (``outside``) right after a step, as the others go into the
collectives of its checkpoint; with and without ``--replace-failed``; with and without gradient
accumulation (2 micro-batches a step). A fault-free run of the same configuration is the reference.
Checked from every worker's records (:func:`check`): launcher exit 0; every committed step recorded
by every rank of the world that committed it, once and in order, with one parameter hash; the final
parameters equal on every final rank; within each epoch no sample trained twice by committed steps,
and the samples not trained are exactly those the trainer reports as skipped (the dead rank's
unconsumed shard of that epoch); checkpoints written after the death holding the parameters of their
step; with replacement the world back to full size; the final loss on the whole data set within
``LOSS_TOLERANCE`` of the reference's. Printed per scenario: the survivors' pause at the death (the
longest gap between two committed steps around it, against the median gap), the pause at the
joiner's admission, and kill to full size again. ``--overhead``: what the integrations cost when
nothing fails, against the trainers' own DDP on torch's gloo in the same run.

tests/test_lightning.py and tests/test_huggingface_faults.py run a few scenarios through the same
functions.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = {"lightning": ROOT / "tests" / "launcher_scripts" / "lightning_train.py",
           "huggingface": ROOT / "tests" / "launcher_scripts" / "hf_train_faults.py"}
NPROC = 3
SAMPLES, BATCH = 96, 4   # per rank per micro-batch; 96 divides by 3 and by 2: no padding
EPOCHS = 30
FULL_STREAK = 6          # with --replace-failed: committed steps at full size that end a run
LOSS_TOLERANCE = 0.005   # |final loss - fault-free final loss| (the data's noise alone: 0.0025)
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "PMI_", "MPI_", "OMPI_", "SLURM_", "PMIX_", "PLUGDIST_",
                 "TORCHELASTIC_", "ACCELERATE_")


@dataclass(frozen=True)
class Scenario:
    victim: int | None = None     # None: no fault (the reference)
    replace: bool = False
    accumulate: int = 1
    where: str = "backward"       # or "start", or "outside" (after the step, in a checkpoint's)
    kill_step: int = 13           # committed steps when the victim dies (mid-epoch 1 or 3)
    plain: bool = False           # the trainer's own DDP on torch's gloo, for comparison

    @property
    def name(self) -> str:
        if self.plain:
            return f"no fault, the trainer's own DDP on torch's gloo, accumulate {self.accumulate}"
        if self.victim is None:
            return f"no fault, accumulate {self.accumulate}"
        return (f"kill rank {self.victim} at step {self.kill_step} ({self.where}), "
                f"{'--replace-failed' if self.replace else 'no replacement'}, "
                f"accumulate {self.accumulate}")


@dataclass
class Run:
    scenario: Scenario
    out: Path
    returncode: int
    stdout: str
    stderr: str
    wall: float
    finals: list[dict[str, Any]]
    records: dict[str, list[dict[str, Any]]]   # pid -> its lines


def clean_env(tmp: Path) -> dict[str, str]:
    """This environment less any launcher's variables; Hugging Face offline and quiet."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCHER_VARS)}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_HOME=str(tmp / "hf"), HF_HUB_DISABLE_TELEMETRY="1",
               TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
    return env


def run(trainer: str, scenario: Scenario, out: Path, *, timeout: float = 280,
        step_time: float = 0.02, epochs: int = EPOCHS) -> Run:
    """One scenario in a fresh world of ``NPROC`` workers; returns what it left behind."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "plugdist_run", "--nproc-per-node", str(NPROC),
           "--monitor-interval", "0.05"]
    if scenario.replace:
        cmd += ["--replace-failed", "--max-restarts", "2"]
    cmd += [str(SCRIPTS[trainer]), "--out", str(out), "--epochs", str(epochs),
            "--samples", str(SAMPLES), "--batch-size", str(BATCH),
            "--accumulate", str(scenario.accumulate), "--step-time", str(step_time),
            "--full-streak", str(FULL_STREAK if scenario.replace else 0)]
    if scenario.victim is not None:
        cmd += ["--kill", f"{scenario.victim}:{scenario.kill_step}:{scenario.where}"]
    if scenario.plain:
        cmd += ["--plain"]
    start = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=clean_env(out), cwd=out)
    wall = time.monotonic() - start
    finals = [json.loads(line[line.index("{"):]) for line in done.stdout.splitlines()
              if '"final": true' in line]
    records = {Path(f).stem: [json.loads(x) for x in Path(f).read_text().splitlines()]
               for f in sorted(glob.glob(str(out / "records" / "*.jsonl")))}
    return Run(scenario, out, done.returncode, done.stdout, done.stderr, wall, finals, records)


class References:
    """A trainer's fault-free runs, one per gradient accumulation, each run when first asked,
    in ``folder(name)`` (a fresh directory for ``name``)."""

    def __init__(self, trainer: str, folder: Callable[[str], Path]) -> None:
        self.trainer, self.folder = trainer, folder
        self.figures: dict[int, dict[str, Any]] = {}

    def loss(self, accumulate: int) -> float:
        """The final loss of the fault-free run with ``accumulate`` micro-batches a step."""
        if accumulate not in self.figures:
            out = self.folder(f"reference-{accumulate}")
            self.figures[accumulate] = check(run(self.trainer, Scenario(accumulate=accumulate),
                                                 out))
        return float(self.figures[accumulate]["loss"])


def expected_skipped(scenario: Scenario) -> int:
    """What the dead rank leaves untrained in the epoch it dies in: the rest of its shard."""
    if scenario.victim is None:
        return 0
    shard = SAMPLES // NPROC
    steps_per_epoch = shard // BATCH // scenario.accumulate
    committed_in_epoch = scenario.kill_step % steps_per_epoch
    return shard - committed_in_epoch * scenario.accumulate * BATCH


def check(r: Run, reference_loss: float | None = None) -> dict[str, Any]:
    """Every invariant of the module docstring; raises AssertionError naming the one broken.
    Returns the scenario's figures."""
    s = r.scenario
    log = f"\n--- launcher stderr (tail) ---\n{r.stderr[-6000:]}"
    assert r.returncode == 0, f"{s.name}: launcher exit {r.returncode}{log}"
    final_size = NPROC - 1 if s.victim is not None and not s.replace else NPROC
    assert len(r.finals) == final_size, f"{s.name}: finals {r.finals}{log}"
    assert sorted(f["rank"] for f in r.finals) == list(range(final_size)), r.finals
    assert len({f["params_sha1"] for f in r.finals}) == 1, f"parameters differ: {r.finals}"
    last = r.finals[0]["step"]
    assert {f["step"] for f in r.finals} == {last}, r.finals

    steps: dict[int, list[dict[str, Any]]] = {}
    samples: dict[int, list[dict[str, Any]]] = {}   # step -> micro-batch records
    killed = [x for lines in r.records.values() for x in lines if "killed" in x]
    for pid, lines in r.records.items():
        mine = [x["step"] for x in lines if "step" in x]
        assert mine == list(range(mine[0], mine[0] + len(mine))) if mine else True, \
            f"{s.name}: process {pid}'s committed steps repeat or go back: {mine}"
        last_mine = mine[-1] if mine else 0
        for x in lines:
            if "step" in x:
                steps.setdefault(x["step"], []).append(x)
            elif "samples_of" in x and x["samples_of"] <= last_mine:
                samples.setdefault(x["samples_of"], []).append(x)
    assert sorted(steps) == list(range(1, last + 1)), \
        f"{s.name}: committed steps recorded: {sorted(steps)[:5]}...{sorted(steps)[-5:]}"
    sizes = []
    for step in range(1, last + 1):
        got = steps[step]
        size = got[0]["world_size"]
        sizes.append(size)
        assert len(got) == size and {x["world_size"] for x in got} == {size}, \
            f"{s.name}: step {step} recorded by {len(got)} ranks of a world of {size}"
        assert len({x["params_sha1"] for x in got}) == 1, \
            f"{s.name}: step {step}: parameters differ"
    assert sizes[0] == NPROC, sizes
    # samples: none twice in an epoch; those not trained are the skipped ones
    skipped = r.finals[0]["skipped"]
    assert {f["skipped"] for f in r.finals} == {skipped}, r.finals
    assert skipped == expected_skipped(s), f"{s.name}: skipped {skipped}, expected " \
        f"{expected_skipped(s)}"
    by_epoch: dict[int, list[int]] = {}
    for step in range(1, last + 1):
        for x in samples.get(step, []):
            by_epoch.setdefault(x["epoch"], []).extend(x["indices"])
    untrained = 0
    for epoch, used in sorted(by_epoch.items()):
        assert len(used) == len(set(used)), f"{s.name}: epoch {epoch}: a sample trained twice"
        untrained += SAMPLES - len(used)   # runs stop at an epoch's end
    assert untrained == skipped, f"{s.name}: {untrained} samples untrained, {skipped} reported"

    figures: dict[str, Any] = {"scenario": s.name, "wall_s": round(r.wall, 1), "steps": last,
                               "final_world": final_size, "skipped": skipped,
                               "loss": r.finals[0]["eval_loss"]}
    if reference_loss is not None:
        assert abs(r.finals[0]["eval_loss"] - reference_loss) <= LOSS_TOLERANCE, \
            f"{s.name}: final loss {r.finals[0]['eval_loss']} vs {reference_loss} without a fault"
    if s.victim is None:
        return figures
    assert killed and killed[0]["killed"] == s.victim, f"{s.name}: no kill recorded {killed}"
    death = killed[0]["time"]
    assert NPROC - 1 in sizes[s.kill_step:], f"{s.name}: never ran on the survivors: {sizes}"
    if s.replace:
        assert sizes[-FULL_STREAK:] == [NPROC] * FULL_STREAK, f"{s.name}: world sizes {sizes}"
    _check_checkpoints(r, death, steps)
    figures.update(_pauses(r, steps, death))
    return figures


def _check_checkpoints(r: Run, death: float, steps: dict[int, list[dict[str, Any]]]) -> None:
    """A checkpoint written after the death holds the parameters of its step."""
    after = [(step, path) for step, path in _checkpoints(r.out) if path.stat().st_mtime > death]
    assert after, f"{r.scenario.name}: no checkpoint written after the death"
    step, path = max(after)
    assert _checkpoint_sha1(path) == steps[step][0]["params_sha1"], \
        f"{r.scenario.name}: checkpoint {path.name} does not hold step {step}'s parameters"


def _checkpoints(out: Path) -> list[tuple[int, Path]]:
    found = []
    for path in (out / "checkpoints").glob("*"):
        name = path.name
        if name.startswith("step=") and name.endswith(".ckpt"):          # Lightning
            found.append((int(name[5:-5]), path))
        elif name.startswith("checkpoint-"):                             # Hugging Face
            found.append((int(name.split("-")[1]), path / "model.safetensors"))
    return found


def _checkpoint_sha1(path: Path) -> str:
    """The scripts' ``params_sha1``: the state dict's tensors in key order."""
    if path.suffix == ".ckpt":
        import torch

        state = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
    else:
        from safetensors.torch import load_file

        state = load_file(str(path))
    digest = hashlib.sha1()
    for _, t in sorted(state.items()):
        digest.update(t.contiguous().numpy().tobytes())
    return digest.hexdigest()


def _pauses(r: Run, steps: dict[int, list[dict[str, Any]]], death: float) -> dict[str, Any]:
    """The survivors' longest gap between committed steps around the death and around the
    admission, against the median gap, and kill to full size again."""
    times = {step: min(x["time"] for x in got) for step, got in steps.items()}
    order = sorted(times)
    gaps = {b: times[b] - times[a] for a, b in zip(order, order[1:], strict=False)}
    median = statistics.median(gaps.values())
    after = [step for step in order if times[step] > death]
    out: dict[str, Any] = {"median_step_s": round(median, 3)}
    if after:
        first = after[0]
        out["death_pause_s"] = round(times[first] - max(
            (times[s] for s in order if times[s] <= death), default=times[first]), 3)
    full = [step for step in after if steps[step][0]["world_size"] == NPROC]
    if r.scenario.replace and full:
        out["admission_pause_s"] = round(gaps.get(full[0], 0.0), 3)
        out["kill_to_full_s"] = round(times[full[0]] - death, 2)
    return out


def step_times(r: Run) -> list[float]:
    """The gaps between consecutive committed steps (each step's time: its first record)."""
    times: dict[int, float] = {}
    for lines in r.records.values():
        for x in lines:
            if "step" in x:
                times[x["step"]] = min(times.get(x["step"], x["time"]), x["time"])
    order = sorted(times)
    return [times[b] - times[a] for a, b in zip(order, order[1:], strict=False)]


def overhead(trainers: tuple[str, ...], rounds: int, folder: Path) -> list[dict[str, Any]]:
    """Fault-free runs with the trainer's own DDP on torch's gloo and with the integration,
    interleaved, no stand-in compute: the median time of a committed step, each ratio."""
    out = []
    for trainer in trainers:
        for accumulate in (1, 2):
            medians: dict[bool, list[float]] = {False: [], True: []}
            for round_ in range(rounds):
                for plain in (True, False):
                    r = run(trainer, Scenario(accumulate=accumulate, plain=plain),
                            folder / trainer / f"overhead-{accumulate}-{plain}-{round_}",
                            step_time=0.0, epochs=10)
                    check(r)
                    medians[plain].append(statistics.median(step_times(r)))
            plain_s, resilient_s = min(medians[True]), min(medians[False])
            out.append({"trainer": trainer, "accumulate": accumulate,
                        "plain_step_ms": round(1000 * plain_s, 2),
                        "resilient_step_ms": round(1000 * resilient_s, 2),
                        "ratio": round(resilient_s / plain_s, 3), "rounds": rounds})
            print(json.dumps(out[-1]), flush=True)
    return out


def matrix(victims: tuple[int, ...] = (0, NPROC - 1)) -> list[Scenario]:
    """Every combination of victim, replacement and accumulation, killed inside the step (in
    backward or as it starts, alternately); and each victim, with and without replacement,
    killed outside a step, in the collectives of a checkpoint (and the log, for Hugging Face)."""
    out = []
    for victim in victims:
        for replace in (False, True):
            for accumulate in (1, 2):
                where = "backward" if (victim + accumulate + replace) % 2 else "start"
                out.append(Scenario(victim, replace, accumulate, where))
            out.append(Scenario(victim, replace, 2 if replace else 1, "outside", kill_step=14))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trainer", choices=("lightning", "huggingface", "both"), default="both")
    ap.add_argument("--repeat", type=int, default=1, help="run the matrix this many times")
    ap.add_argument("--dir", default="trainer-faults", help="where the runs leave their records")
    ap.add_argument("--json", default=None, help="write every scenario's figures here")
    ap.add_argument("--overhead", type=int, default=0, metavar="ROUNDS",
                    help="instead: the step time against the trainer's own DDP on torch's "
                         "gloo, best of ROUNDS interleaved fault-free runs each")
    args = ap.parse_args()
    trainers = ("lightning", "huggingface") if args.trainer == "both" else (args.trainer,)
    if args.overhead:
        figures = overhead(trainers, args.overhead, Path(args.dir))
        if args.json:
            Path(args.json).write_text(json.dumps(figures, indent=1))
        return
    results, failures = [], []
    for trainer in trainers:
        reference = References(trainer, lambda name, t=trainer: Path(args.dir) / t / name)
        for accumulate in (1, 2):
            reference.loss(accumulate)
            results.append({"trainer": trainer, **reference.figures[accumulate]})
            print(json.dumps(results[-1]), flush=True)
        for round_ in range(args.repeat):
            for i, scenario in enumerate(matrix()):
                out = Path(args.dir) / trainer / f"{round_}-{i}"
                r = run(trainer, scenario, out)
                try:
                    figures = check(r, reference.loss(scenario.accumulate))
                except AssertionError as err:
                    failures.append(f"{trainer}: {err}")
                    print(f"FAILED {trainer}: {scenario.name}: {str(err)[:3000]}", flush=True)
                    continue
                results.append({"trainer": trainer, **figures})
                print(json.dumps(results[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "failures": failures},
                                              indent=1))
    print(f"{len(results)} runs passed (the fault-free references among them), "
          f"{len(failures)} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
