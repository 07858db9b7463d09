"""Rank-side bodies of tests/test_torch_bridge.py, run by plugdist.testing.run_world.

Each suite runs many checks in one world and returns ``{check name: None or the error text}``.
The reference for every check is torch's own Gloo, in the same world and on the same inputs: a
``torch.distributed.new_group(backend="gloo")`` beside the bridged groups.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as tdist
from torch import nn

Checks = dict[str, Callable[[], None]]


def run_checks(checks: Checks) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name, check in checks.items():
        try:
            check()
            out[name] = None
        except Exception:  # noqa: BLE001 - reported per check
            out[name] = traceback.format_exc()
    return out


def _equal(ours: Any, ref: Any, what: str) -> None:
    if isinstance(ours, (list, tuple)):
        if len(ours) != len(ref):
            raise AssertionError(f"{what}: {len(ours)} tensors vs {len(ref)}")
        for i, (o, r) in enumerate(zip(ours, ref, strict=True)):
            _equal(o, r, f"{what}[{i}]")
        return
    if not torch.equal(ours, ref):
        raise AssertionError(f"{what}: bridged {ours.tolist()} != torch's gloo {ref.tolist()}")


# -- every op, bridged group against torch's gloo --------------------------------------------
def op_checks(ours: Any, ref: Any, tag: str) -> Checks:
    """Every torch.distributed op on the bridged group ``ours`` and on torch's Gloo ``ref``."""
    rank, n = tdist.get_rank(ours), tdist.get_world_size(ours)
    ranks = tdist.get_process_group_ranks(ours)
    g = ranks  # group rank -> global rank

    def base(k: int = 6, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (torch.arange(k) + 10 * rank + 1).to(dtype)

    def both(fn: Callable[[Any], Any]) -> tuple[Any, Any]:
        return fn(ours), fn(ref)

    def reduction(op: Any, dtype: torch.dtype) -> Callable[[], None]:
        def check() -> None:
            def run(group: Any) -> torch.Tensor:
                t = base(dtype=dtype)
                tdist.all_reduce(t, op=op, group=group)
                return t
            _equal(*both(run), f"all_reduce {op}")
        return check

    def avg() -> None:
        t = base()
        tdist.all_reduce(t, op=tdist.ReduceOp.AVG, group=ours)
        s = base()
        tdist.all_reduce(s, group=ref)
        _equal(t, s / n, "all_reduce AVG (torch's gloo: SUM / n)")

    def async_all_reduce() -> None:
        def run(group: Any) -> torch.Tensor:
            t = base()
            w = tdist.all_reduce(t, group=group, async_op=True)
            fut = w.get_future()
            w.wait()
            got = fut.wait()
            if not w.is_completed() or not torch.equal(got[0], t):
                raise AssertionError(f"future value {got} vs tensor {t}")
            return t
        _equal(*both(run), "async all_reduce")

    def premul_sum_refused() -> None:
        t = base()
        try:
            tdist.all_reduce(t, op=tdist._make_nccl_premul_sum(2.0), group=ours)
        except ValueError as err:
            text = str(err)
            if not all(w in text for w in ("PREMUL_SUM", f"rank {rank}", "all_reduce",
                                           "plugdist_")):
                raise AssertionError(f"unclear refusal: {text}") from err
            return
        raise AssertionError("PREMUL_SUM was accepted")

    def broadcast() -> None:
        def run(group: Any) -> torch.Tensor:
            t = base()
            tdist.broadcast(t, src=g[n - 1], group=group)
            return t
        _equal(*both(run), "broadcast")

    def reduce() -> None:
        def run(group: Any) -> torch.Tensor:
            t = base()
            tdist.reduce(t, dst=g[1], op=tdist.ReduceOp.MAX, group=group)
            return t
        o, r = both(run)
        if rank == 1:
            _equal(o, r, "reduce MAX at dst")

    def all_gather() -> None:
        def run(group: Any) -> list[torch.Tensor]:
            out = [torch.zeros(6) for _ in range(n)]
            tdist.all_gather(out, base(), group=group)
            return out
        _equal(*both(run), "all_gather")

    def all_gather_into_tensor() -> None:
        def run(group: Any) -> torch.Tensor:
            out = torch.zeros(6 * n)
            tdist.all_gather_into_tensor(out, base(), group=group)
            return out
        _equal(*both(run), "all_gather_into_tensor")

    def all_gather_coalesced() -> None:
        outs = [[torch.zeros(6), torch.zeros(2)] for _ in range(n)]
        ins = [base(), base(2)]
        tdist.all_gather_coalesced(outs, ins, group=ours)
        for r in range(n):
            peer = [(torch.arange(6) + 10 * r + 1).float(), (torch.arange(2) + 10 * r + 1).float()]
            _equal(outs[r], peer, f"all_gather_coalesced from rank {r}")

    def all_reduce_coalesced() -> None:
        ts = [base(), base(3), base(2)]
        tdist.all_reduce_coalesced(ts, group=ours)
        refs = [base(), base(3), base(2)]
        for t in refs:
            tdist.all_reduce(t, group=ref)
        _equal(ts, refs, "all_reduce_coalesced")

    def gather() -> None:
        def run(group: Any) -> list[torch.Tensor]:
            out = [torch.zeros(6) for _ in range(n)] if rank == 0 else None
            tdist.gather(base(), out, dst=g[0], group=group)
            return out or []
        _equal(*both(run), "gather")

    def scatter() -> None:
        def run(group: Any) -> torch.Tensor:
            out = torch.zeros(6)
            chunks = [base() * (i + 1) for i in range(n)] if rank == n - 1 else None
            tdist.scatter(out, chunks, src=g[n - 1], group=group)
            return out
        _equal(*both(run), "scatter")

    def reduce_scatter() -> None:
        def run(group: Any) -> torch.Tensor:
            out = torch.zeros(6)
            tdist.reduce_scatter(out, [base() * (i + 1) for i in range(n)], group=group)
            return out
        _equal(*both(run), "reduce_scatter")

    def reduce_scatter_tensor() -> None:
        def run(group: Any) -> torch.Tensor:
            out = torch.zeros(6)
            tdist.reduce_scatter_tensor(out, base(6 * n), group=group)
            return out
        _equal(*both(run), "reduce_scatter_tensor")

    def all_to_all() -> None:
        def run(group: Any) -> list[torch.Tensor]:
            out = [torch.zeros(2) for _ in range(n)]
            tdist.all_to_all(out, [base(2) * (i + 1) for i in range(n)], group=group)
            return out
        _equal(*both(run), "all_to_all")

    def all_to_all_single_splits() -> None:
        # rank r sends i+1 rows to rank i; so it receives r+1 rows from everyone
        in_splits = [i + 1 for i in range(n)]
        out_splits = [rank + 1] * n

        def run(group: Any) -> torch.Tensor:
            out = torch.zeros(sum(out_splits), 2)
            inp = base(2 * sum(in_splits)).reshape(-1, 2)
            tdist.all_to_all_single(out, inp, out_splits, in_splits, group=group)
            return out
        _equal(*both(run), "all_to_all_single with splits")

    def barrier() -> None:
        tdist.barrier(group=ours)
        w = tdist.barrier(group=ours, async_op=True)
        w.wait()

    def send_recv_ring() -> None:
        def run(group: Any) -> torch.Tensor:
            got = torch.zeros(6)
            right, left = g[(rank + 1) % n], g[(rank - 1) % n]
            if rank % 2 == 0:
                tdist.send(base(), right, group=group)
                tdist.recv(got, left, group=group)
            else:
                tdist.recv(got, left, group=group)
                tdist.send(base(), right, group=group)
            return got
        _equal(*both(run), "send/recv ring")

    def isend_irecv_batch() -> None:
        def run(group: Any) -> torch.Tensor:
            got = torch.zeros(6)
            ops = [tdist.P2POp(tdist.isend, base(), g[(rank + 1) % n], group),
                   tdist.P2POp(tdist.irecv, got, g[(rank - 1) % n], group)]
            for w in tdist.batch_isend_irecv(ops):
                w.wait()
            return got
        _equal(*both(run), "batch_isend_irecv")

    def recv_any_source() -> None:
        def run(group: Any) -> tuple[int, torch.Tensor]:
            got = torch.zeros(6)
            if rank == 0:
                sender = tdist.recv(got, group=group)  # any source
                return sender, got
            if rank == 1:
                tdist.send(base(), g[0], group=group)
            return -1, got
        (s1, t1), (s2, t2) = both(run)
        if s1 != s2:
            raise AssertionError(f"any-source sender {s1} vs torch's gloo {s2}")
        _equal(t1, t2, "recv from any source")

    def object_collectives() -> None:
        objs: list[Any] = [None] * n
        tdist.all_gather_object(objs, {"rank": rank}, group=ours)
        if objs != [{"rank": r} for r in range(n)]:
            raise AssertionError(f"all_gather_object gave {objs}")
        lst = [f"from {rank}"]
        tdist.broadcast_object_list(lst, src=g[0], group=ours)
        if lst != ["from 0"]:
            raise AssertionError(f"broadcast_object_list gave {lst}")

    red = tdist.ReduceOp
    checks: Checks = {
        "all_reduce SUM": reduction(red.SUM, torch.float32),
        "all_reduce PRODUCT": reduction(red.PRODUCT, torch.float64),
        "all_reduce MIN": reduction(red.MIN, torch.float32),
        "all_reduce MAX": reduction(red.MAX, torch.int32),
        "all_reduce BAND": reduction(red.BAND, torch.int64),
        "all_reduce BOR": reduction(red.BOR, torch.int64),
        "all_reduce BXOR": reduction(red.BXOR, torch.uint8),
        "all_reduce AVG": avg,
        "all_reduce async": async_all_reduce,
        "PREMUL_SUM refused": premul_sum_refused,
        "broadcast": broadcast, "reduce": reduce, "all_gather": all_gather,
        "all_gather_into_tensor": all_gather_into_tensor,
        "all_gather_coalesced": all_gather_coalesced,
        "all_reduce_coalesced": all_reduce_coalesced, "gather": gather, "scatter": scatter,
        "reduce_scatter": reduce_scatter, "reduce_scatter_tensor": reduce_scatter_tensor,
        "all_to_all": all_to_all, "all_to_all_single splits": all_to_all_single_splits,
        "barrier": barrier, "send/recv": send_recv_ring, "batch_isend_irecv": isend_irecv_batch,
        "object collectives": object_collectives,
    }
    if getattr(ours, "plugdist_group", None) is not None and \
            ours.plugdist_group.capabilities().any_source_recv:
        checks["recv any source"] = recv_any_source
    return {f"{tag} {k}": v for k, v in checks.items()}


# -- torch DDP and FSDP2 over a bridged group against torch's gloo ------------------------------
class WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)
        self.unused = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4))


def ddp_params(group: Any, variant: str, steps: int = 4) -> list[torch.Tensor]:
    """Train with torch's DDP over ``group``; the parameters at the end."""
    rank = tdist.get_rank()
    torch.manual_seed(0)
    model = WithUnused() if variant == "find_unused" else _mlp()
    kwargs: dict[str, Any] = {"process_group": group, "bucket_cap_mb": 0.001}
    if variant == "bucket_view":
        kwargs["gradient_as_bucket_view"] = True
    if variant == "find_unused":
        kwargs["find_unused_parameters"] = True
    ddp = nn.parallel.DistributedDataParallel(model, **kwargs)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(steps):
        x = torch.randn(5, 8, generator=gen)
        if variant == "no_sync" and step % 2 == 0:
            with ddp.no_sync():
                ddp(x).pow(2).sum().backward()
            continue
        ddp(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def fsdp_losses(group: Any, steps: int = 4) -> list[float]:
    """Train an MLP sharded with FSDP2 over ``group``; the loss of every step."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    rank = tdist.get_rank()
    torch.manual_seed(0)
    model = _mlp()
    mesh = DeviceMesh.from_group(group, "cpu")
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(200 + rank)
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(6, 8, generator=gen)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        tdist.all_reduce(total, group=group)
        losses.append(total.item())
    return losses


def training_checks(groups: dict[str, Any], ref: Any) -> Checks:
    checks: Checks = {}
    for name, group in groups.items():
        for variant in ("plain", "bucket_view", "no_sync", "find_unused"):
            def ddp(group: Any = group, variant: str = variant, name: str = name) -> None:
                _equal(ddp_params(group, variant), ddp_params(ref, variant),
                       f"DDP {variant} parameters over {name}")
            checks[f"DDP {variant} over {name}"] = ddp

        def fsdp(group: Any = group, name: str = name) -> None:
            ours, theirs = fsdp_losses(group), fsdp_losses(ref)
            if ours != theirs:
                raise AssertionError(f"FSDP2 losses over {name} {ours} != torch's gloo {theirs}")
        checks[f"FSDP2 over {name}"] = fsdp
    return checks


# -- suites -----------------------------------------------------------------------------------
def torch_first_suite(rank: int, n: int, ports: list[int]) -> dict[str, str | None]:
    """torch.distributed alone (no plugdist call): init over plugdist_gloo, every op and torch's
    DDP/FSDP2/DeviceMesh on it; then the device-map form; then plugdist's world shared."""
    timeout = timedelta(seconds=60)
    tdist.init_process_group("plugdist_gloo", init_method=f"tcp://127.0.0.1:{ports[0]}",
                             rank=rank, world_size=n, timeout=timeout)
    ref = tdist.new_group(backend="gloo")
    toy = tdist.new_group(backend="plugdist_toy")
    world = tdist.group.WORLD
    checks: Checks = {}

    def identity() -> None:
        from plugdist._torch.bridge import BridgeGroup
        if tdist.get_backend() != "plugdist_gloo" or not isinstance(world, BridgeGroup):
            raise AssertionError(f"default group {world!r}, backend {tdist.get_backend()}")
        if tdist.get_backend(toy) != "plugdist_toy":
            raise AssertionError(f"toy group backend {tdist.get_backend(toy)}")
        caps = tdist.Backend.backend_capability
        if caps.get("plugdist_gloo") != ["cpu"]:
            raise AssertionError(f"capabilities {caps}")
        if world.group_name != "0" or world.plugdist_group.group_name != "torch:0":
            raise AssertionError(f"names {world.group_name} / {world.plugdist_group.group_name}")

    checks["identity"] = identity
    checks.update(op_checks(world, ref, "plugdist_gloo"))
    checks.update(op_checks(toy, ref, "plugdist_toy"))
    if n == 2:
        checks.update(training_checks({"plugdist_gloo": world, "plugdist_toy": toy}, ref))
        checks.update(mesh_1d_checks())
    out = run_checks(checks)
    tdist.destroy_process_group()
    if n == 2:
        out.update(run_checks({
            "device maps": lambda: _device_map(rank, n, [ports[1], *ports[6:10]]),
            "plugdist's world in torch": lambda: _world_in_torch(rank, n, ports[2:])}))
    return out


def mesh_1d_checks() -> Checks:
    def mesh_1d() -> None:
        import torch.distributed._functional_collectives as funcol
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        group = mesh.get_group("dp")
        if tdist.get_backend(group) != "plugdist_gloo":
            raise AssertionError(f"mesh group backend {tdist.get_backend(group)}")
        rank = tdist.get_rank()
        got = funcol.all_reduce(torch.tensor([rank + 1.0]), "sum", mesh).wait()
        if got.item() != 3.0:
            raise AssertionError(f"functional all_reduce gave {got}")
        full = torch.arange(8.0).reshape(4, 2)
        dt = distribute_tensor(full, mesh, [Shard(0)])
        if not torch.equal(dt.to_local(), full[2 * rank:2 * rank + 2]):
            raise AssertionError(f"shard {dt.to_local()}")
        if not torch.equal(dt.redistribute(mesh, [Replicate()]).to_local(), full):
            raise AssertionError("redistribute to Replicate lost data")
    return {"DeviceMesh (2,) + functional collectives + DTensor": mesh_1d}


def _device_map(rank: int, n: int, ports: list[int]) -> None:
    """The device-map form: one plugdist backend for cpu; then maps mixing plugdist and torch
    backends (the other device is cuda, never used here: its backend is still built, and the
    GPU test in test_nccl.py sends it tensors); then a map whose torch backend cannot be built
    next to a plugdist one."""
    from plugdist._torch.bridge import BridgeGroup, BridgeWork

    def init(spec: str, port: int) -> None:
        tdist.init_process_group(spec, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                 world_size=n, timeout=timedelta(seconds=60))

    init("cpu:plugdist_gloo", ports[0])
    try:
        t = torch.tensor([rank + 1.0])
        tdist.all_reduce(t)
        if t.item() != n * (n + 1) / 2 or "plugdist_gloo" not in str(tdist.get_backend_config()):
            raise AssertionError(f"{t}, {tdist.get_backend_config()}")
    finally:
        tdist.destroy_process_group()

    def torch_gloo(device: str) -> Callable[[Any], bool]:
        return lambda route: isinstance(route._get_backend(torch.device(device)),
                                        tdist.ProcessGroupGloo)

    def plugdist_toy(route: Any) -> bool:
        return isinstance(route, BridgeGroup) and route.plugdist_group.backend_name == "toy"

    # spec -> (cpu tensors go through plugdist?, the device served by another group, its check)
    cases: dict[str, tuple[bool, str, Callable[[Any], bool]]] = {
        "cpu:gloo,cuda:plugdist_toy": (False, "cpu", torch_gloo("cpu")),
        "cpu:plugdist_gloo,cuda:gloo": (True, "cuda", torch_gloo("cuda")),
        "cpu:plugdist_gloo,cuda:plugdist_toy": (True, "cuda", plugdist_toy)}
    for port, (spec, (plugdist_cpu, routed, is_expected)) in zip(ports[1:], cases.items(),
                                                                  strict=False):
        init(spec, port)
        world: Any = tdist.group.WORLD
        routes = dict(world.routes)
        try:
            t = torch.tensor([rank + 1.0])
            work = tdist.all_reduce(t, async_op=True)
            work.wait()
            objects: list[Any] = [None] * n
            tdist.all_gather_object(objects, rank)
            tdist.barrier()
            got = (t.item(), isinstance(work, BridgeWork), objects, list(routes))
            want = (n * (n + 1) / 2, plugdist_cpu, list(range(n)), [routed])
            if got != want or not is_expected(routes[routed]):
                raise AssertionError(f"{spec}: (sum, plugdist's work, objects, routed devices) "
                                     f"{got} != {want}; {routed} served by {routes}")
        finally:
            tdist.destroy_process_group()
        if world.routes:
            raise AssertionError(f"{spec}: destroy left the routes {world.routes}")
    try:
        init("cpu:plugdist_gloo,cuda:ucc", ports[4])
    except ValueError as err:
        if "cpu:plugdist_gloo,cuda:ucc" not in str(err) or "give cuda" not in str(err):
            raise AssertionError(f"unclear error: {err}") from err
    else:
        tdist.destroy_process_group()
        raise AssertionError("cpu:plugdist_gloo,cuda:ucc was accepted")


def _world_in_torch(rank: int, n: int, ports: list[int]) -> None:
    import plugdist
    from torch.utils.data.distributed import DistributedSampler

    def init(port: int, **kwargs: Any) -> None:
        plugdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=n, timeout=timedelta(seconds=60), **kwargs)

    init(ports[0])
    if not tdist.is_initialized() or tdist.get_rank() != rank or tdist.get_world_size() != n:
        raise AssertionError("torch does not see plugdist's world")
    if tdist.group.WORLD.plugdist_group is not plugdist.group.WORLD:
        raise AssertionError("torch's default group is not plugdist's")
    if list(DistributedSampler(range(10), shuffle=False)) != list(range(rank, 10, n)):
        raise AssertionError("DistributedSampler() did not shard by plugdist's ranks")
    t = torch.tensor([1.0])
    tdist.all_reduce(t)
    sub = tdist.new_group([0, 1], backend="plugdist_gloo")  # torch-built, on plugdist's store
    s = torch.tensor([2.0])
    tdist.all_reduce(s, group=sub)
    if t.item() != n or s.item() != 4.0:
        raise AssertionError(f"all_reduce over the shared world gave {t}, {s}")
    plugdist.destroy_process_group()
    if tdist.is_initialized():
        raise AssertionError("plugdist.destroy_process_group left torch's default group")
    init(ports[1], torch_world=False)
    if tdist.is_initialized():
        raise AssertionError("torch_world=False still initialized torch")
    plugdist.destroy_process_group()
    os.environ["PLUGDIST_TORCH_WORLD"] = "0"
    try:
        init(ports[2])
        if tdist.is_initialized():
            raise AssertionError("PLUGDIST_TORCH_WORLD=0 still initialized torch")
        plugdist.destroy_process_group()
    finally:
        del os.environ["PLUGDIST_TORCH_WORLD"]
    init(ports[3])  # and back on: re-init after destroy
    t = torch.tensor([float(rank)])
    tdist.all_reduce(t)
    plugdist.destroy_process_group()
    if t.item() != n * (n - 1) / 2 or tdist.is_initialized():
        raise AssertionError(f"re-init: {t}, torch initialized={tdist.is_initialized()}")


def ops_suite(rank: int, n: int, port: int) -> dict[str, str | None]:
    """Every op over plugdist_gloo and plugdist_toy against torch's gloo, torch-first."""
    return torch_first_suite(rank, n, [port])


def mesh_2d_suite(rank: int, n: int, port: int) -> dict[str, str | None]:
    """init_device_mesh (2, 2) over plugdist_gloo: each dimension's group has the right ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    tdist.init_process_group("plugdist_gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                             world_size=n, timeout=timedelta(seconds=60))

    def mesh_2d() -> None:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp, tp = mesh.get_group("dp"), mesh.get_group("tp")
        want_dp, want_tp = [rank % 2, rank % 2 + 2], [rank // 2 * 2, rank // 2 * 2 + 1]
        got = (tdist.get_process_group_ranks(dp), tdist.get_process_group_ranks(tp))
        if got != (want_dp, want_tp):
            raise AssertionError(f"mesh groups {got}, expected {(want_dp, want_tp)}")
        for group, ranks in ((dp, want_dp), (tp, want_tp)):
            if tdist.get_backend(group) != "plugdist_gloo":
                raise AssertionError(f"backend {tdist.get_backend(group)}")
            if group.plugdist_group.options.global_ranks != tuple(ranks):
                raise AssertionError(f"plugdist group ranks {group.plugdist_group.options}")
            t = torch.tensor([float(rank)])
            tdist.all_reduce(t, group=group)
            if t.item() != sum(ranks):
                raise AssertionError(f"all_reduce over {ranks} gave {t}")

    try:
        return run_checks({"DeviceMesh (2, 2)": mesh_2d})
    finally:
        tdist.destroy_process_group()


def mpi_suite(rank: int, n: int) -> dict[str, str | None]:
    """Under mpiexec, after plugdist.init_process_group("mpi") (the harness's): torch's default
    group is plugdist_mpi; ops, DDP and FSDP2 on it and on a torch-built plugdist_mpi group."""
    ref = tdist.new_group(backend="gloo")
    built = tdist.new_group(backend="plugdist_mpi")
    world = tdist.group.WORLD
    checks: Checks = {}

    def shared() -> None:
        if tdist.get_backend() != "plugdist_mpi" or world.plugdist_group.backend_name != "mpi":
            raise AssertionError(f"default group {world!r}")

    checks["torch's default group is plugdist's mpi world"] = shared

    def device_map_subgroup() -> None:
        """The issue's spelling "cpu:plugdist_mpi,cuda:nccl", with gloo for cuda (no GPU
        here), as a new_group: cpu through plugdist's MPI, cuda's backend built beside it."""
        from plugdist._torch.bridge import BridgeWork

        mixed: Any = tdist.new_group(backend="cpu:plugdist_mpi,cuda:gloo")
        t = torch.tensor([rank + 1.0])
        work = tdist.all_reduce(t, group=mixed, async_op=True)
        work.wait()
        cuda = mixed.routes["cuda"]._get_backend(torch.device("cuda"))
        if (t.item(), isinstance(work, BridgeWork), mixed.plugdist_group.backend_name,
                isinstance(cuda, tdist.ProcessGroupGloo)) != (n * (n + 1) / 2, True, "mpi", True):
            raise AssertionError(f"{t}, {work!r}, {mixed!r}, cuda served by {cuda!r}")

    checks["new_group(backend='cpu:plugdist_mpi,cuda:gloo')"] = device_map_subgroup
    checks.update(op_checks(world, ref, "plugdist_mpi (shared)"))
    checks.update(op_checks(built, ref, "plugdist_mpi (torch-built)"))
    checks.update(training_checks({"plugdist_mpi": world}, ref))
    return run_checks(checks)


def dead_peer(rank: int, n: int, port: int) -> dict[str, Any]:
    """Rank 1 dies once the groups exist; rank 0's waits must fail within the group timeout."""
    tdist.init_process_group("plugdist_gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                             world_size=n, timeout=timedelta(seconds=5))
    toy = tdist.new_group(backend="plugdist_toy", timeout=timedelta(seconds=3))
    tdist.barrier()
    if rank == 1:
        os._exit(0)
    time.sleep(0.5)
    out: dict[str, Any] = {}
    calls = {"all_reduce": lambda g: tdist.all_reduce(torch.ones(4), group=g,
                                                      async_op=True).wait(),
             "barrier": lambda g: tdist.barrier(group=g)}
    for name, group in (("plugdist_toy", toy), ("plugdist_gloo", None)):
        for op, call in calls.items():
            t0 = time.monotonic()
            try:
                call(group)
                out[name, op] = ("no error", time.monotonic() - t0)
            except Exception as err:  # noqa: BLE001 - the error is the result
                out[name, op] = (f"{type(err).__name__}: {err}", time.monotonic() - t0)
    return out


def barrier_timeout(rank: int, n: int, port: int) -> dict[str, str]:
    """torch's test_barrier_timeout_*: only rank 0 calls barrier (on short-timeout groups of
    either backend, through torch's API), so it times out; returns rank 0's messages."""
    tdist.init_process_group("plugdist_gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                             world_size=n, timeout=timedelta(seconds=30))
    short = timedelta(seconds=1)
    groups = {b: tdist.new_group(backend=b, timeout=short) for b in ("plugdist_gloo",
                                                                      "plugdist_toy")}
    out: dict[str, str] = {}
    if rank == 0:
        for name, group in groups.items():
            try:
                tdist.barrier(group=group)
                out[name] = "no error"
            except Exception as err:  # noqa: BLE001 - the error is the result
                out[name] = f"{type(err).__name__}: {err}"
    tdist.barrier()  # the default group: rank 1 stays until rank 0 is done
    return out


def detail_suite(rank: int, n: int, port: int) -> dict[str, str | None]:
    """TORCH_DISTRIBUTED_DEBUG=DETAIL (set by the test): plugdist-debug wraps the bridged
    groups; torch's DDP builds on them; a mismatched collective is caught before it is sent."""
    from plugdist.errors import DistError

    tdist.init_process_group("plugdist_gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                             world_size=n, timeout=timedelta(seconds=30))
    sub = tdist.new_group(backend="plugdist_toy")

    def wrapped() -> None:
        for group in (tdist.group.WORLD, sub):
            inner = type(group.plugdist_group.backend_for("cpu")).__name__
            if inner != "DebugBackend":
                raise AssertionError(f"{group!r} is not wrapped by plugdist-debug ({inner})")

    def ddp_builds() -> None:
        model = nn.parallel.DistributedDataParallel(_mlp())
        model(torch.ones(2, 8)).sum().backward()

    def mismatch_caught() -> None:
        for group in (None, sub):
            try:
                tdist.all_reduce(torch.ones(2 + rank), group=group)
            except DistError as err:
                text = str(err)
                if "tensor shape: [2] on rank 0 vs [3] on rank 1" not in text:
                    raise AssertionError(f"unexpected message: {text}") from err
                continue
            raise AssertionError(f"mismatched all_reduce over {group} was not caught")

    def destroy_forgets_the_groups() -> None:
        # a flight-recorder watcher left polling a destroyed group's store could be inside a
        # C++ store call when the interpreter ends, and abort the process
        from plugdist._observability.flight_recorder import recorder
        tdist.destroy_process_group()
        if recorder._groups:
            raise AssertionError(f"the flight recorder still watches {list(recorder._groups)}")

    try:
        return run_checks({"DETAIL wraps bridged groups": wrapped,
                           "DETAIL torch DDP constructs": ddp_builds,
                           "DETAIL mismatch caught": mismatch_caught,
                           "DETAIL destroy forgets the groups": destroy_forgets_the_groups})
    finally:
        if tdist.is_initialized():
            tdist.destroy_process_group()
