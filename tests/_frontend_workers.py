"""Functions the frontend tests run on every rank (module level, so workers can import them)."""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import plugdist as dist
import torch


def init_and_sum(rank: int, world_size: int, init_method: str | None,
                 backend: str = "gloo") -> float:
    explicit = init_method and not init_method.startswith("env")
    kwargs = {"rank": rank, "world_size": world_size} if explicit else {}
    dist.init_process_group(backend, init_method=init_method, timeout=timedelta(seconds=60),
                            **kwargs)
    try:
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        assert dist.get_rank() == rank and dist.get_world_size() == world_size
        return float(t.item())
    finally:
        dist.destroy_process_group()


def explicit_store(rank: int, world_size: int, port: int) -> list[float]:
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0,
                          timeout=timedelta(seconds=60))
    out = []
    for _ in range(2):  # re-init after destroy works
        dist.init_process_group("gloo", store=dist.PrefixStore(f"run{len(out)}", store),
                                rank=rank, world_size=world_size)
        t = torch.ones(2)
        dist.all_reduce(t)
        out.append(float(t.sum()))
        dist.destroy_process_group()
        assert not dist.is_initialized()
    return out


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def init_destroy_loop(rank: int, world_size: int, ports: tuple[int, int],
                      loops: int) -> dict[str, int]:
    """Init and destroy the world ``loops`` times, on ``ports`` in turn; returns fd and thread
    counts before/after."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    counts = {}
    for i in range(loops):
        os.environ["MASTER_PORT"] = str(ports[i % 2])
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == world_size
        g = dist.new_group([0, 1])
        dist.all_reduce(t, group=g)
        dist.destroy_process_group()
        if i == 4:  # after warm-up: lazily created pools and imports exist by now
            counts["fds_start"], counts["threads_start"] = _fds(), threading.active_count()
            counts["tasks_start"] = len(os.listdir("/proc/self/task"))
    counts["fds_end"], counts["threads_end"] = _fds(), threading.active_count()
    # Thread.join returns a moment before the OS thread is gone from /proc: allow it to finish
    deadline = time.monotonic() + 2.0
    while (len(os.listdir("/proc/self/task")) > counts["tasks_start"]
           and time.monotonic() < deadline):
        time.sleep(0.01)
    counts["tasks_end"] = len(os.listdir("/proc/self/task"))
    return counts


def api_errors(rank: int, world_size: int) -> list[str]:
    """Frontend error messages, collected on each rank (the world is already initialized)."""
    msgs = []
    for call in (lambda: dist.init_process_group("gloo"),
                 lambda: dist.new_group([0, world_size]),
                 lambda: dist.new_group([0, 0]),
                 lambda: dist.get_group_rank(dist.group.WORLD, world_size + 3)):
        try:
            call()
        except (ValueError, RuntimeError) as err:
            msgs.append(str(err))
        else:
            msgs.append("no error")
    return msgs


def non_member_handles(rank: int, world_size: int) -> dict:
    g = dist.new_group([0])
    out = {"is_non_member": g is dist.GroupMember.NON_GROUP_MEMBER, "rank": dist.get_rank(g),
           "size": dist.get_world_size(g), "all_reduce": dist.all_reduce(torch.ones(1), group=g),
           "launched": dist.is_torchelastic_launched(), "backend": dist.get_backend()}
    mine, groups = dist.new_subgroups(group_size=1)
    out["subgroups"] = len(groups)
    out["sub_rank"] = dist.get_rank(mine)
    dist.destroy_process_group(g) if g is not dist.GroupMember.NON_GROUP_MEMBER else None
    return out


def monitored_barrier_with_missing_rank(rank: int, world_size: int) -> str:
    if rank == world_size - 1:
        return "skipped"
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=3), wait_all_ranks=True)
    except dist.DistError as err:
        return str(err)
    return "no error"


def destroy_with_an_op_pending(rank: int, world_size: int, op: str, grace: float) -> dict:
    """On a group of both ranks (its timeout, and its grace for confirming a failure,
    ``grace`` seconds), rank 0 leaves an op pending that rank 1 never joins — a receive, or an
    all_reduce it stopped waiting for after half a second — then destroys that group while
    rank 1 waits in a world barrier (alive: no failure to confirm); or a barrier whose own
    timeout (half a second) bounds its wait. Returns, on rank 0,
    whether the group was monitored, how long the destroy took and the op's error."""
    group = dist.new_group([0, 1], timeout=timedelta(seconds=grace))
    out: dict = {}
    if rank == 0:
        signal = group.abort_signal
        out["monitored"], signal.confirm_grace = signal.monitored, grace
        if op == "recv":
            work = dist.irecv(torch.zeros(3), src=1, group=group)
        elif op == "barrier":
            work = dist.barrier(group=group, async_op=True, timeout=timedelta(seconds=0.5))
            try:
                work.wait()  # bounded by the barrier's timeout, not the group's
            except dist.DistTimeoutError:
                out["timed_out"] = True
        else:
            work = dist.all_reduce(torch.ones(3), group=group, async_op=True)
            try:
                work.wait(timeout=timedelta(seconds=0.5))
            except dist.DistTimeoutError:
                out["timed_out"] = True
        start = time.monotonic()
        dist.destroy_process_group(group)
        out["destroy_s"] = time.monotonic() - start
        try:
            work.wait()
            out["error"] = None
        except dist.DistError as err:
            out["error"] = f"{type(err).__name__}: {err}"
    dist.barrier()
    return out
