"""Rank bodies for tests/test_nccl.py (module level, so the harness can import them by name).
They need a GPU per rank; each makes its GPU current first (``check_device``: ``LOCAL_RANK``
modulo the GPU count)."""

from __future__ import annotations

import plugdist as dist
import torch
from plugdist.testing.checks import check_device
from torch import nn


def _gpu() -> torch.device:
    device = check_device()
    assert device is not None, "the nccl backend handles CUDA tensors only"
    return device


def stream_ordering(rank: int, ws: int) -> list[str]:
    """The seed's example: an all_reduce consumed on another stream after ``wait()`` (which must
    not block the host) and that stream's ``wait_stream`` on the caller's stream; a long kernel
    queued first on the caller's stream must be ordered before the collective."""
    dev = _gpu()
    problems = []
    side = torch.cuda.Stream(dev)
    for size in (1, 1 << 20):
        big = torch.randn(2048, 2048, device=dev)
        out = torch.full((size,), float(rank + 1), device=dev)
        big = big @ big  # keeps the GPU busy so a missing dependency would show
        out.mul_(1.0)
        work = dist.all_reduce(out, async_op=True)
        work.wait()
        caller = torch.cuda.current_stream(dev)
        side.wait_stream(caller)  # outside the `with`: inside it, the current stream is `side`
        with torch.cuda.stream(side):
            out.add_(100)
        side.synchronize()
        want = ws * (ws + 1) / 2 + 100
        if not torch.all(out == want).item():
            problems.append(f"size {size}: got {out[:3].tolist()}, want {want}")
        if not work.is_completed():
            problems.append("is_completed() False after the stream synchronized")
    # the future completes (watchdog) and chains on the GPU's result
    t = torch.ones(8, device=dev)
    fut = dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0] * 2)
    got = fut.wait()
    if not torch.equal(got.cpu(), torch.full((8,), 2.0 * ws)):
        problems.append(f"future chain: got {got.tolist()}")
    return problems


def high_priority(rank: int, ws: int) -> tuple[int, float]:
    """A group built with is_high_priority_stream runs its ops on a high-priority stream."""
    from plugdist_nccl import NCCLOptions

    dev = _gpu()
    g = dist.new_group(list(range(ws)), pg_options=NCCLOptions(is_high_priority_stream=True))
    t = torch.ones(4, device=dev)
    dist.all_reduce(t, group=g)
    # a debug wrapper, if one is installed, forwards ``stream`` to the NCCL group
    return g.stream.priority, t.sum().item()


def ddp_one_rank(rank: int, ws: int) -> list[float]:
    """DDP on CUDA: gradients equal plain single-process training (world of one)."""
    from plugdist.parallel import DistributedDataParallel

    dev = _gpu()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).to(dev)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).to(dev)
    ref.load_state_dict(model.state_dict())
    ddp = DistributedDataParallel(model, device_ids=[dev.index])
    x, y = torch.randn(32, 8, device=dev), torch.randn(32, 2, device=dev)
    nn.functional.mse_loss(ddp(x), y).backward()
    nn.functional.mse_loss(ref(x), y).backward()
    return [float((a.grad - b.grad).abs().max()) for a, b in zip(model.parameters(),
                                                                  ref.parameters(), strict=True)]


def blocking_wait_timeout(rank: int, ws: int) -> str:
    """NCCL_BLOCKING_WAIT: rank 1 never joins the second all_reduce; rank 0's wait raises
    DistTimeoutError within the group timeout."""
    dev = _gpu()
    t = torch.ones(4, device=dev)
    dist.all_reduce(t)  # builds the communicator on both
    torch.cuda.synchronize()
    if rank == 1:
        import time
        time.sleep(8)
        return "slept"
    try:
        dist.all_reduce(t)
    except dist.DistTimeoutError as err:
        return f"timeout: {err}"
    return "no error"


def ddp_two_ranks(rank: int, ws: int) -> list[str]:
    """DDP on CUDA at world size 2: the paths a world of one never reaches (bucket rebuild
    agreement, find_unused_parameters' all_reduce, static_graph) run with CUDA tensors."""
    from plugdist.parallel import DistributedDataParallel

    dev = _gpu()
    problems = []

    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.unused = nn.Linear(8, 8), nn.Linear(8, 2), nn.Linear(8, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.relu(self.a(x)))

    # (flags, drop the unused layer, buckets regrouped: not with find_unused_parameters)
    for kwargs, plain, rebuilds in (({"find_unused_parameters": True}, False, False),
                                    ({"static_graph": True}, False, True), ({}, True, True)):
        torch.manual_seed(0)
        model = Branchy().to(dev)
        if plain:
            del model.unused
        ddp = DistributedDataParallel(model, device_ids=[dev.index], **kwargs)
        for step in range(3):
            torch.manual_seed(100 + step * ws + rank)
            x, y = torch.randn(16, 8, device=dev), torch.randn(16, 2, device=dev)
            ddp.zero_grad(set_to_none=True)
            nn.functional.mse_loss(ddp(x), y).backward()
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
        everyone = [torch.zeros_like(grads) for _ in range(ws)]
        dist.all_gather(everyone, grads)
        if not all(torch.equal(everyone[0], g) for g in everyone):
            problems.append(f"{kwargs}: gradients differ across ranks")
        if rebuilds and not ddp.reducer.has_rebuilt_buckets:
            problems.append(f"{kwargs}: buckets were never rebuilt")
    return problems


def p2p_eager_versus_held(rank: int, ws: int) -> list[str]:
    """Settles the held-back point-to-point question on a GPU: rank 0 isends and then blocks on
    the store until rank 1 has the data on the host. With NCCLOptions(eager_p2p=True) (torch's
    behaviour) that completes; held back (the default), the send waits for rank 0's next call on
    the group, so rank 1 must see a timeout there, not the data.

    Each pair is connected first by a blocking send/recv: NCCL connects two ranks at their first
    point-to-point call, whose group call then blocks the host until the peer posts its side, so
    on a cold pair rank 1's timed wait could not return before rank 0 flushed (seen on an H100,
    NCCL 2.28)."""
    from plugdist.world import world
    from plugdist_nccl import NCCLOptions

    dev = _gpu()
    store = world.store
    assert store is not None
    problems = []
    for eager in (True, False):
        g = dist.new_group([0, 1], pg_options=NCCLOptions(device_id=dev.index, eager_p2p=eager))
        connect = torch.ones(1, device=dev)
        if rank == 0:
            dist.send(connect, dst=1, group=g)
        else:
            dist.recv(connect, src=0, group=g)
        torch.cuda.synchronize(dev)
        key = f"p2p-test/{eager}"
        if rank == 0:
            work = dist.isend(torch.full((4,), 7.0, device=dev), dst=1, group=g)
            got = store.get(key).decode()  # rank 1's verdict, before rank 0 touches the work
            work.wait()
            want = "data" if eager else "nothing yet"
            if got != want:
                problems.append(f"eager_p2p={eager}: rank 1 saw {got!r}, expected {want!r}")
        elif rank == 1:
            t = torch.zeros(4, device=dev)
            work = dist.irecv(t, src=0, group=g)
            try:
                work.wait(timeout=5.0)  # the host waits for the data
                seen = "data" if t.sum().item() == 28.0 else f"wrong data {t.tolist()}"
            except dist.DistTimeoutError:
                seen = "nothing yet"
            store.set(key, seen)
            if seen == "nothing yet":  # the held send goes out once rank 0 waits on it
                work.wait(timeout=60.0)
                if t.sum().item() != 28.0:
                    problems.append(f"eager_p2p={eager}: the held send delivered {t.tolist()}")
        dist.barrier()
    return problems


def barrier_timeout(rank: int, ws: int) -> str:
    """Without NCCL_BLOCKING_WAIT (and with the watchdog's handling off) a barrier whose peer
    never comes raises DistTimeoutError after the group timeout and leaves the communicator
    alone."""
    dev = _gpu()
    t = torch.ones(4, device=dev)
    dist.all_reduce(t)  # builds the communicator on both
    torch.cuda.synchronize()
    if rank == 1:
        import time
        time.sleep(8)
        dist.barrier()  # the late arrival lets rank 0's stuck barrier finish
        return "slept"
    try:
        dist.barrier()
    except dist.DistTimeoutError as err:
        return f"timeout: {err}"
    return "no error"


# -- plugdist_nccl inside torch.distributed ---------------------------------------------------
def torch_over_plugdist_nccl(rank: int, ws: int, ports: list[int]) -> list[str]:
    """torch.distributed alone (no plugdist call) over plugdist_nccl, against torch's own NCCL
    in the same world: ops, torch's DDP (parameters bitwise equal), FSDP2 (equal losses); then
    the device-map forms that mix plugdist and torch backends, with cpu and cuda tensors."""
    from datetime import timedelta

    import torch.distributed as tdist
    from plugdist.testing.checks import assign_gpu
    from plugdist.torch_bridge import BridgeWork

    dev = assign_gpu(rank, ws)
    problems: list[str] = []
    tdist.init_process_group("plugdist_nccl", init_method=f"tcp://127.0.0.1:{ports[0]}",
                             rank=rank, world_size=ws, timeout=timedelta(seconds=60))
    world, ref = tdist.group.WORLD, tdist.new_group(backend="nccl")

    def ops(group: object) -> list[object]:
        t = torch.full((3,), rank + 1.0, device=dev)
        tdist.all_reduce(t, group=group)
        a = torch.empty(2 * ws, device=dev)
        tdist.all_gather_into_tensor(a, torch.full((2,), float(rank), device=dev), group=group)
        r = torch.empty(1, device=dev)
        tdist.reduce_scatter_tensor(r, torch.arange(float(ws), device=dev), group=group)
        b = torch.full((2,), float(rank), device=dev)
        tdist.broadcast(b, src=ws - 1, group=group)
        o = torch.empty(ws, device=dev)
        tdist.all_to_all_single(o, torch.arange(float(ws), device=dev) + 10 * rank, group=group)
        tdist.barrier(group=group)
        objs: list[object] = [None] * ws
        tdist.all_gather_object(objs, {"rank": rank}, group=group)
        return [t.tolist(), a.tolist(), r.tolist(), b.tolist(), o.tolist(), objs]

    ours, theirs = ops(world), ops(ref)
    if ours != theirs:
        problems.append(f"ops over plugdist_nccl {ours} != over nccl {theirs}")

    def mlp() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)).to(dev)

    def ddp(group: object) -> list[torch.Tensor]:
        model = mlp()
        wrapped = nn.parallel.DistributedDataParallel(model, device_ids=[dev.index],
                                                      process_group=group, bucket_cap_mb=0.001)
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(100 + rank)
        for _ in range(4):
            wrapped(torch.randn(5, 8, generator=gen).to(dev)).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        return [p.detach().cpu() for p in model.parameters()]

    if not all(torch.equal(a, b) for a, b in zip(ddp(world), ddp(ref), strict=True)):
        problems.append("torch DDP over plugdist_nccl ended with other parameters than over nccl")

    def fsdp(group: object) -> list[float]:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        model = mlp()
        mesh = DeviceMesh.from_group(group, "cuda")
        for layer in (model[0], model[2], model):
            fully_shard(layer, mesh=mesh)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        gen = torch.Generator().manual_seed(200 + rank)
        losses = []
        for _ in range(4):
            loss = model(torch.randn(6, 8, generator=gen).to(dev)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    if fsdp(world) != fsdp(ref):
        problems.append("FSDP2 over plugdist_nccl gave other losses than over nccl")
    tdist.destroy_process_group()

    # which backend serves each device: (cpu work is plugdist's?, cuda work is plugdist's?)
    maps = {"cpu:gloo,cuda:plugdist_nccl": (False, True),
            "cpu:plugdist_gloo,cuda:nccl": (True, False),
            "cpu:plugdist_gloo,cuda:plugdist_nccl": (True, True)}
    for port, (spec, want) in zip(ports[1:], maps.items(), strict=True):
        tdist.init_process_group(spec, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                 world_size=ws, timeout=timedelta(seconds=60))
        try:
            cpu, gpu = torch.tensor([rank + 1.0]), torch.tensor([rank + 1.0], device=dev)
            works = [tdist.all_reduce(t, async_op=True) for t in (cpu, gpu)]
            for w in works:
                w.wait()
            seen = tuple(isinstance(w, BridgeWork) for w in works)
            model = nn.parallel.DistributedDataParallel(mlp(), device_ids=[dev.index])
            model(torch.randn(2, 8, device=dev)).sum().backward()
            tdist.barrier()
            total = ws * (ws + 1) / 2
            if (cpu.item(), gpu.item(), seen) != (total, total, want):
                problems.append(f"{spec}: all_reduce gave cpu {cpu.item()}, cuda {gpu.item()} "
                                f"(want {total}); plugdist served (cpu, cuda) = {seen}, "
                                f"want {want}")
        finally:
            tdist.destroy_process_group()
    return problems
