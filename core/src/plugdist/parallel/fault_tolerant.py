"""Fault-tolerant training: commit whole steps only, go on without a dead rank, take joiners in.

:class:`ResilientTraining` wraps a user's training step over a data-parallel model (plugdist's
``DistributedDataParallel``, or torch's over a ``plugdist_X`` group):

1. **Commit.** The step's forward and backward run (DDP synchronises the gradients); then the
   members vote. The optimizer steps only if every member finished its gradient
   synchronisation. A member that died during the step makes the survivors discard the step's
   gradients (never apply a partially reduced one), shrink, and redo the step with the
   survivors. The outcome of each step is decided once, in the store (compare-and-set), so a
   vote that completed on some members and failed on others still ends the same everywhere.
2. **Admission.** Rank 0 looks for processes waiting to join during each vote; when one waits,
   the members admit it at the next step boundary (``grow_group``), and rank 0 sends it the
   training state (``state_dict()``: model, optimizer, step, sampler) over the group itself.
3. **Data.** With an :class:`ElasticSampler`, each committed step consumes one global batch of
   the epoch's permutation, shared out by the ranks of the world that committed it, so when the
   world size changes no sample of the epoch is skipped or seen twice by committed steps.

:meth:`ResilientTraining.run_step` does all three for a step function. A trainer that owns the
optimizer step itself calls the parts instead: ``vote``, ``recover`` and ``admit``, and
``agree`` for collectives outside the step; :class:`plugdist.parallel.TrainerSteps` runs them
as a trainer's micro-batch loop (the Lightning and Hugging Face integrations use it).

All members and joiners call the same methods in the same order; see docs/fault_tolerance.md.
"""

from __future__ import annotations

import json
import pickle
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch

from plugdist._log import get_logger
from plugdist._observability.page_reporter import note_step
from plugdist._resilience.policy import off_hint
from plugdist._resilience.writes import MemberWrites
from plugdist._world.state import world
from plugdist.errors import BelowMinWorldSizeError, DistError, DistRankFailureError
from plugdist.parallel.elastic_sampler import ElasticSampler
from plugdist.store._worldkeys import FT_FORGOTTEN as _FORGOTTEN
from plugdist.store._worldkeys import (
    ft_block_prefix,
    ft_epoch_prefix,
    ft_state_key,
    ft_step_key,
    ft_vote_key,
)

__all__ = ["ResilientTraining", "ElasticSampler", "BelowMinWorldSizeError", "is_rank_failure"]

_VOTE_BLOCK = 64  # the vote outcomes of this many steps are dropped from the store at once

T = TypeVar("T")


def is_rank_failure(err: BaseException) -> bool:
    """Whether ``err`` (or what it wraps: torch's DDP re-raises hook errors as RuntimeError,
    trainers wrap what a step raised) is a rank failure (:class:`plugdist.DistRankFailureError`)."""
    seen = 0
    while err is not None and seen < 8:
        if isinstance(err, DistRankFailureError):
            return True
        if "DistRankFailureError" in str(err) and isinstance(err, RuntimeError):
            return True
        err = err.__cause__ or err.__context__  # type: ignore[assignment]
        seen += 1
    return False


class ResilientTraining:
    """Run training steps that commit only when every member finished them.

    ``model``: plugdist's DistributedDataParallel, or torch's over a ``plugdist_X`` group
    (register :func:`plugdist.parallel.resilient_allreduce_hook` on it). ``optimizer``: stepped
    on commit by :meth:`run_step` (None where the caller steps it: a trainer that calls
    :meth:`vote` itself). ``state_dict``/``load_state_dict``: the training state sent to a joiner
    (default: model, optimizer, step and sampler). ``min_world_size``: below it, stop with
    :class:`BelowMinWorldSizeError`. ``timeout``: for shrink, grow and the state transfer
    (default: the group's). ``on_world_change``: called with no argument after every shrink and
    grow this object makes (``get_rank()``/``get_world_size()`` already give the new world; after
    a grow, the joiners have the state).

    Constructed by every member after the model, and by a joiner right after it built its model
    (the joiner then receives the state here, blocking until it has it).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 *, sampler: ElasticSampler | None = None,
                 state_dict: Callable[[], dict[str, Any]] | None = None,
                 load_state_dict: Callable[[dict[str, Any]], None] | None = None,
                 min_world_size: int = 1, timeout: timedelta | None = None,
                 on_world_change: Callable[[], None] | None = None) -> None:
        pg = world.require("ResilientTraining")
        if world.membership is None:
            raise DistError(off_hint("ResilientTraining"))
        if optimizer is None and (state_dict is None or load_state_dict is None):
            raise ValueError("ResilientTraining without an optimizer needs state_dict and "
                             "load_state_dict: a joiner's state would lack the optimizer's")
        self.model, self.optimizer, self.sampler = model, optimizer, sampler
        self._user_state, self._user_load = state_dict, load_state_dict
        self._on_world_change = on_world_change
        self.min_world_size = min_world_size
        self.timeout = timeout or pg.timeout
        self.step = 0          # committed steps
        self.redone = 0        # attempts discarded because a member failed
        self._committed_at = time.monotonic()  # when the last step was committed
        self.stopping = False  # a stop was agreed (request_stop): the same on every member
        self._stop_asked = False
        self._grow_due = False
        self._agreements = 0   # agree() calls since the last commit or world change
        self._agreed_epoch = world.epoch
        self._torch_group = getattr(model, "process_group", None) \
            if not _is_plugdist_ddp(model) else None
        self._log = get_logger(rank=world.rank)
        self._check_size()
        if world.joined_epoch == world.epoch and not world.state_received:
            self._transfer_state(sending=False)

    # -- the step ----------------------------------------------------------------------------
    def request_stop(self) -> None:
        """Ask every member to stop at a step boundary (a preemption notice, a stop file seen by
        one rank). The request rides on the next step's vote: once that step is committed,
        :attr:`stopping` is True on every member at the same step, so all leave the training
        loop together. Any member may call it between steps; it does not block."""
        self._stop_asked = True

    def run_step(self, step_fn: Callable[[], T]) -> T:
        """Run ``step_fn`` (forward and backward, with DDP's gradient synchronisation) until
        an attempt is committed, then step the optimizer; returns that attempt's result.
        Blocks; every member calls it once per step. The parts, for a trainer that steps its
        optimizer itself: ``admit(); step_fn(); vote() and optimizer.step() or recover()``."""
        if self.optimizer is None:
            raise ValueError("run_step steps the optimizer: construct ResilientTraining with "
                             "one, or call admit(), vote() and recover() yourself")
        while True:
            self.admit()
            try:
                result = step_fn()
                finished = True
            except Exception as err:
                if not is_rank_failure(err):
                    raise
                finished = False
            if self.vote(finished):
                self.optimizer.step()
                return result
            self.recover()

    def vote(self, finished: bool = True) -> bool:
        """Whether the current attempt of the step is committed: every member finished it
        (``finished``: this member's forward and backward completed; False when they raised a
        rank failure). True: the caller applies the step (steps its optimizer); :attr:`step`
        has gone up by one, the sampler has moved past the step's samples, a waiting joiner
        and a stop request are noted. False: a member failed; call :meth:`recover`, then run the
        attempt again. Blocks for one small all_reduce and one store compare-and-set; the same
        outcome on every member. Every member calls it once per attempt."""
        ok, waiting, stop = self._vote(finished)
        if ok:
            self.step += 1
            now = time.monotonic()
            note_step(self.step, now - self._committed_at, world.epoch)  # for plugdist-run --page
            self._committed_at = now
            if self.sampler is not None:
                self.sampler.commit(world.size)
            self._grow_due = waiting > 0
            self.stopping = self.stopping or stop > 0
            self._agreements = 0
        return ok

    def recover(self) -> None:
        """After a vote that did not commit: discard the attempt's gradients (a partially
        reduced one is never applied), shrink the world to the survivors and give the model a
        fresh reducer. The caller then runs the whole attempt again, every micro-batch of an
        accumulated step included. Blocks up to ``timeout``; raises
        :class:`BelowMinWorldSizeError` when too few are left."""
        self.redone += 1
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.model.zero_grad(set_to_none=True)
        self._shrink()

    def admit(self) -> bool:
        """At a step boundary: if the last committed vote saw a process waiting to join, admit
        it (``grow_group``), bring the model's replicas in line and send the joiners the
        training state. Returns whether the world changed (it may also have shrunk, when a
        member or the joiner died meanwhile). Blocks; every member calls it at the same step."""
        if not self._grow_due:
            return False
        before = world.epoch
        self._grow()
        return world.epoch != before

    def agree(self, fn: Callable[[], T]) -> T:
        """Run ``fn``, collectives outside a step (a metric's all_reduce, a checkpoint's
        barrier or broadcast, an evaluation), until every member completed it: after each run
        the members vote as for a step; when a member failed, the survivors shrink and run
        ``fn`` again. Returns the result of the run that every member completed; raises what
        ``fn`` raises other than a rank failure. Every member calls it at the same point."""
        while True:
            try:
                result = fn()
                finished = True
            except Exception as err:
                if not is_rank_failure(err):
                    raise
                finished = False
            if world.epoch != self._agreed_epoch:
                self._agreements, self._agreed_epoch = 0, world.epoch
            self._agreements += 1
            block = self.step // _VOTE_BLOCK
            key = ft_vote_key(world.epoch, block, self.step, self._agreements)
            if self._decide(key, finished)[0]:
                return result
            self._shrink()

    def _vote(self, finished: bool) -> tuple[bool, float, float]:
        """(commit?, joiners waiting, stop requests) for the current attempt of the step. Rank
        0 adds what membership's monitor last saw of joiners (no store round trip of its own),
        and every 64 steps drops the outcomes of the steps before the last 64."""
        waiting = 0.0
        if finished and world.rank == 0:
            assert world.membership is not None  # checked at construction
            waiting = float(world.membership.joiners_waiting)
        block = self.step // _VOTE_BLOCK
        agreed, (waiting, stop) = self._decide(
            ft_step_key(world.epoch, block, self.step), finished,
            (waiting, 1.0 if self._stop_asked else 0.0))
        if world.rank == 0 and self.step % _VOTE_BLOCK == 0 and block >= 2:
            _forget(ft_block_prefix(world.epoch, block - 2))
        return agreed, waiting, stop

    def _decide(self, key: str, finished: bool,
                extra: tuple[float, ...] = ()) -> tuple[bool, list[float]]:
        """Whether every member finished the attempt ``key`` names: each member that did
        contributes 1 to a small all_reduce (with ``extra``: summed), and the first outcome
        written to ``key`` in the store wins, ``commit`` from a member whose all_reduce
        completed with every vote, ``abort`` from any other (a member's checked write where
        the store owns the world's membership: no other process can write an outcome). So
        the outcome is the same on every member, even when the all_reduce completed on some
        and failed on others.
        Returns (outcome, the sums of ``extra`` as the committing member saw them)."""
        votes = torch.tensor([1.0 if finished else 0.0, *extra])
        agreed = False
        if finished:
            try:
                pg = world.default
                assert pg is not None
                pg.run_blocking("all_reduce", votes)
                agreed = int(votes[0].item()) == world.size
            except DistError as err:
                if not is_rank_failure(err):
                    raise
        # the committing member writes the sums with the outcome, so a member whose all_reduce
        # failed after another's completed still reads the same sums
        mine = b"commit " + json.dumps(votes[1:].tolist()).encode() if agreed else b"abort"
        outcome = _writes().compare_set(key, b"", mine)
        if not outcome.startswith(b"commit"):
            return False, [0.0] * len(extra)
        return True, [float(v) for v in json.loads(outcome[len(b"commit "):] or b"[]")]

    # -- membership changes ------------------------------------------------------------------
    def _shrink(self) -> None:
        from plugdist._lifecycle import regroup as resilience

        resilience.shrink_group(group=self._torch_group, timeout=self.timeout)
        self._forget_old_epoch()
        self._check_size()
        self._rebind(grown=False)
        self._log.info("resilient_training_shrunk", step=self.step, world_size=world.size)
        if self._on_world_change is not None:
            self._on_world_change()

    def _grow(self) -> None:
        from plugdist._lifecycle import regroup as resilience

        self._grow_due = False
        before = world.epoch
        resilience.grow_group(group=self._torch_group, timeout=self.timeout)
        if world.epoch == before:
            return
        self._forget_old_epoch()
        self._check_size()  # a member may have failed while the joiners were admitted
        self._log.info("resilient_training_grown", step=self.step, world_size=world.size)
        try:  # meanwhile the joiners' model constructors run the same collectives
            self._rebind(grown=True)
            rebound = True
        except Exception as err:
            if not is_rank_failure(err):
                raise
            rebound = False
        self._transfer_state(sending=True, ready=rebound)
        if self._on_world_change is not None:
            self._on_world_change()

    def _forget_old_epoch(self) -> None:
        """Rank 0 drops the votes of the epochs before last (a member may still read the last),
        every one not dropped yet: a shrink or grow whose group was rebuilt went through more
        than one epoch, and a rank 0 may die before it drops them."""
        if world.rank != 0 or world.epoch < 2 or world.membership is None:
            return
        writes = _writes()
        done = int(writes.compare_set(_FORGOTTEN, b"", b"-1"))
        for epoch in range(done + 1, world.epoch - 1):
            _forget(ft_epoch_prefix(epoch))
        if world.epoch - 2 > done:
            writes.compare_set(_FORGOTTEN, str(done), str(world.epoch - 2))

    def _rebind(self, grown: bool) -> None:
        """Point the model at the new default group. After a grow, repeat what the joiners'
        model constructors do collectively (shape check and state broadcast). After a shrink,
        torch's DDP gets a fresh reducer: the failed attempt may have ended inside backward,
        before the reducer finalized it, and the old one then refuses the next forward
        (an internal assert, or "Expected to have finished reduction")."""
        model = self.model
        if _is_plugdist_ddp(model):
            model._replace_process_group(world.default, resync=grown)  # type: ignore[union-attr, operator]
        elif grown:
            _torch_ddp_resync(model)
        elif isinstance(model, torch.nn.parallel.DistributedDataParallel):
            _torch_ddp_fresh_reducer(model)

    def _transfer_state(self, sending: bool, ready: bool = True) -> None:
        """Rank 0 sends the training state to every rank (a joiner keeps it, the others
        already hold it); then every member decides whether everyone has it. If not (a joiner,
        or the sender, died meanwhile), the survivors shrink and the transfer starts over.
        ``ready``: False when this member already failed the step before (the model's resync)."""
        from plugdist._world.object_collectives import broadcast_object_list

        while True:
            payload: list[Any] = [self._state() if sending and world.rank == 0 else None]
            done = ready
            if done:
                try:
                    broadcast_object_list(payload, src=0)
                except Exception as err:
                    if not is_rank_failure(err):
                        raise
                    done = False
            if self._decide(ft_state_key(world.epoch), done)[0]:
                break
            self._shrink()
            ready = True
        if not sending:
            self._load(payload[0])
            world.state_received = True

    def _state(self) -> bytes:
        if self._user_state is not None:
            user = self._user_state()
        else:
            assert self.optimizer is not None  # checked at construction
            user = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        state = {"step": self.step, "user": user,
                 "sampler": self.sampler.state_dict() if self.sampler is not None else None}
        return pickle.dumps(state)

    def _load(self, blob: bytes) -> None:
        state = pickle.loads(blob)
        self.step = state["step"]
        if self.sampler is not None and state["sampler"] is not None:
            self.sampler.load_state_dict(state["sampler"])
        if self._user_load is not None:
            self._user_load(state["user"])
        else:
            assert self.optimizer is not None  # checked at construction
            self.model.load_state_dict(state["user"]["model"])
            self.optimizer.load_state_dict(state["user"]["optimizer"])

    def _check_size(self) -> None:
        if world.size < self.min_world_size:
            raise BelowMinWorldSizeError(
                f"[rank {world.rank}] the world has {world.size} rank(s) left, below "
                f"min_world_size={self.min_world_size}: stopping rather than training on too "
                f"few. Start replacements (plugdist-run --replace-failed) or lower "
                f"min_world_size")


def _writes() -> MemberWrites:
    """This member's writes of the outcomes: the store checks each where it owns the world's
    membership (a stranger cannot forge a commit or a stop), plain writes elsewhere."""
    if world.membership is None:
        raise DistError(off_hint("ResilientTraining"))
    return world.membership.writes


def _forget(prefix: str) -> None:
    """Drop the store's keys under ``prefix`` where the store can (it keeps them otherwise)."""
    try:
        _writes().delete_prefix(prefix)
    except NotImplementedError:
        pass


def _is_plugdist_ddp(model: Any) -> bool:
    from plugdist.parallel.ddp import DistributedDataParallel

    return isinstance(model, DistributedDataParallel)


def _torch_ddp_resync(model: Any) -> None:
    """On the members' torch DDP, what a joiner's torch DDP constructor does collectively (the
    shape check, the broadcast of rank 0's parameters), then a fresh reducer as the constructor
    builds it, so that members and joiners rebuild their buckets at the same iteration (a
    collective too); comm hooks are registered again on it. torch 2.3 to 2.13 do these."""
    from torch.distributed.utils import _sync_module_states, _verify_param_shape_across_processes

    params, expect_sparse = model._build_params_for_reducer()
    _verify_param_shape_across_processes(model.process_group, params)
    _sync_module_states(module=model.module, process_group=model.process_group,
                        broadcast_bucket_size=model.broadcast_bucket_size, src=0,
                        params_and_buffers_to_ignore=model.parameters_to_ignore,
                        broadcast_buffers=True)
    _torch_ddp_fresh_reducer(model, params, expect_sparse)


def _torch_ddp_fresh_reducer(model: Any, params: Any = None, expect_sparse: Any = None) -> None:
    """A new reducer for torch's DDP ``model``, built as its constructor builds one (no
    collective here; the first iteration's bucket rebuild is one, on every member alike), with
    its comm hooks registered again."""
    if params is None:
        params, expect_sparse = model._build_params_for_reducer()
    hooks = list(getattr(model, "_comm_hooks", []))
    model._ddp_init_helper(params, expect_sparse,
                           model._build_debug_param_to_name_mapping(params), model.static_graph)
    model._comm_hooks = []
    for hook, state in hooks:
        model.register_comm_hook(state, hook)
