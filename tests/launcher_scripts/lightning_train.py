"""A small Lightning run on plugdist_lightning's ResilientDDPStrategy, for the tests and the
benchmark (tests/test_lightning.py, benchmarks/trainer_faults.py).

Trains a small MLP on a fixed synthetic regression set with the real ``lightning.Trainer``: SGD
with momentum (learning rate times the accumulated micro-batches) and a StepLR schedule,
``self.log(..., sync_dist=True)`` in training and validation, validation every epoch, a
ModelCheckpoint every ``--checkpoint-every`` steps, a CSVLogger. Every rank appends one JSON line
per committed step to ``OUT/records/<pid>.jsonl`` (``step``, ``epoch``, ``world_size``,
``rank``, ``params_sha1``, ``time``) and one per micro-batch (``samples_of``: the step it is part
of, ``indices``); at the end every rank prints ``{"final": true, ...}`` with the model's loss on
the whole set.

``--kill RANK:STEP:WHERE``: the first-generation worker of that rank SIGKILLs itself when the
committed step count reaches STEP: ``backward`` as the step's last backward starts (the others
are in DDP's all_reduce), ``start`` as the step's first micro-batch starts, ``outside`` right
after the step committed, as the others go into the ModelCheckpoint's collectives of that step
(with ``--checkpoint-every`` dividing STEP). Replacements never kill themselves.
``--full-streak N``: train at least ``--epochs`` epochs, then on until the world had its launch
size for the last N committed steps (joiners are admitted at epoch boundaries; every rank
decides this from the same committed world sizes). ``--plain``: Lightning's own DDPStrategy over
torch's gloo (no fault tolerance), for the benchmark's overhead comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from _trainer_run import die, make_data, params_sha1, parse_args, record_file
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy
from plugdist_lightning import ResilientDDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Regression(pl.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
        self.args = args
        self.kill_at: int | None = None   # set on the victim
        self.used: list[int] = []         # the samples of the last micro-batch

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        index, x, y = batch
        self.used = index.tolist()
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        last = (batch_idx + 1) % self.args.accumulate == 0
        if self.kill_at == self.trainer.global_step and self.args.kill_where == "backward" \
                and last:
            loss.register_hook(lambda grad: die())
        if self.args.step_time:
            time.sleep(self.args.step_time)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        _, x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> Any:
        # the learning rate scales with the batch a step takes (linear scaling)
        opt = torch.optim.SGD(self.parameters(), lr=self.args.lr * self.args.accumulate,
                              momentum=0.9)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.95)]


class Record(Callback):
    """One line per committed step on every rank; the stop decision at each epoch's end."""

    def __init__(self, args: argparse.Namespace, full_size: int) -> None:
        self.args, self.full_size = args, full_size
        self.seen = -1
        self.streak = 0   # committed steps in a row at full size; the same on every rank
        self.file = record_file()

    def world_changed(self, trainer: pl.Trainer, old: int, new: int) -> None:
        self.streak = 0

    def on_train_batch_start(self, trainer: pl.Trainer, module: Any, batch: Any,
                             batch_idx: int) -> None:
        if self.seen < 0:
            self.seen = trainer.global_step
        first = batch_idx % self.args.accumulate == 0
        if module.kill_at == trainer.global_step and self.args.kill_where == "start" and first:
            die()

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # the micro-batch's samples, for the step it is part of (committed once that step is)
        step = trainer.global_step + (0 if trainer.global_step > self.seen else 1)
        self.file.write(json.dumps({"samples_of": step, "epoch": trainer.current_epoch,
                                    "indices": module.used}) + "\n")
        if trainer.global_step == self.seen:
            return
        self.seen = trainer.global_step
        size = trainer.world_size
        self.streak = self.streak + 1 if size >= self.full_size else 0
        self.file.write(json.dumps({
            "step": trainer.global_step, "epoch": trainer.current_epoch, "world_size": size,
            "rank": trainer.global_rank, "pid": os.getpid(), "time": time.time(),
            "params_sha1": params_sha1(module)}) + "\n")
        self.file.flush()
        if module.kill_at == trainer.global_step and self.args.kill_where == "outside":
            die()   # the others go on into the checkpoint's collectives (callbacks after this)

    def on_train_epoch_end(self, trainer: pl.Trainer, module: Any) -> None:
        epochs = trainer.fit_loop.epoch_progress.current.processed
        if epochs >= self.args.epochs and self.streak >= self.args.full_streak:
            trainer.should_stop = True


def main() -> None:
    args = parse_args(__doc__, max_epochs=40, plain="Lightning's own DDPStrategy on torch's gloo")
    args.kill_where = args.kill.split(":")[2] if args.kill else ""

    full_size = int(os.environ["WORLD_SIZE"])   # the launch's: shrink and grow rewrite it
    first_generation = os.environ.get("PLUGDIST_JOIN") != "1"
    x, y = make_data(args.samples)
    model = Regression(args)
    if args.kill and first_generation and int(os.environ["RANK"]) == int(args.kill.split(":")[0]):
        model.kill_at = int(args.kill.split(":")[1])
    record = Record(args, full_size)
    strategy = (DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=args.timeout))
                if args.plain else
                ResilientDDPStrategy(timeout=timedelta(seconds=args.timeout),
                                     on_world_change=record.world_changed))
    out = Path(args.out)
    trainer = pl.Trainer(
        accelerator="cpu", devices=full_size, strategy=strategy, max_epochs=args.max_epochs,
        accumulate_grad_batches=args.accumulate, logger=CSVLogger(out / "logs", name="run"),
        callbacks=[record, ModelCheckpoint(dirpath=out / "checkpoints", filename="{step}",
                                           every_n_train_steps=args.checkpoint_every,
                                           save_top_k=-1)],
        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
        num_sanity_val_steps=0)
    data = TensorDataset(torch.arange(len(x)), x, y)
    trainer.fit(model, DataLoader(data, batch_size=args.batch_size, shuffle=True),
                DataLoader(data, batch_size=16))
    with torch.no_grad():
        eval_loss = float(nn.functional.mse_loss(model.net(x), y))
    print(json.dumps({"final": True, "rank": trainer.global_rank, "step": trainer.global_step,
                      "epoch": trainer.current_epoch, "world_size": trainer.world_size,
                      "params_sha1": params_sha1(model), "eval_loss": eval_loss,
                      "skipped": getattr(strategy, "skipped_samples", 0),
                      "val_loss": float(trainer.callback_metrics.get("val_loss", -1.0))}),
          flush=True)
    if args.plain:   # torch's gloo left to the interpreter's exit at times aborts the process
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
