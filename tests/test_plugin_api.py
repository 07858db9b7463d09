"""The plugin API version: the core states it, plugins declare theirs, the registry refuses a
plugin written for another one, naming the plugin and both versions; ``plugdist info`` tells
the truth about each backend's reductions.

The refused entry points are real distributions pip-installed (not editable) into a scratch
folder that a subprocess puts on its path: tests/plugins/plugdist-broken's ``plugdist_future``
(declaring API 3.0), and tests/plugins/plugdist-legacy, backends and a hook written for plugin
API 1 (subclasses of ProcessGroup; the group-wrapping hook), each refused with what to change."""

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
from plugdist.backend import BackendBase

pytestmark = pytest.mark.timeout(180)


def _run(code: str, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120)


def test_the_core_states_its_plugin_api() -> None:
    assert plugdist.PLUGIN_API == PLUGIN_API == (2, 0)


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


class _FromTheFuture(BackendBase):
    backend_name = "future"
    plugin_api = (PLUGIN_API[0] + 1, 0)


class _NewerMinor(BackendBase):
    backend_name = "newer"
    plugin_api = (PLUGIN_API[0], PLUGIN_API[1] + 1)


class _Undeclared(BackendBase):
    backend_name = "undeclared"


class _Legacy(ProcessGroup):
    """A backend as plugin API 1 had them: a ProcessGroup with native hooks."""

    backend_name = "legacy"

    def native_send(self, *, tensor, dst, tag):  # type: ignore[no-untyped-def]
        raise NotImplementedError


def test_runtime_registration_outside_the_range_is_refused_naming_both_versions() -> None:
    reg = Registry()
    with pytest.raises(PluginAPIError) as err:
        reg.register(BACKENDS, "future", _FromTheFuture)
    msg = str(err.value)
    assert "backend 'future'" in msg and "needs plugdist plugin API 3.0" in msg, msg
    assert "this plugdist provides plugin API 2.0" in msg and "upgrade plugdist" in msg, msg
    with pytest.raises(PluginAPIError,
                       match=r"needs plugdist plugin API 2\.1 .*provides plugin API 2\.0"):
        reg.register(BACKENDS, "newer", _NewerMinor)
    with pytest.raises(PluginAPIError, match=r"plugin_api = '1\.0'; it must be a \(major, minor\)"):
        reg.register(BACKENDS, "bad", type("Bad", (BackendBase,), {"plugin_api": "1.0"}))
    # no declaration on a BackendBase subclass: written for the API that introduced it, 2.0
    assert declared_plugin_api(_Undeclared) == (2, 0)
    reg.register(BACKENDS, "undeclared", _Undeclared)
    assert reg.load(BACKENDS, "undeclared") is _Undeclared
    # a plugin API 1 backend (a ProcessGroup subclass, undeclared: 1.0) is told what to change
    assert declared_plugin_api(_Legacy) == (1, 0)
    with pytest.raises(PluginAPIError) as err:
        reg.register(BACKENDS, "legacy", _Legacy)
    msg = str(err.value)
    assert "subclass plugdist.backend.BackendBase instead of ProcessGroup" in msg, msg
    assert "plugin_api = (2, 0)" in msg and "_Legacy" in msg, msg
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
    assert "needs plugdist plugin API 3.0" in out and "provides plugin API 2.0" in out, out
    assert "GLOO OK 1.0" in out, out
    info = _run("from plugdist._tools.cli import main; raise SystemExit(main(['info']))",
                broken_site)
    assert info.returncode == 0, info.stderr
    line = next(ln for ln in info.stdout.splitlines() if ln.strip().startswith("future "))
    assert "FAILED TO LOAD" in line, info.stdout
    assert "needs plugdist plugin API 3.0" in info.stdout


LEGACY = ("legacy", "legacy_undeclared", "legacy_mislabelled", "legacy_factory")


def test_backends_written_for_plugin_api_1_are_refused_saying_what_to_change(
        legacy_site: Path) -> None:
    code = ("import plugdist as dist, torch\n"
            f"for name in {LEGACY!r}:\n"
            "    try:\n"
            "        dist.init_process_group(name, store=dist.HashStore(), rank=0, world_size=1)\n"
            "    except Exception as e:\n"
            "        print('ERR', name, type(e).__name__, ' '.join(str(e).split()))\n"
            "    else:\n"
            "        print('RAN', name)\n"
            "        dist.destroy_process_group()\n"
            "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
            "t = torch.ones(1); dist.all_reduce(t); print('GLOO OK', t.item())\n")
    proc = _run(code, legacy_site)
    assert proc.returncode == 0, proc.stderr
    lines = {ln.split()[1]: ln for ln in proc.stdout.splitlines() if ln.startswith("ERR ")}
    assert set(lines) == set(LEGACY), proc.stdout
    for line in lines.values():
        assert "AttributeError" not in line, line
        assert "subclass plugdist.backend.BackendBase instead of ProcessGroup" in line, line
        assert "plugin_api = (2, 0)" in line, line
    assert "plugin API 1" in lines["legacy"] and "LegacyProcessGroup" in lines["legacy"]
    assert "(plugdist-legacy 0.0.1, plugdist_legacy:LegacyProcessGroup)" in lines["legacy"]
    assert "UndeclaredProcessGroup" in lines["legacy_undeclared"]
    assert "MislabelledProcessGroup" in lines["legacy_mislabelled"]
    assert "GLOO OK 1.0" in proc.stdout, proc.stdout
    info = _run("from plugdist._tools.cli import main; raise SystemExit(main(['info']))",
                legacy_site)
    assert info.returncode == 0, info.stderr
    text = " ".join(info.stdout.split())
    for name in ("legacy", "legacy_undeclared"):
        line = next(ln for ln in info.stdout.splitlines() if ln.strip().startswith(name + " "))
        assert "FAILED TO LOAD" in line, info.stdout
    assert "implements plugdist_wrap_process_group, which plugin API 2.0 replaced" in text, text


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
