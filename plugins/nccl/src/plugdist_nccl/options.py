"""``NCCLOptions`` (the plugin's ``pg_options``) and the failure-handling environment variables."""

from __future__ import annotations

import os
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import torch

__all__ = ["NCCLOptions", "ErrorHandling", "blocking_wait_from_env", "error_handling_from_env",
           "BLOCKING_WAIT_ENV", "ASYNC_ERROR_HANDLING_ENV"]

BLOCKING_WAIT_ENV = ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT")
ASYNC_ERROR_HANDLING_ENV = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING")


@dataclass(frozen=True)
class NCCLOptions:
    """Options for an nccl group, passed as ``pg_options=`` (``GroupOptions.backend_options``).

    ``is_high_priority_stream``: run the group's ops on a high-priority CUDA stream, so they are
    scheduled ahead of compute kernels waiting on the GPU. ``device_id``: the GPU this rank uses
    (int, ``"cuda:N"`` or ``torch.device``); given, the communicator is built eagerly when the
    group is created, otherwise at the group's first op, on that op's tensor's device.
    A torch ``ProcessGroupNCCL.Options``-like object with ``is_high_priority_stream`` is accepted
    too (see :meth:`coerce`).
    """

    is_high_priority_stream: bool = False
    device_id: int | str | torch.device | None = None

    def device(self) -> torch.device | None:
        if self.device_id is None:
            return None
        dev = torch.device("cuda", self.device_id) if isinstance(self.device_id, int) \
            else torch.device(self.device_id)
        if dev.type != "cuda":
            raise ValueError(f"NCCLOptions.device_id must name a CUDA device, got {self.device_id!r}")
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
                       device_id=getattr(value, "device_id", None))
        raise TypeError(f"pg_options for the nccl backend must be a plugdist_nccl.NCCLOptions, "
                        f"got {type(value).__name__}")


class ErrorHandling(IntEnum):
    """What the watchdog does when an op times out or NCCL reports an asynchronous error
    (the values of ``NCCL_ASYNC_ERROR_HANDLING``)."""

    OFF = 0         # no watchdog timeout; waits are bounded only by the caller
    TEAR_DOWN = 1   # abort the communicator, fail pending works, then end the process
    CLEAN_UP = 2    # abort the communicator and fail pending works; the process lives on
    SKIP_CLEANUP = 3  # end the process without aborting the communicator


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
    """``NCCL_ASYNC_ERROR_HANDLING`` (or the ``TORCH_`` spelling) as an :class:`ErrorHandling`."""
    found = _first_env(ASYNC_ERROR_HANDLING_ENV)
    if found is None:
        return ErrorHandling.OFF
    name, raw = found
    try:
        return ErrorHandling(int(raw))
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not one of 0 (off), 1 (abort and end the process), "
                         f"2 (abort, keep the process), 3 (end the process)") from None
