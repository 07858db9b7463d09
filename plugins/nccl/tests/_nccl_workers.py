"""Rank bodies for tests/test_nccl.py (module level, so the harness can import them by name).
They need a GPU per rank; each makes its GPU current first (``check_device``: ``LOCAL_RANK``
modulo the GPU count)."""

from __future__ import annotations

import functools
import time
from typing import Any

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
    from plugdist._world.state import world
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
    from plugdist._torch.bridge import BridgeWork
    from plugdist.testing.checks import assign_gpu

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


# -- CUDA graphs -------------------------------------------------------------------------------
def _capture_cases(rank: int, ws: int, dev: torch.device) -> tuple[Any, Any, Any]:
    """Every op torch's NCCL lets you capture, on plugdist's group and through torch over it:
    ``fill(k)`` sets the inputs for trial k, ``issue()`` runs the ops (eagerly or inside a
    capture), ``check(k)`` lists wrong outputs. Every value is linear in k, so a replay after
    fill(k) must give k times the k=1 results."""
    import torch.distributed as tdist

    full = functools.partial(torch.full, device=dev)
    t: dict[str, Any] = {
        "ar": full((4,), 0.0), "ar_async": full((4,), 0.0), "avg": full((4,), 0.0),
        "max": full((4,), 0.0), "bc": full((3,), 0.0), "red": full((3,), 0.0),
        "agt_in": full((2,), 0.0), "agt": full((2 * ws,), -1.0),
        "ag_in": full((2,), 0.0), "ag": [full((2,), -1.0) for _ in range(ws)],
        "rst_in": full((2 * ws,), 0.0), "rst": full((2,), -1.0),
        "rs_in": [full((2,), 0.0) for _ in range(ws)], "rs": full((2,), -1.0),
        "a2a_in": full((ws,), 0.0), "a2a": full((ws,), -1.0),
        "a2al_in": [full((1,), 0.0) for _ in range(ws)], "a2al": [full((1,), -1.0)
                                                                  for _ in range(ws)],
        "g_in": full((2,), 0.0), "g": [full((2,), -1.0) for _ in range(ws)] if rank == 0 else None,
        "s": full((2,), -1.0), "s_in": [full((2,), 0.0) for _ in range(ws)] if rank == 0 else None,
        "p2p_out": full((2,), 0.0), "p2p_in": full((2,), -1.0),
        "torch_ar": full((4,), 0.0), "torch_async": full((4,), 0.0), "torch_agt": full((ws,), -1.0),
    }

    def fill(k: float) -> None:
        v = float(rank + 1) * k
        for name in ("ar", "ar_async", "avg", "max", "bc", "red", "agt_in", "ag_in", "torch_ar",
                     "torch_async", "p2p_out"):
            t[name].fill_(v)
        for i in range(ws):
            t["rst_in"][2 * i:2 * i + 2].fill_(v + 10 * i * k)
            t["rs_in"][i].fill_(v + 10 * i * k)
            t["a2a_in"][i] = (100 * rank + i) * k
            t["a2al_in"][i].fill_((100 * rank + i) * k)
            if t["s_in"] is not None:
                t["s_in"][i].fill_((7 * i + 1) * k)
        t["g_in"].fill_(v)

    def issue() -> None:
        dist.all_reduce(t["ar"])
        dist.all_reduce(t["ar_async"], async_op=True).wait()
        dist.all_reduce(t["avg"], op=dist.ReduceOp.AVG)
        dist.all_reduce(t["max"], op=dist.ReduceOp.MAX)
        dist.broadcast(t["bc"], src=ws - 1)
        dist.reduce(t["red"], dst=0)
        dist.all_gather_into_tensor(t["agt"], t["agt_in"])
        dist.all_gather(t["ag"], t["ag_in"])
        dist.reduce_scatter_tensor(t["rst"], t["rst_in"])
        dist.reduce_scatter(t["rs"], t["rs_in"])
        dist.all_to_all_single(t["a2a"], t["a2a_in"])
        dist.all_to_all(t["a2al"], t["a2al_in"])
        dist.gather(t["g_in"], t["g"], dst=0)
        dist.scatter(t["s"], t["s_in"], src=0)
        if ws > 1:
            works = [dist.isend(t["p2p_out"], dst=(rank + 1) % ws),
                     dist.irecv(t["p2p_in"], src=(rank - 1) % ws)]
            for w in works:
                w.wait()
        tdist.all_reduce(t["torch_ar"])  # torch over plugdist_nccl: its synchronous path
        tdist.all_reduce(t["torch_async"], async_op=True).wait()
        tdist.all_gather_into_tensor(t["torch_agt"], t["torch_ar"][:1].contiguous())

    def check(k: float) -> list[str]:
        total = ws * (ws + 1) / 2 * k
        want: dict[str, Any] = {
            "ar": [total] * 4, "ar_async": [total] * 4, "avg": [total / ws] * 4,
            "max": [ws * k] * 4, "bc": [ws * k] * 3,
            "red": [total if rank == 0 else (rank + 1) * k] * 3,
            "agt": [(r + 1) * k for r in range(ws) for _ in range(2)],
            "ag": [[(r + 1) * k] * 2 for r in range(ws)],
            "rst": [total + ws * 10 * rank * k] * 2, "rs": [total + ws * 10 * rank * k] * 2,
            "a2a": [(100 * r + rank) * k for r in range(ws)],
            "a2al": [[(100 * r + rank) * k] for r in range(ws)],
            "g": [[(r + 1) * k] * 2 for r in range(ws)] if rank == 0 else None,
            "s": [(7 * rank + 1) * k] * 2,
            "torch_ar": [total] * 4, "torch_async": [total] * 4, "torch_agt": [total] * ws,
        }
        if ws > 1:
            want["p2p_in"] = [((rank - 1) % ws + 1) * k] * 2
        bad = []
        for name, expected in want.items():
            got = t[name]
            got = [x.tolist() for x in got] if isinstance(got, list) else \
                None if got is None else got.tolist()
            if got != expected:
                bad.append(f"{name}: got {got}, want {expected}")
        return bad

    return fill, issue, check


def graph_capture(rank: int, ws: int) -> list[str]:
    """Every capturable op captured in one CUDA graph (torch's default, global capture mode)
    on plugdist's group and through torch over it, then replayed twice with new inputs; the
    results must equal the eager ones. While the graph is captured, another thread keeps eager
    ops of a second group in flight, so that group's watchdog queries events throughout the
    capture (it must not disturb it). A captured Work refuses is_completed() clearly, a barrier
    refuses to be captured, and the group works eagerly afterwards."""
    import threading

    dev = _gpu()
    problems: list[str] = []
    fill, issue, check = _capture_cases(rank, ws, dev)
    fill(1.0)
    issue()  # eagerly first: the communicator, p2p connections, torch's lazy state
    torch.cuda.synchronize(dev)
    problems += [f"eager: {p}" for p in check(1.0)]

    other = dist.new_group(list(range(ws)))
    busy = torch.ones(1 << 20, device=dev)
    dist.all_reduce(busy, group=other)
    torch.cuda.synchronize(dev)
    capturing, captured = threading.Event(), threading.Event()
    eager_errors: list[str] = []
    side = torch.cuda.Stream(dev)  # not the legacy default stream, which a capture forbids

    def eager_traffic() -> None:
        torch.cuda.set_device(dev)
        try:
            with torch.cuda.stream(side):
                capturing.wait(60)
                for _ in range(20):
                    dist.all_reduce(busy, group=other, async_op=True).wait()
                captured.wait(60)
            side.synchronize()
        except Exception as exc:  # noqa: BLE001 - reported as a problem
            eager_errors.append(f"{type(exc).__name__}: {exc}")

    traffic = threading.Thread(target=eager_traffic)
    traffic.start()
    graph = torch.cuda.CUDAGraph()
    refusals = []
    try:
        with torch.cuda.graph(graph):
            capturing.set()
            issue()
            work = dist.all_reduce(torch.ones(1, device=dev), async_op=True)
            try:
                work.is_completed()
                refusals.append("is_completed() of a captured op answered")
            except dist.DistBackendError as err:
                if "captured in a CUDA graph" not in str(err):
                    refusals.append(f"is_completed(): {err}")
            work.wait()
            time.sleep(0.3)  # the other thread's ops stay in flight, watched, meanwhile
    finally:
        captured.set()
        traffic.join(120)
    problems += refusals + [f"eager ops on another thread: {e}" for e in eager_errors]
    if busy[0].item() != float(ws ** 21):
        problems.append(f"the other group's eager ops gave {busy[0].item()}, want {ws ** 21}")
    for k in (2.0, 3.0):
        fill(k)
        graph.replay()
        torch.cuda.synchronize(dev)
        problems += [f"replay k={k}: {p}" for p in check(k)]

    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            dist.barrier()
        problems.append("a barrier was captured without an error")
    except dist.DistBackendError as err:
        if "barrier cannot be captured in a CUDA graph" not in str(err):
            problems.append(f"barrier in a capture: {err}")
    fill(5.0)
    issue()
    torch.cuda.synchronize(dev)
    problems += [f"eager after the captures: {p}" for p in check(5.0)]
    return problems


def graph_training_step(rank: int, ws: int, through: str) -> list[str]:
    """A training step (forward, backward, all_reduce of every gradient, SGD with momentum)
    captured in a CUDA graph as torch's docs capture a whole network, replayed for 5 steps,
    against the same steps run eagerly on an identical model: parameters equal after every
    step. ``through``: "plugdist" (plugdist.all_reduce) or "bridge" (torch.distributed over
    plugdist_nccl)."""
    import torch.distributed as tdist

    dev = _gpu()
    all_reduce = dist.all_reduce if through == "plugdist" else tdist.all_reduce

    def model_and_optimizer() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4)).to(dev)
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
             y: torch.Tensor) -> torch.Tensor:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        for p in model.parameters():
            all_reduce(p.grad)
            p.grad.div_(ws)
        opt.step()
        return loss.detach()

    gen = torch.Generator().manual_seed(1000 + rank)
    batches = [(torch.randn(8, 16, generator=gen).to(dev), torch.randn(8, 4, generator=gen).to(dev))
               for _ in range(8)]
    eager_model, eager_opt = model_and_optimizer()
    graph_model, graph_opt = model_and_optimizer()
    static_x, static_y = batches[0][0].clone(), batches[0][1].clone()
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):  # warm-up, as torch's docs do it: 3 steps on a side stream
        for x, y in batches[:3]:
            for model, opt in ((eager_model, eager_opt), (graph_model, graph_opt)):
                opt.zero_grad(set_to_none=True)
                static_x.copy_(x)
                static_y.copy_(y)
                step(model, opt, static_x, static_y)
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    graph_opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = step(graph_model, graph_opt, static_x, static_y)
    problems = []
    for i, (x, y) in enumerate(batches[3:]):
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
        eager_opt.zero_grad(set_to_none=True)
        eager_loss = step(eager_model, eager_opt, x, y)
        torch.cuda.synchronize(dev)
        diff = max((a - b).abs().max().item() for a, b in
                   zip(graph_model.parameters(), eager_model.parameters(), strict=True))
        if diff > 1e-6 or abs(static_loss.item() - eager_loss.item()) > 1e-6:
            problems.append(f"{through} step {i}: parameters differ by {diff}, loss "
                            f"{static_loss.item()} (graph) vs {eager_loss.item()} (eager)")
    params = torch.cat([p.detach().reshape(-1) for p in graph_model.parameters()])
    everyone = [torch.zeros_like(params) for _ in range(ws)]
    dist.all_gather(everyone, params)
    if not all(torch.equal(everyone[0], p) for p in everyone):
        problems.append(f"{through}: parameters differ across ranks after the replays")
    return problems


def graph_replay_hang(rank: int, ws: int) -> str:
    """Both ranks capture an all_reduce and replay it once together; then rank 0 replays it
    again while rank 1 never does. Rank 0's watchdog must name the stuck replay after the group
    timeout and end the process (NCCL_ASYNC_ERROR_HANDLING's default)."""
    dev = _gpu()
    t = torch.ones(4, device=dev)
    dist.all_reduce(t)
    torch.cuda.synchronize(dev)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dist.all_reduce(t)
    graph.replay()
    torch.cuda.synchronize(dev)
    if rank == 1:
        time.sleep(25)
        return "slept"
    graph.replay()  # rank 1 never joins this one
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.1)  # the watchdog ends this process
    return "the stuck replay was not named"


def sync_ops_on_caller_stream(rank: int, ws: int) -> list[str]:
    """Synchronous ops (the lean route) run on the caller's current stream: queued after a long
    kernel there, seen by the next kernel there, with the host never blocked; each lean op."""
    dev = _gpu()
    problems = []
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    big = torch.randn(4096, 4096, device=dev)
    with torch.cuda.stream(side):
        t = torch.zeros(1 << 16, device=dev)
        for _ in range(4):
            big = big @ big / 4096  # keeps the stream busy: a missing dependency would show
        t.add_(rank + 1)
        dist.all_reduce(t)
        t.add_(100)
        out = torch.empty(ws * 4, device=dev)
        dist.all_gather_into_tensor(out, torch.full((4,), float(rank), device=dev))
        rs = torch.empty(2, device=dev)
        dist.reduce_scatter_tensor(rs, torch.ones(2 * ws, device=dev))
        b = torch.full((3,), float(rank), device=dev)
        dist.broadcast(b, src=ws - 1)
        r = torch.full((3,), 1.0, device=dev)
        dist.reduce(r, dst=0)
        a2a = torch.empty(ws, device=dev)
        dist.all_to_all_single(a2a, torch.arange(float(ws), device=dev) + 10 * rank)
    side.synchronize()
    want = ws * (ws + 1) / 2 + 100
    if not torch.all(t == want).item():
        problems.append(f"all_reduce on the caller's stream: {t[:3].tolist()}, want {want}")
    checks = {"all_gather_into_tensor": (out.tolist(), [float(r) for r in range(ws)
                                                        for _ in range(4)]),
              "reduce_scatter_tensor": (rs.tolist(), [float(ws)] * 2),
              "broadcast": (b.tolist(), [float(ws - 1)] * 3),
              "reduce": (r.tolist(), [float(ws) if rank == 0 else 1.0] * 3),
              "all_to_all_single": (a2a.tolist(), [10.0 * s + rank for s in range(ws)])}
    problems += [f"{op}: {got}, want {expected}" for op, (got, expected) in checks.items()
                 if got != expected]
    return problems


def sync_op_timeout(rank: int, ws: int) -> str:
    """A synchronous all_reduce (no Work: the lean route) whose peer never comes is still
    bounded: the watchdog times it out (NCCL_ASYNC_ERROR_HANDLING=2: abort, the process lives),
    and the group's next op raises naming it."""
    dev = _gpu()
    t = torch.ones(4, device=dev)
    dist.all_reduce(t)
    torch.cuda.synchronize(dev)
    if rank == 1:
        time.sleep(10)
        return "slept"
    dist.all_reduce(t)  # returns at once: queued, never completed by rank 1
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            dist.all_reduce(torch.ones(1, device=dev))
        except dist.DistBackendError as err:
            return f"error: {err}"
        time.sleep(0.2)
    return "no error"
