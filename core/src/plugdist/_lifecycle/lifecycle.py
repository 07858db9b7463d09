"""``init_process_group`` and ``destroy_process_group``: plugdist's world (:mod:`.groups`) and,
on top of it, torch.distributed's default group running over that world (:mod:`.torch_bridge`).

Kept apart from :mod:`.groups` so that the arrows run one way: the bridge builds its groups
through ``groups``, and only this module, above both, knows that a world has a torch side.
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta
from typing import Any

from plugdist._group.process_group import ProcessGroup
from plugdist._launch_protocol import PAGE_VAR
from plugdist._log import get_logger
from plugdist._observability import page_reporter
from plugdist._world import groups
from plugdist._world.state import world
from plugdist.errors import where
from plugdist.store import Store

__all__ = ["init_process_group", "destroy_process_group", "TORCH_WORLD_ENV", "JOIN_ENV"]

TORCH_WORLD_ENV = "PLUGDIST_TORCH_WORLD"


def init_process_group(backend: str | None = None, init_method: str | None = None,
                       timeout: timedelta | None = None, world_size: int = -1, rank: int = -1,
                       store: Store | None = None, group_name: str = "", pg_options: Any = None,
                       device_id: Any = None, torch_world: bool | None = None,
                       join: bool | None = None) -> None:
    """Join the world: rendezvous, build the default group, wait until every rank has joined.

    Blocks until all ``world_size`` ranks called it (bounded by ``timeout``, default 30 min);
    raises DistTimeoutError naming the ranks that did not arrive. ``init_method`` and ``store``
    are exclusive; with neither, ``env://`` is used, unless the backend knows the world itself
    (MPI under mpiexec), which then ignores ``rank``/``world_size`` (a disagreeing one warns).

    ``torch_world`` (default: on, unless ``PLUGDIST_TORCH_WORLD=0``): also make torch's default
    group run over this world's default group (backend ``plugdist_<backend>``), so code that asks
    ``torch.distributed`` sees this world; skipped when torch's default group already exists.

    ``join`` (default: ``PLUGDIST_JOIN=1`` in the environment): join a running world instead of
    forming one. ``rank``/``world_size`` are not given: the store (``init_method`` or
    ``store``) is the running world's; this blocks until the members admit this process at
    their next ``plugdist.grow_group()`` (bounded by ``timeout``), and returns with this
    process's rank and the new world size.
    """
    if _wants_join(join):
        pg = _join(backend, init_method, timeout, store, pg_options)
    else:
        pg = groups.init_world(backend, init_method, timeout, world_size, rank, store,
                               group_name, pg_options, device_id)
    if _wants_torch_world(torch_world):
        _share_with_torch(pg, explicit=bool(torch_world))
    if os.environ.get(PAGE_VAR) == "1" and world.store is not None:
        page_reporter.start(world.store, _who)  # plugdist-run --page
    get_logger(rank=world.rank, group=pg.group_name).info(
        "init_process_group", backend=world.backend, world_size=world.size,
        torch_world=world.torch_default is not None)


def destroy_process_group(group: ProcessGroup | None = None) -> None:
    """Destroy ``group``, or (default) every group and the world, torch's default group over it
    included. Not collective; releases sockets and threads. Afterwards ``init_process_group``
    may be called again."""
    if (group is None or group is world.default) and world.torch_default is not None:
        from plugdist._torch import bridge as torch_bridge

        torch_bridge.release_world(world.torch_default)
        world.torch_default = None
    if group is None or group is world.default:
        page_reporter.stop()
    groups.destroy(group)


def _who() -> dict[str, Any]:
    """This process in the world now, for the live page (its rank changes when the world
    shrinks; its member id does not)."""
    m = world.membership
    return {"uid": m.uid if m is not None else str(world.rank), "rank": world.rank,
            "world_size": world.size, "epoch": world.epoch}


JOIN_ENV = "PLUGDIST_JOIN"


def _wants_join(arg: bool | None) -> bool:
    if arg is not None:
        return arg
    return os.environ.get(JOIN_ENV, "0").strip().lower() in ("1", "true", "yes", "on")


def _join(backend: str | None, init_method: str | None, timeout: timedelta | None,
          store: Store | None, pg_options: Any) -> ProcessGroup:
    from plugdist._group.process_group import DEFAULT_TIMEOUT
    from plugdist._lifecycle import regroup as resilience
    from plugdist._world.rendezvous import join_store

    limit = timeout if timeout is not None else DEFAULT_TIMEOUT
    if store is not None and init_method is not None:
        raise ValueError("pass either init_method or store to init_process_group, not both")
    if backend is None:
        backend = groups.get_default_backend_for_device("cpu")
    if store is None:
        store = join_store(init_method, limit)
    return resilience.join_world(backend, store, limit, pg_options)


def _wants_torch_world(arg: bool | None) -> bool:
    if arg is not None:
        return arg
    return os.environ.get(TORCH_WORLD_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _share_with_torch(pg: ProcessGroup, explicit: bool) -> None:
    """torch's default group over ``pg`` (see plugdist._torch.bridge.share_world). A failure is
    an error when asked for explicitly, else a warning: the plugdist world works without it."""
    store, backend, rank, size = world.store, world.backend, world.rank, world.size
    if store is None or backend is None:
        raise RuntimeError("init_world returned without a store or backend")
    try:
        import plugdist._torch.bridge as torch_bridge  # needs torch built with distributed support

        world.torch_default = torch_bridge.share_world(
            pg, backend, torch_bridge.world_store(store, world.epoch), rank, size, pg.timeout)
    except Exception as err:
        if explicit:
            destroy_process_group()
            raise
        warnings.warn(f"{where(rank=rank, backend=backend)} torch.distributed could not be set "
                      f"to run over plugdist's world ({type(err).__name__}: {err}); torch's "
                      f"default group stays uninitialized. Pass torch_world=False or set "
                      f"{TORCH_WORLD_ENV}=0 to skip this step", RuntimeWarning, stacklevel=3)
