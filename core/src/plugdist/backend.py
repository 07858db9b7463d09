"""Everything a backend author imports from plugdist, in one place.

A backend (``plugdist-gloo``, ``plugdist-mpi``, a third party's ``plugdist-foo``) imports from
plugdist only this module and the other public ones (``plugdist``, ``plugdist.store``,
``plugdist.errors``, ``plugdist.hookspecs``, ``plugdist.testing``); every other module of
plugdist is private and may change in any release. The names here are covered by
:data:`plugdist.PLUGIN_API`: a change that breaks them bumps its major version.

    from plugdist.backend import BackendBase, GroupOptions, Work

    class FooBackend(BackendBase):
        backend_name = "foo"
        plugin_api = (2, 0)

        def __init__(self, store, rank, size, options):
            super().__init__(rank, size, options)
            ...

        def native_send(self, *, tensor, dst, tag): ...
        def native_recv(self, *, tensor, src, tag): ...

docs/backends.md gives every hook's contract. What is here:

* the base class and what describes a group: ``BackendBase`` (subclass it, override
  ``native_*`` hooks), ``BackendWrapper`` (subclass it to wrap a backend: it forwards
  everything), ``GroupOptions``, ``Capabilities``, ``OPS``, ``BACKEND_HOOKS``,
  ``DEFAULT_TIMEOUT``, ``GroupLike`` (a group's identity, for helpers that take one), and
  ``ProcessGroup``, the group users hold over one backend per device type (not a base class
  for backends since plugin API 2.0);
* completing ops: ``Work``, ``completed_work``, ``failed_work``, ``gather_works``;
* aborting: ``AbortSignal``, ``wait_sliced`` (a blocking wait that an abort releases);
* reductions: ``ReduceOp``, ``ALL_REDUCE_OPS``, ``check_reduce_op``;
* errors and their wording: the error tree, ``where``, ``op_timeout``, ``timed_out``,
  ``store_timeout``;
* logging: ``get_logger``, ``set_log_level``;
* stores: ``Store``, ``DEFAULT_STORE_TIMEOUT``, ``to_bytes``, ``to_seconds``, ``is_loopback``,
  and ``PlugdistStoreForTorch`` (a plugdist store as a torch one: imported on first use, since
  it imports torch.distributed);
* failure reporting: ``report_failed_ranks``;
* observation, for wrappers that run ops themselves: ``observing``, ``run_observed``;
  ``dump_on_signal`` (a recorder's dump when the process gets a named signal);
* threads: ``BackendThreads`` (start them, stop them at shutdown and at program exit),
  ``program_running``, ``recv_exact`` (a socket read that stops with them), ``POLL_SECONDS``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from plugdist._backend.abort import AbortSignal, wait_sliced
from plugdist._backend.base import BACKEND_HOOKS, DEFAULT_TIMEOUT, OPS, BackendBase, GroupOptions
from plugdist._backend.capabilities import ALL_REDUCE_OPS, Capabilities
from plugdist._backend.group import GroupLike
from plugdist._backend.reduce_op import ReduceOp, check_reduce_op
from plugdist._backend.threads import POLL_SECONDS, BackendThreads, program_running, recv_exact
from plugdist._backend.work import Work, completed_work, failed_work, gather_works
from plugdist._backend.wrapper import BackendWrapper
from plugdist._group.process_group import ProcessGroup
from plugdist._lifecycle.regroup import report_failed_ranks
from plugdist._log import get_logger, set_log_level
from plugdist._observability.dump_signal import dump_on_signal
from plugdist._observability.observe import active as observing
from plugdist._observability.observe import run as run_observed
from plugdist.errors import (
    DistBackendError,
    DistError,
    DistNetworkError,
    DistRankFailureError,
    DistStoreError,
    DistTimeoutError,
    op_timeout,
    store_timeout,
    timed_out,
    where,
)
from plugdist.store import DEFAULT_STORE_TIMEOUT, Store
from plugdist.store._tokens import is_loopback
from plugdist.store.api import to_bytes, to_seconds

if TYPE_CHECKING:
    from plugdist.store._for_torch import PlugdistStoreForTorch

__all__ = [
    "BackendBase", "BackendWrapper", "ProcessGroup", "GroupOptions", "Capabilities", "OPS",
    "BACKEND_HOOKS", "DEFAULT_TIMEOUT",
    "GroupLike",
    "Work", "completed_work", "failed_work", "gather_works",
    "AbortSignal", "wait_sliced",
    "ReduceOp", "ALL_REDUCE_OPS", "check_reduce_op",
    "DistError", "DistBackendError", "DistRankFailureError", "DistStoreError",
    "DistNetworkError", "DistTimeoutError", "where", "op_timeout", "timed_out", "store_timeout",
    "get_logger", "set_log_level",
    "Store", "DEFAULT_STORE_TIMEOUT", "to_bytes", "to_seconds", "is_loopback",
    "PlugdistStoreForTorch",
    "report_failed_ranks",
    "observing", "run_observed", "dump_on_signal",
    "BackendThreads", "POLL_SECONDS", "program_running", "recv_exact",
]


def __getattr__(name: str) -> Any:
    """``PlugdistStoreForTorch``: imported on first use (it imports torch.distributed)."""
    if name == "PlugdistStoreForTorch":
        return importlib.import_module("plugdist.store._for_torch").PlugdistStoreForTorch
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
