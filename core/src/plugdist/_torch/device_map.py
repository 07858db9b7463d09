"""torch's device-map form (``"cpu:gloo,cuda:plugdist_nccl"``) with ``plugdist_*`` backends.

torch builds a group from a device map by creating one backend per device in a loop, but stops
at the first factory that returns a whole ``ProcessGroup`` (which every Python backend must: the
C++ ``Backend`` class has no Python constructor in torch 2.x) and then sends every device's ops
to that group. So when torch calls a ``plugdist_*`` factory for a map that names other backends
too, :func:`other_devices` builds the rest the way torch would have, and the bridged group
routes each op by the device of its tensors (see ``RoutingBridgeGroup``):

- a torch backend that torch built earlier in its loop (``gloo`` for cpu in
  ``"cpu:gloo,cuda:plugdist_nccl"``) is used as torch registered it, on the C++ group torch was
  building;
- a torch backend later in the map (``nccl`` in ``"cpu:plugdist_gloo,cuda:nccl"``) is built here
  as torch builds it (gloo and nccl only), on the same store prefix, and registered on that same
  C++ group;
- another plugdist backend gets a plugdist group of the same ranks.

The map, the store and the group under construction are read from the frame of torch's
``_new_process_group_helper`` (its locals ``backend_config``, ``prefix_store``, ``pg``,
``timeout`` and ``backend_options``, the same from torch 2.3 to 2.13). Should torch rename
them, :func:`other_devices` finds no map and the group serves every device with its one backend,
which refuses tensors on devices it does not handle, naming the device; a test pins the names.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from types import FrameType
from typing import Any

import _plugdist_torch_autoload as autoload
import torch
from torch._C import _distributed_c10d as c10d

__all__ = ["DeviceMap", "caller_device_map", "other_devices"]

_HELPER = "_new_process_group_helper"
_NATIVE = ("gloo", "nccl")


@dataclass
class DeviceMap:
    """One device map being built by torch: ``backends`` maps device type to backend name
    (lower case, as torch parsed it); ``store`` is the group's store (``"<group>/"``), ``native``
    torch's C++ group under construction, ``options`` the ``pg_options`` the user passed."""

    backends: dict[str, str]
    store: Any
    native: Any
    timeout: timedelta
    options: Any
    group_name: str

    def spec(self) -> str:
        return ",".join(f"{device}:{name}" for device, name in self.backends.items())


def caller_device_map(max_depth: int = 12) -> DeviceMap | None:
    """The device map torch is building a group from, when it names more than one backend and
    the caller runs inside torch's group-building helper; else None."""
    frame: FrameType | None = sys._getframe(1)
    try:
        for _ in range(max_depth):
            if frame is None or frame.f_code.co_name == _HELPER:
                break
            frame = frame.f_back
        if frame is None or frame.f_code.co_name != _HELPER:
            return None
        local = frame.f_locals
        config = local.get("backend_config")
        if config is None or "pg" not in local or "prefix_store" not in local:
            return None
        backends = {str(d): str(b) for d, b in config.get_device_backend_map().items()}
        if len(set(backends.values())) < 2:
            return None
        return DeviceMap(backends, local["prefix_store"], local["pg"], local["timeout"],
                         local.get("backend_options"), str(local.get("group_name") or ""))
    finally:
        del frame


def other_devices(device_map: DeviceMap, own: str, group_rank: int, group_size: int,
                  global_ranks: list[int],
                  plugdist_group: Callable[[str, str, Any], Any]) -> dict[str, Any]:
    """What serves each device of ``device_map`` whose backend is not ``own`` (a torch name):
    torch's C++ group holding the torch backends, or ``plugdist_group(backend, device, store)``
    for another plugdist backend. Collective: every member of the group builds the same."""
    routes: dict[str, Any] = {}
    native = device_map.native
    for device, name in device_map.backends.items():
        if name == own:
            continue
        store = c10d.PrefixStore(f"{device}/", device_map.store)
        if name.startswith(autoload.PREFIX):
            routes[device] = plugdist_group(name[len(autoload.PREFIX):], device, store)
            continue
        if _registered(native, device) is None:
            backend, kind = _build_native(device_map, device, name, store, group_rank,
                                          group_size, global_ranks)
            native._register_backend(torch.device(device), kind, backend)
        routes[device] = native
    if any(route is native for route in routes.values()):
        native._set_group_name(device_map.group_name)
    return routes


def _registered(native: Any, device: str) -> Any:
    try:
        return native._get_backend(torch.device(device))
    except RuntimeError:  # torch: "Could not retrieve or create the backend ..."
        return None


def _build_native(device_map: DeviceMap, device: str, name: str, store: Any, rank: int,
                  size: int, global_ranks: list[int]) -> tuple[Any, Any]:
    """torch's backend ``name`` for ``device``, built as torch's helper builds it."""
    kinds = c10d.ProcessGroup.BackendType
    backend: Any
    options: Any
    if name == "gloo":
        backend = c10d.ProcessGroupGloo(store, rank, size, device_map.timeout)
        options = getattr(backend, "options", None)
    elif name == "nccl" and hasattr(c10d, "ProcessGroupNCCL"):
        given = device_map.options
        options = given if isinstance(given, c10d.ProcessGroupNCCL.Options) else \
            c10d.ProcessGroupNCCL.Options()
        if options is not given:
            options.is_high_priority_stream = False
        options._timeout = device_map.timeout
    else:
        why = ("this torch has no NCCL" if name == "nccl" else
               f"only {' and '.join(_NATIVE)} can be built next to a plugdist backend")
        raise ValueError(
            f"device map {device_map.spec()!r}: cannot build torch's {name!r} for {device} next "
            f"to a plugdist backend ({why}); give {device} a plugdist backend or one of "
            f"{', '.join(_NATIVE)}")
    if options is not None:  # what torch's helper sets, where this torch has the fields
        for field, value in (("global_ranks_in_group", global_ranks),
                             ("group_name", device_map.group_name)):
            if hasattr(options, field):
                setattr(options, field, value)
    if name == "nccl":
        backend = c10d.ProcessGroupNCCL(store, rank, size, options)
    backend._set_sequence_number_for_group()
    return backend, kinds.GLOO if name == "gloo" else kinds.NCCL
