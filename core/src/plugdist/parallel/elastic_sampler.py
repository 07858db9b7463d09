"""The sample indices of each step for a world whose size changes mid-epoch: each committed step
takes the next global batch of the epoch's permutation, shared out by the ranks of the world that
committed it (:class:`plugdist.parallel.ResilientTraining` commits them)."""

from __future__ import annotations

import random

from plugdist._world.state import world

__all__ = ["ElasticSampler"]


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
