"""What each process of the resilience tests runs: ``python _resilience_workers.py SCENARIO``.

The environment gives MASTER_ADDR/MASTER_PORT (or a store URL in INIT_METHOD), RANK/WORLD_SIZE
(or PLUGDIST_JOIN=1 for a joiner), BACKEND and RESULT_DIR; each process writes
``RESULT_DIR/<name>.json`` with what it saw, and the test checks every file. Victims SIGKILL
themselves (a real kill, no exception).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from typing import Any

import plugdist as dist
import torch

TIMEOUT = timedelta(seconds=60)


def check_collectives(tag: str) -> list[str]:
    """Every collective once on the default group; the wrong results, described."""
    rank, size = dist.get_rank(), dist.get_world_size()
    bad: list[str] = []

    def expect(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if not torch.equal(got, want):
            bad.append(f"{tag} {name}: rank {rank}/{size} got {got.tolist()} want {want.tolist()}")

    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t)
    expect("all_reduce", t, torch.full((3,), float(size * (size + 1) // 2)))
    t = torch.full((2,), float(rank))
    dist.broadcast(t, src=size - 1)
    expect("broadcast", t, torch.full((2,), float(size - 1)))
    outs = [torch.zeros(2) for _ in range(size)]
    dist.all_gather(outs, torch.full((2,), float(rank)))
    expect("all_gather", torch.stack(outs), torch.arange(size).float().repeat_interleave(2)
           .reshape(size, 2))
    out = torch.zeros(2)
    dist.reduce_scatter(out, [torch.full((2,), float(rank + i)) for i in range(size)])
    expect("reduce_scatter", out, torch.full((2,), float(sum(r + rank for r in range(size)))))
    big = torch.zeros(size * 2)
    dist.all_gather_into_tensor(big, torch.full((2,), float(rank)))
    expect("all_gather_into_tensor", big, torch.arange(size).float().repeat_interleave(2))
    t = torch.full((1,), float(rank))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    expect("all_reduce MAX", t, torch.full((1,), float(size - 1)))
    a2a_in = torch.arange(size, dtype=torch.float32) + 10 * rank
    a2a_out = torch.zeros(size)
    dist.all_to_all_single(a2a_out, a2a_in)
    expect("all_to_all_single", a2a_out, torch.arange(size).float() * 10 + rank)
    if size > 1:
        nxt, prv = (rank + 1) % size, (rank - 1) % size
        got = torch.zeros(1)
        reqs = [dist.isend(torch.full((1,), float(rank)), nxt), dist.irecv(got, prv)]
        for r in reqs:
            r.wait()
        expect("send/recv", got, torch.full((1,), float(prv)))
    dist.barrier()
    return bad


def check_local_group(tag: str) -> list[str]:
    """A group of the last two ranks made by them alone (use_local_synchronization): its name
    comes from its ranks and how many such groups of them this process made, counted afresh in
    each epoch, so that a joiner's pairs with a survivor's. The wrong result, described."""
    rank, size = dist.get_rank(), dist.get_world_size()
    pair = [size - 2, size - 1]
    if rank not in pair:
        return []
    g = dist.new_group(pair, use_local_synchronization=True)
    t = torch.ones(1)
    dist.all_reduce(t, group=g)
    dist.destroy_process_group(g)
    return [] if t.item() == 2.0 else [f"{tag} local-sync group: rank {rank} got {t.item()}"]


def _store() -> Any:
    from plugdist._world.state import world

    return world.store


def _write(name: str, result: dict[str, Any]) -> None:
    path = os.path.join(os.environ["RESULT_DIR"], f"{name}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)


def _die(store: Any) -> None:
    """SIGKILL this process (or, with HANG=1, SIGSTOP it: alive but silent; with DIE_BY=raise,
    end it with an uncaught exception)."""
    store.set(f"test/killed/{os.environ['RANK']}", repr(time.time()))
    if os.environ.get("DIE_BY") == "raise":
        raise RuntimeError(f"rank {os.environ['RANK']} fails on purpose (an uncaught error)")
    os.kill(os.getpid(), signal.SIGSTOP if os.environ.get("HANG") == "1" else signal.SIGKILL)


def _until_failure(victims: set[int], kill_at: int, steps: int = 10_000) -> tuple[int, Any]:
    """Run collectives until one fails; the victims kill themselves at step ``kill_at``."""
    rank = dist.get_rank()
    for step in range(steps):
        if step == kill_at and rank in victims:
            _die(_store())
        try:
            t = torch.ones(4)
            dist.all_reduce(t)
            if step % 3 == 0:
                dist.broadcast(t, src=0)
            if step % 5 == 0:
                dist.barrier()
        except dist.DistRankFailureError as err:
            return step, err
    raise AssertionError("no rank failure seen")


def _grow_to(size: int, deadline_s: float = 60.0) -> float:
    """grow_group until the world has ``size`` ranks; seconds spent."""
    start = time.monotonic()
    while dist.get_world_size() < size:
        if time.monotonic() - start > deadline_s:
            raise AssertionError(f"world still {dist.get_world_size()} ranks after {deadline_s}s")
        dist.grow_group(timeout=TIMEOUT)
        if dist.get_world_size() < size:
            time.sleep(0.05)
    return time.monotonic() - start


def torch_view() -> dict[str, Any]:
    """torch's default group as torch reports it (an all_reduce over it included), next to
    plugdist's world; {} when torch's world is off."""
    import torch.distributed as tdist

    if not tdist.is_initialized():
        return {}
    t = torch.ones(1)
    tdist.all_reduce(t)
    return {"rank": tdist.get_rank(), "size": tdist.get_world_size(),
            "world_size": tdist.group.WORLD.size(), "sum": t.item(),
            "plugdist": [dist.get_rank(), dist.get_world_size()]}


def fr_watched() -> list[str | None]:
    """The group the flight recorder's watcher takes dump requests through, and the world's."""
    from plugdist._observability.flight_recorder import recorder

    watched = recorder.watched()
    return [watched.name if watched is not None else None, dist.group.WORLD.group_name]


def kill_shrink_grow() -> None:
    """Victims die mid-loop; survivors name them, shrink, check, admit joiners, check."""
    victims = {int(v) for v in os.environ["VICTIMS"].split(",")}
    grow_back = int(os.environ.get("GROW_TO", "0"))
    backend = os.environ["BACKEND"]
    if os.environ.get("PLUGDIST_JOIN") == "1":
        t0 = time.time()
        dist.init_process_group(backend, timeout=TIMEOUT)
        admitted = time.time()
        bad = check_collectives("joined") + check_local_group("joined")
        _write(f"joiner-{os.getpid()}", {"role": "joiner", "rank": dist.get_rank(),
                                         "size": dist.get_world_size(), "bad": bad,
                                         "init_s": admitted - t0, "torch": torch_view(),
                                         "fr_watched": fr_watched()})
        final_barrier()
        return
    # INIT_METHOD: a store URL (etcd://...) instead of env://
    dist.init_process_group(backend, init_method=os.environ.get("INIT_METHOD"), timeout=TIMEOUT)
    rank = dist.get_rank()
    bad = check_collectives("start") + check_local_group("start")
    step, err = _until_failure(victims, kill_at=3)
    seen = time.time()
    store = _store()
    killed = [float(store.get(f"test/killed/{v}")) for v in sorted(victims)]
    failed_known = dist.get_failed_ranks()
    shrink_start = time.time()
    dist.shrink_group(timeout=TIMEOUT)
    t = torch.ones(1)
    dist.all_reduce(t)
    first_op = time.time()
    bad += check_collectives("shrunk")
    result = {"role": "survivor", "old_rank": rank, "error_type": type(err).__name__,
              "error": str(err), "error_ranks": list(err.ranks), "failed_known": failed_known,
              "detect_s": seen - max(killed), "shrink_s": first_op - shrink_start,
              "rank": dist.get_rank(), "size": dist.get_world_size(), "bad": bad,
              "torch_shrunk": torch_view(), "fr_watched_shrunk": fr_watched()}
    if grow_back:
        result["grow_s"] = _grow_to(grow_back)
        result["bad"] += check_collectives("grown") + check_local_group("grown")
        result["grown_size"] = dist.get_world_size()
        result["torch_grown"] = torch_view()
        result["fr_watched_grown"] = fr_watched()
    _write(f"survivor-{rank}", result)
    final_barrier()


def destroy_at_failure() -> None:
    """The victims die mid-loop; the others destroy the world as soon as they learn of it
    (a ``finally: destroy_process_group()``), timing the destroy."""
    victims = {int(v) for v in os.environ["VICTIMS"].split(",")}
    dist.init_process_group(os.environ["BACKEND"], timeout=TIMEOUT)
    rank = dist.get_rank()
    _, err = _until_failure(victims, kill_at=3)
    started = time.time()
    dist.destroy_process_group()
    _write(f"survivor-{rank}", {"role": "survivor", "old_rank": rank,
                                "error_type": type(err).__name__,
                                "destroy_s": time.time() - started})


def final_barrier() -> None:
    dist.barrier()
    dist.destroy_process_group()


def excluded_alive() -> None:
    """Rank 1 is excluded with ranks_to_exclude=[1] while alive; it must get a clear error."""
    dist.init_process_group(os.environ["BACKEND"], timeout=TIMEOUT)
    rank = dist.get_rank()
    if rank == 1:
        time.sleep(1.0)  # the others shrink it away meanwhile
        try:
            t = torch.ones(1)
            dist.all_reduce(t)
            outcome = "no error"
        except dist.DistRankFailureError as err:
            outcome = str(err)
        _write("excluded-1", {"role": "excluded", "error": outcome})
        os._exit(0)  # not a member any more: nothing to leave cleanly
    dist.shrink_group(ranks_to_exclude=[1], timeout=TIMEOUT)
    bad = check_collectives("shrunk")
    _write(f"survivor-{rank}", {"role": "survivor", "rank": dist.get_rank(),
                                "size": dist.get_world_size(), "bad": bad})
    final_barrier()


def die_during_shrink() -> None:
    """Rank 3 dies first; rank 2 dies once it sees the failure, while the others shrink."""
    dist.init_process_group(os.environ["BACKEND"], timeout=TIMEOUT)
    rank = dist.get_rank()
    _until_failure({3}, kill_at=2)
    if rank == 2:
        time.sleep(0.3)  # the others are inside shrink_group by now
        _die(_store())
    dist.shrink_group(timeout=TIMEOUT)
    bad = check_collectives("shrunk")
    _write(f"survivor-{rank}", {"role": "survivor", "rank": dist.get_rank(),
                                "size": dist.get_world_size(), "bad": bad,
                                "failed": dist.get_failed_ranks()})
    final_barrier()


def _rank2_dies_in_the_rebuild(arm_rank2: Any) -> None:
    """Rank 3 dies; rank 2 takes part in the agreement and ``arm_rank2()`` makes it die
    (SIGKILL) somewhere in the rebuild; the others shrink to 2 and write what they saw."""
    from plugdist._world.state import world

    dist.init_process_group(os.environ["BACKEND"], timeout=TIMEOUT)
    rank = dist.get_rank()
    _until_failure({3}, kill_at=2)
    if rank == 2:
        arm_rank2()
    start = time.monotonic()
    dist.shrink_group(timeout=TIMEOUT)
    shrink_s = time.monotonic() - start
    bad = check_collectives("shrunk")
    _write(f"survivor-{rank}", {"role": "survivor", "rank": dist.get_rank(),
                                "size": dist.get_world_size(), "bad": bad, "epoch": world.epoch,
                                "shrink_s": shrink_s})
    final_barrier()


def die_after_agreeing() -> None:
    """Rank 2 dies before it builds the new group: the others must notice while building, and
    agree again without it."""
    from plugdist._lifecycle import regroup as resilience

    def arm() -> None:
        def die_on_entry(*_args: Any, **_kwargs: Any) -> None:
            _die(_store())

        resilience._enter = die_on_entry  # type: ignore[assignment]

    _rank2_dies_in_the_rebuild(arm)


def die_while_connecting() -> None:
    """Rank 2 publishes its Gloo address for the new group, then dies before the others
    connect to it: the others must leave Gloo's connect (which waits up to five times the
    group's timeout for a dead peer) and agree again, without it."""
    from plugdist.store._for_torch import PlugdistStoreForTorch

    def arm() -> None:
        publish = PlugdistStoreForTorch.set

        def publish_then_die(self: Any, key: str, value: Any) -> None:
            publish(self, key, value)
            _die(_store())

        PlugdistStoreForTorch.set = publish_then_die  # type: ignore[method-assign]

    _rank2_dies_in_the_rebuild(arm)


def torch_ddp() -> None:
    """torch's DDP over plugdist_gloo: rank 2 dies, then rank 1; each time the survivors shrink
    and keep training with the DDP built at the start, on the torch group object it holds (run
    over each new group), while torch's default group becomes a new one of the survivors; the
    parameters stay identical on every survivor."""
    import hashlib

    import torch.distributed as tdist
    from plugdist.parallel import resilient_allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    dist.init_process_group(os.environ["BACKEND"], timeout=TIMEOUT)
    rank = dist.get_rank()
    tgroup = tdist.group.WORLD
    torch.manual_seed(0)
    model = TorchDDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                         torch.nn.Linear(16, 1)), process_group=tgroup)
    model.register_comm_hook(tgroup, resilient_allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    committed = 0
    failures = 0
    returned: Any = None
    while committed < 12:
        if (committed, rank) in ((4, 2), (8, 1)):  # launch ranks (rank 0 hosts the store)
            _die(_store())
        gen = torch.Generator().manual_seed(1000 * committed + dist.get_rank())
        x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)
        opt.zero_grad()
        try:
            torch.nn.functional.mse_loss(model(x), y).backward()
        except dist.DistRankFailureError:
            failures += 1
            returned = dist.shrink_group(group=tgroup, timeout=TIMEOUT)
            continue  # the step's gradients are discarded; redo it with the survivors
        opt.step()
        committed += 1
    digest = hashlib.sha1(b"".join(p.detach().numpy().tobytes()
                                   for p in model.parameters())).hexdigest()
    _write(f"survivor-{rank}", {"role": "survivor", "rank": dist.get_rank(),
                                "size": dist.get_world_size(), "failures": failures,
                                "sha1": digest, "torch_rank": tdist.get_rank(),
                                "torch_size": tdist.get_world_size(),
                                "world_is_new": tdist.group.WORLD is not tgroup,
                                "returned_world": returned is tdist.group.WORLD})
    final_barrier()


def default_mode() -> None:
    """Worlds built one after another in the same processes, each under another
    PLUGDIST_RESILIENCE: which of them got resilient groups (a membership)."""
    from plugdist._world.state import world

    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    addr, files = os.environ["MASTER_ADDR"], os.environ["RESULT_DIR"]
    worlds = {  # name: (PLUGDIST_RESILIENCE or None for unset, init_method)
        "tcp_unset": (None, "env://"),
        "tcp_off": ("0", f"tcp://{addr}:{os.environ['SECOND_PORT']}"),
        "file_unset": (None, f"file://{files}/store_a"),
        "file_on": ("1", f"file://{files}/store_b"),
    }
    got = {}
    for name, (value, url) in worlds.items():
        os.environ.pop("PLUGDIST_RESILIENCE", None)
        if value is not None:
            os.environ["PLUGDIST_RESILIENCE"] = value
        dist.init_process_group(os.environ["BACKEND"], init_method=url, rank=rank,
                                world_size=size, timeout=TIMEOUT)
        got[name] = world.membership is not None
        dist.barrier()
        dist.destroy_process_group()
    _write(f"rank{rank}", {"resilient": got})


if __name__ == "__main__":
    {"default_mode": default_mode, "kill_shrink_grow": kill_shrink_grow,
     "excluded_alive": excluded_alive, "die_during_shrink": die_during_shrink,
     "die_after_agreeing": die_after_agreeing, "die_while_connecting": die_while_connecting,
     "torch_ddp": torch_ddp, "destroy_at_failure": destroy_at_failure}[sys.argv[1]]()
