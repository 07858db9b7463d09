"""``ResilientTrainer``: Hugging Face's ``Trainer`` over a plugdist world that survives a rank loss.

A callback cannot catch what a backward raises, so this is a ``Trainer`` subclass; it keeps the
Trainer's own loop (``_run_epoch``) and maps four points of it onto ``plugdist.parallel``'s
``TrainerSteps``, which holds the loop:

- **the step** (``training_step`` of an update step's last micro-batch, where DDP all_reduces
  the accumulated gradients): ``TrainerSteps.commit`` runs it until every member committed the
  attempt; a failed attempt makes the survivors shrink (fresh DDP reducer, gradients zeroed)
  and redo the whole update step, its earlier micro-batches included
  (``TrainerSteps.micro_batch`` recorded them), with the loss normalisation
  (``num_items_in_batch``) counted again over the survivors. Clipping, ``optimizer.step()`` and
  the scheduler run after the commit, as Trainer does them.
- **collectives outside the step** (the logged loss's gather, the FLOs' broadcast, evaluation
  and prediction, checkpoint saving, the input-token count): each call of the Trainer method
  that holds them runs until every member completed it (``TrainerSteps.agree``); before a
  redo the Trainer's logging counters are put back as they were. The loss normalisation's count
  (``num_items_in_batch``) is part of the update step: its failure fails the step's attempt
  (``TrainerSteps.in_attempt``).
- **the world** after a shrink or grow: Accelerate's ``PartialState``/``AcceleratorState``
  (``num_processes``, ``process_index``), hence ``args.world_size``, ``should_save``,
  ``is_world_process_zero``; at the next epoch boundary the data shards
  (``BatchSamplerShard``), the steps per epoch and, for an epoch-based run, the LR schedule's
  length.
- **joiners** (``plugdist-run --replace-failed``): admitted at the next epoch boundary; they
  receive the model, optimizer, scheduler, ``TrainerState`` and callback states over the group
  and start their loop at the members' epoch.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from collections.abc import Callable
from typing import Any

import plugdist
import torch
from accelerate.data_loader import BatchSamplerShard
from accelerate.state import AcceleratorState, PartialState
from plugdist.parallel import TrainerSteps, resilient_allreduce_hook
from transformers import Trainer
from transformers.trainer_callback import ExportableState, TrainerState

__all__ = ["ResilientTrainer", "WorldChangeHook"]

WorldChangeHook = Callable[["ResilientTrainer", int, int], None]
"""``hook(trainer, old_world_size, new_world_size)``: called on every rank after the world shrank
or grew (before the step is redone, or the epoch begins); rescale the learning rate here."""


class ResilientTrainer(Trainer):
    """``transformers.Trainer`` that trains through a rank loss.

    Call ``plugdist.init_process_group("gloo")`` before building ``TrainingArguments`` (a
    replacement joins the running world there) and start the script with ``plugdist-run``
    (``--replace-failed`` to bring the world back to full size). ``on_world_change``: a
    :data:`WorldChangeHook`. ``min_world_size``: below it, stop with
    ``plugdist.parallel.BelowMinWorldSizeError``. Other arguments are Trainer's.

    :attr:`skipped_samples`: samples no rank trains on because their rank died (the rest of its
    shard of that epoch); the same on every rank, and carried to joiners.
    """

    def __init__(self, *args: Any, on_world_change: WorldChangeHook | None = None,
                 min_world_size: int = 1, **kwargs: Any) -> None:
        if not plugdist.is_initialized():
            raise RuntimeError(
                "ResilientTrainer: call plugdist.init_process_group('gloo') before building "
                "TrainingArguments (a replacement started by plugdist-run --replace-failed "
                "joins the running world there), and start the script with plugdist-run")
        super().__init__(*args, **kwargs)
        self._on_world_change, self._min_world_size = on_world_change, min_world_size
        self._steps: TrainerSteps[dict[str, Any]] | None = None
        self._received: dict[str, Any] | None = None
        self._epoch_batches = 0       # this rank's micro-batches in the epoch _run_epoch runs
        self._update_steps = 0        # update steps per epoch at the world size of the last one

    @property
    def skipped_samples(self) -> int:
        """Samples no rank trains on because their rank died (the rest of its shard of that
        epoch); the same on every rank, and carried to joiners."""
        return self._steps.skipped_samples if self._steps is not None else 0

    # -- the run's shape ---------------------------------------------------------------------
    def set_initial_training_values(self, args: Any, dataloader: Any) -> Any:
        """As Trainer's, except that the epoch loop's bound depends on the arguments alone: a
        joiner computes it at another world size than the members did, and every rank must
        leave the loop together (a run with ``max_steps`` stops there, as Trainer stops it)."""
        values: list[Any] = list(super().set_initial_training_values(args, dataloader))
        values[0] = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs)
        self._update_steps = values[1]
        return tuple(values)

    def _prepare_for_training(self, max_steps: int, train_dataloader: Any,
                              resume_from_checkpoint: Any) -> Any:
        model, train_dataloader = super()._prepare_for_training(
            max_steps, train_dataloader, resume_from_checkpoint)
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise RuntimeError(
                f"ResilientTrainer needs the model in torch's DistributedDataParallel, got "
                f"{type(model).__name__}: run on 2 or more processes, use_cpu=True on a machine "
                f"without a GPU (else Accelerate sees a world of 1), no FSDP or DeepSpeed")
        # torch's DDP divides by the group's size at construction; this hook by the current one
        model.register_comm_hook(None, resilient_allreduce_hook)  # type: ignore[arg-type]
        # a joiner's DDP constructor above met the members' resync; the state follows
        self._steps = TrainerSteps(
            model, state_dict=self._state, load_state_dict=self._receive,
            on_world_change=self._world_changed, untrained_per_rank=self._untrained_per_rank,
            min_world_size=self._min_world_size)
        if self._received is not None:
            self._restore(self._received)
            self._received = None
        return model, train_dataloader

    def _run_epoch(self, model: Any, epoch: int, train_dataloader: Any, steps_in_epoch: int,
                   num_update_steps_per_epoch: int, trial: Any, ignore_keys_for_eval: Any,
                   start_time: Any, resume_from_checkpoint: Any, epochs_trained: Any,
                   steps_trained_in_current_epoch: Any) -> Any:
        """An epoch boundary: admit joiners, shard the data over the current world, then
        Trainer's epoch with the step counts of this world."""
        steps = self._steps
        if steps is not None:
            if steps.joining and epoch < steps.epoch:
                return None    # the members trained it before this process joined
            steps.begin_epoch(epoch)
        self._shard(train_dataloader)
        steps_in_epoch = len(train_dataloader)
        ga = self.args.gradient_accumulation_steps
        num_update_steps_per_epoch = max(math.ceil(steps_in_epoch / ga), 1)
        if num_update_steps_per_epoch != self._update_steps:
            self._follow_schedule(epoch, num_update_steps_per_epoch)
        self._epoch_batches = steps_in_epoch
        return super()._run_epoch(model, epoch, train_dataloader, steps_in_epoch,
                                  num_update_steps_per_epoch, trial, ignore_keys_for_eval,
                                  start_time, resume_from_checkpoint, epochs_trained,
                                  steps_trained_in_current_epoch)

    def _shard(self, dataloader: Any) -> None:
        sampler = getattr(dataloader, "batch_sampler", None)
        if not isinstance(sampler, BatchSamplerShard):
            raise RuntimeError(
                f"ResilientTrainer shards the data itself after a world change and needs "
                f"Accelerate's BatchSamplerShard in the train dataloader, got "
                f"{type(sampler).__name__} (an IterableDataset or dispatch_batches=True are not "
                f"supported)")
        sampler.num_processes = plugdist.get_world_size()
        sampler.process_index = plugdist.get_rank()

    def _follow_schedule(self, epoch: int, update_steps: int) -> None:
        """An epoch-based run whose steps per epoch changed: the schedule's length becomes the
        steps done plus those of the epochs left at this world size, at the same position."""
        self._update_steps = update_steps
        if self.args.max_steps > 0 or self.lr_scheduler is None:
            return
        left = math.ceil(self.args.num_train_epochs) - epoch
        self.state.max_steps = self.state.global_step + left * update_steps
        self.lr_scheduler = None
        scheduler = self.create_scheduler(self.state.max_steps)
        if self.state.global_step:
            scheduler.last_epoch = self.state.global_step - 1
            with warnings.catch_warnings():   # a joiner's optimizer has not stepped yet
                warnings.simplefilter("ignore", UserWarning)
                scheduler.step()
        self.callback_handler.lr_scheduler = scheduler

    # -- the world ---------------------------------------------------------------------------
    def _world_changed(self, old: int, new: int) -> None:
        rank = plugdist.get_rank()
        one_node = os.environ.get("GROUP_WORLD_SIZE") == "1"   # plugdist-run on one host
        for shared in (PartialState._shared_state, AcceleratorState._shared_state):
            if shared:
                shared["num_processes"], shared["process_index"] = new, rank
                if one_node:
                    shared["local_process_index"] = rank
        self.state.is_world_process_zero = self.is_world_process_zero()
        self.state.is_local_process_zero = self.is_local_process_zero()
        if self._on_world_change is not None:
            self._on_world_change(self, old, new)

    def _untrained_per_rank(self) -> int:
        """This rank's samples of the epoch in no committed update step."""
        assert self._steps is not None
        left = max(0, self._epoch_batches - self._steps.committed_in_epoch)
        return left * self.args.per_device_train_batch_size

    # -- the state a joiner receives ---------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        state = dataclasses.asdict(self.state)
        state["stateful_callbacks"] = {
            type(cb).__name__: cb.state() for cb in [*self.callback_handler.callbacks, self.control]
            if isinstance(cb, ExportableState)}
        assert self.optimizer is not None and self.lr_scheduler is not None
        return {"trainer_state": state,
                "model": self.accelerator.unwrap_model(self.model_wrapped).state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "lr_scheduler": self.lr_scheduler.state_dict(),
                "update_steps": self._update_steps}

    def _receive(self, state: dict[str, Any]) -> None:
        self._received = state

    def _restore(self, state: dict[str, Any]) -> None:
        """The members' training state, at the epoch boundary where they admitted this process;
        its loop then skips the epochs before that one."""
        assert self.optimizer is not None and self.lr_scheduler is not None
        self.accelerator.unwrap_model(self.model_wrapped).load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.state = TrainerState(**state["trainer_state"])
        self.state.is_world_process_zero = self.is_world_process_zero()
        self.state.is_local_process_zero = self.is_local_process_zero()
        stored: dict[str, Any] = state["trainer_state"]["stateful_callbacks"]
        for cb in [*self.callback_handler.callbacks, self.control]:
            saved = stored.get(type(cb).__name__)
            if isinstance(cb, ExportableState) and isinstance(saved, dict):
                for name, value in saved.get("attributes", {}).items():
                    setattr(cb, name, value)
        self._update_steps = state["update_steps"]

    # -- the step ----------------------------------------------------------------------------
    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: Any = None) -> torch.Tensor:
        steps = self._steps
        if steps is None:
            return super().training_step(model, inputs, num_items_in_batch)
        # the loss normalisation's count of the update step (shared by its micro-batches)
        items, counted = [num_items_in_batch], num_items_in_batch is not None

        def run(micro_inputs: dict[str, Any]) -> torch.Tensor:
            return super(ResilientTrainer, self).training_step(model, micro_inputs, items[0])

        if not self.accelerator.gradient_state.sync_gradients:
            # an earlier micro-batch of the update step: no collective, unless the model's own
            # (its buffers' broadcast); if one fails, the update step's attempt has failed
            return steps.micro_batch(inputs, lambda: run(inputs),
                                     lambda: torch.zeros((), device=self.args.device))
        earlier_inputs = steps.recorded

        def replay(micro_inputs: dict[str, Any]) -> None:
            with self.accelerator.no_sync(model):
                run(micro_inputs)

        def recount() -> None:   # the loss is normalised over the survivors
            if counted:   # (a count that failed fails the next attempt too: counted again)
                items[0] = self._get_num_items_in_batch([*earlier_inputs, inputs],
                                                        self.args.device)

        return steps.commit(lambda: run(inputs), replay, recount)

    # -- collectives outside the step --------------------------------------------------------
    def _agreed(self, run: Callable[[], Any], before_redo: Callable[[], None] | None = None
                ) -> Any:
        """``run()`` until every member completed it; ``before_redo()`` before each run again."""
        if self._steps is None:
            return run()
        return self._steps.agree(run, before_redo)

    def _get_num_items_in_batch(self, batch_samples: list[Any], device: Any) -> Any:
        """Part of the update step: when its gather fails, the step's attempt has failed (its
        vote discards it) and the count is taken again over the survivors for the redo."""
        parent = super()._get_num_items_in_batch
        if self._steps is None:
            return parent(batch_samples, device)
        return self._steps.in_attempt(lambda: parent(batch_samples, device), lambda: None)

    def _track_num_input_tokens(self, inputs: Any) -> Any:
        return self._agreed(lambda: super(ResilientTrainer, self)._track_num_input_tokens(inputs))

    def store_flos(self) -> None:
        self._agreed(super().store_flos, self._flos_back(self.state.total_flos,
                                                         self.current_flos))

    def _flos_back(self, total: float, current: Any) -> Callable[[], None]:
        def back() -> None:
            self.state.total_flos, self.current_flos = total, current
        return back

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        if self._steps is not None and self._steps.joining:
            # a joiner's eval_on_start: the members are training
            return {}
        return self._agreed(lambda: super(ResilientTrainer, self).evaluate(*args, **kwargs),
                            self._counters_back())

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        return self._agreed(lambda: super(ResilientTrainer, self).predict(*args, **kwargs),
                            self._counters_back())

    def _maybe_log_save_evaluate(self, tr_loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Logging (the loss's gather, the FLOs' broadcast), evaluation and saving, until every
        member completed them all; a redo starts from the same counters on every member."""
        control = self.control
        if not (control.should_log or control.should_evaluate or control.should_save):
            super()._maybe_log_save_evaluate(tr_loss, *args, **kwargs)   # nothing collective
            return
        loss = tr_loss.detach().clone()
        back = self._counters_back()

        def before_redo() -> None:
            tr_loss.copy_(loss)
            back()

        self._agreed(lambda: super(ResilientTrainer, self)._maybe_log_save_evaluate(
            tr_loss, *args, **kwargs), before_redo)

    def _counters_back(self) -> Callable[[], None]:
        """What a log/evaluate/save changes in the Trainer, as it is now, to put back."""
        saved = (self._globalstep_last_logged, self._total_loss_scalar, self.state.total_flos,
                 self.current_flos, len(self.state.log_history), self.state.best_metric,
                 self.state.best_global_step, self.state.best_model_checkpoint,
                 dataclasses.replace(self.control))

        def back() -> None:
            (self._globalstep_last_logged, self._total_loss_scalar, self.state.total_flos,
             self.current_flos, logged, self.state.best_metric, self.state.best_global_step,
             self.state.best_model_checkpoint, control) = saved
            del self.state.log_history[logged:]
            self.control = dataclasses.replace(control)
        return back
