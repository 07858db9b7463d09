"""``ResilientDDPStrategy``: Lightning's DDP over a plugdist world that survives a rank loss.

The loop is ``plugdist.parallel.TrainerSteps``'s; this module maps Lightning onto it. How a step
survives (automatic optimization): Lightning runs the step's closure (training_step and backward,
DDP's all_reduce in it) inside ``optimizer.step``. The strategy runs that closure through
``TrainerSteps.commit`` (attempt, vote, recover, replay the earlier micro-batches of an
accumulated step, which Lightning ran outside ``optimizer_step``: ``TrainerSteps.micro_batch``).
Clipping and the optimizer's update run after the commit only.

Collectives outside the step (checkpoint barriers and broadcasts, ``self.log(sync_dist=True)``
at epoch end, validation's metric syncs, early-stopping decisions) go through the strategy's
``barrier``/``broadcast``/``reduce``/``all_gather``; each is run until every member completed it
(``TrainerSteps.agree``). Inside a step, such a collective that fails marks the attempt as
failed and returns this rank's own value (``TrainerSteps.in_attempt``); the step's vote then
discards the attempt.

Joiners (``plugdist-run --replace-failed``) are admitted at the next epoch boundary: the members
grow the world, resync DDP and send a Lightning checkpoint over the group; the joiner loads it
and, until it reaches that same epoch boundary, runs its collectives alone. At every epoch
boundary after a world change, every rank rebuilds its data loaders over the current world.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import plugdist
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.loops.loop import _Loop
from lightning.pytorch.loops.optimization.automatic import ClosureResult
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from plugdist.parallel import TrainerSteps, resilient_allreduce_hook
from torch.distributed import ReduceOp
from torch.optim import Optimizer

from .environment import PlugdistEnvironment, joining

__all__ = ["ResilientDDPStrategy", "WorldChangeHook"]

MicroBatch = tuple[tuple[Any, ...], dict[str, Any]]  # training_step's arguments

# what a ModelCheckpoint decides its next save from, beside its state_dict
_CHECKPOINT_MARKS = ("_last_global_step_saved", "_last_checkpoint_saved",
                     "_defer_save_until_validation")

WorldChangeHook = Callable[["pl.Trainer", int, int], None]
"""``hook(trainer, old_world_size, new_world_size)``: called on every rank after the world shrank
or grew (before the step is redone, or the epoch begins); rescale the learning rate or the batch
here."""


class ResilientDDPStrategy(DDPStrategy):
    """DDP over plugdist's ``backend`` (default ``"gloo"``) that trains through a rank loss.

    Start the run with ``plugdist-run`` (``--replace-failed`` to bring the world back to full
    size); the strategy initializes plugdist's world itself unless the script did.
    ``on_world_change``: a :data:`WorldChangeHook`. ``min_world_size``: below it the run stops with
    ``plugdist.parallel.BelowMinWorldSizeError``. ``timeout``: of the group and of shrink, grow
    and the state transfer. Other keyword arguments go to torch's DDP (not ``ddp_comm_hook``:
    plugdist's resilient all_reduce hook is registered, which divides by the current size).

    :attr:`skipped_samples`: samples of the current epoch that no rank trains on because their
    rank died (the rest of its shard of that epoch); the same on every rank, and carried to
    joiners.
    """

    strategy_name = "plugdist_resilient_ddp"

    def __init__(self, backend: str = "gloo", *, on_world_change: WorldChangeHook | None = None,
                 min_world_size: int = 1, timeout: timedelta | None = default_pg_timeout,
                 **ddp_kwargs: Any) -> None:
        if ddp_kwargs.get("ddp_comm_hook") is not None:
            raise ValueError("ResilientDDPStrategy registers plugdist's resilient_allreduce_hook "
                             "(it averages over the world's current size); ddp_comm_hook cannot "
                             "be combined with it")
        super().__init__(cluster_environment=PlugdistEnvironment(),
                         process_group_backend=f"plugdist_{backend}", timeout=timeout,
                         **ddp_kwargs)
        self._backend, self._min_world_size = backend, min_world_size
        self._on_world_change = on_world_change
        self._steps: TrainerSteps[MicroBatch] | None = None
        self._join_late = False    # a joiner: joins right before its DDP constructor
        self._received: dict[str, Any] | None = None   # the checkpoint a joiner received
        self._reload = False       # rebuild the data loaders at the next epoch boundary
        self._boundary_installed = False

    @property
    def skipped_samples(self) -> int:
        return self._steps.skipped_samples if self._steps is not None else 0

    @property
    def _module(self) -> pl.LightningModule:
        module = self.lightning_module
        assert module is not None, "the strategy has no LightningModule before Trainer.fit"
        return module

    @property
    def _trainer(self) -> pl.Trainer:
        return self._module.trainer

    # -- the world ---------------------------------------------------------------------------
    def setup_distributed(self) -> None:
        reset_seed()
        if joining():
            self._join_late = True   # admitted at the members' next epoch boundary
        elif not plugdist.is_initialized():
            plugdist.init_process_group(self._backend, timeout=self._timeout, torch_world=True)
        self.set_world_ranks()

    def configure_ddp(self) -> None:
        if self._join_late:
            # returns once the members admitted this process; they then wait in the DDP
            # constructor's collectives and the state transfer below
            plugdist.init_process_group(self._backend, timeout=self._timeout, torch_world=True)
            self._join_late = False
            self.set_world_ranks()
        super().configure_ddp()
        assert isinstance(self.model, torch.nn.parallel.DistributedDataParallel)
        # a joiner receives the checkpoint here (kept until setup restores it)
        self._steps = TrainerSteps(
            self.model, state_dict=self._state, load_state_dict=self._receive,
            on_world_change=self._world_changed, untrained_per_rank=self._untrained_per_rank,
            min_world_size=self._min_world_size, timeout=self._timeout)

    def _register_ddp_hooks(self) -> None:
        assert isinstance(self.model, torch.nn.parallel.DistributedDataParallel)
        self.model.register_comm_hook(None, resilient_allreduce_hook)  # type: ignore[arg-type]

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def setup(self, trainer: pl.Trainer) -> None:
        if trainer.state.fn == TrainerFn.FITTING:
            module = trainer.lightning_module
            if not module.automatic_optimization:
                raise MisconfigurationException(
                    "ResilientDDPStrategy redoes a step whose attempt a dead rank interrupted; it "
                    "needs automatic optimization (LightningModule.automatic_optimization = True)")
        super().setup(trainer)
        if self._received is not None:
            self._restore(trainer, self._received)
            self._received = None
        if not self._boundary_installed:
            loop = trainer.fit_loop
            loop.on_advance_start = functools.partial(  # type: ignore[method-assign]
                self._epoch_boundary, loop.on_advance_start)
            self._boundary_installed = True

    def _epoch_boundary(self, start_epoch: Callable[[], None]) -> None:
        """Before the fit loop starts an epoch (its data loader not yet iterated): admit
        joiners (a joiner meets the members here), and rebuild the data loaders if the world
        changed."""
        if self._steps is not None and self._steps.begin_epoch(self._trainer.current_epoch):
            self._reload = True
        if self._reload:
            self._reload = False
            trainer = self._trainer
            trainer.fit_loop._combined_loader = None
            trainer.fit_loop.epoch_loop.val_loop._combined_loader = None
        start_epoch()

    def _world_changed(self, old: int, new: int) -> None:
        """After a shrink or a grow: Lightning's ranks, the data at the next epoch boundary, the
        user's hook."""
        self.set_world_ranks()
        self._reload = True
        if self._on_world_change is not None:
            self._on_world_change(self._trainer, old, new)

    def _untrained_per_rank(self) -> int:
        """How many samples of a rank's shard of this epoch no committed step has taken."""
        trainer = self._trainer
        loader = trainer.fit_loop._combined_loader
        if loader is None or not loader.flattened:
            return 0
        data = loader.flattened[0]
        batch_size = getattr(data, "batch_size", None) or 1
        sampler = getattr(data, "sampler", None)
        try:
            shard = len(sampler)  # type: ignore[arg-type]
        except TypeError:
            return 0
        batches = trainer.num_training_batches
        if batches != float("inf"):
            shard = min(shard, int(batches) * batch_size)
        assert self._steps is not None
        return max(0, shard - self._steps.committed_in_epoch * batch_size)

    # -- the state a joiner receives ---------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        trainer = self._trainer
        return {"checkpoint": trainer._checkpoint_connector.dump_checkpoint(weights_only=False),
                "checkpoint_marks": [{name: getattr(cb, name) for name in _CHECKPOINT_MARKS}
                                     for cb in trainer.checkpoint_callbacks]}

    def _receive(self, state: dict[str, Any]) -> None:
        self._received = state

    def _restore(self, trainer: pl.Trainer, state: dict[str, Any]) -> None:
        """What ``Trainer.fit(ckpt_path=...)`` restores, from the members' checkpoint: model,
        callbacks, loops' progress, optimizers, schedulers. The fit loop then goes on from the
        epoch boundary where the members are, as they do."""
        connector = trainer._checkpoint_connector
        connector._loaded_checkpoint = state["checkpoint"]
        try:
            connector.restore_model()
            connector.restore_datamodule()
            connector.restore_callbacks()
            connector.restore_training_state()
        finally:
            connector._loaded_checkpoint = {}
        _not_resuming(trainer.fit_loop)  # at an epoch boundary: nothing to resume within it
        # ModelCheckpoint decides whether to save (a collective) from marks outside its
        # state_dict: the members' own, so that the joiner decides as they do
        for cb, marks in zip(trainer.checkpoint_callbacks, state["checkpoint_marks"],
                             strict=True):
            for name, value in marks.items():
                setattr(cb, name, value)
        trainer.num_sanity_val_steps = 0

    # -- the step ----------------------------------------------------------------------------
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        steps = self._steps
        if steps is None or steps.in_step or self._trainer.state.fn != TrainerFn.FITTING:
            # outside fit, or the step's last micro-batch (or a replayed one) in commit()
            return super().training_step(*args, **kwargs)
        # an earlier micro-batch of an accumulated step (Lightning runs it outside
        # optimizer_step): recorded for a redo; a rank failure fails the step's attempt and
        # Lightning goes on to the last one
        return steps.micro_batch((args, kwargs), lambda: super(ResilientDDPStrategy, self)
                                 .training_step(*args, **kwargs), self._zero_loss)

    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any],
                       model: pl.LightningModule | torch.nn.Module | None = None,
                       **kwargs: Any) -> Any:
        steps = self._steps
        if steps is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)

        def replay(micro_batch: MicroBatch) -> None:
            """An earlier micro-batch again, without DDP's gradient sync, as Lightning ran it."""
            args, kw = micro_batch
            with self.block_backward_sync():
                output = self.training_step(*args, **kw)
                result = ClosureResult.from_training_step_output(
                    output, self._trainer.accumulate_grad_batches)
                if result.closure_loss is not None:
                    self.backward(result.closure_loss, optimizer)

        return super().optimizer_step(optimizer, lambda: steps.commit(closure, replay), model,
                                      **kwargs)

    def _zero_loss(self) -> torch.Tensor:
        """A loss whose backward gives zero gradients: what a failed micro-batch contributes."""
        params = [p for p in self._module.parameters() if p.requires_grad]
        return sum((p.sum() * 0.0 for p in params), torch.zeros(()))

    # -- collectives outside the step --------------------------------------------------------
    def _collective(self, run: Callable[[], Any], alone: Callable[[], Any]) -> Any:
        """``run()`` where every member completes it; ``alone()`` (this rank's own value) where
        there is no world yet, a joiner has not reached the members, or a step's attempt has
        already failed."""
        steps = self._steps
        if not torch.distributed.is_initialized() or (steps is not None and steps.joining):
            return alone()
        if steps is None:
            return run()
        if steps.in_step:
            return steps.in_attempt(run, alone)
        return steps.agree(run)

    def barrier(self, name: str | None = None, *args: Any, **kwargs: Any) -> None:
        steps = self._steps
        if steps is not None and not (steps.joining or steps.in_step):
            # the agreement's vote is an all_reduce of every member: a barrier already
            self._collective(lambda: None, lambda: None)
        else:
            self._collective(lambda: DDPStrategy.barrier(self, name), lambda: None)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self._collective(lambda: DDPStrategy.broadcast(self, obj, src), lambda: obj)

    def reduce(self, tensor: Any, group: Any | None = None,
               reduce_op: Any | None = "mean") -> Any:
        if not isinstance(tensor, torch.Tensor):
            return tensor

        # Lightning's reduce is a barrier and an all_reduce; the barrier adds nothing here. An
        # average is a sum, then divided (for integers, Lightning's batch-size counts, as
        # Lightning does it on torch's gloo, which it knows by name)
        mean = isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg")
        if reduce_op is None or mean:
            op = ReduceOp.SUM
        elif isinstance(reduce_op, str):
            op = getattr(ReduceOp, reduce_op.upper())
        else:
            op = reduce_op

        def run() -> torch.Tensor:   # torch reduces in place: each attempt on a fresh copy
            result = tensor.clone()
            torch.distributed.all_reduce(result, op=op, group=group)
            if mean:
                result = result / torch.distributed.get_world_size(group)
            return tensor.copy_(result)

        return self._collective(run, lambda: tensor)

    def all_gather(self, tensor: torch.Tensor, group: Any | None = None,
                   sync_grads: bool = False) -> torch.Tensor:
        return self._collective(
            lambda: DDPStrategy.all_gather(self, tensor, group, sync_grads),
            lambda: torch.stack([tensor] * max(1, self.world_size)))


def _not_resuming(loop: _Loop) -> None:
    """``loop`` and its children go on as loops that were never stopped (they were loaded from a
    checkpoint taken between two epochs, where Lightning's own resume logic has nothing to do)."""
    loop.restarting = False
    for each in _loops(loop):
        each._loaded_from_state_dict = False
        each._resuming_from_checkpoint = False


def _loops(loop: _Loop) -> list[_Loop]:
    found = [loop]
    for child in vars(loop).values():
        if isinstance(child, _Loop):
            found += _loops(child)
    return found
