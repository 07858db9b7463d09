"""Rank functions for tests/test_observe.py (module level, so run_world can import them).

Each returns plain data (event names and shapes, dump paths, flags) that the test checks for every
rank.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from typing import Any

import plugdist as dist
import torch
from plugdist import ReduceOp

PREFIX = "plugdist:"


def _events(prof: Any) -> list[tuple[str, list[Any], list[Any]]]:
    return [(e.name, [list(s) for s in e.input_shapes], list(e.input_dtypes))
            for e in prof.events() if e.name.startswith(PREFIX)]


def _every_op(rank: int, ws: int) -> list[str]:
    """Every public op once through the frontend (sync), plus async ones; returns the op names
    issued, in order."""
    issued: list[str] = []

    def did(op: str) -> None:
        issued.append(op)

    t = torch.ones(4, 2)
    dist.all_reduce(t)
    did("all_reduce")
    dist.all_reduce(t, op=ReduceOp.AVG)
    did("all_reduce")
    dist.broadcast(t, src=0)
    did("broadcast")
    dist.reduce(t, dst=0)
    did("reduce")
    dist.all_gather([torch.empty(4, 2) for _ in range(ws)], t)
    did("all_gather")
    dist.all_gather_into_tensor(torch.empty(4 * ws, 2), t)
    did("all_gather_into_tensor")
    dist.gather(t, [torch.empty(4, 2) for _ in range(ws)] if rank == 0 else None, dst=0)
    did("gather")
    dist.scatter(t, [torch.ones(4, 2) for _ in range(ws)] if rank == 0 else None, src=0)
    did("scatter")
    dist.reduce_scatter(torch.empty(4, 2), [torch.ones(4, 2) for _ in range(ws)])
    did("reduce_scatter")
    dist.reduce_scatter_tensor(torch.empty(4, 2), torch.ones(4 * ws, 2))
    did("reduce_scatter_tensor")
    dist.all_to_all([torch.empty(3) for _ in range(ws)], [torch.ones(3) for _ in range(ws)])
    did("all_to_all")
    dist.all_to_all_single(torch.empty(2 * ws, 2), torch.ones(2 * ws, 2))
    did("all_to_all_single")
    dist.barrier()
    did("barrier")
    if rank == 0:
        dist.send(torch.ones(5), dst=1)
        did("send")
    elif rank == 1:
        dist.recv(torch.empty(5), src=0)
        did("recv")
    if rank == 1:
        time.sleep(0.3)  # rank 0's async all_reduce waits for it: its event must span that
    work = dist.all_reduce(torch.ones(6), async_op=True)
    assert work is not None
    work.wait()
    did("all_reduce")
    return issued


def profiled_ops(rank: int, ws: int) -> dict[str, Any]:
    """Every op under torch.profiler: the plugdist events seen, and what was issued."""
    with torch.profiler.profile(record_shapes=True) as prof:
        issued = _every_op(rank, ws)
    bridged: list[tuple[str, list[Any], list[Any]]] = []
    import torch.distributed as tdist

    if tdist.is_initialized():
        with torch.profiler.profile(record_shapes=True) as prof2:
            x = torch.ones(3, 5)
            tdist.all_reduce(x)
            tdist.broadcast(x, src=0)
            tdist.all_reduce(x, async_op=True).wait()
        bridged = _events(prof2)
    last = [e for e in prof.events() if e.name.startswith(PREFIX)][-1]
    return {"events": _events(prof), "issued": issued, "bridged": bridged,
            "late_span_us": last.time_range.elapsed_us()}


# -- flight recorder ----------------------------------------------------------------------------
def _device() -> str:
    """Where this world's tensors live: a GPU of its own under nccl, else the CPU."""
    if dist.get_backend() == "nccl":
        torch.cuda.set_device(dist.get_rank())
        return "cuda"
    return "cpu"


def _warm(n: int, group: Any = None) -> None:
    t = torch.ones(16, device=_device())
    for _ in range(n):
        dist.all_reduce(t, group=group)


def hang(rank: int, ws: int, culprit: int, wait_s: float, timeout_s: float) -> dict[str, Any]:
    """On a group of every rank (timeout ``timeout_s``), every rank runs 3 all_reduces and a
    broadcast; then all but ``culprit`` run one more all_reduce, which hangs until the group's
    timeout; ``culprit`` waits until its peers asked it to dump. Returns the error each rank saw
    and whether its dump file exists."""
    group = dist.new_group(timeout=timedelta(seconds=timeout_s))
    device = _device()
    _warm(3, group)
    dist.broadcast(torch.ones(4, device=device), src=0, group=group)
    err = None
    if rank != culprit:
        try:
            dist.all_reduce(torch.ones(16, device=device), group=group)
        except dist.DistError as e:
            err = type(e).__name__
    path = _dump_file(rank)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not os.path.exists(path):
        time.sleep(0.1)
    return {"error": err, "dumped": os.path.exists(path)}


def mismatch(rank: int, ws: int, culprit: int, wait_s: float) -> dict[str, Any]:
    """Every rank runs 3 all_reduces, then one whose size differs on ``culprit``. An error (the
    DETAIL check's) dumps by itself; MPI runs the op regardless: then dump on request."""
    _warm(3)
    err = None
    try:
        dist.all_reduce(torch.ones(32 if rank == culprit else 16))
    except dist.DistError as e:
        err = type(e).__name__
    if err is None:
        dist.barrier()
        dist.dump_flight_recorder()
    path = _dump_file(rank)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not os.path.exists(path):
        time.sleep(0.1)
    return {"error": err, "dumped": os.path.exists(path)}


def clean(rank: int, ws: int) -> dict[str, Any]:
    """A healthy run, dumped on a signal, then on request at the end."""
    path = _dump_file(rank)
    os.kill(os.getpid(), signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not os.path.exists(path):
        time.sleep(0.05)
    signal_dump = os.path.exists(path)
    os.remove(path)
    _warm(4)
    dist.broadcast(torch.ones(4), src=0)
    dist.barrier()
    written = dist.dump_flight_recorder()
    return {"path": None if written is None else str(written), "signal_dump": signal_dump}


def _dump_file(rank: int) -> str:
    return f"{os.environ['TORCH_FR_DUMP_TEMP_FILE']}{rank}"
