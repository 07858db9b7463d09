"""Rank functions for tests/test_debug.py (module level, so run_world can import them).

Each returns plain data (messages, flags, log lines) that the test checks for every rank.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import plugdist as dist
import torch
from plugdist import DebugLevel, ReduceOp
from plugdist.testing.checks import run_checks

STUCK_TIMEOUT = 3.0


def _error_of(fn: Callable[[], Any]) -> dict[str, Any]:
    """What ``fn`` raised: type, message and (for mismatches) the differing fields."""
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - reported to the parent test
        return {"type": type(err).__name__, "message": str(err),
                "differences": list(getattr(err, "differences", [])),
                "is_dist_error": isinstance(err, dist.DistError)}
    return {"type": None, "message": "nothing raised", "differences": [], "is_dist_error": False}


def _wrapped(pg: Any) -> bool:
    from plugdist_debug import DebugBackend

    return all(isinstance(b, DebugBackend) for b in pg.backends.values())


# -- mismatches and stuck ranks (3 ranks, rank 1 is the odd one) ----------------------------------
def mismatches_and_stuck(rank: int, ws: int, analysis_dir: str) -> dict[str, Any]:
    if ws != 3:
        raise ValueError("mismatches_and_stuck needs 3 ranks")
    odd = rank == 1
    out: dict[str, Any] = {"wrapped": _wrapped(dist.group.WORLD)}
    ten = torch.ones(10)
    out["op"] = _error_of(lambda: dist.reduce(ten, dst=0) if odd else dist.all_reduce(ten))
    out["op_left_tensor_alone"] = bool(torch.equal(ten, torch.ones(10)))
    out["shape"] = _error_of(lambda: dist.all_reduce(torch.ones(20 if odd else 10)))
    out["dtype"] = _error_of(lambda: dist.all_reduce(
        torch.ones(10, dtype=torch.int64 if odd else torch.float32)))
    out["reduce_op"] = _error_of(lambda: dist.all_reduce(
        torch.ones(10), op=ReduceOp.MAX if odd else ReduceOp.SUM))
    out["root"] = _error_of(lambda: dist.broadcast(torch.ones(10), src=1 if odd else 0))
    out["async"] = _error_of(lambda: dist.all_gather(
        [torch.zeros(4 if odd else 2) for _ in range(ws)], torch.ones(4 if odd else 2),
        async_op=True))
    # rank 1 sends 2 rows to rank 0 and none to itself; everyone expects one row from each peer
    splits = [2, 0, 1] if odd else [1, 1, 1]
    out["splits"] = _error_of(lambda: dist.all_to_all_single(torch.zeros(3), torch.ones(3),
                                                             [1, 1, 1], splits))

    # the group is still in step: real collectives, object collectives and p2p all work
    t = torch.full((2,), float(rank))
    dist.all_reduce(t)
    objs: list[Any] = [None] * ws
    dist.all_gather_object(objs, {"r": rank})
    got = torch.zeros(1)
    works = [dist.isend(torch.tensor([float(rank)]), dst=(rank + 1) % ws),
             dist.irecv(got, src=(rank - 1) % ws)]
    for w in works:
        if w is not None:
            w.wait()
    dist.monitored_barrier(timeout=timedelta(seconds=30))
    # a send on another thread is not held up by a collective waiting in its check for the
    # very rank that needs the send first
    if rank == 0:
        def send_later() -> None:
            time.sleep(0.5)
            dist.send(torch.ones(1), 1)

        sender = threading.Thread(target=send_later)
        sender.start()
        dist.all_reduce(t)
        sender.join()
    else:
        if rank == 1:
            dist.recv(torch.zeros(1), src=0)
        dist.all_reduce(t)
    out["after"] = {"sum": t.tolist(), "objects": objs, "ring": got.item()}

    # a stuck rank: rank 1 never calls the second all_reduce on a group with a short timeout
    sub = dist.new_group(list(range(ws)), timeout=timedelta(seconds=STUCK_TIMEOUT))
    dist.all_reduce(torch.ones(1), group=sub)
    if not odd:
        start = time.monotonic()
        out["stuck"] = _error_of(lambda: dist.all_reduce(torch.ones(1), group=sub))
        out["stuck_after_s"] = time.monotonic() - start
    dist.barrier()
    out["signal_dump"] = _dump_by_signal() if odd else None
    from plugdist_debug import dump_flight_recorder

    dump_flight_recorder("planted divergence", directory=analysis_dir)
    dist.barrier()
    if odd:  # arriving after the others gave up: told at once, no hang
        start = time.monotonic()
        out["late"] = _error_of(lambda: dist.all_reduce(torch.ones(1), group=sub))
        out["late_after_s"] = time.monotonic() - start
    dist.barrier()
    return out


def _dump_by_signal() -> str | None:
    """Send SIGUSR2 to this process and return the reason in the dump it wrote (None when the
    plugin could not install its handler here, e.g. someone else handles the signal)."""
    handler = signal.getsignal(signal.SIGUSR2)
    if getattr(handler, "__name__", "") != "on_signal":
        return None
    path = Path(os.environ["PLUGDIST_FLIGHT_RECORDER_DIR"]) / f"rank_{dist.get_rank()}.json"
    before = path.stat().st_mtime_ns if path.exists() else 0
    os.kill(os.getpid(), signal.SIGUSR2)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if path.exists() and path.stat().st_mtime_ns != before:
            return str(json.loads(path.read_text())["reason"])
        time.sleep(0.01)
    return "no dump appeared"


# -- the conformance checks with every group wrapped -----------------------------------------------
def conformance_under_detail(rank: int, ws: int) -> dict[str, Any]:
    from plugdist_debug import recorders

    world = dist.group.WORLD
    if world is None:
        raise RuntimeError("conformance_under_detail runs inside an initialized world")
    wrapped = _wrapped(world)
    results = run_checks(rank, ws)
    rec = recorders.get(world.group_name)
    return {"wrapped": wrapped, "results": results,
            "checked": rec.collectives_issued if rec is not None else 0}


# -- levels at runtime, and DDP logging -----------------------------------------------------------
class _Net(torch.nn.Module):
    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 8)
        self.fc2 = torch.nn.Linear(8, 2)
        self.dead = torch.nn.Linear(8, 2) if unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _train(model: torch.nn.Module, steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(3, 4)).sum().backward()


class _CaptureStderr:
    """Everything written to file descriptor 2 (where plugdist's structlog events go)."""

    def __enter__(self) -> _CaptureStderr:
        sys.stderr.flush()
        self._file = tempfile.TemporaryFile(mode="w+b")
        self._saved = os.dup(2)
        os.dup2(self._file.fileno(), 2)
        return self

    def __exit__(self, *exc: Any) -> None:
        sys.stderr.flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)
        self._file.seek(0)
        self.lines = self._file.read().decode(errors="replace").splitlines()
        self._file.close()


def levels_and_ddp(rank: int, ws: int) -> dict[str, Any]:
    from plugdist.parallel import DistributedDataParallel as DDP

    out: dict[str, Any] = {"start_level": dist.get_debug_level().name,
                           "world_wrapped": _wrapped(dist.group.WORLD)}
    torch.manual_seed(0)
    with _CaptureStderr() as cap:
        dist.set_debug_level("INFO")
        info_model = DDP(_Net(), bucket_cap_mb=1)
        _train(info_model, 3)
        unused = DDP(_Net(unused=True))
        _train(unused, 1)
        out["unused_error"] = _error_of(lambda: _train(unused, 1))

        dist.set_debug_level(DebugLevel.DETAIL)
        g = dist.new_group()
        out["detail_group_wrapped"] = _wrapped(g)
        detail_model = DDP(_Net(), process_group=g)
        _train(detail_model, 4)
        out["detail_mismatch"] = _error_of(
            lambda: dist.all_reduce(torch.ones(3 + rank), group=g))

        dist.set_debug_level(DebugLevel.OFF)
        g_off = dist.new_group()
        out["off_group_wrapped"] = _wrapped(g_off)
        t = torch.ones(2)
        dist.all_reduce(t, group=g_off)
        out["off_sum"] = t.tolist()
    out["log_lines"] = cap.lines

    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    os.environ["PLUGDIST_DEBUG"] = "INFO"
    dist.set_debug_level_from_env()
    out["from_env"] = dist.get_debug_level().name
    del os.environ["PLUGDIST_DEBUG"]
    dist.set_debug_level_from_env()
    out["from_torch_env"] = dist.get_debug_level().name
    dist.set_debug_level("OFF")
    return out


# -- a report reaches every rank even when the store's rank leaves at once -------------------------
def mismatch_then_exit(rank: int, ws: int, out_dir: str) -> None:
    """Rank 0 (whose process serves the store) all-reduces while rank 1 reduces; each rank
    writes what it raised to ``out_dir`` and exits at once, the way a crashing job would."""
    t = torch.ones(8)
    outcome = _error_of(lambda: dist.reduce(t, dst=0) if rank == 1 else dist.all_reduce(t))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(outcome))
    sys.stdout.flush()
    os._exit(0)


def numbering_matches_flight_recorder(rank: int, ws: int) -> dict[str, Any]:
    """One good all_reduce, then a mismatch (rank 1 reduces): the DETAIL error's number and the
    core flight recorder's collective_seq_id (torch's dump) and the debug recorder's seq."""
    from plugdist._observability.flight_recorder import recorder

    dist.all_reduce(torch.ones(4))
    odd = rank == 1
    err = _error_of(lambda: dist.reduce(torch.ones(4), dst=0) if odd
                    else dist.all_reduce(torch.ones(4)))
    core = [(e["collective_seq_id"], e["profiling_name"].split(":", 1)[1], e["state"])
            for e in recorder.snapshot()["entries"]
            if e["process_group"][0] == "0" and not e["is_p2p"]]
    debug = [(e["seq"], e["op"], e["state"])
             for e in dist.group.WORLD.backend_for("cpu").recorder.snapshot()["entries"]
             if e["seq"] is not None]
    dist.barrier()
    return {"error": err, "core": core, "debug": debug}
