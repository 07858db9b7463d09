"""What each rank of the MPI-with-ULFM tests runs, under Open MPI's
``mpiexec --with-ft ulfm -n N python _ulfm_workers.py SCENARIO`` (tests/test_ulfm.py).

The environment gives RESULT_DIR (each survivor writes ``RESULT_DIR/survivor-<rank>.json``
with what it saw), VICTIMS (the ranks that SIGKILL themselves, e.g. "2" or "1,4") and
PLUGDIST_RESILIENCE.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta
from typing import Any

import plugdist as dist
import torch
from _resilience_workers import _store, _write, check_collectives

TIMEOUT = timedelta(seconds=60)


def _victims() -> list[int]:
    return [int(v) for v in os.environ["VICTIMS"].split(",")]


def _loop_until_failure(victims: list[int], kill_at: int) -> tuple[int, BaseException, float]:
    """Mixed collectives until one fails; the ``victims`` SIGKILL themselves at step
    ``kill_at``. Returns (step, the error, when it was raised)."""
    rank = dist.get_rank()
    for step in range(100_000):
        if step == kill_at and rank in victims:
            _store().set(f"test/killed/{rank}", repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            t = torch.ones(4)
            dist.all_reduce(t)
            if step % 3 == 0:
                dist.broadcast(t, src=0)
            if step % 4 == 1:
                outs = [torch.zeros(4) for _ in range(dist.get_world_size())]
                dist.all_gather(outs, t)
            if step % 5 == 0:
                dist.barrier()
            if step % 7 == 2:
                work = dist.all_reduce(torch.ones(2), async_op=True)
                assert work is not None
                work.wait()
        except dist.DistError as err:
            return step, err, time.time()
    raise AssertionError("no failure seen")


def _seen(rank: int, err: BaseException) -> dict[str, Any]:
    """What every survivor reports of the error the failure gave it."""
    return {"role": "survivor", "old_rank": rank, "error_type": type(err).__name__,
            "error": str(err), "error_ranks": list(getattr(err, "ranks", ()))}


def kill_shrink() -> None:
    """The victim dies mid-loop; every survivor names it, shrinks, checks every collective on
    the survivors' group, and sees grow_group refused with its reason."""
    victims = _victims()
    dist.init_process_group("mpi", timeout=TIMEOUT)
    rank = dist.get_rank()
    bad = check_collectives("start")
    step, err, seen = _loop_until_failure(victims, kill_at=int(os.environ.get("KILL_AT", "20")))
    killed = max(float(_store().get(f"test/killed/{v}")) for v in victims)
    failed_known = dist.get_failed_ranks()
    shrink_start = time.time()
    dist.shrink_group(timeout=TIMEOUT)
    t = torch.ones(1)
    dist.all_reduce(t)
    first_op = time.time()
    same_sum = t.item() == dist.get_world_size()
    bad += check_collectives("shrunk")
    # a sub-group of the new world is made from the survivors' MPI world
    sub = dist.new_group([0, dist.get_world_size() - 1])
    if dist.get_rank() in (0, dist.get_world_size() - 1):
        s = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(s, group=sub)
        if s.item() != float(dist.get_world_size() - 1):
            bad.append(f"sub-group all_reduce gave {s.item()}")
    try:
        dist.grow_group(timeout=TIMEOUT)
        grow = "no error"
    except dist.DistError as refusal:
        grow = str(refusal)
    _write(f"survivor-{rank}", {
        **_seen(rank, err), "step": step, "failed_known": failed_known, "detect_s": seen - killed,
        "shrink_s": first_op - shrink_start, "first_sum_ok": same_sum, "rank": dist.get_rank(),
        "size": dist.get_world_size(), "bad": bad, "grow": grow})
    dist.barrier()
    dist.destroy_process_group()


def die_after_agreeing() -> None:
    """Rank 3 dies mid-loop; rank 2 takes part in the survivors' agreement, then dies before
    the new group is built: MPI's shrink finds fewer survivors than agreed, and the others
    agree again without it."""
    from plugdist._lifecycle import regroup as resilience
    from plugdist._world.state import world

    dist.init_process_group("mpi", timeout=TIMEOUT)
    rank = dist.get_rank()
    _loop_until_failure([3], kill_at=10)
    if rank == 2:
        def die_on_entry(*_args: Any, **_kwargs: Any) -> None:
            _store().set("test/killed/2", repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)

        resilience._enter = die_on_entry  # type: ignore[assignment]
    dist.shrink_group(timeout=TIMEOUT)
    bad = check_collectives("shrunk")
    _write(f"survivor-{rank}", {"role": "survivor", "old_rank": rank, "rank": dist.get_rank(),
                                "size": dist.get_world_size(), "bad": bad,
                                "epoch": world.epoch})
    dist.barrier()
    dist.destroy_process_group()


def mpi_only() -> None:
    """Resilient groups off: the error the survivors get comes from MPI (ULFM) alone."""
    dist.init_process_group("mpi", timeout=TIMEOUT)
    rank = dist.get_rank()
    step, err, seen = _loop_until_failure(_victims(), kill_at=10)
    try:
        dist.shrink_group(timeout=TIMEOUT)
        shrink = "no error"
    except dist.DistError as refusal:
        shrink = str(refusal)
    _write(f"survivor-{rank}", {**_seen(rank, err), "shrink": shrink})
    dist.destroy_process_group()


def refusals() -> None:
    """No failure: what shrink_group and grow_group say on this MPI."""
    dist.init_process_group("mpi", timeout=TIMEOUT)
    out = {}
    for name, call in (("shrink", lambda: dist.shrink_group(ranks_to_exclude=[1])),
                       ("grow", lambda: dist.grow_group())):
        try:
            call()
            out[name] = "no error"
        except dist.DistError as err:
            out[name] = str(err)
    _write(f"rank-{dist.get_rank()}", {"role": "refused", **out})
    dist.destroy_process_group()


if __name__ == "__main__":
    {"kill_shrink": kill_shrink, "mpi_only": mpi_only, "refusals": refusals,
     "die_after_agreeing": die_after_agreeing}[sys.argv[1]]()
