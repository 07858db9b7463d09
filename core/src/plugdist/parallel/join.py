"""Training with uneven inputs: the Join context manager and the Joinable protocol.

Ranks that run out of inputs early *join*: inside ``Join.__exit__`` they keep answering the
collectives that the ranks still training issue each iteration (each Joinable's
:meth:`JoinHook.main_hook` shadows them, e.g. DDP all-reduces zero gradients), so nobody
hangs. Every iteration of a still-training rank starts with an all-reduce of 1 (from
:meth:`Join.notify_join_context`), to which joined ranks add 0; when the sum is 0 every rank has
joined and each JoinHook's ``post_hook`` runs once.

With ``throw_on_early_termination`` the first rank to run out makes every rank raise instead.
"""

from __future__ import annotations

import abc
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from plugdist._backend.work import Work
    from plugdist._group.process_group import ProcessGroup

__all__ = ["Join", "Joinable", "JoinHook"]

_SKEW_WARNING_ITERATIONS = 1000


class JoinHook:
    """What a joined rank does on behalf of one Joinable. Both methods default to nothing."""

    def main_hook(self) -> None:
        """Called once per iteration of the ranks still training, on a joined rank: issue the
        collectives that such an iteration issues (with neutral data). Collective."""

    def post_hook(self, is_last_joiner: bool) -> None:
        """Called once on every rank after all ranks joined; ``is_last_joiner`` is True on the
        ranks that joined last (they hold the most up-to-date state). May run collectives."""


@dataclass(frozen=True)
class _JoinConfig:
    enable: bool = False
    throw_on_early_termination: bool = False
    is_first_joinable: bool = False


class Joinable(abc.ABC):
    """An object whose per-iteration collectives a joined rank can shadow.

    Subclasses call ``Joinable.__init__`` and, at the start of every iteration,
    ``Join.notify_join_context(self)``.
    """

    def __init__(self) -> None:
        self._join_config = _JoinConfig()

    @abc.abstractmethod
    def join_hook(self, **kwargs: Any) -> JoinHook:
        """The hook a joined rank runs for this object; ``kwargs`` come from ``Join(...)``."""

    @property
    @abc.abstractmethod
    def join_device(self) -> torch.device:
        """Device of the tensors used for the join bookkeeping all-reduces."""

    @property
    @abc.abstractmethod
    def join_process_group(self) -> ProcessGroup:
        """Group over which ranks join."""


class Join:
    """Context manager for training with uneven inputs over ``joinables`` (see module docs).

    All joinables must share one process group and device. Every rank of the group must enter
    the context. ``kwargs`` are passed to each ``joinable.join_hook``.
    """

    def __init__(self, joinables: Sequence[Joinable], enable: bool = True,
                 throw_on_early_termination: bool = False, **kwargs: Any) -> None:
        if not joinables:
            raise ValueError("Join needs at least one Joinable")
        self._joinables = list(joinables)
        self._hooks = [j.join_hook(**kwargs) for j in self._joinables]
        self._enable = enable
        self._throw = throw_on_early_termination
        self._pg = self._joinables[0].join_process_group
        self._device = self._joinables[0].join_device
        for j in self._joinables[1:]:
            if j.join_process_group is not self._pg or j.join_device != self._device:
                raise ValueError("all Joinables in one Join must share the process group and "
                                 f"device: {type(j).__name__} uses {j.join_process_group!r} on "
                                 f"{j.join_device}, the first uses {self._pg!r} on {self._device}")
        self._set_configs(enable)

    def _set_configs(self, enable: bool) -> None:
        for i, j in enumerate(self._joinables):
            j._join_config = _JoinConfig(enable=enable, throw_on_early_termination=self._throw,
                                         is_first_joinable=i == 0)

    def __enter__(self) -> Join:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            if not self._enable or exc_type is not None:
                return
            self._join_loop()
        finally:
            self._set_configs(False)

    def _join_loop(self) -> None:
        is_last_joiner = True
        iterations = 0
        while True:
            if self._all_reduce(0.0) == 0:
                break
            if self._throw:
                self._all_reduce(1.0)  # tells the training ranks to raise too
                raise RuntimeError(f"{self._pg.where('join')} this rank exhausted its inputs; "
                                   f"throw_on_early_termination=True makes every rank raise")
            is_last_joiner = False
            for hook in self._hooks:
                hook.main_hook()
            iterations += 1
            if iterations == _SKEW_WARNING_ITERATIONS:
                warnings.warn(f"{self._pg.where('join')} this rank has had at least "
                              f"{_SKEW_WARNING_ITERATIONS} fewer inputs than the ranks still "
                              f"training; such skew wastes their time", RuntimeWarning,
                              stacklevel=3)
        for hook in self._hooks:
            hook.post_hook(is_last_joiner)

    def _all_reduce(self, value: float) -> float:
        t = torch.full((1,), value, device=self._device)
        self._pg.all_reduce(t).wait()
        return float(t.item())

    @staticmethod
    def notify_join_context(joinable: Joinable) -> Work | None:
        """Call at the start of each iteration of ``joinable`` (every rank, same order).

        Returns the Work of the all-reduce that counts the ranks still training (its result is
        that count), or None when not inside an enabled Join or not the first joinable. With
        ``throw_on_early_termination`` raises RuntimeError on every rank once one has joined.
        """
        config = joinable._join_config
        if not (config.enable and config.is_first_joinable):
            return None
        pg, device = joinable.join_process_group, joinable.join_device
        ones = torch.ones(1, device=device)
        work = pg.all_reduce(ones)
        if config.throw_on_early_termination:
            zeros = torch.zeros(1, device=device)
            pg.all_reduce(zeros).wait()
            if zeros.item() != 0:
                raise RuntimeError(f"{pg.where('join')} at least one rank exhausted its inputs; "
                                   f"throw_on_early_termination=True makes every rank raise")
        return work
