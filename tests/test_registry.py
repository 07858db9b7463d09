"""Plugin discovery: entry points found by name, runtime registration, broken plugins reported.

The broken plugin is a real distribution (tests/plugins/plugdist-broken) pip-installed by the test
into a scratch directory that the subprocesses put on their path."""

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import plugdist as dist
import pytest
import torch
from plugdist._registry import BACKENDS, PluginNotFoundError, Registry, registry
from plugdist.backend import BackendBase, Work, completed_work
from plugdist.errors import DistError

HERE = Path(__file__).parent
pytestmark = pytest.mark.timeout(180)



def _run(code: str, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120)


def test_info_reports_broken_plugin_and_keeps_the_rest(broken_site: Path) -> None:
    proc = _run("from plugdist._tools.cli import main; raise SystemExit(main(['info']))",
                broken_site)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "broken" in out and "FAILED TO LOAD" in out
    assert "plugdist_dependency_that_does_not_exist" in out
    assert "plugdist-broken 0.0.1" in out
    assert "backend gloo: available" in out and "gloo" in out


def test_asking_for_broken_backend_names_the_reason(broken_site: Path) -> None:
    code = ("import plugdist as dist\n"
            "try:\n"
            "    dist.init_process_group('broken', store=dist.HashStore(), rank=0, world_size=1)\n"
            "except ValueError as e:\n"
            "    print('ERR', e)\n"
            "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
            "import torch; t = torch.ones(1); dist.all_reduce(t); print('GLOO OK', t.item())\n")
    proc = _run(code, broken_site)
    assert proc.returncode == 0, proc.stderr
    assert "ERR" in proc.stdout and "failed to load" in proc.stdout
    assert "plugdist_dependency_that_does_not_exist" in proc.stdout
    assert "GLOO OK 1.0" in proc.stdout


def test_entry_point_backends_are_found_by_name() -> None:
    names = registry.names(BACKENDS)
    assert {"gloo", "toy"} <= set(names)
    toy = registry.load(BACKENDS, "toy")
    assert toy.__name__ == "ToyProcessGroup" and toy.__module__ == "plugdist_toy"


def test_runtime_registration_wins_over_entry_point() -> None:
    reg = Registry()
    marker = object()
    reg.register(BACKENDS, "gloo", marker)
    assert reg.load(BACKENDS, "gloo") is marker
    with pytest.raises(ValueError, match="already registered"):
        reg.register(BACKENDS, "gloo", object())
    reg.unregister(BACKENDS, "gloo")
    assert reg.load(BACKENDS, "gloo").__name__ == "GlooProcessGroup"


def test_register_backend_is_used_by_init_process_group() -> None:
    calls = []

    def factory(store, rank, size, options):
        calls.append((rank, size, options.group_name))
        return registry.load(BACKENDS, "gloo")(store, rank, size, options)

    dist.Backend.register_backend("mine", factory, devices=["cpu"])
    try:
        dist.init_process_group("MINE", store=dist.HashStore(), rank=0, world_size=1)
        assert dist.get_backend() == "mine" and calls == [(0, 1, "0")]
        dist.destroy_process_group()
    finally:
        registry.unregister(BACKENDS, "mine")


def test_unknown_names_raise_with_what_is_installed() -> None:
    with pytest.raises(PluginNotFoundError) as info:
        registry.load(BACKENDS, "nope")
    assert "gloo" in str(info.value) and "pip install plugdist-nope" in str(info.value)
    with pytest.raises(PluginNotFoundError, match="reducer"):
        registry.load("plugdist.reducers", "nope")


def test_backend_name_normalisation() -> None:
    assert dist.Backend("GLOO") == "gloo" == dist.Backend.GLOO
    with pytest.raises(ValueError):
        dist.Backend(3)  # type: ignore[arg-type]


def test_importing_plugdist_loads_no_plugin_and_subpackages_on_first_use() -> None:
    code = ("import sys, plugdist\n"
            "print(sorted(m for m in sys.modules if m.startswith(('plugdist_', 'stevedore'))))\n"
            "print('plugdist.parallel' in sys.modules, 'plugdist.testing' in sys.modules)\n"
            "print(plugdist.parallel.DistributedDataParallel.__name__)\n"
            "print(plugdist.testing.run_world.__name__, hasattr(plugdist, 'no_such_thing'))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.splitlines() == ["[]", "False False", "DistributedDataParallel",
                                        "run_world False"], proc.stdout + proc.stderr


# ---- stores: the plugdist.stores group ---------------------------------------------------------

def test_core_stores_register_through_the_entry_point_group() -> None:
    from plugdist._registry import STORES
    assert {"tcp", "file", "hash", "dirstore"} <= set(registry.names(STORES))
    infos = {p.name: p for p in registry.describe() if p.group == STORES}
    assert infos["tcp"].distribution == "plugdist" and infos["tcp"].error is None
    assert infos["dirstore"].distribution == "plugdist-toystore"
    assert infos["dirstore"].version == "0.0.1"


def test_third_party_store_by_url_and_as_init_method(tmp_path: Path) -> None:
    """plugdist-toystore (tests/plugins/) declares one entry point; open_store, init_method and
    plugdist info find it with no import and no registration call."""
    url = f"dirstore://{tmp_path}/s"
    s = dist.open_store(url)
    assert type(s).__name__ == "DirStore" and type(s).__module__ == "plugdist_toystore"
    s.set("k", "v")
    assert dist.open_store(url).get("k") == b"v"
    assert s.add("n", 2) == 2
    dist.init_process_group("gloo", init_method=f"dirstore://{tmp_path}/w?rank=0&world_size=1")
    try:
        import torch
        t = torch.ones(2)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()
    with pytest.raises(ValueError, match="no rendezvous handler or store.*dirstore://"):
        dist.init_process_group("gloo", init_method="nosuchstore://x", rank=0, world_size=1)
    with pytest.raises(PluginNotFoundError, match="no store named 'nosuch'.*plugdist-nosuch"):
        dist.open_store("nosuch://x")


def test_broken_store_plugin_is_reported(broken_site: Path) -> None:
    proc = _run("from plugdist._tools.cli import main; raise SystemExit(main(['info']))",
                broken_site)
    assert proc.returncode == 0, proc.stderr
    stores = proc.stdout.split("plugdist.stores:")[1].split("plugdist.rendezvous:")[0]
    assert "brokenstore" in stores and "FAILED TO LOAD" in stores
    assert "dirstore" in stores and "plugdist-toystore 0.0.1" in stores
    code = ("import plugdist as dist\n"
            "try:\n"
            "    dist.open_store('brokenstore://x')\n"
            "except ValueError as e:\n"
            "    print('ERR', e)\n"
            "try:\n"
            "    dist.init_process_group('gloo', init_method='brokenstore://x', rank=0,\n"
            "                            world_size=1)\n"
            "except ValueError as e:\n"
            "    print('ERR2', e)\n"
            "print('TCP OK', dist.open_store('hash://ok') is not None)\n")
    proc = _run(code, broken_site)
    assert proc.returncode == 0, proc.stderr
    assert "ERR the store 'brokenstore' is installed but failed to load" in proc.stdout
    assert "plugdist_dependency_that_does_not_exist" in proc.stdout
    assert "ERR2 the store 'brokenstore'" in proc.stdout and "TCP OK True" in proc.stdout


# -- one group, one backend per device type -----------------------------------------------------
class _Meta(BackendBase):
    """Ops on ``meta`` tensors, done at once; records what reached it."""

    backend_name = "metaonly"
    device_types = ("meta",)

    def __init__(self, store: Any, rank: int, size: int, options: Any) -> None:
        super().__init__(rank, size, options)
        self.calls: list[str] = []

    def native_all_reduce(self, *, tensor: torch.Tensor, op: Any) -> Work:
        self.calls.append("all_reduce")
        return completed_work([tensor])


def test_a_device_map_builds_one_group_over_a_backend_per_device_type() -> None:
    dist.Backend.register_backend("metaonly", _Meta)
    try:
        dist.init_process_group("cpu:gloo,meta:metaonly", store=dist.HashStore(), rank=0,
                                world_size=1)
        try:
            pg = dist.group.WORLD
            assert isinstance(pg, dist.ProcessGroup) and pg.device_types == ("cpu", "meta")
            gloo, meta = pg.backend_for("cpu"), pg.backend_for("meta")
            assert type(gloo).__name__ == "GlooProcessGroup" and isinstance(meta, _Meta)
            assert pg.backends == {"cpu": gloo, "meta": meta}
            # torch's default group runs over it, as torch's device map of plugdist_* backends
            assert torch.distributed.is_initialized()
            assert torch.distributed.group.WORLD.plugdist_group is pg
            t = torch.ones(3)
            dist.all_reduce(t)                               # gloo's
            dist.all_reduce(t, async_op=True).wait()
            assert meta.calls == [] and torch.equal(t, torch.ones(3))
            dist.all_reduce(torch.ones(3, device="meta"))    # the meta backend's
            assert meta.calls == ["all_reduce"]
            with pytest.raises(ValueError, match="no backend for cuda tensors"):
                pg.backend_for("cuda")
        finally:
            dist.destroy_process_group()
        with pytest.raises(DistError, match="mapped to cpu but handles meta"):
            dist.init_process_group("cpu:metaonly", store=dist.HashStore(), rank=0, world_size=1)
        with pytest.raises(ValueError, match="names each device type once"):
            dist.init_process_group("cpu:gloo,cpu:toy", store=dist.HashStore(), rank=0,
                                    world_size=1)
    finally:
        registry.unregister(BACKENDS, "metaonly")


def test_the_registry_and_open_store_import_no_torch() -> None:
    """plugdist-run's launcher runs on a bare plugdist package without torch, and opens its
    rendezvous store by URL (plugdist._open_store -> the registry): neither may import torch
    (the plugin API's version once came from the backend base class, which imports it)."""
    code = ("import importlib.util, sys, types\n"
            "spec = importlib.util.find_spec('plugdist')\n"
            "pkg = types.ModuleType('plugdist')\n"
            "pkg.__path__ = list(spec.submodule_search_locations)\n"
            "pkg.__spec__ = spec; sys.modules['plugdist'] = pkg\n"
            "import plugdist._open_store, plugdist._registry, plugdist._launcher\n"
            "from plugdist._registry import STORES, registry\n"
            "assert 'tcp' in registry.names(STORES)\n"
            "print('torch' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False", "importing them loaded torch"
