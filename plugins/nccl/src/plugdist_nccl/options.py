"""``NCCLOptions`` (the plugin's ``pg_options``) and the failure-handling environment variables."""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch

__all__ = ["NCCLOptions", "ErrorHandling", "FailurePolicy", "blocking_wait_from_env",
           "error_handling_from_env", "BLOCKING_WAIT_ENV", "ASYNC_ERROR_HANDLING_ENV"]

BLOCKING_WAIT_ENV = ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT")
ASYNC_ERROR_HANDLING_ENV = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")


@dataclass(frozen=True)
class NCCLOptions:
    """Options for an nccl group, passed as ``pg_options=`` (``GroupOptions.backend_options``).

    ``is_high_priority_stream``: run the group's ops on a high-priority CUDA stream, so they are
    scheduled ahead of compute kernels waiting on the GPU. ``device_id``: the GPU this rank uses
    (int, ``"cuda:N"`` or ``torch.device``); given, the communicator is built eagerly when the
    group is created, otherwise at the group's first op, on that op's tensor's device.
    ``eager_p2p``: hand every ``isend``/``irecv`` to NCCL at once, as torch does, instead of
    holding them back until the next wait, query or op on the group (see the README's
    "Point-to-point" section for what each choice can deadlock on).
    A torch ``ProcessGroupNCCL.Options``-like object with ``is_high_priority_stream`` is accepted
    too (see :meth:`coerce`).
    """

    is_high_priority_stream: bool = False
    device_id: int | str | torch.device | None = None
    eager_p2p: bool = False

    def device(self) -> torch.device | None:
        if self.device_id is None:
            return None
        dev = torch.device("cuda", self.device_id) if isinstance(self.device_id, int) \
            else torch.device(self.device_id)
        if dev.type != "cuda":
            raise ValueError(f"NCCLOptions.device_id must name a CUDA device, got "
                             f"{self.device_id!r}")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        return dev

    @classmethod
    def coerce(cls, value: Any) -> NCCLOptions:
        """``value`` as NCCLOptions: None gives the defaults; an object with the attribute
        ``is_high_priority_stream`` (torch's options class) is read duck-typed."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if hasattr(value, "is_high_priority_stream"):
            return cls(is_high_priority_stream=bool(value.is_high_priority_stream),
                       device_id=getattr(value, "device_id", None),
                       eager_p2p=bool(getattr(value, "eager_p2p", False)))
        raise TypeError(f"pg_options for the nccl backend must be a plugdist_nccl.NCCLOptions, "
                        f"got {type(value).__name__}")


class ErrorHandling(IntEnum):
    """What the watchdog does when an op times out or NCCL reports an asynchronous error
    (the values of ``NCCL_ASYNC_ERROR_HANDLING``; 3 when unset, as in torch)."""

    OFF = 0         # no watchdog timeout; waits are bounded only by the caller
    TEAR_DOWN = 1   # abort the communicator, fail pending works, then end the process
    CLEAN_UP = 2    # abort the communicator and fail pending works; the process lives on
    SKIP_CLEANUP = 3  # end the process without aborting the communicator (the default)


@dataclass(frozen=True)
class FailurePolicy:
    """Who bounds what, and what a failure does, for one group (read from the environment once).

    As torch's NCCL backend: ``NCCL_ASYNC_ERROR_HANDLING`` defaults to 3 (end the process
    without clean-up), and under ``NCCL_BLOCKING_WAIT`` the waiter, not the watchdog, times GPU
    ops out (aborting the communicator and raising). One addition: an NCCL call that blocks the
    host while an op is being *queued* (``ncclGroupEnd`` waiting for a peer to connect) has no
    waiter yet, so the watchdog bounds it in every mode but an explicit ``..._HANDLING=0``.
    """

    blocking_wait: bool = False
    handling: ErrorHandling = ErrorHandling.SKIP_CLEANUP

    @classmethod
    def from_env(cls) -> FailurePolicy:
        return cls(blocking_wait_from_env(), error_handling_from_env())

    def watchdog_op_timeout(self, timeout_s: float) -> float | None:
        """How long the watchdog lets an op run on the GPU before acting (None: never)."""
        if self.blocking_wait or self.handling is ErrorHandling.OFF:
            return None
        return timeout_s

    def watchdog_launch_timeout(self, timeout_s: float) -> float | None:
        """How long the watchdog lets the host sit inside an NCCL call queueing an op."""
        if self.handling is ErrorHandling.OFF and not self.blocking_wait:
            return None
        return timeout_s

    def wait_timeout_aborts(self) -> bool:
        """Whether a wait that ran out (blocking mode, a barrier, ``wait(timeout=...)``)
        aborts the communicator: only under ``NCCL_BLOCKING_WAIT``. Otherwise the waiter gets
        its DistTimeoutError and the communicator is left to the watchdog's handling."""
        return self.blocking_wait

    def on_failure(self) -> tuple[bool, bool]:
        """``(abort, end_process)`` for a failure the watchdog found (timeout or NCCL error).
        Under blocking wait the failure is cleaned up and raised to the waiters."""
        if self.blocking_wait:
            return True, False
        return {ErrorHandling.OFF: (True, False), ErrorHandling.TEAR_DOWN: (True, True),
                ErrorHandling.CLEAN_UP: (True, False),
                ErrorHandling.SKIP_CLEANUP: (False, True)}[self.handling]


def _first_env(names: tuple[str, ...]) -> tuple[str, str] | None:
    for name in names:
        raw = os.environ.get(name)
        if raw is not None and raw.strip() != "":
            return name, raw.strip()
    return None


def blocking_wait_from_env() -> bool:
    """``NCCL_BLOCKING_WAIT`` (or ``TORCH_NCCL_BLOCKING_WAIT``) set to 1/true."""
    found = _first_env(BLOCKING_WAIT_ENV)
    return found is not None and found[1].lower() in ("1", "true", "yes", "on")


def error_handling_from_env() -> ErrorHandling:
    """``NCCL_ASYNC_ERROR_HANDLING`` (or the ``TORCH_`` spelling) as an :class:`ErrorHandling`;
    unset means 3 (end the process without clean-up), torch's default."""
    found = _first_env(ASYNC_ERROR_HANDLING_ENV)
    if found is None:
        return ErrorHandling.SKIP_CLEANUP
    name, raw = found
    try:
        return ErrorHandling(int(raw))
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not one of 0 (off), 1 (abort and end the process), "
                         f"2 (abort, keep the process), 3 (end the process)") from None
