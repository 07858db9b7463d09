"""The torch.distributed-compatible frontend: init methods, lifecycle, errors, non-members."""

import re
from pathlib import Path

import _frontend_workers as w
import plugdist as dist
import pytest
import torch
from plugdist.testing import free_port, run_world

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("scheme", ["env", "tcp", "file"])
def test_init_methods_each_scheme(scheme: str, tmp_path: Path) -> None:
    port = free_port()
    url = {"env": "env://", "tcp": f"tcp://127.0.0.1:{port}",
           "file": f"file://{tmp_path}/rendezvous"}[scheme]
    results = run_world(w.init_and_sum, 3, args=(url,))
    assert results == [6.0, 6.0, 6.0]


def test_reduce_op_warns_like_torch() -> None:
    with pytest.warns(FutureWarning, match=r"`plugdist.reduce_op` is deprecated.*ReduceOp"):
        assert dist.reduce_op.SUM is dist.ReduceOp.SUM
    with pytest.warns(FutureWarning, match=r"reduce_op` is deprecated"):
        torch.distributed.reduce_op.SUM  # noqa: B018 - the same use warns the same way in torch
    with pytest.raises(AttributeError):
        dist.reduce_op.NOT_AN_OP  # noqa: B018


def test_default_backend_names_an_installed_but_unavailable_volunteer() -> None:
    from plugdist._registry import BACKENDS, registry

    assert dist.get_default_backend_for_device("cpu") == "gloo"
    if "nccl" not in registry.names(BACKENDS):
        pytest.skip("plugdist-nccl is not installed")
    ok, reason = registry.load(BACKENDS, "nccl").is_available()
    if ok:
        pytest.skip("nccl works here: cuda has a default backend")
    with pytest.raises(dist.DistError) as info:
        dist.get_default_backend_for_device(torch.device("cuda", 0))
    msg = str(info.value)
    assert f"'nccl' is installed but unavailable here: {reason}" in msg, msg
    assert "pip install" not in msg and "backend=" in msg, msg


def test_explicit_store_and_reinit() -> None:
    assert run_world(w.explicit_store, 2, args=(free_port(),)) == [[4.0, 4.0], [4.0, 4.0]]


def test_init_destroy_loop_leaks_no_fds_or_threads() -> None:
    results = run_world(w.init_destroy_loop, 2, args=((free_port(), free_port()), 50),
                        timeout=170)
    for r, c in enumerate(results):
        assert c["fds_end"] <= c["fds_start"], f"rank {r} leaked fds: {c}"
        assert c["threads_end"] <= c["threads_start"], f"rank {r} leaked threads: {c}"
        assert c["tasks_end"] <= c["tasks_start"], f"rank {r} leaked OS threads: {c}"


def test_frontend_errors_name_what_is_wrong() -> None:
    results = run_world(w.api_errors, 2, backend="gloo")
    for msgs in results:
        assert "already called" in msgs[0] and "destroy_process_group" in msgs[0]
        assert "not in the world" in msgs[1] and "0..1" in msgs[1]
        assert "duplicates" in msgs[2]
        assert "not in group" in msgs[3]


def test_non_members_and_subgroups() -> None:
    results = run_world(w.non_member_handles, 2, backend="gloo")
    assert results[0]["is_non_member"] is False and results[0]["rank"] == 0
    assert results[1]["is_non_member"] is True
    assert results[1]["rank"] == -1 and results[1]["size"] == -1
    assert results[1]["all_reduce"] is None
    for r in results:
        assert r["subgroups"] == 2 and r["sub_rank"] == 0 and r["backend"] == "gloo"


def test_monitored_barrier_names_the_missing_rank() -> None:
    results = run_world(w.monitored_barrier_with_missing_rank, 3, backend="gloo", group_timeout=20)
    assert re.search(r"Ranks 2 failed to pass monitoredBarrier in \d+ ms", results[0]), results[0]
    assert "ranks [2]" in results[1], results[1]
    assert results[2] == "skipped"


def test_api_before_init_is_a_clear_error() -> None:
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="init_process_group"):
        dist.all_reduce(torch.ones(1))
    with pytest.raises(ValueError, match="init_process_group"):
        dist.get_rank()


def test_unknown_backend_names_installed_ones_and_package() -> None:
    with pytest.raises(ValueError) as info:
        dist.init_process_group("nosuchbackend", store=dist.HashStore(), rank=0, world_size=1)
    msg = str(info.value)
    assert "nosuchbackend" in msg and "gloo" in msg and "pip install plugdist-nosuchbackend" in msg
    assert not dist.is_initialized()


@pytest.mark.parametrize("var", ["MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"])
def test_env_rendezvous_names_the_missing_variable(var: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0",
           "WORLD_SIZE": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv(var)
    with pytest.raises(ValueError, match=var):
        dist.init_process_group("gloo", init_method="env://")
    assert not dist.is_initialized()


def test_bad_init_method_lists_registered_schemes() -> None:
    with pytest.raises(ValueError) as info:
        dist.init_process_group("gloo", init_method="bogus://x", rank=0, world_size=1)
    for scheme in ("bogus://", "env://", "tcp://"):
        assert scheme in str(info.value)


def test_bad_rank_and_world_size() -> None:
    with pytest.raises(ValueError, match="out of range"):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=3,
                                world_size=2)
    with pytest.raises(ValueError, match="rank= and world_size="):
        dist.init_process_group("gloo", store=dist.HashStore())


def test_single_process_world_with_hash_store() -> None:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        t = torch.arange(4.0)
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        assert torch.equal(t, torch.arange(4.0))
        assert dist.get_backend() == "gloo" and dist.is_gloo_available()
        assert dist.get_default_backend_for_device("cpu") == "gloo"
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()


def test_plugdist_and_torch_distributed_side_by_side() -> None:
    import torch.distributed as tdist

    port = free_port()
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        a, b = torch.ones(2), torch.ones(2) * 2
        tdist.all_reduce(a)
        dist.all_reduce(b)
        assert torch.equal(a, torch.ones(2)) and torch.equal(b, torch.ones(2) * 2)
        assert tdist.get_world_size() == 1 and dist.get_world_size() == 1
    finally:
        dist.destroy_process_group()
        tdist.destroy_process_group()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("backend", "op"), [("toy", "recv"), ("gloo", "recv"),
                                             ("gloo", "all_reduce"), ("gloo", "barrier")])
def test_destroying_a_group_fails_its_pending_ops_at_once(backend: str, op: str) -> None:
    """An op pending when its group is destroyed fails, its error saying the group was shut
    down, and the destroy does not wait for it: not for the grace a transport error gets for
    membership to name a failed member, nor for the op's timeout (Gloo's teardown waited for
    its ops in flight). Both are 100 s here: a destroy that waited would take that long."""
    results = run_world(w.destroy_with_an_op_pending, 2, backend=backend, args=(op, 100.0),
                        timeout=100)
    got = results[0]
    assert got["monitored"], "resilience is on by default: the group's errors are explained"
    assert got["destroy_s"] < 50, got
    assert got["error"] is not None and got["error"].startswith("DistError:"), got
    assert "shut down" in got["error"], got
    assert got.get("timed_out") == (True if op in ("all_reduce", "barrier") else None), got
    assert results[1] == {}
