"""Creating, finding and destroying groups: the torch.distributed-compatible functions.

Every function here that creates a group must be called by every rank of the world, in the same
order (the group's name is its position in that order). Non-members of a group get
``GroupMember.NON_GROUP_MEMBER``; queries on it answer -1 and collectives on it do nothing.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

from plugdist import _log as log
from plugdist._backend.base import BackendBase
from plugdist._debug_level import DebugLevel, get_debug_level
from plugdist._group.process_group import DEFAULT_TIMEOUT, GroupOptions, ProcessGroup
from plugdist._launch_protocol import mark_resilient
from plugdist._log import get_logger
from plugdist._observability import flight_recorder
from plugdist._registry import (
    BACKENDS,
    RENDEZVOUS,
    STORES,
    Backend,
    PluginNotFoundError,
    legacy_backend_refusal,
    registry,
)
from plugdist._resilience.guarded_store import GuardedPrefixStore
from plugdist._resilience.membership import Membership
from plugdist._resilience.policy import resilience_mode
from plugdist._world.rendezvous import RendezvousHandler, store_rendezvous_handler
from plugdist._world.state import GroupInfo, NotInitializedError, world
from plugdist.errors import DistError, DistTimeoutError, timed_out, where
from plugdist.store import PrefixStore, Store
from plugdist.store._worldkeys import (
    CLOSED,
    group_prefix,
    leaving_key,
    left_key,
    member_leaving_key,
    member_left_key,
)

__all__ = [
    "init_world", "destroy", "is_initialized", "is_available",
    "new_group", "new_subgroups", "new_subgroups_by_enumeration", "get_rank", "get_world_size",
    "get_pg_count",
    "get_backend", "get_global_rank", "get_group_rank", "get_process_group_ranks",
    "get_node_local_rank", "is_backend_available", "is_gloo_available", "is_mpi_available",
    "is_nccl_available", "is_torchelastic_launched", "get_default_backend_for_device",
    "register_rendezvous_handler", "group", "GroupMember", "resolve_group", "build_group",
]


class _NonMember:
    """The handle non-members get from ``new_group``."""

    def __repr__(self) -> str:
        return "GroupMember.NON_GROUP_MEMBER"


_NON_MEMBER = _NonMember()


class _GroupNamespace:
    """``group.WORLD`` is the default group (None before init), as in torch.distributed."""

    @property
    def WORLD(self) -> ProcessGroup | None:  # noqa: N802 - torch's spelling
        return world.default


class _GroupMemberNamespace(_GroupNamespace):
    NON_GROUP_MEMBER = _NON_MEMBER


group = _GroupNamespace()
GroupMember = _GroupMemberNamespace()

_warned_no_debug_plugin = False


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return world.initialized


def is_torchelastic_launched() -> bool:
    """True when started by ``plugdist-run`` (or torchrun): the launcher sets a run id."""
    return bool(os.environ.get("PLUGDIST_RUN_ID") or os.environ.get("TORCHELASTIC_RUN_ID"))


def is_backend_available(backend: str) -> bool:
    """True when the backend's plugin is installed and its library works here."""
    try:
        factory = registry.load(BACKENDS, Backend(backend))
    except PluginNotFoundError:
        return False
    return _availability(factory)[0]


def _availability(factory: Any) -> tuple[bool, str]:
    """``factory.is_available()``: whether its library works here, and why not."""
    check = getattr(factory, "is_available", None)
    if not callable(check):
        return True, ""
    ok, reason = check()
    return bool(ok), str(reason)


def is_gloo_available() -> bool:
    return is_backend_available("gloo")


def is_mpi_available() -> bool:
    return is_backend_available("mpi")


def is_nccl_available() -> bool:
    return is_backend_available("nccl")


def get_default_backend_for_device(device: Any) -> str:
    """The installed backend that volunteers as default for ``device``'s type (its factory's
    ``default_for`` attribute) and works here, e.g. 'cpu' -> 'gloo' when plugdist-gloo is
    installed. Raises DistError naming the volunteers that do not work here, and why."""
    dev = device.type if hasattr(device, "type") else str(device).split(":")[0]
    unavailable = []
    for name in registry.names(BACKENDS):
        try:
            factory = registry.load(BACKENDS, name)
        except PluginNotFoundError:
            continue
        if dev in getattr(factory, "default_for", ()):
            ok, reason = _availability(factory)
            if ok:
                return name
            unavailable.append(f"{name!r} is installed but unavailable here: {reason}")
    installed = ", ".join(registry.names(BACKENDS)) or "none"
    if unavailable:
        raise DistError(f"no default backend for {dev!r} devices: {'; '.join(unavailable)} "
                        f"(installed: {installed}); fix that, or pass backend= explicitly")
    raise DistError(f"no installed backend volunteers as default for {dev!r} devices (installed: "
                    f"{installed}); pass backend= explicitly or install one, e.g. "
                    f"pip install plugdist-gloo")


def _known_world(factory: Any, timeout: timedelta) -> tuple[Store, int, int] | None:
    """``factory.rendezvous(timeout)``: the world as a backend that knows it finds it (MPI
    under mpiexec), or None (``BackendBase.rendezvous``'s default; a factory function)."""
    find = getattr(factory, "rendezvous", None)
    found: tuple[Store, int, int] | None = find(timeout) if callable(find) else None
    return found


def register_rendezvous_handler(scheme: str, handler: RendezvousHandler) -> None:
    """Register ``handler(url, rank, world_size, timeout) -> (store, rank, world_size)`` (a
    :class:`~plugdist._world.rendezvous.RendezvousHandler`) for ``scheme://`` URLs in this
    process; wins over an installed entry point."""
    registry.register(RENDEZVOUS, scheme, handler)


# -- init / destroy -------------------------------------------------------------------------------
def init_world(backend: str | None = None, init_method: str | None = None,
               timeout: timedelta | None = None, world_size: int = -1, rank: int = -1,
               store: Store | None = None, group_name: str = "", pg_options: Any = None,
               device_id: Any = None) -> ProcessGroup:
    """Join the world: rendezvous, build the default group, wait until every rank has joined.

    Blocks until all ``world_size`` ranks called it (bounded by ``timeout``, default 30 min);
    raises DistTimeoutError naming the ranks that did not arrive. ``init_method`` and ``store``
    are exclusive; with neither, ``env://`` is used, unless the backend knows the world itself
    (MPI under mpiexec), which then ignores ``rank``/``world_size`` (a disagreeing one warns).

    Returns the default group. The public ``init_process_group``
    (:mod:`plugdist._lifecycle.lifecycle`) adds torch's default group on top.
    """
    if world.initialized:
        raise DistError("init_process_group was already called in this process; call "
                        "destroy_process_group() first to re-initialize")
    timeout = timeout if timeout is not None else DEFAULT_TIMEOUT
    if not isinstance(timeout, timedelta):
        raise TypeError(f"timeout must be a datetime.timedelta, got {type(timeout).__name__}")
    if store is not None and init_method is not None:
        raise ValueError("pass either init_method or store to init_process_group, not both")
    name = Backend(backend) if backend else get_default_backend_for_device("cpu")
    mapped = device_map(name)
    # every backend named is loaded now, so an unknown one fails before anyone waits
    factories = [registry.load(BACKENDS, kind)
                 for kind in (dict.fromkeys(mapped.values()) if mapped else (name,))]
    found_world = None
    if store is None and init_method is None:
        found_world = next((found for f in factories
                            if (found := _known_world(f, timeout)) is not None), None)
    if store is not None:
        if rank < 0 or world_size < 1:
            raise ValueError(f"init_process_group with an explicit store needs rank= and "
                             f"world_size= (got rank={rank}, world_size={world_size})")
        if rank >= world_size:
            raise ValueError(f"rank {rank} is out of range for world_size {world_size}")
        owned = False
    elif found_world is not None:
        # The backend knows the world itself (MPI under mpiexec): as in torch, rank= and
        # world_size= are not needed, and MASTER_ADDR in the environment does not matter.
        store, r, ws = found_world
        if (rank >= 0 and rank != r) or (world_size > 0 and world_size != ws):
            warnings.warn(f"init_process_group({name!r}): the backend found rank {r} of {ws} "
                          f"processes and ignores rank={rank}, world_size={world_size}",
                          UserWarning, stacklevel=2)
        rank, world_size, owned = r, ws, True
    else:
        url = init_method or "env://"
        scheme = urlparse(url).scheme
        if not scheme:
            raise ValueError(f"init_method {url!r} has no scheme; use env://, tcp://HOST:PORT or "
                             f"file:///PATH (registered: {', '.join(registry.names(RENDEZVOUS))})")
        if scheme in registry.names(RENDEZVOUS):
            handler: RendezvousHandler = registry.load(RENDEZVOUS, scheme)
        elif scheme in registry.names(STORES):   # any store URL is a rendezvous too
            handler = store_rendezvous_handler
        else:
            known = sorted(set(registry.names(RENDEZVOUS)) | set(registry.names(STORES)))
            raise ValueError(f"init_method {url!r}: no rendezvous handler or store for scheme "
                             f"{scheme + '://'!r}; registered: "
                             f"{', '.join(s + '://' for s in known)}; a store scheme comes with "
                             f"its plugin (e.g. pip install plugdist-{scheme})")
        store, rank, world_size = handler(url, rank=rank, world_size=world_size, timeout=timeout)
        owned = True
    store.set_timeout(timeout)
    world.reset()
    world.store, world.rank, world.size, world.backend = store, rank, world_size, name
    world.owned_store = owned
    world.group_options = pg_options
    try:
        resilience = resilience_mode()
        if world_size > 1 and resilience != "off" and _store_exposed(store, resilience):
            resilience = "off"
        if world_size > 1 and resilience != "off":
            m = Membership(store, str(rank), [str(r) for r in range(world_size)])
            if m.start(only_with_store_liveness=resilience == "auto"):
                start_membership(m, started=True)
        pg = _build_group(name, tuple(range(world_size)), group_name or "0", timeout, pg_options)
    except BaseException:
        _stop_membership()
        _close_store()
        world.reset()
        raise
    pg.group_desc = "default_pg"
    world.default = pg
    return pg


_exposure_warned: set[str] = set()


def _store_exposed(store: Store, resilience: str) -> bool:
    """Whether resilient groups stay off on ``store`` because any process that reaches it could
    forge the world's membership (``Store.membership_exposure``): off in ``auto`` mode, on when
    asked for explicitly; one warning either way, naming why and the fix."""
    why = store.membership_exposure()
    if why is None:
        return False
    off = resilience == "auto"
    if why not in _exposure_warned:
        _exposure_warned.add(why)
        then = ("off (PLUGDIST_RESILIENCE=1 turns them on regardless)" if off else
                "on, as PLUGDIST_RESILIENCE=1 asks, though such a process could exclude ranks")
        warnings.warn(f"resilient groups are {then}: {why}", UserWarning, stacklevel=3)
    return off


def start_membership(m: Membership, started: bool = False) -> None:
    """Make ``m`` the world's membership and start it (unless ``started``). At exit its will is
    withdrawn (a clean exit is not a failure), unless the program is ending on an uncaught
    exception: then the will stays, and runs when the process's connections close, so the
    others learn that this rank failed and go on without it."""
    if not started:
        m.start()
    world.membership = m
    _note_uncaught_exceptions()
    atexit.register(_leave_at_exit, m)
    mark_resilient(m.uid)


def _stop_membership() -> None:
    m, world.membership = world.membership, None
    if m is not None:
        m.stop()
        atexit.unregister(_leave_at_exit)


_uncaught = {"seen": False}  # the main thread is ending on an uncaught exception


def _note_uncaught_exceptions() -> None:
    """Wrap ``sys.excepthook`` (once) to note an uncaught exception: Python calls it before
    the atexit handlers."""
    previous = sys.excepthook
    if getattr(previous, "plugdist_notes_uncaught", False):
        return

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        _uncaught["seen"] = True
        previous(kind, value, tb)

    hook.plugdist_notes_uncaught = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _leave_at_exit(m: Membership) -> None:
    m.stop(withdraw=not _uncaught["seen"])


def _build_group(backend: str, global_ranks: tuple[int, ...], name: str, timeout: timedelta,
                 pg_options: Any, factory: Callable[..., BackendBase] | None = None
                 ) -> ProcessGroup:
    """Build this process's member of a group of the world and record it there. ``factory``:
    stands in for the backend's constructor (see :func:`build_group`)."""
    assert world.store is not None  # callers hold an initialized world
    prefix = group_prefix(world.epoch, name)
    m = world.membership
    uids = m.uids_of(global_ranks) if m is not None else ()
    base = (PrefixStore(prefix, world.store) if m is None
            else GuardedPrefixStore(prefix, world.store, m, uids))
    info = GroupInfo(name=name, backend=backend, global_ranks=global_ranks, store=base,
                     timeout=timeout)

    def record(pg: ProcessGroup) -> None:
        world.add(pg, info)
        if m is not None:
            m.watch(pg, uids)

    return build_group(backend, base, global_ranks, global_ranks.index(world.rank), name,
                       timeout, pg_options, global_rank=world.rank, record=record,
                       factory=factory, is_world=world.default is None
                       and global_ranks == tuple(range(world.size)))


def build_group(backend: str, store: Store, global_ranks: tuple[int, ...], group_rank: int,
                name: str, timeout: timedelta, pg_options: Any = None, *,
                global_rank: int | None = None,
                record: Callable[[ProcessGroup], None] | None = None,
                factory: Callable[..., BackendBase] | None = None,
                is_world: bool = False) -> ProcessGroup:
    """Build this process's member of a group: the backend on ``store`` (private to the group)
    through its factory (the entry point), wrapped by the plugins (the debug plugin at DETAIL),
    in a ProcessGroup; once every member has built its side, ``record`` it and announce it to
    the plugins. ``backend`` may name a backend per device type (``"cpu:gloo,cuda:nccl"``,
    :func:`device_map`): one backend of each, one group over them. Blocks up to ``timeout`` for
    the other members. ``factory`` stands in for the backend's constructor (same arguments);
    ``is_world``: the group is the whole world (``GroupOptions.is_world``).

    The one path every group takes: the world's groups (:func:`init_process_group`,
    :func:`new_group`) and the groups torch.distributed builds over a ``plugdist_*`` backend
    (:mod:`plugdist._torch.bridge`), which plugdist's world does not record.
    """
    me = group_rank if global_rank is None else global_rank
    options = GroupOptions(group_name=name, timeout=timeout, global_ranks=global_ranks,
                           backend_options=pg_options, is_world=is_world)
    devices = device_map(backend)
    level = get_debug_level()
    if factory is not None or devices is None:
        pg = ProcessGroup(_make_backend(backend, factory, store, "", group_rank, global_ranks,
                                        options, me, level))
    else:
        by_name: dict[str, BackendBase] = {}
        try:
            for kind in dict.fromkeys(devices.values()):
                by_name[kind] = _make_backend(kind, None, store, f"/{kind}", group_rank,
                                              global_ranks, options, me, level)
                wanted = [d for d, k in devices.items() if k == kind]
                handled = by_name[kind].device_types
                if any(d not in handled for d in wanted):
                    raise DistError(
                        f"{where(rank=me, group=name, backend=backend)} backend {kind!r} is "
                        f"mapped to {', '.join(wanted)} but handles {', '.join(handled)} "
                        f"tensors; map it to those (e.g. 'cpu:gloo,cuda:nccl')")
        except BaseException:
            for b in by_name.values():
                b.shutdown()
            raise
        pg = ProcessGroup({d: by_name[k] for d, k in devices.items()})
    _warn_if_detail_unserved(level)
    try:
        _store_barrier(store, "created", group_rank, len(global_ranks), timeout, name)
    except BaseException:
        pg.shutdown()
        raise
    if record is not None:
        record(pg)
    _announce(pg, store, global_ranks, me)
    registry.plugins().hook.plugdist_group_created(group=pg, global_ranks=global_ranks,
                                                   backend=backend)
    return pg


def device_map(backend: str) -> dict[str, str] | None:
    """A backend spec naming a backend per device type, ``"cpu:gloo,cuda:nccl"`` (torch's form),
    as ``{"cpu": "gloo", "cuda": "nccl"}``; None for a plain backend name."""
    if ":" not in backend:
        return None
    out: dict[str, str] = {}
    for part in backend.split(","):
        device, sep, kind = (p.strip().lower() for p in part.partition(":"))
        if not sep or not device or not kind or device in out:
            raise ValueError(f"backend {backend!r}: a device map names each device type once, "
                             f"as 'cpu:gloo,cuda:nccl'")
        out[device] = kind
    return out


def _make_backend(backend: str, factory: Callable[..., Any] | None, store: Store, suffix: str,
                  group_rank: int, global_ranks: tuple[int, ...], options: GroupOptions,
                  me: int, level: DebugLevel) -> BackendBase:
    """One backend of a group: its factory called on ``store``'s ``backend<suffix>`` prefix,
    refused unless it is a ``BackendBase`` (a plugin API 1 backend is told what to change),
    then wrapped by the plugins (``debug<suffix>``)."""
    name = options.group_name
    make: Any = registry.load(BACKENDS, backend) if factory is None else factory
    if isinstance(make, type) and issubclass(make, ProcessGroup):
        raise DistError(f"{where(rank=me, group=name, backend=backend)} "
                        f"{legacy_backend_refusal(backend, make, 'its factory')}")
    try:
        made = make(PrefixStore("backend" + suffix, store), group_rank, len(global_ranks),
                       options)
    except DistError:
        raise
    except Exception as err:
        raise DistError(f"{where(rank=me, group=name, backend=backend)} could not create "
                        f"the group: {type(err).__name__}: {err}") from err
    if not isinstance(made, BackendBase):
        shutdown = getattr(made, "shutdown", None)
        if callable(shutdown):
            shutdown()
        raise DistError(f"{where(rank=me, group=name, backend=backend)} "
                        f"{legacy_backend_refusal(backend, made, 'what its factory returned')}")
    wrapped: BackendBase = registry.wrap_backend(made, store=PrefixStore("debug" + suffix, store),
                                                 debug_level=level)
    return wrapped


def _announce(pg: ProcessGroup, store: Store, global_ranks: tuple[int, ...], me: int) -> None:
    """The built group to the flight recorder and the lifecycle log."""
    flight_recorder.recorder.add_group(pg, PrefixStore("observe", store), global_ranks, me)
    log.set_global_rank(me)
    log.lifecycle("group_built", group=pg.group_name, group_rank=pg.rank(),
                  backend=pg.backend_name, size=pg.size(), global_ranks=list(global_ranks),
                  timeout_s=pg.timeout.total_seconds())


def retire_group(pg: ProcessGroup) -> None:
    """What destroying a group made by :func:`build_group` owes after its ``shutdown``: the
    flight recorder forgets it (its watcher stops polling the group's store) and the lifecycle
    log records its end."""
    flight_recorder.recorder.remove_group(pg)
    log.lifecycle("group_destroyed", group=pg.group_name, group_rank=pg.rank(),
                  backend=pg.backend_name)


def _warn_if_detail_unserved(level: DebugLevel) -> None:
    global _warned_no_debug_plugin
    if level is DebugLevel.DETAIL and not _warned_no_debug_plugin \
            and not registry.has_hook("plugdist_wrap_backend"):
        _warned_no_debug_plugin = True
        warnings.warn("TORCH_DISTRIBUTED_DEBUG=DETAIL asks for collective checks, but no debug "
                      "plugin is installed: pip install plugdist-debug", RuntimeWarning,
                      stacklevel=3)


def _store_barrier(store: Store, tag: str, group_rank: int, size: int, timeout: timedelta,
                   name: str) -> None:
    store.set(f"{tag}/{group_rank}", b"1")
    keys = [f"{tag}/{r}" for r in range(size)]
    try:
        store.wait(keys, timeout)
    except DistTimeoutError as err:
        missing = [r for r in range(size) if not store.check([f"{tag}/{r}"])]
        here = where(rank=group_rank, group=name)
        raise DistTimeoutError(f"{timed_out(here, timeout.total_seconds(), 'every rank to join')}"
                               f": group ranks {missing} never did; are they running, and calling "
                               f"the same group constructors in the same order?") from err


_LEAVE_WAIT = timedelta(seconds=10)
_LEAVE_LOOK = timedelta(seconds=0.25)  # how often the host's wait looks for failed members


def _close_store() -> None:
    if world.owned_store and world.store is not None:
        world.store.close()


def _leave(m: Membership | None) -> None:
    """Tell the others this rank is done (through ``m``'s checked writes where the store owns
    the world's membership: no stranger can count a rank out, or stop the count); the rank
    that serves the store waits (at most ``_LEAVE_WAIT``) for the rest, so peers still reading
    their last messages are not cut off. Called while ``m`` still holds its identity."""
    store = world.store
    if store is None or not world.owned_store or world.size <= 1:
        return
    checked = m is not None and m.protected
    leaving, left = ((member_leaving_key(world.epoch), member_left_key(world.epoch)) if checked
                     else (leaving_key(world.epoch), left_key(world.epoch)))
    writes: Any = m.writes if m is not None and checked else store
    try:
        if writes.add(leaving, 1) == world.size:
            writes.set(left, b"1")
            if world.epoch and not checked:
                store.set(CLOSED, str(world.epoch))  # tells waiting joiners
        if getattr(store, "is_master", False):
            _wait_for_the_others(store, leaving, left, m)
    except DistError as err:
        get_logger(rank=world.rank).warning("destroy_process_group: peers did not all leave",
                                            error=str(err))


def _wait_for_the_others(store: Store, leaving: str, left: str, m: Membership | None) -> None:
    """The store's host, in ``_leave``: block until every member has left (``left`` is set)
    or every member still alive has (a failed member never will: membership knows it), at
    most ``_LEAVE_WAIT``; then raises DistTimeoutError."""
    deadline = time.monotonic() + _LEAVE_WAIT.total_seconds()
    while True:
        try:
            store.wait([left], min(_LEAVE_LOOK, timedelta(
                seconds=max(0.0, deadline - time.monotonic()))))
            return
        except DistTimeoutError:
            gone = int(store.get(leaving))
            failed = len(m.failed_ranks()) if m is not None else 0
            if failed and gone + failed >= world.size:
                return
            if time.monotonic() >= deadline:
                here = where(rank=world.rank, op="destroy_process_group")
                raise DistTimeoutError(
                    f"{timed_out(here, _LEAVE_WAIT.total_seconds(), 'the others to leave')}: "
                    f"{gone} of {world.size} ranks called destroy_process_group") from None


def destroy(group: ProcessGroup | None = None) -> None:
    """Destroy ``group``, or (default) every group and the world. Not collective; releases
    sockets and threads. Afterwards ``init_process_group`` may be called again."""
    if group is _NON_MEMBER:
        return
    hook = registry.plugins().hook
    if group is None or group is world.default:
        for pg in reversed(world.members()):
            hook.plugdist_group_destroyed(group=pg)
            pg.shutdown()
            retire_group(pg)
        _leave(world.membership)  # while its identity is held: a member's checked writes
        _stop_membership()
        _close_store()
        world.reset()
        return
    world.info(group)
    hook.plugdist_group_destroyed(group=group)
    group.shutdown()
    retire_group(group)
    world.remove(group)


# -- new groups -----------------------------------------------------------------------------------
def new_group(ranks: Sequence[int] | None = None, timeout: timedelta | None = None,
              backend: str | None = None, pg_options: Any = None,
              use_local_synchronization: bool = False, group_desc: str | None = None) -> Any:
    """A group of ``ranks`` (global ranks; default all). Every rank of the world must call it,
    in the same order; members get the group, non-members ``GroupMember.NON_GROUP_MEMBER``.
    With ``use_local_synchronization``, only the members must call it (in the same order among
    themselves): its name comes from its ranks (``World.local_group_name``), not the call
    order, and a non-member's call does nothing. Blocks until every member has built its side
    (bounded by ``timeout``). ``group_desc``: the group's ``group_desc``, a description for
    people (``"undefined"`` by default, as torch's)."""
    world.require("new_group")
    members = tuple(sorted(range(world.size) if ranks is None else ranks))
    if len(set(members)) != len(members):
        raise ValueError(f"new_group: ranks {list(ranks or [])} contain duplicates")
    bad = [r for r in members if not 0 <= r < world.size]
    if bad:
        raise ValueError(
            f"new_group: ranks {bad} are not in the world (valid: 0..{world.size - 1})")
    if not members:
        raise ValueError("new_group: ranks must not be empty")
    if use_local_synchronization:
        if world.rank not in members:
            return _NON_MEMBER
        name = world.local_group_name(members)
    else:
        name = world.next_group_name()
        if world.rank not in members:
            return _NON_MEMBER
    default_info = world.info(world.require("new_group"))
    pg = _build_group(Backend(backend) if backend else default_info.backend, members, name,
                      timeout or default_info.timeout, pg_options)
    if group_desc is not None:
        pg.group_desc = group_desc
    return pg


def new_subgroups(group_size: int | None = None, group: Any = None,
                  timeout: timedelta | None = None,
                  backend: str | None = None, pg_options: Any = None,
                  group_desc: str | None = None) -> tuple[Any, list[Any]]:
    """Split ``group``'s ranks (default: the world's) into consecutive subgroups of
    ``group_size`` ranks (default: the ranks of one node, LOCAL_WORLD_SIZE). Returns (this
    rank's subgroup, every subgroup handle). Splitting the world, every rank calls it; splitting
    another group, its members do (a non-member's call is a ValueError, as torch's), and the
    subgroups are made with ``use_local_synchronization``, so the other ranks need not call."""
    world.require("new_subgroups")
    if group_size is None:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        if env is None:
            raise ValueError("new_subgroups: pass group_size= (LOCAL_WORLD_SIZE is not set)")
        group_size = int(env)
    whole = group is None or group is world.default
    if group is _NON_MEMBER:
        raise ValueError(f"new_subgroups: this rank ({world.rank}) is not a member of group; "
                         f"only the group's members split it")
    ranks = list(range(world.size)) if whole else get_process_group_ranks(group)
    if group_size <= 0 or len(ranks) % group_size:
        raise ValueError(f"new_subgroups: group_size={group_size} must divide the "
                         f"{'world' if whole else 'group'} size {len(ranks)}")
    enumeration = [ranks[s:s + group_size] for s in range(0, len(ranks), group_size)]
    return _subgroups(enumeration, timeout, backend, pg_options, group_desc, local=not whole)


def new_subgroups_by_enumeration(ranks_per_subgroup_list: Sequence[Sequence[int]],
                                 timeout: timedelta | None = None, backend: str | None = None,
                                 pg_options: Any = None,
                                 group_desc: str | None = None) -> tuple[Any, list[Any]]:
    """One group per listed rank set (sets must not overlap). Returns (this rank's subgroup or
    None, every subgroup handle); ``group_desc`` describes each (see :func:`new_group`)."""
    return _subgroups(ranks_per_subgroup_list, timeout, backend, pg_options, group_desc,
                      local=False)


def _subgroups(ranks_per_subgroup_list: Sequence[Sequence[int]], timeout: timedelta | None,
               backend: str | None, pg_options: Any, group_desc: str | None,
               local: bool) -> tuple[Any, list[Any]]:
    """``new_subgroups_by_enumeration``; ``local``: each made with
    ``use_local_synchronization``."""
    seen: set[int] = set()
    for ranks in ranks_per_subgroup_list:
        overlap = seen & set(ranks)
        if overlap:
            raise ValueError(f"new_subgroups_by_enumeration: ranks {sorted(overlap)} appear in "
                             f"more than one subgroup")
        seen |= set(ranks)
    subgroups, mine = [], None
    for ranks in ranks_per_subgroup_list:
        handle = new_group(ranks, timeout=timeout, backend=backend, pg_options=pg_options,
                           use_local_synchronization=local, group_desc=group_desc)
        subgroups.append(handle)
        if world.rank in ranks:
            mine = handle
    return mine, subgroups


# -- queries --------------------------------------------------------------------------------------
def resolve_group(group: Any, what: str) -> ProcessGroup | None:
    """The ProcessGroup for ``group`` (None: the default); None for a non-member handle."""
    if group is None:
        pg = world.default  # world.require, inlined: every collective call passes here
        return pg if pg is not None else world.require(what)
    if group is _NON_MEMBER:
        return None
    if not isinstance(group, ProcessGroup):
        raise TypeError(f"{what}: group must be a ProcessGroup from new_group/init_process_group, "
                        f"got {type(group).__name__}")
    return group


def get_rank(group: Any = None) -> int:
    pg = resolve_group(group, "get_rank")
    return -1 if pg is None else pg.rank()


def get_world_size(group: Any = None) -> int:
    pg = resolve_group(group, "get_world_size")
    return -1 if pg is None else pg.size()


def get_backend(group: Any = None) -> str:
    pg = resolve_group(group, "get_backend")
    if pg is None:
        raise ValueError("get_backend: this process is not a member of the group")
    return world.info(pg).backend


def get_pg_count() -> int:
    """How many groups this process's world has named in call order: the default group and
    every ``new_group`` call (non-members' included, local-sync groups not), as torch's."""
    world.require("get_pg_count")
    return world.group_count + 1


def get_process_group_ranks(group: Any) -> list[int]:
    pg = resolve_group(group, "get_process_group_ranks")
    if pg is None:
        raise ValueError("get_process_group_ranks: this process is not a member of the group")
    return list(world.info(pg).global_ranks)


def get_global_rank(group: Any, group_rank: int) -> int:
    ranks = get_process_group_ranks(group)
    if not 0 <= group_rank < len(ranks):
        raise ValueError(f"get_global_rank: group rank {group_rank} is not in a group of "
                         f"{len(ranks)}")
    return ranks[group_rank]


def get_group_rank(group: Any, global_rank: int) -> int:
    pg = resolve_group(group, "get_group_rank")
    if pg is None:
        raise ValueError("get_group_rank: this process is not a member of the group")
    r = world.info(pg).group_rank(global_rank)
    if r is None:
        raise ValueError(f"get_group_rank: global rank {global_rank} is not in group "
                         f"{pg.group_name!r} (ranks {list(world.info(pg).global_ranks)})")
    return r


def get_node_local_rank(fallback_rank: int | None = None) -> int:
    """LOCAL_RANK from the launcher, or ``fallback_rank`` when it is not set."""
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    if fallback_rank is not None:
        return fallback_rank
    raise RuntimeError("LOCAL_RANK is not set (start with plugdist-run) and no fallback_rank given")


__all__ += ["NotInitializedError"]
