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

All members and joiners call the same methods in the same order; see docs/fault_tolerance.md.
"""

from __future__ import annotations

import json
import pickle
import random
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch

from ..errors import DistError, DistRankFailureError
from ..log import get_logger
from ..membership import off_hint
from ..world import world

__all__ = ["ResilientTraining", "ElasticSampler", "BelowMinWorldSizeError"]

_VOTE_BLOCK = 64  # the vote outcomes of this many steps are dropped from the store at once
_FORGOTTEN = "plugdist/ft/forgotten"  # the votes of the epochs up to this one were dropped

T = TypeVar("T")


class BelowMinWorldSizeError(DistError):
    """The world lost so many ranks that it fell below ``min_world_size``."""


def _rank_failure(err: BaseException) -> bool:
    """Whether ``err`` (or what it wraps: torch's DDP re-raises hook errors as RuntimeError)
    is a rank failure."""
    seen = 0
    while err is not None and seen < 8:
        if isinstance(err, DistRankFailureError):
            return True
        if "DistRankFailureError" in str(err) and isinstance(err, RuntimeError):
            return True
        err = err.__cause__ or err.__context__  # type: ignore[assignment]
        seen += 1
    return False


class ElasticSampler:
    """The sample indices of each step, for a world whose size changes mid-epoch.

    Each epoch is one permutation of ``range(num_samples)`` (``seed`` + epoch; in order without
    ``shuffle``). A step takes the next ``batch_size * world_size`` samples of it (fewer at the
    epoch's end), and rank r of the world at that step takes its r-th share; :meth:`commit`
    moves past them only when the step is committed. So the committed steps of an epoch cover
    each sample exactly once, whatever the world size did meanwhile. Not thread-safe."""

    def __init__(self, num_samples: int, batch_size: int, *, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False) -> None:
        if num_samples < 1 or batch_size < 1:
            raise ValueError(f"ElasticSampler needs num_samples >= 1 and batch_size >= 1, got "
                             f"{num_samples} and {batch_size}")
        self.num_samples, self.batch_size = num_samples, batch_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch = 0
        self.consumed = 0  # samples of this epoch taken by committed steps
        self._order: list[int] | None = None

    def _permutation(self) -> list[int]:
        if self._order is None:
            order = list(range(self.num_samples))
            if self.shuffle:
                random.Random(self.seed + self.epoch).shuffle(order)
            self._order = order
        return self._order

    def _global_batch(self, world_size: int) -> tuple[int, int]:
        """[start, end) of the next step's samples in the permutation."""
        end = min(self.consumed + self.batch_size * world_size, self.num_samples)
        return self.consumed, end

    def indices(self, rank: int | None = None, world_size: int | None = None) -> list[int]:
        """This rank's samples for the next step (default: plugdist's current rank and world
        size). At an epoch's end the last global batch is shared out as evenly as it goes."""
        rank = world.rank if rank is None else rank
        world_size = world.size if world_size is None else world_size
        start, end = self._global_batch(world_size)
        share = (end - start) // world_size
        extra = (end - start) % world_size
        lo = start + rank * share + min(rank, extra)
        hi = lo + share + (1 if rank < extra else 0)
        return self._permutation()[lo:hi]

    def commit(self, world_size: int) -> None:
        """The step taken at ``world_size`` was committed: move past its samples, and on to the
        next epoch once the permutation is used up (or can no longer fill a global batch with
        ``drop_last``)."""
        self.consumed = self._global_batch(world_size)[1]
        left = self.num_samples - self.consumed
        if left <= 0 or (self.drop_last and left < self.batch_size * world_size):
            self.epoch += 1
            self.consumed = 0
            self._order = None

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])
        self._order = None


class ResilientTraining:
    """Run training steps that commit only when every member finished them.

    ``model``: plugdist's DistributedDataParallel, or torch's over a ``plugdist_X`` group
    (register :func:`plugdist.parallel.resilient_allreduce_hook` on it). ``optimizer``: stepped
    on commit only. ``state_dict``/``load_state_dict``: the training state sent to a joiner
    (default: model, optimizer, step and sampler). ``min_world_size``: below it, stop with
    :class:`BelowMinWorldSizeError`. ``timeout``: for shrink, grow and the state transfer
    (default: the group's).

    Constructed by every member after the model, and by a joiner right after it built its model
    (the joiner then receives the state here, blocking until it has it).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 sampler: ElasticSampler | None = None,
                 state_dict: Callable[[], dict[str, Any]] | None = None,
                 load_state_dict: Callable[[dict[str, Any]], None] | None = None,
                 min_world_size: int = 1, timeout: timedelta | None = None) -> None:
        pg = world.require("ResilientTraining")
        if world.membership is None:
            raise DistError(off_hint("ResilientTraining"))
        self.model, self.optimizer, self.sampler = model, optimizer, sampler
        self._user_state, self._user_load = state_dict, load_state_dict
        self.min_world_size = min_world_size
        self.timeout = timeout or pg.timeout
        self.step = 0          # committed steps
        self.redone = 0        # attempts discarded because a member failed
        self.stopping = False  # a stop was agreed (request_stop): the same on every member
        self._stop_asked = False
        self._grow_due = False
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
        Blocks; every member calls it once per step."""
        while True:
            if self._grow_due:
                self._grow()
            try:
                result = step_fn()
                ok, waiting, stop = self._vote(finished=True)
            except Exception as err:
                if not _rank_failure(err):
                    raise
                ok, waiting, stop = self._vote(finished=False)
            if ok:
                self.optimizer.step()
                size = world.size
                self.step += 1
                if self.sampler is not None:
                    self.sampler.commit(size)
                self._grow_due = waiting > 0
                self.stopping = self.stopping or stop > 0
                return result
            self.redone += 1
            self.optimizer.zero_grad(set_to_none=True)
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
            f"plugdist/ft/{world.epoch}/step/{block}/{self.step}", finished,
            (waiting, 1.0 if self._stop_asked else 0.0))
        if world.rank == 0 and self.step % _VOTE_BLOCK == 0 and block >= 2:
            _forget(f"plugdist/ft/{world.epoch}/step/{block - 2}/")
        return agreed, waiting, stop

    def _decide(self, key: str, finished: bool,
                extra: tuple[float, ...] = ()) -> tuple[bool, list[float]]:
        """Whether every member finished the attempt ``key`` names: each member that did
        contributes 1 to a small all_reduce (with ``extra``: summed), and the first outcome
        written to ``key`` in the store wins, ``commit`` from a member whose all_reduce
        completed with every vote, ``abort`` from any other. So the outcome is the same on
        every member, even when the all_reduce completed on some and failed on others.
        Returns (outcome, the sums of ``extra`` as the committing member saw them)."""
        store = world.store
        assert store is not None
        votes = torch.tensor([1.0 if finished else 0.0, *extra])
        agreed = False
        if finished:
            try:
                pg = world.default
                assert pg is not None
                pg.run_blocking("all_reduce", votes)
                agreed = int(votes[0].item()) == world.size
            except DistError as err:
                if not _rank_failure(err):
                    raise
        # the committing member writes the sums with the outcome, so a member whose all_reduce
        # failed after another's completed still reads the same sums
        mine = b"commit " + json.dumps(votes[1:].tolist()).encode() if agreed else b"abort"
        outcome = store.compare_set(key, b"", mine)
        if not outcome.startswith(b"commit"):
            return False, [0.0] * len(extra)
        return True, [float(v) for v in json.loads(outcome[len(b"commit "):] or b"[]")]

    # -- membership changes ------------------------------------------------------------------
    def _shrink(self) -> None:
        from .. import resilience

        resilience.shrink_group(group=self._torch_group, timeout=self.timeout)
        self._forget_old_epoch()
        self._check_size()
        self._rebind(grown=False)
        self._log.info("resilient_training_shrunk", step=self.step, world_size=world.size)

    def _grow(self) -> None:
        from .. import resilience

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
            if not _rank_failure(err):
                raise
            rebound = False
        self._transfer_state(sending=True, ready=rebound)

    def _forget_old_epoch(self) -> None:
        """Rank 0 drops the votes of the epochs before last (a member may still read the last),
        every one not dropped yet: a shrink or grow whose group was rebuilt went through more
        than one epoch, and a rank 0 may die before it drops them."""
        store = world.store
        if world.rank != 0 or world.epoch < 2 or store is None:
            return
        done = int(store.compare_set(_FORGOTTEN, b"", b"-1"))
        for epoch in range(done + 1, world.epoch - 1):
            _forget(f"plugdist/ft/{epoch}/")
        if world.epoch - 2 > done:
            store.compare_set(_FORGOTTEN, str(done), str(world.epoch - 2))

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
        from ..object_collectives import broadcast_object_list

        while True:
            payload: list[Any] = [self._state() if sending and world.rank == 0 else None]
            done = ready
            if done:
                try:
                    broadcast_object_list(payload, src=0)
                except Exception as err:
                    if not _rank_failure(err):
                        raise
                    done = False
            if self._decide(f"plugdist/ft/{world.epoch}/state", done)[0]:
                break
            self._shrink()
            ready = True
        if not sending:
            self._load(payload[0])
            world.state_received = True

    def _state(self) -> bytes:
        state = {"step": self.step,
                 "sampler": self.sampler.state_dict() if self.sampler is not None else None,
                 "user": (self._user_state() if self._user_state is not None else
                          {"model": self.model.state_dict(),
                           "optimizer": self.optimizer.state_dict()})}
        return pickle.dumps(state)

    def _load(self, blob: bytes) -> None:
        state = pickle.loads(blob)
        self.step = state["step"]
        if self.sampler is not None and state["sampler"] is not None:
            self.sampler.load_state_dict(state["sampler"])
        if self._user_load is not None:
            self._user_load(state["user"])
        else:
            self.model.load_state_dict(state["user"]["model"])
            self.optimizer.load_state_dict(state["user"]["optimizer"])

    def _check_size(self) -> None:
        if world.size < self.min_world_size:
            raise BelowMinWorldSizeError(
                f"[rank {world.rank}] the world has {world.size} rank(s) left, below "
                f"min_world_size={self.min_world_size}: stopping rather than training on too "
                f"few. Start replacements (plugdist-run --replace-failed) or lower "
                f"min_world_size")


def _forget(prefix: str) -> None:
    """Drop the store's keys under ``prefix`` where the store can (it keeps them otherwise)."""
    try:
        world.store.delete_prefix(prefix)  # type: ignore[union-attr]
    except NotImplementedError:
        pass


def _is_plugdist_ddp(model: Any) -> bool:
    from .ddp import DistributedDataParallel

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
