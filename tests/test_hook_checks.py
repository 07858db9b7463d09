"""Checked hook contracts: a backend class with a misspelt hook, or a hook whose parameters
differ from its spec, is refused when the class is created; a pluggy plugin implementing a hook
with no spec is left out by the registry (the others kept), each error naming the class or
plugin, the hook, the nearest valid name and the fix.

The installed case is a real distribution (tests/plugins/plugdist-broken's ``plugdist_misspelt``)
pip-installed into a scratch folder that a subprocess puts on its path."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import plugdist
import pytest
import torch
from plugdist import DistError, GroupOptions, HookContractError, ProcessGroup, ReduceOp, Work
from plugdist._backend import base
from plugdist._backend.hook_checks import backend_class_problems
from plugdist._backend.work import completed_work
from plugdist._group.process_group import BACKEND_HOOKS
from plugdist._registry import BACKENDS, PLUGINS, PluginHookError, Registry, registry
from plugdist.backend import BackendBase
from plugdist.hookspecs import hookimpl

pytestmark = pytest.mark.timeout(180)
HERE = f"{__name__}"


def _refusal(make: Any) -> str:
    """The message of the HookContractError that ``make()`` (defining a class) raises."""
    with pytest.raises(HookContractError) as info:
        make()
    assert isinstance(info.value, TypeError) and isinstance(info.value, DistError)
    return str(info.value)


# -- backend classes ---------------------------------------------------------------------------
def test_a_misspelt_native_hook_is_refused_naming_the_hook_it_resembles() -> None:
    def make() -> None:
        class Misspelt(BackendBase):
            def native_allreduce(self, *, tensor: torch.Tensor, op: ReduceOp) -> Work:
                return completed_work([tensor])

    msg = _refusal(make)
    assert f"backend class {HERE}.test_a_misspelt_native_hook_is_refused_naming_the_hook_it_" \
           "resembles.<locals>.make.<locals>.Misspelt defines 'native_allreduce'" in msg
    assert "'native_allreduce'" in msg and "did you mean 'native_all_reduce'?" in msg
    assert "Rename it to 'native_all_reduce'" in msg and "docs/backends.md" in msg


def test_a_misspelt_blocking_hook_and_one_from_a_mixin_are_refused() -> None:
    def lean() -> None:
        class Lean(BackendBase):
            def native_allreduce_blocking(self, *, tensor: torch.Tensor, op: ReduceOp) -> Any:
                return None

    assert "did you mean 'native_all_reduce_blocking'?" in _refusal(lean)

    class Mixin:
        def native_brodcast(self, *, tensor: torch.Tensor, src: int) -> Work:
            return completed_work([tensor])

    def mixed() -> None:
        class Mixed(Mixin, BackendBase):
            pass

    msg = _refusal(mixed)
    assert ".Mixed (through " in msg and ".Mixin)" in msg
    assert "did you mean 'native_broadcast'?" in msg


def test_a_hook_with_a_wrong_parameter_name_is_refused_naming_the_right_one() -> None:
    def make() -> None:
        class Typo(BackendBase):
            def native_all_reduce(self, *, tensr: torch.Tensor, op: ReduceOp) -> Work:
                return completed_work([tensr])

    msg = _refusal(make)
    assert ".Typo: native_all_reduce(self, *, tensr, op) does not match the hook " \
           "native_all_reduce(self, *, tensor, op)" in msg
    assert "lacks the keyword-only parameter 'tensor' (nearest: 'tensr'); rename 'tensr' to " \
           "'tensor'" in msg


@pytest.mark.parametrize("source, expected", [
    # positional where the hook passes keywords
    ("def native_broadcast(self, tensor, src): pass", "'tensor' is positional, the hook's is "
                                                      "keyword-only"),
    # a parameter the core never passes, without a default
    ("def native_barrier(self, *, deadline): pass", "'deadline' is not a parameter of the hook "
                                                    "and has no default"),
    # a parameter the hook passes, missing
    ("def native_send(self, *, tensor, dst): pass", "lacks the keyword-only parameter 'tag'"),
    # native_blocking(op, kwargs) is called positionally
    ("def native_blocking(self, *, op, kwargs): pass", "'op' is keyword-only, but the hook "
                                                       "passes it by position"),
    ("def native_blocking(self, operation, kwargs): pass", "positional parameter 1 is named "
                                                           "'operation', the hook's is 'op'"),
    # a classmethod overridden by a plain method
    ("def static_capabilities(self): pass", "static_capabilities is a method, but the hook is a "
                                            "classmethod"),
    # the hook's op and kwargs may be passed by name
    ("def native_blocking(self, op, kwargs, /): pass", "'op' is positional-only"),
])
def test_hooks_whose_parameters_differ_from_the_spec_are_refused(source: str,
                                                                 expected: str) -> None:
    namespace: dict[str, Any] = {}
    exec(source, namespace)  # the hook under test, defined from its text
    hook = {k: v for k, v in namespace.items() if k != "__builtins__"}
    msg = _refusal(lambda: type("Bad", (BackendBase,), hook))
    assert expected in msg, msg


def test_several_problems_are_reported_together() -> None:
    def make() -> None:
        class Two(BackendBase):
            def native_allreduce(self, **kwargs: Any) -> Work:
                raise AssertionError

            def native_send(self, *, tensor: torch.Tensor, dest: int, tag: int) -> Work:
                raise AssertionError

    msg = _refusal(make)
    assert "breaks the hook contract in 2 ways:" in msg
    assert "'native_all_reduce'?" in msg and "rename 'dest' to 'dst'" in msg


class _Valid(BackendBase):
    """Every liberty the contract allows (created at import: the check let it through)."""

    backend_name = "valid"

    def __init__(self, store: Any, rank: int, size: int, options: GroupOptions) -> None:
        super().__init__(rank, size, options)  # __init__'s parameters are the factory's

    def native_all_reduce(self, *, tensor: torch.Tensor, op: ReduceOp,
                          chunk: int = 2) -> Work:  # an extra parameter, with a default
        tensor.mul_(chunk)
        return completed_work([tensor])

    def native_broadcast(self, **kwargs: Any) -> Work:  # **kwargs takes every keyword
        return completed_work([kwargs["tensor"]])

    def native_blocking(self, op: str, kwargs: dict[str, Any]) -> Any:
        return NotImplemented

    def native_shrink(self, *args: Any) -> Any:  # *args takes the positional ones
        return NotImplemented

    @classmethod
    def static_capabilities(cls) -> Any:
        return super().static_capabilities()

    def _native_all_reduce_chunk(self) -> None:  # a private helper may look like a hook
        pass


def test_a_valid_subclass_passes_and_its_hooks_run() -> None:
    assert backend_class_problems(_Valid, BackendBase, BACKEND_HOOKS) == []
    pg = ProcessGroup(_Valid(None, 0, 1, GroupOptions(group_name="v", global_ranks=(0,))))
    t = torch.ones(2)
    pg.all_reduce(t).wait()
    assert t.tolist() == [2.0, 2.0]  # the hook the check let through is the one that runs
    pg.run_blocking("all_reduce", t)
    assert t.tolist() == [4.0, 4.0]


def test_the_check_runs_at_class_creation_only(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[type] = []
    real = base.check_backend_class
    monkeypatch.setattr(base, "check_backend_class",
                        lambda cls, *a, **k: (calls.append(cls), real(cls, *a, **k)))

    class Once(BackendBase):
        def native_all_reduce(self, *, tensor: torch.Tensor, op: ReduceOp) -> Work:
            return completed_work([tensor])

    assert calls == [Once]
    pg = ProcessGroup(Once(0, 1, GroupOptions(group_name="o", global_ranks=(0,))))
    for _ in range(3):
        pg.all_reduce(torch.ones(1)).wait()
        pg.run_blocking("all_reduce", torch.ones(1))
    assert calls == [Once]  # nothing per group, nothing per op


def _all_subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_all_subclasses(sub)]
    return out


def test_every_installed_backend_and_wrapper_passes() -> None:
    loaded = []
    for name in registry.names(BACKENDS):
        try:
            loaded.append(registry.load(BACKENDS, name))
        except plugdist._registry.PluginNotFoundError:
            continue
    import plugdist_debug.wrapper

    # (classes this module refused may linger, held by the tracebacks pytest keeps)
    checked = {c.__qualname__: c for c in _all_subclasses(BackendBase)
               if c.__module__ != __name__}
    for expected in ("GlooProcessGroup", "MPIProcessGroup", "NCCLProcessGroup",
                     "ToyProcessGroup", "DebugBackend"):
        assert expected in checked, sorted(checked)
    assert plugdist_debug.wrapper.DebugBackend in checked.values()
    for cls in checked.values():
        assert backend_class_problems(cls, BackendBase, BACKEND_HOOKS) == [], cls


# -- pluggy plugins ----------------------------------------------------------------------------
def _plugin_module(name: str, **hooks: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.plugin_api = plugdist.PLUGIN_API  # type: ignore[attr-defined]
    for hook_name, function in hooks.items():
        function.__name__ = hook_name
        setattr(module, hook_name, hookimpl(function))
    return module


@pytest.fixture
def fake_plugins(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    """Three plugdist.plugins entry points: ``good`` (observes group creation), ``typo``
    (implements ``plugdist_group_creatd``) and ``badarg`` (its plugdist_group_created takes
    ``backnd``); a fresh Registry sees only them."""
    seen: dict[str, list[Any]] = {"good": [], "typo": [], "badarg": []}
    good = _plugin_module("hook_checks_good", plugdist_group_created=lambda group, global_ranks,
                          backend: seen["good"].append(backend))
    typo = _plugin_module("hook_checks_typo", plugdist_group_creatd=lambda group, global_ranks,
                          backend: seen["typo"].append(backend))
    badarg = _plugin_module("hook_checks_badarg", plugdist_group_created=lambda group,
                            global_ranks, backnd: seen["badarg"].append(backnd))
    monkeypatch.setitem(sys.modules, "hook_checks_good", good)
    monkeypatch.setitem(sys.modules, "hook_checks_typo", typo)
    monkeypatch.setitem(sys.modules, "hook_checks_badarg", badarg)
    eps = [importlib.metadata.EntryPoint(name, f"hook_checks_{name}", PLUGINS)
           for name in ("good", "typo", "badarg")]
    real = importlib.metadata.entry_points

    def entry_points(**select: Any) -> Any:
        if select.get("group") == PLUGINS:
            return [ep for ep in eps if select.get("name", ep.name) == ep.name]
        return real(**select)

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    return seen


def test_a_misspelt_hookimpl_is_refused_with_the_nearest_hook_and_spares_the_others(
        fake_plugins: dict[str, list[Any]]) -> None:
    reg = Registry()
    pm = reg.plugins()  # does not raise: the broken plugin is left out, not fatal
    assert pm.get_plugin("good") is not None and pm.get_plugin("typo") is None
    assert pm.get_plugin("badarg") is None
    pm.hook.plugdist_group_created(group=None, global_ranks=(0,), backend="gloo")
    assert fake_plugins == {"good": ["gloo"], "typo": [], "badarg": []}
    error = reg.load_error(PLUGINS, "typo")
    assert error is not None and reg.load_error(PLUGINS, "good") is None
    assert "plugin 'typo'" in error and "'plugdist_group_creatd'" in error
    assert "did you mean 'plugdist_group_created'?" in error
    assert "Rename the function to 'plugdist_group_created'" in error
    assert "unknown hook 'plugdist_group_creatd'" in error  # pluggy's own words kept
    with pytest.raises(PluginHookError) as info:
        reg.load(PLUGINS, "typo")
    assert isinstance(info.value, HookContractError)
    assert "did you mean 'plugdist_group_created'?" in str(info.value)
    described = {p.name: p.error for p in reg.describe() if p.group == PLUGINS}
    assert described["good"] is None and "plugdist_group_created" in (described["typo"] or "")


def test_a_hookimpl_taking_an_argument_its_hook_lacks_is_refused_with_the_nearest(
        fake_plugins: dict[str, list[Any]]) -> None:
    reg = Registry()
    assert reg.plugins().get_plugin("badarg") is None
    error = reg.load_error(PLUGINS, "badarg") or ""
    assert "plugin 'badarg'" in error and "its plugdist_group_created takes 'backnd'" in error
    assert "did you mean 'backend'? Rename it" in error
    assert "are declared in the hookimpl but can not be found in the hookspec" in error  # pluggy's
    with pytest.raises(PluginHookError, match="did you mean 'backend'"):
        reg.load(PLUGINS, "badarg")


def test_an_optional_hookimpl_without_a_spec_is_not_refused(
        monkeypatch: pytest.MonkeyPatch, fake_plugins: dict[str, list[Any]]) -> None:
    typo = sys.modules["hook_checks_typo"]
    optional = pluggy_optional(typo.plugdist_group_creatd)
    monkeypatch.setattr(typo, "plugdist_group_creatd", optional)
    reg = Registry()
    assert reg.plugins().get_plugin("typo") is not None
    assert reg.load_error(PLUGINS, "typo") is None


def pluggy_optional(function: Any) -> Any:
    marked = hookimpl(optionalhook=True)(lambda group, global_ranks, backend: None)
    marked.__name__ = function.__name__
    return marked


# -- installed: plugdist info and the others ---------------------------------------------------
def _run(code: str, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120)


def test_installed_misspelt_plugins_are_reported_and_the_rest_work(broken_site: Path) -> None:
    code = ("from plugdist._tools.cli import main\n"
            "main(['info'])\n"
            "import plugdist as dist, torch\n"
            "from plugdist._registry import registry\n"
            "print('DEBUG PLUGIN', registry.plugins().get_plugin('debug') is not None)\n"
            "for name in ('misspelt',):\n"
            "    try:\n"
            "        dist.init_process_group(name, store=dist.HashStore(), rank=0,"
            " world_size=1)\n"
            "    except dist.HookContractError as e:\n"
            "        print('REFUSED', type(e).__name__)\n"
            "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
            "t = torch.ones(1); dist.all_reduce(t); print('GLOO OK', t.item())\n")
    proc = _run(code, broken_site)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    # the pluggy plugin: left out, named with its hook and the nearest one
    assert "plugin 'misspelt' (plugdist-broken 0.0.1, plugdist_misspelt)" in out, out
    assert "'plugdist_group_creatd'" in out and "did you mean 'plugdist_group_created'?" in out
    # the backend: refused at class creation, so reported as failed to load with the fix
    assert "HookContractError: backend class plugdist_misspelt.backend.MisspeltProcessGroup " \
           "defines 'native_allreduce'" in out, out
    assert "did you mean 'native_all_reduce'?" in out
    assert "REFUSED PluginHookError" in out
    assert "DEBUG PLUGIN True" in out and "GLOO OK 1.0" in out
