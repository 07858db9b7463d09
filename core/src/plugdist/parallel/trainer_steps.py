"""The step loop of a trainer that owns its optimizer step, over :class:`ResilientTraining`.

A trainer (Lightning, Hugging Face's Trainer) runs an update step as micro-batches: the earlier
ones without DDP's gradient sync, the last one with it, then its optimizer step. To train through
a rank loss it needs, beside :class:`ResilientTraining`'s parts (``vote``, ``recover``, ``admit``,
``agree``), the same loop around them whatever the trainer:

- record the update step's earlier micro-batches (:meth:`TrainerSteps.micro_batch`), so that a
  redo runs them again;
- run the last one until an attempt is committed: attempt, vote, recover, replay the earlier
  ones, attempt again (:meth:`TrainerSteps.commit`);
- fail the attempt, rather than raise, when a collective inside it fails
  (:meth:`TrainerSteps.in_attempt`), and agree the collectives outside the step
  (:meth:`TrainerSteps.agree`);
- admit joiners at an epoch boundary and keep a joiner to itself until it reaches the members'
  (:meth:`TrainerSteps.begin_epoch`, :attr:`TrainerSteps.joining`);
- count the samples of the dead ranks' shards that the epoch leaves untrained
  (:attr:`TrainerSteps.skipped_samples`, carried to joiners);
- exit with ``DistExcludedError.exit_code`` when the others excluded this process
  (:func:`exit_if_excluded`), for ``plugdist-run --replace-failed`` to replace it.

:class:`TrainerSteps` does these; an integration keeps what is particular to its trainer (which
of its methods is a micro-batch, the last one, a collective; its state; its data). All ranks
call the same methods in the same order; see docs/fault_tolerance.md.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, Generic, TypeVar

import torch

from plugdist._world.state import world
from plugdist.errors import DistExcludedError
from plugdist.parallel.fault_tolerant import ResilientTraining, is_rank_failure

__all__ = ["TrainerSteps", "exit_if_excluded"]

T = TypeVar("T")
B = TypeVar("B")  # what a trainer records of a micro-batch, to run it again


@contextlib.contextmanager
def exit_if_excluded() -> Iterator[None]:
    """A context manager (and decorator): a :class:`plugdist.DistExcludedError` raised in it,
    because the others excluded this process from the world (it was stopped or stalled past
    the hang timeout, and they went on), becomes ``SystemExit(DistExcludedError.exit_code)``
    with a line on stderr. ``plugdist-run`` takes that exit for a lost rank and, with
    ``--replace-failed``, starts a new process in its place. Any rank may use it; it adds no
    collective and blocks nothing. Other exceptions pass through unchanged."""
    try:
        yield
    except DistExcludedError as err:
        print(f"plugdist: {err}; exiting with {err.exit_code} for plugdist-run to replace this "
              f"process", file=sys.stderr, flush=True)
        raise SystemExit(err.exit_code) from err


class TrainerSteps(Generic[B]):
    """The attempt loop, the joiner's state and the skipped samples of a trainer integration.

    Constructed by every member once its model is in torch's (or plugdist's) DDP, and by a
    joiner right after its DDP constructor met the members' resync: it builds the
    :class:`ResilientTraining` (:attr:`training`, no optimizer: the trainer steps its own), and
    on a joiner receives the state there, blocking until it has it. ``state_dict()`` /
    ``load_state_dict(state)``: the trainer's own state, sent to a joiner (the skipped count
    travels with it). ``on_world_change(old_size, new_size)``: called on every rank after each
    shrink and grow, once ``plugdist.get_rank()``/``get_world_size()`` give the new world,
    before the step is redone or the epoch begins. ``untrained_per_rank()``: called on every
    survivor when the world shrank, how many samples of a rank's shard of the current epoch
    no committed step took (use :attr:`committed_in_epoch`); None counts nothing.
    ``min_world_size``, ``timeout``: :class:`ResilientTraining`'s. Raises what it raises
    (``BelowMinWorldSizeError``, ``DistError`` when resilience is off).

    ``B`` is what the trainer records of a micro-batch (its inputs) to run it again.
    """

    def __init__(self, model: torch.nn.Module, *,
                 state_dict: Callable[[], dict[str, Any]],
                 load_state_dict: Callable[[dict[str, Any]], None],
                 on_world_change: Callable[[int, int], None] | None = None,
                 untrained_per_rank: Callable[[], int] | None = None,
                 min_world_size: int = 1, timeout: timedelta | None = None) -> None:
        self.skipped_samples = 0     # the same on every rank; carried to joiners
        self.committed_in_epoch = 0  # this rank's micro-batches in committed steps this epoch
        self.epoch = 0               # the epoch begin_epoch last started
        self.joining = False         # a joiner that has not yet reached the members' epoch
        self._trainer_state, self._trainer_load = state_dict, load_state_dict
        self._on_world_change, self._untrained = on_world_change, untrained_per_rank
        self._size = world.size
        self._window: list[B] = []  # the open update step's micro-batches before its last
        self._in_step = False       # inside a micro-batch or an attempt of the update step
        self._failed = False        # a collective of the update step's attempt failed
        self._agreeing = False
        self.training = ResilientTraining(
            model, None, state_dict=self._state, load_state_dict=self._load,
            min_world_size=min_world_size, timeout=timeout, on_world_change=self._world_changed)

    @property
    def in_step(self) -> bool:
        """Whether a micro-batch or an attempt of the update step is running on this rank (a
        collective there goes through :meth:`in_attempt`, not :meth:`agree`)."""
        return self._in_step

    @property
    def recorded(self) -> list[B]:
        """The open update step's micro-batches before its last, as :meth:`micro_batch`
        recorded them (a copy; empty once the step is committed)."""
        return list(self._window)

    # -- epochs ------------------------------------------------------------------------------
    def begin_epoch(self, epoch: int) -> bool:
        """At an epoch boundary, before the epoch's data is iterated: admit the joiners the last
        committed vote saw waiting (:meth:`ResilientTraining.admit`: grow, DDP resync, the
        state sent). A joiner calls it at the boundary where the members admitted it: from
        there on it runs what they run (:attr:`joining` becomes False) and admits nothing here.
        Every rank calls it at the same boundary; blocks for the admission. Returns whether the
        world changed (rebuild the data's shards then). Raises ``BelowMinWorldSizeError``."""
        self.epoch, self.committed_in_epoch = epoch, 0
        if self.joining:
            self.joining = False
            return True
        with exit_if_excluded():
            return self.training.admit()

    # -- the update step ---------------------------------------------------------------------
    def micro_batch(self, batch: B, run: Callable[[], T], fallback: Callable[[], T]) -> T:
        """An update step's micro-batch before its last (no gradient sync): record ``batch``
        for a redo, then ``run()``. When it raises a rank failure (a collective of the model or
        of the step), the step's attempt has failed: returns ``fallback()`` (a loss whose
        backward gives zero gradients) and the vote of :meth:`commit` discards the attempt.
        Raises what ``run`` raises other than a rank failure. Called on each rank for each of
        its earlier micro-batches, outside :meth:`commit`; blocks as ``run`` does."""
        self._window.append(batch)
        outer, self._in_step = self._in_step, True
        try:
            return self.in_attempt(run, fallback)
        finally:
            self._in_step = outer

    def in_attempt(self, run: Callable[[], T], fallback: Callable[[], T]) -> T:
        """A collective that belongs to the update step's attempt (one inside a micro-batch,
        the loss normalisation's count): ``run()``; when it raises a rank failure, the attempt
        has failed (the next vote of :meth:`commit` discards it) and ``fallback()`` (this
        rank's own value) is returned. Raises what ``run`` raises other than a rank failure.
        Called on each rank where its trainer runs the collective; blocks as ``run`` does."""
        try:
            return run()
        except Exception as err:
            if not is_rank_failure(err):
                raise
            self._failed = True
            return fallback()

    def commit(self, last: Callable[[], T], replay: Callable[[B], None],
               before_redo: Callable[[], None] | None = None) -> T:
        """The update step's last micro-batch (with DDP's gradient sync): run ``last()`` until
        an attempt is committed by every member, and return that attempt's result; the caller
        then clips and steps its optimizer. An attempt that failed here, in an earlier
        micro-batch or in :meth:`in_attempt` is discarded: :meth:`ResilientTraining.recover`
        (gradients zeroed, the world shrunk, a fresh DDP reducer), ``before_redo()`` (what the
        trainer counts again over the survivors; a rank failure there goes through
        :meth:`in_attempt`), then ``replay(batch)`` for each earlier micro-batch (without the
        gradient sync) and ``last()`` again. Every member calls it once per update step;
        blocks for the vote (and the shrink). Raises what ``last``/``replay`` raise other than
        a rank failure, ``BelowMinWorldSizeError``, and ``SystemExit`` when this process was
        excluded (:func:`exit_if_excluded`)."""
        earlier = self._window
        redo = False
        try:
            with exit_if_excluded():
                while True:
                    self._in_step = True
                    try:
                        if redo:
                            for batch in earlier:
                                replay(batch)
                        result = last()
                        finished = not self._failed
                    except Exception as err:
                        if not is_rank_failure(err):
                            raise
                        finished = False
                    finally:
                        self._in_step, self._failed = False, False
                    if self.training.vote(finished):
                        self.committed_in_epoch += len(earlier) + 1
                        return result
                    self.training.recover()
                    redo = True
                    if before_redo is not None:
                        before_redo()
        finally:
            self._window = []

    # -- collectives outside the step --------------------------------------------------------
    def agree(self, run: Callable[[], T], before_redo: Callable[[], None] | None = None) -> T:
        """Collectives outside the update step (logging's gathers, evaluation, a checkpoint's
        barrier and broadcast): ``run()`` until every member completed it
        (:meth:`ResilientTraining.agree`: a vote after each run; the survivors shrink and run
        it again), with ``before_redo()`` before each run again (put back what the failed run
        changed). Inside another :meth:`agree`, or on a joiner that has not reached the
        members (:attr:`joining`), just ``run()``: the outer vote (or none) covers it. Every
        member calls it at the same point; blocks for the vote. Raises what ``run`` raises
        other than a rank failure, ``BelowMinWorldSizeError``, and ``SystemExit`` when this
        process was excluded."""
        if self._agreeing or self.joining:
            return run()
        first = True

        def attempt() -> T:
            nonlocal first
            if not first and before_redo is not None:
                before_redo()
            first = False
            return run()

        self._agreeing = True
        try:
            with exit_if_excluded():
                return self.training.agree(attempt)
        finally:
            self._agreeing = False

    # -- the world and the state -------------------------------------------------------------
    def _world_changed(self) -> None:
        old, new = self._size, world.size
        self._size = new
        if new < old and self._untrained is not None:
            lost = (old - new) * self._untrained()
            if lost:
                self.skipped_samples += lost
                if world.rank == 0:
                    warnings.warn(
                        f"plugdist: {old - new} rank(s) died in epoch {self.epoch}: {lost} "
                        f"sample(s) of their shards are not trained on this epoch "
                        f"({self.skipped_samples} in all)", stacklevel=2)
        if self._on_world_change is not None:
            self._on_world_change(old, new)

    def _state(self) -> dict[str, Any]:
        return {"trainer": self._trainer_state(), "skipped_samples": self.skipped_samples,
                "epoch": self.epoch}

    def _load(self, state: dict[str, Any]) -> None:
        self.skipped_samples, self.epoch = state["skipped_samples"], state["epoch"]
        self.joining = True
        self._trainer_load(state["trainer"])
