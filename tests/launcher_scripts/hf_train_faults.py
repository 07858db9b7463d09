"""A small Hugging Face Trainer run on plugdist_transformers' ResilientTrainer, for the tests and
the benchmark (tests/test_huggingface_faults.py, benchmarks/trainer_faults.py).

The counterpart of lightning_train.py, with the same options and records: the real
``transformers.Trainer`` trains a small MLP (a ``torch.nn.Module`` whose loss is normalised by
Trainer's ``num_items_in_batch``, so the token count's gather runs every step) on a fixed
synthetic regression set: SGD with momentum (learning rate times the accumulated micro-batches),
Trainer's linear schedule, the loss logged (gathered) every step, evaluation every epoch, a
checkpoint every ``--checkpoint-every`` steps. Every rank appends one JSON line per committed step
to ``OUT/records/<pid>.jsonl``; at the end every rank prints ``{"final": true, ...}``.

``--kill RANK:STEP:WHERE`` (``backward``: as the update step's last backward computes its first
gradient; ``start``: as the update step begins; ``outside``: as step STEP is logged, the others
going on into the collectives of its logging and saving) and ``--full-streak N``: as in
lightning_train.py.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import plugdist
import torch
import torch.distributed as tdist
from _trainer_run import die, make_data, params_sha1, parse_args, record_file
from plugdist_transformers import ResilientTrainer
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments


class Samples(torch.utils.data.Dataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i], "index": torch.tensor(i)}


class Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None,
                index: torch.Tensor | None = None, **kwargs: Any) -> dict[str, torch.Tensor]:
        out = self.net(x)
        if labels is None:
            return {"logits": out}
        items = kwargs.get("num_items_in_batch")   # the update step's, over every rank
        loss = ((out - labels) ** 2).sum() / items if items is not None else \
            nn.functional.mse_loss(out, labels)
        return {"loss": loss, "logits": out}


def recorded(base: type[Trainer]) -> type[Trainer]:
    """``base`` noting each micro-batch's samples and the epoch, and placing the kill in a
    backward."""

    class Recorded(base):  # type: ignore[valid-type,misc]
        kill_at: int | None = None
        kill_where = ""
        used: list[int] = []
        epoch_now = 0

        def training_step(self, model: nn.Module, inputs: dict[str, Any],
                          num_items_in_batch: Any = None) -> torch.Tensor:
            self.used = inputs["index"].tolist()
            if self.kill_at == self.state.global_step and self.kill_where == "backward" \
                    and self.accelerator.gradient_state.sync_gradients:
                self.accelerator.unwrap_model(model).net[2].weight.register_hook(
                    lambda g: die())
            return super().training_step(model, inputs, num_items_in_batch)

        def _run_epoch(self, model: Any, epoch: int, **kwargs: Any) -> Any:
            self.epoch_now = epoch
            return super()._run_epoch(model=model, epoch=epoch, **kwargs)

    return Recorded


class Record(TrainerCallback):
    """One line per committed step on every rank; the stop decision at each epoch's end."""

    def __init__(self, args: argparse.Namespace, full_size: int) -> None:
        self.args, self.full_size = args, full_size
        self.trainer: Any = None
        self.streak = 0   # committed steps in a row at full size; the same on every rank
        self.file = record_file()

    def world_changed(self, trainer: Any, old: int, new: int) -> None:
        self.streak = 0

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self.trainer
        assert trainer is not None
        if trainer.kill_at == state.global_step and trainer.kill_where == "start":
            die()

    def _samples(self, step: int) -> None:
        assert self.trainer is not None
        self.file.write(json.dumps({"samples_of": step, "epoch": self.trainer.epoch_now,
                                    "indices": self.trainer.used}) + "\n")

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._samples(state.global_step + 1)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self.trainer
        assert trainer is not None
        self._samples(state.global_step)
        size = tdist.get_world_size()
        self.streak = self.streak + 1 if size >= self.full_size else 0
        self.file.write(json.dumps({
            "step": state.global_step, "epoch": trainer.epoch_now, "world_size": size,
            "rank": tdist.get_rank(), "pid": os.getpid(), "time": time.time(),
            "params_sha1": params_sha1(trainer.accelerator.unwrap_model(trainer.model))}) + "\n")
        self.file.flush()

    def on_log(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self.trainer
        assert trainer is not None
        if trainer.kill_at == state.global_step and trainer.kill_where == "outside":
            die()   # the others go on into the log's, evaluation's and save's collectives

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        assert self.trainer is not None
        if self.trainer.epoch_now + 1 >= self.args.epochs \
                and self.streak >= self.args.full_streak:
            control.should_training_stop = True


def main() -> None:
    args = parse_args(__doc__, max_epochs=60, plain="transformers.Trainer on torch's gloo")

    full_size = int(os.environ["WORLD_SIZE"])   # the launch's: shrink and grow rewrite it
    first_generation = os.environ.get("PLUGDIST_JOIN") != "1"
    launch_rank = int(os.environ.get("RANK", "-1"))   # a replacement has none
    x, y = make_data(args.samples)
    model = Regression()
    if not args.plain:
        # a replacement joins the running world here (PLUGDIST_JOIN=1, set by --replace-failed)
        plugdist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    training_args = TrainingArguments(
        output_dir=str(Path(args.out) / "checkpoints"), use_cpu=True,
        per_device_train_batch_size=args.batch_size, per_device_eval_batch_size=16,
        gradient_accumulation_steps=args.accumulate, num_train_epochs=args.max_epochs,
        learning_rate=args.lr * args.accumulate, optim="sgd", optim_args="momentum=0.9",
        logging_steps=1, eval_strategy="epoch", save_strategy="steps",
        save_steps=args.checkpoint_every, report_to="none", disable_tqdm=True, seed=0,
        dataloader_num_workers=0, ddp_find_unused_parameters=False)
    record = Record(args, full_size)
    extra = {} if args.plain else {"on_world_change": record.world_changed}
    trainer = recorded(Trainer if args.plain else ResilientTrainer)(
        model=model, args=training_args, train_dataset=Samples(x, y),
        eval_dataset=Samples(x, y), callbacks=[record], **extra)
    record.trainer = trainer
    if args.kill and first_generation and launch_rank == int(args.kill.split(":")[0]):
        trainer.kill_at = int(args.kill.split(":")[1])
        trainer.kill_where = args.kill.split(":")[2]
    if args.step_time:
        trainer.add_callback(_Sleep(args.step_time))
    trainer.train()
    with torch.no_grad():
        eval_loss = float(nn.functional.mse_loss(model.net(x), y))
    print(json.dumps({"final": True, "rank": tdist.get_rank(),
                      "step": trainer.state.global_step, "world_size": tdist.get_world_size(),
                      "params_sha1": params_sha1(model), "eval_loss": eval_loss,
                      "skipped": getattr(trainer, "skipped_samples", 0)}), flush=True)
    if plugdist.is_initialized():
        plugdist.destroy_process_group()
    elif tdist.is_initialized():   # torch's gloo left to the interpreter's exit at times aborts
        tdist.destroy_process_group()


class _Sleep(TrainerCallback):
    """Stands in for compute: each micro-batch takes this much longer."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        time.sleep(self.seconds)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        time.sleep(self.seconds)


if __name__ == "__main__":
    main()
