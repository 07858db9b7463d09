"""Surviving a dead rank: ``shrink_group``, ``grow_group``, ``get_failed_ranks`` and the join
side of ``init_process_group(join=True)``.

The mechanism is the same on every backend: :mod:`plugdist._resilience` names the failed
members and records the epoch the survivors agree on; the groups of the old epoch are aborted
and shut down, and the new world's default group is built through ``build_group`` on a fresh
store prefix (so plugins such as the debug wrapper apply), unless the backend builds it
natively (``BackendBase.native_shrink``). torch's default group over plugdist's world follows:
a new torch group over the new default group (:func:`plugdist._torch.bridge.follow_world`).

Above :mod:`plugdist._world.groups` and the torch bridge; nothing below imports it.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from plugdist._backend.base import BackendBase
from plugdist._group.process_group import GroupOptions, ProcessGroup
from plugdist._log import get_logger, lifecycle
from plugdist._registry import BACKENDS, Backend, registry
from plugdist._resilience.agreement import Decision
from plugdist._resilience.joining import request_join
from plugdist._resilience.membership import Membership
from plugdist._resilience.policy import off_hint
from plugdist._world import groups
from plugdist._world.state import world
from plugdist.errors import DistError
from plugdist.store import Store

__all__ = ["shrink_group", "grow_group", "get_failed_ranks", "join_world", "report_failed_ranks"]

_ATTEMPTS = 3  # agreements tried when members keep failing while the new group is built
_NAMING_GRACE = 5.0  # s a failed build waits for liveness to name a dead member
_EXIT_GRACE = 2.0  # s the process's exit waits for builds left behind


def _membership(what: str) -> Membership:
    pg = world.require(what)
    refusal = getattr(pg, "rebuild_refusal", "")
    if refusal:
        raise DistError(f"{pg.where(what)} {what} is not available on this backend: {refusal}")
    m = world.membership
    if m is None:
        raise DistError(off_hint(what))
    return m


def _resolve(group: Any, what: str) -> tuple[ProcessGroup, Any]:
    """(plugdist's default group, the handle to return): ``group`` may be None, plugdist's
    default group, or torch's default group running over it."""
    pg = world.require(what)
    if group is None or group is pg:
        return pg, None
    inner = getattr(group, "plugdist_group", None)
    if inner is not None and inner is pg:
        return pg, group
    raise ValueError(f"{what}: only the default group (plugdist's, or torch's default group over "
                     f"it) can be shrunk or grown; sub-groups of a world that loses a rank are "
                     f"destroyed: create them again with new_group() over the new world")


def get_failed_ranks(group: Any = None) -> list[int]:
    """The ranks of ``group`` (default: the world) known to have failed, as group ranks of the
    current epoch; [] when none (or resilience is off). Does not block."""
    m = world.membership
    if m is None:
        return []
    if group is None or group is world.default or \
            getattr(group, "plugdist_group", None) is world.default:
        return m.failed_ranks()
    info = world.info(group)
    uids = m.uids_of(info.global_ranks)
    dead = {m.rank_of(u) for u in uids if u in m.failed}
    return [i for i, g in enumerate(info.global_ranks) if g in dead]


def report_failed_ranks(ranks: Sequence[int], how: str) -> None:
    """For backends whose transport sees a failure itself (an MPI error naming the failed
    processes, a closed connection): ``ranks`` (global ranks of the current world) failed, as
    ``how`` describes. Membership acts on it at once, as on a death the store saw: it aborts
    every group holding them and tells the other members. A no-op when resilient groups are
    off. Safe from any thread; does a few store round trips the first time a rank is named."""
    m = world.membership
    if m is not None:
        m.report(ranks, how)


def shrink_group(ranks_to_exclude: Sequence[int] | None = None, group: Any = None,
                 timeout: timedelta | None = None) -> Any:
    """Continue without failed ranks: a collective of the survivors of the default group.

    ``ranks_to_exclude`` None: the ranks the survivors agree have failed (every rank not known
    to have failed must call this); given: those ranks (torch's meaning; the others call it with
    the same list). Aborts whatever is in flight on the old groups, destroys them (sub-groups
    included), and returns the new default group, ranks compacted in the old order;
    ``get_rank()``/``get_world_size()`` follow it, and so does torch's default group over
    plugdist's world: a new torch group, returned when ``group`` is a torch group over the world
    (the old one runs over the new group too, for whoever holds it). Blocks up to ``timeout``
    (default: the group's); raises DistRankFailureError on an excluded rank."""
    pg, handle = _resolve(group, "shrink_group")
    m = _membership("shrink_group")
    limit = timeout or world.info(pg).timeout
    exclude: tuple[str, ...] | None = None
    if ranks_to_exclude is not None:
        bad = [r for r in ranks_to_exclude if not 0 <= r < world.size]
        if bad:
            raise ValueError(f"shrink_group: ranks_to_exclude {bad} are not ranks of the world "
                             f"(0..{world.size - 1})")
        exclude = m.uids_of(ranks_to_exclude)
    for g in world.members():
        g.abort(f"shrink_group was called on rank {world.rank}: the group is being replaced")
    _enter_until_built(m, m.agree_shrink(exclude, limit), limit, "shrink_group")
    return _returned(handle)


def grow_group(group: Any = None, timeout: timedelta | None = None) -> Any:
    """Admit the processes waiting to join (``init_process_group(join=True)``): a collective of
    every member of the default group. Returns the same group at once when nobody waits;
    otherwise the new default group with the joiners' ranks appended (torch's new default group
    when ``group`` is a torch group over the world). Blocks up to ``timeout``."""
    pg, handle = _resolve(group, "grow_group")
    m = _membership("grow_group")
    refusal = getattr(pg, "grow_refusal", "")
    if refusal:
        raise DistError(f"{pg.where('grow_group')} grow_group is not available on this "
                        f"backend: {refusal}")
    limit = timeout or world.info(pg).timeout
    decision = m.agree_grow(limit)
    if decision is None:
        return _returned(handle)
    _enter_until_built(m, decision, limit, "grow_group")
    return _returned(handle)


def _returned(torch_group: Any) -> Any:
    """What a shrink or grow returns: torch's default group when called with a torch group
    (the new one, or the same when the script had torch's world destroyed), else plugdist's."""
    if torch_group is None:
        return world.default
    return world.torch_default if world.torch_default is not None else torch_group


def _enter_until_built(m: Membership, decision: Decision, timeout: timedelta,
                       why: str) -> None:
    """Enter ``decision``'s epoch; when a member of it fails before its group is built, the
    survivors of it (every one of them comes here too, joiners included) agree again, without
    it, up to ``_ATTEMPTS`` times. Raises the last error otherwise."""
    rounds = 0  # agreements within the epoch this process is still in
    for attempt in range(_ATTEMPTS):
        epoch = m.epoch
        try:
            _enter(m, decision, timeout, why)
            return
        except DistError as err:
            failed_now = [u for u in decision.members if u in m.failed]
            if not failed_now or attempt == _ATTEMPTS - 1:
                raise
            get_logger(rank=world.rank).warning("rebuild_retry", epoch=decision.epoch,
                                                failed=failed_now, error=str(err))
        # a native shrink fails before the epoch is entered: agree again within it
        rounds = rounds + 1 if m.epoch == epoch else 0
        decision, why = m.agree_shrink(None, timeout, rounds), "shrink_group"


def _enter(m: Membership, decision: Decision, timeout: timedelta, why: str) -> None:
    """Leave the old epoch's groups and build the default group of ``decision``."""
    old_default = world.default
    hook = registry.plugins().hook
    native = None
    if why == "shrink_group" and old_default is not None:
        keep = [m.rank_of(u) for u in decision.members]
        native = _native_shrink(old_default, keep, decision)
    for g in reversed(world.members()):
        hook.plugdist_group_destroyed(group=g)
        g.shutdown()
        # the flight recorder's watcher moves to the new epoch's world, as a joiner's watches
        # it: dump requests must reach every member through one store prefix
        groups.retire_group(g)
        world.remove(g)
    world.default = None
    decision = m.enter(decision)
    world.epoch, world.rank, world.size = decision.epoch, m.rank, len(decision.members)
    world.group_count = 0  # names restart in the epoch's store prefix, on joiners too
    world.local_group_counts.clear()
    if os.environ.get("RANK") is not None:  # scripts that read them see the new world
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(world.rank), str(world.size)
    assert world.backend is not None and world.store is not None
    name = f"e{decision.epoch}"
    info_timeout = timeout if old_default is None else old_default.timeout
    # a natively shrunk group goes through the same steps as a fresh one (plugins wrap it,
    # the world records it, membership watches it)
    ranks = tuple(range(world.size))
    factory = ((lambda *_args: native) if native is not None
               else _abandoned_if_a_member_fails(m, m.uids_of(ranks), world.backend))
    pg = groups._build_group(world.backend, ranks, name, info_timeout, world.group_options,
                             factory=factory)
    pg.group_desc = "default_pg"
    world.default = pg
    if world.torch_default is not None:
        from plugdist._torch import bridge as torch_bridge

        world.torch_default = torch_bridge.follow_world(
            world.torch_default, pg, world.backend,
            torch_bridge.world_store(world.store, world.epoch),
            world.rank, world.size, pg.timeout)
    lifecycle("group_shrunk" if why == "shrink_group" else "group_grown", group=name,
              group_rank=world.rank, backend=world.backend, epoch=decision.epoch,
              world_size=world.size, joined=decision.joined)


def _abandoned_if_a_member_fails(m: Membership, uids: tuple[str, ...],
                                 backend: str) -> Callable[..., BackendBase] | None:
    """The backend's constructor, run on a helper thread while the calling thread watches
    ``uids``: it returns the group, or raises the failure as soon as one of them is known to
    have failed. A backend's connect to a peer that died after it published its address may
    wait in C++, where no abort reaches (Gloo's listening side waits five times the group's
    timeout). The build left behind ends on its own; a group it still makes is shut down.

    A build that fails by itself (a connection refused by the dead peer) waits up to
    ``_NAMING_GRACE`` for liveness to name the member, so that the survivors agree again.
    None (build on the calling thread) for a backend whose groups live on an accelerator,
    whose current device is set per thread."""
    if groups.device_map(backend) is not None:
        return None  # a backend per device type: each built on the calling thread
    factory = registry.load(BACKENDS, backend)
    if any(t != "cpu" for t in getattr(factory, "device_types", ("cpu",))):
        return None

    def build(*args: Any) -> BackendBase:
        done, lock = threading.Event(), threading.Lock()
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                pg = factory(*args)
            except BaseException as err:  # the caller's to raise, unless it left already
                with lock:
                    if "abandoned" not in outcome:
                        outcome["error"] = err
                    done.set()
                return
            with lock:
                outcome["group"] = pg
                done.set()
                abandoned = "abandoned" in outcome
            if abandoned:
                pg.shutdown()

        name = getattr(args[-1], "group_name", "")
        thread = threading.Thread(target=run, name=f"plugdist-build-{name}", daemon=True)
        thread.start()
        while not done.wait(0.05):
            failure = m.first_failure(uids)
            if failure is not None:
                with lock:
                    if not done.is_set():
                        outcome["abandoned"] = True
                        _left_behind(thread)
                        raise failure
        if "error" in outcome:
            # popped: the error's traceback holds run's frame, which holds outcome; a cycle
            # would keep the half-built group (a Gloo device and its thread) until a GC at exit
            error = outcome.pop("error")
            failure = m.wait_for_failure(uids, _NAMING_GRACE)
            if failure is not None:
                raise failure from error
            raise error
        group: BackendBase = outcome["group"]
        return group

    return build


_abandoned: list[threading.Thread] = []


def _left_behind(thread: threading.Thread) -> None:
    if not _abandoned:
        atexit.register(_let_builds_left_behind_end)
    _abandoned[:] = [t for t in _abandoned if t.is_alive()] + [thread]


def _let_builds_left_behind_end() -> None:
    """At exit, wait up to ``_EXIT_GRACE`` for the builds left behind. One that is inside a
    store call the backend made (its peer's address not yet there) ends within a fraction of a
    second, as the store or the membership refuses it; left running, it would be a daemon
    thread with C++ frames below it that Python ends at shutdown, and that aborts the process
    ("terminate called without an active exception"). One waiting in the backend's own C++
    (a connect) is safe to leave."""
    deadline = time.monotonic() + _EXIT_GRACE
    for thread in _abandoned:
        thread.join(max(0.0, deadline - time.monotonic()))


def _native_shrink(old: ProcessGroup, keep: list[int],
                   decision: Decision) -> BackendBase | None:
    """The backend's own shrink of ``old``: the survivors' new backend (None: build a fresh
    one instead)."""
    options = GroupOptions(group_name=f"e{decision.epoch}", timeout=old.timeout,
                           global_ranks=tuple(range(len(decision.members))),
                           backend_options=world.group_options)
    result = old.native_shrink(keep, options)
    return None if result is NotImplemented else result


def join_world(backend: str, store: Store, timeout: timedelta, pg_options: Any) -> ProcessGroup:
    """The joiner's side of ``init_process_group(join=True)``: register through ``store``, wait
    to be admitted by the members' ``grow_group`` (bounded by ``timeout``), build its member of
    the new default group, and make it this process's world."""
    if world.initialized:
        raise DistError("init_process_group was already called in this process; call "
                        "destroy_process_group() first to re-initialize")
    name = Backend(backend)
    mapped = groups.device_map(name)
    # an unknown backend fails before anyone waits
    factories = [registry.load(BACKENDS, kind)
                 for kind in (dict.fromkeys(mapped.values()) if mapped else (name,))]
    refusal = next((r for f in factories if (r := getattr(f, "grow_refusal", ""))), "")
    if refusal:
        raise DistError(f"init_process_group(join=True): backend {backend!r} cannot admit a new "
                        f"process into a running world: {refusal}")
    store.set_timeout(timeout)
    m, decision = request_join(store, timeout)
    world.reset()
    world.store, world.backend, world.owned_store = store, name, True
    world.group_options = pg_options
    world.epoch, world.rank, world.size = decision.epoch, m.rank, len(decision.members)
    groups.start_membership(m, started=True)
    try:
        _enter_until_built(m, decision, timeout, "grow_group")
    except BaseException:
        groups._stop_membership()
        world.reset()
        raise
    pg = world.default
    assert pg is not None
    world.joined_epoch = world.epoch
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(world.rank), str(world.size)
    get_logger(rank=world.rank).info("joined", epoch=world.epoch, world_size=world.size,
                                     members=json.dumps(m.members))
    return pg

