"""The plugin API version: the core states it, plugins declare theirs, the registry refuses a
plugin written for another one, naming the plugin and both versions; ``plugdist info`` tells
the truth about each backend's reductions.

The refused entry point is a real distribution (tests/plugins/plugdist-broken's
``plugdist_future``, declaring API 2.0) pip-installed into a scratch folder that a subprocess
puts on its path."""

import os
import subprocess
import sys
from pathlib import Path

import plugdist
import pytest
from plugdist import ProcessGroup
from plugdist._backend.capabilities import Capabilities
from plugdist._backend.reduce_op import ReduceOp
from plugdist._registry import (
    BACKENDS,
    PLUGIN_API,
    PluginAPIError,
    Registry,
    declared_plugin_api,
    registry,
)
from plugdist._tools.cli import reduction_lines

pytestmark = pytest.mark.timeout(180)


def _run(code: str, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120)


def test_the_core_states_its_plugin_api() -> None:
    assert plugdist.PLUGIN_API == PLUGIN_API == (1, 0)


@pytest.mark.parametrize("name", ["gloo", "mpi", "nccl", "toy"])
def test_every_in_repo_backend_declares_the_api_it_was_written_for(name: str) -> None:
    factory = registry.load(BACKENDS, name)
    assert "plugin_api" in vars(factory), f"{factory.__name__} declares no plugin_api"
    assert factory.plugin_api == PLUGIN_API


def test_in_repo_store_and_hook_plugins_declare_it_in_their_module() -> None:
    import plugdist_debug.hooks
    import plugdist_etcd
    import plugdist_toystore

    for module in (plugdist_debug.hooks, plugdist_etcd, plugdist_toystore):
        assert module.plugin_api == PLUGIN_API, module.__name__


class _FromTheFuture(ProcessGroup):
    backend_name = "future"
    plugin_api = (PLUGIN_API[0] + 1, 0)


class _NewerMinor(ProcessGroup):
    backend_name = "newer"
    plugin_api = (PLUGIN_API[0], PLUGIN_API[1] + 1)


class _Undeclared(ProcessGroup):
    backend_name = "undeclared"


def test_runtime_registration_outside_the_range_is_refused_naming_both_versions() -> None:
    reg = Registry()
    with pytest.raises(PluginAPIError) as err:
        reg.register(BACKENDS, "future", _FromTheFuture)
    msg = str(err.value)
    assert "backend 'future'" in msg and "needs plugdist plugin API 2.0" in msg, msg
    assert "this plugdist provides plugin API 1.0" in msg and "upgrade plugdist" in msg, msg
    with pytest.raises(PluginAPIError,
                       match=r"needs plugdist plugin API 1\.1 .*provides plugin API 1\.0"):
        reg.register(BACKENDS, "newer", _NewerMinor)
    with pytest.raises(PluginAPIError, match=r"plugin_api = '1\.0'; it must be a \(major, minor\)"):
        reg.register(BACKENDS, "bad", type("Bad", (ProcessGroup,), {"plugin_api": "1.0"}))
    # no declaration: the API before versions existed, 1.0, accepted
    assert declared_plugin_api(_Undeclared) == (1, 0)
    reg.register(BACKENDS, "undeclared", _Undeclared)
    assert reg.load(BACKENDS, "undeclared") is _Undeclared
    # Backend.register_backend goes through the same check
    with pytest.raises(PluginAPIError, match="backend 'future'"):
        plugdist.Backend.register_backend("future", _FromTheFuture)
    assert "future" not in plugdist.Backend.backend_list()


def test_an_installed_backend_for_another_api_is_refused_and_the_rest_work(
        broken_site: Path) -> None:
    code = ("import plugdist as dist\n"
            "try:\n"
            "    dist.init_process_group('future', store=dist.HashStore(), rank=0, world_size=1)\n"
            "except ValueError as e:\n"
            "    print('ERR', type(e).__name__, e)\n"
            "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
            "import torch; t = torch.ones(1); dist.all_reduce(t); print('GLOO OK', t.item())\n")
    proc = _run(code, broken_site)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "ERR PluginNotFoundError the backend 'future' is installed but failed to load" in out
    assert "(plugdist-broken 0.0.1, plugdist_future:FutureProcessGroup)" in out, out
    assert "needs plugdist plugin API 2.0" in out and "provides plugin API 1.0" in out, out
    assert "GLOO OK 1.0" in out, out
    info = _run("from plugdist._tools.cli import main; raise SystemExit(main(['info']))",
                broken_site)
    assert info.returncode == 0, info.stderr
    line = next(ln for ln in info.stdout.splitlines() if ln.strip().startswith("future "))
    assert "FAILED TO LOAD" in line, info.stdout
    assert "needs plugdist plugin API 2.0" in info.stdout


def test_info_lists_no_native_reduction_for_a_send_recv_backend() -> None:
    toy = registry.load(BACKENDS, "toy")
    lines = reduction_lines(toy.static_capabilities())
    assert lines == ["native reductions: none",
                     "composed reductions: all as an all_gather, then a local reduce"], lines


def test_info_names_native_composed_and_refused_reductions() -> None:
    every = frozenset(ReduceOp) - {ReduceOp.AVG}
    gloo_like = Capabilities(native=frozenset({("all_reduce", "cpu")}), reduce_ops=every)
    assert reduction_lines(gloo_like) == [
        "native reductions: BAND, BOR, BXOR, MAX, MIN, PRODUCT, SUM (in all_reduce)",
        "composed reductions: AVG as SUM, then a local divide"]
    nccl_like = Capabilities(
        native=frozenset({("all_reduce", "cuda"), ("reduce", "cuda")}),
        reduce_ops=frozenset({ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MAX}),
        refused_reduce_ops=frozenset({ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR}))
    assert reduction_lines(nccl_like) == [
        "native reductions: AVG, MAX, SUM (in all_reduce, reduce)",
        "composed reductions: MIN, PRODUCT as an all_gather, then a local reduce",
        "refused reductions (an error, not composed): BAND, BOR, BXOR"]
