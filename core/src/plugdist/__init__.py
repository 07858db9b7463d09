"""plugdist: torch.distributed's design as a plugin framework.

``import plugdist as dist`` is a drop-in for the torch.distributed API; backends come from
installed plugins (``plugdist-gloo``, ``plugdist-mpi``, ``plugdist-nccl`` or a third party's),
found by entry point when first asked for. Importing plugdist discovers nothing.

The subpackages ``plugdist.parallel`` (DistributedDataParallel), ``plugdist.testing`` and
``plugdist.nn`` are reachable as attributes after ``import plugdist``, imported on first use so
that ``import plugdist`` does not pay for them.
"""

import importlib
from typing import Any

from plugdist._backend.reduce_op import ReduceOp, reduce_op
from plugdist._backend.work import Work
from plugdist._debug_level import (
    DebugLevel,
    get_debug_level,
    set_debug_level,
    set_debug_level_from_env,
)
from plugdist._group.process_group import Capabilities, GroupOptions, ProcessGroup
from plugdist._launch_protocol import record
from plugdist._lifecycle.lifecycle import destroy_process_group, init_process_group
from plugdist._lifecycle.regroup import get_failed_ranks, grow_group, shrink_group
from plugdist._observability.flight_recorder import dump_flight_recorder
from plugdist._open_store import open_store
from plugdist._registry import PLUGIN_API, Backend
from plugdist._world.collectives import (
    P2POp,
    all_gather,
    all_gather_coalesced,
    all_gather_into_tensor,
    all_gather_single,
    all_reduce,
    all_reduce_coalesced,
    all_to_all,
    all_to_all_single,
    barrier,
    batch_isend_irecv,
    broadcast,
    gather,
    irecv,
    isend,
    monitored_barrier,
    recv,
    reduce,
    reduce_scatter,
    reduce_scatter_single,
    reduce_scatter_tensor,
    scatter,
    send,
)
from plugdist._world.groups import (
    GroupMember,
    get_backend,
    get_default_backend_for_device,
    get_global_rank,
    get_group_rank,
    get_node_local_rank,
    get_pg_count,
    get_process_group_ranks,
    get_rank,
    get_world_size,
    group,
    is_available,
    is_backend_available,
    is_gloo_available,
    is_initialized,
    is_mpi_available,
    is_nccl_available,
    is_torchelastic_launched,
    new_group,
    new_subgroups,
    new_subgroups_by_enumeration,
    register_rendezvous_handler,
)
from plugdist._world.object_collectives import (
    all_gather_object,
    broadcast_object_list,
    gather_object,
    recv_object_list,
    scatter_object_list,
    send_object_list,
)
from plugdist.errors import (
    BelowMinWorldSizeError,
    DistBackendError,
    DistError,
    DistExcludedError,
    DistNetworkError,
    DistRankFailureError,
    DistStoreError,
    DistTimeoutError,
    HookContractError,
    LaunchError,
    NotInitializedError,
    PluginAPIError,
    PluginHookError,
    PluginNotFoundError,
    QueueEmptyError,
    RendezvousError,
    RendezvousInterrupted,
    StoreLost,
    WorldClosedError,
    WorldError,
)
from plugdist.store import FileStore, HashStore, PrefixStore, Store, TCPStore

__version__ = "0.1.0"

_LAZY_SUBPACKAGES = frozenset({"nn", "parallel", "testing"})


def __getattr__(name: str) -> Any:
    """``plugdist.parallel`` and the other subpackages: imported on first access."""
    if name in _LAZY_SUBPACKAGES:
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise  # the subpackage exists but something it imports is missing
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "Backend", "Capabilities", "DebugLevel", "DistBackendError", "DistError", "DistNetworkError",
    "DistStoreError", "DistTimeoutError", "QueueEmptyError", "FileStore", "GroupMember",
    "GroupOptions", "HashStore",
    "P2POp", "PrefixStore", "ProcessGroup", "ReduceOp", "Store", "TCPStore", "Work", "open_store",
    "all_gather", "all_gather_coalesced", "all_gather_into_tensor", "all_gather_object",
    "all_gather_single", "all_reduce", "all_reduce_coalesced", "all_to_all", "all_to_all_single",
    "barrier", "batch_isend_irecv", "broadcast", "broadcast_object_list",
    "destroy_process_group", "dump_flight_recorder", "gather", "gather_object", "get_backend",
    "get_debug_level",
    "get_default_backend_for_device", "get_global_rank", "get_group_rank", "get_node_local_rank",
    "get_pg_count", "get_process_group_ranks", "get_rank", "get_world_size", "group",
    "init_process_group",
    "irecv", "is_available", "is_backend_available", "is_gloo_available", "is_initialized",
    "is_mpi_available", "is_nccl_available", "is_torchelastic_launched", "isend",
    "monitored_barrier", "new_group", "new_subgroups", "new_subgroups_by_enumeration", "recv",
    "recv_object_list", "reduce", "reduce_op", "reduce_scatter", "reduce_scatter_single",
    "reduce_scatter_tensor", "register_rendezvous_handler", "scatter", "scatter_object_list",
    "send", "send_object_list", "set_debug_level", "set_debug_level_from_env",
    "DistRankFailureError", "DistExcludedError", "shrink_group", "grow_group",
    "get_failed_ranks", "PLUGIN_API", "NotInitializedError", "RendezvousError",
    "RendezvousInterrupted", "StoreLost", "LaunchError", "PluginNotFoundError", "PluginAPIError",
    "BelowMinWorldSizeError", "WorldClosedError", "WorldError", "record", "HookContractError",
    "PluginHookError",
]
