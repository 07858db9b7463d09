"""The plugin registry: one object owning every way plugdist finds code it does not import.

Named drivers come from entry-point groups through stevedore, loaded one at a time when first
asked for; cross-cutting hooks come from ``plugdist.plugins`` through a pluggy PluginManager.
Registrations made at runtime (``Backend.register_backend``, ``register_rendezvous_handler``,
...) win over an entry point of the same name. A plugin that fails to import is recorded with its
error: it never breaks the others, ``plugdist info`` lists it, and asking for it by name raises an
error that carries the reason. So is a ``plugdist.plugins`` plugin implementing a hook that
``hookspecs`` does not specify (pluggy's ``check_pending``; a misspelt ``@hookimpl``), or taking
an argument its hook does not pass: it is left out, the others run, and the error names the
plugin, the hook and the nearest valid name.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pluggy

from plugdist import _debug_level as debug_level
from plugdist import hookspecs
from plugdist._backend.api_version import MIGRATION, PLUGIN_API
from plugdist._backend.hook_checks import nearest, unknown_hook
from plugdist.errors import HookContractError, PluginAPIError, PluginHookError, PluginNotFoundError

__all__ = ["Registry", "registry", "PluginInfo", "GROUPS", "Backend", "PluginNotFoundError",
           "BACKENDS", "STORES", "PLUGIN_API", "PluginAPIError", "plugin_api_refusal",
           "declared_plugin_api", "PluginHookError", "legacy_backend_refusal", "MIGRATION"]

# the hook plugin API 1 had, which plugin API 2 replaced (see _old_hook_refusal)
_OLD_WRAP_HOOK = "plugdist_wrap_process_group"

BACKENDS = "plugdist.backends"
STORES = "plugdist.stores"
RENDEZVOUS = "plugdist.rendezvous"
REDUCERS = "plugdist.reducers"
COMM_HOOKS = "plugdist.comm_hooks"
PLUGINS = "plugdist.plugins"
GROUPS = (BACKENDS, STORES, RENDEZVOUS, REDUCERS, COMM_HOOKS, PLUGINS)

_KIND = {BACKENDS: "backend", STORES: "store", RENDEZVOUS: "rendezvous scheme", REDUCERS: "reducer",
         COMM_HOOKS: "comm hook", PLUGINS: "plugin"}


def _api_text(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


def _is_backend_base(obj: Any) -> bool:
    """Whether ``obj`` is a subclass of ``plugdist.backend.BackendBase``. Read from the loaded
    modules, not imported: a class derived from it has loaded it, and the registry must not
    import torch (through the base class) for plugdist-run's launcher, which runs without it."""
    base = sys.modules.get("plugdist._backend.base")
    return base is not None and isinstance(obj, type) and issubclass(obj, base.BackendBase)


def declared_plugin_api(obj: Any, module: str | None = None) -> Any:
    """The plugin API version ``obj`` (what an entry point names) declares: its own
    ``plugin_api`` attribute (a backend class's, a hook module's), else that of ``module`` (the
    entry point's module; default: the one defining ``obj``). Without one: (2, 0) for a
    subclass of ``BackendBase`` (which plugin API 2.0 introduced), else (1, 0), the API as it was
    before it had a version."""
    declared = _own_declaration(obj, module)
    if declared is None:
        origin = module or getattr(obj, "__module__", None) or ""
        if origin.split(".")[0] == "plugdist":  # the core's own (its stores, its rendezvous)
            return PLUGIN_API
        return (2, 0) if _is_backend_base(obj) else (1, 0)
    return declared


def _own_declaration(obj: Any, module: str | None) -> Any:
    declared = getattr(obj, "plugin_api", None)
    if declared is None:
        found = sys.modules.get(module or getattr(obj, "__module__", None) or "")
        declared = getattr(found, "plugin_api", None)
    return declared


def legacy_backend_refusal(name: str, obj: Any, origin: str) -> str:
    """The refusal of a backend written for plugin API 1 (a ``ProcessGroup`` subclass): what to
    change, exactly."""
    what = obj.__name__ if isinstance(obj, type) else type(obj).__name__
    return (f"backend {name!r} ({origin}) is written for plugdist plugin API 1 ({what} is a "
            f"ProcessGroup with native_* hooks), but this plugdist provides plugin API "
            f"{_api_text(PLUGIN_API)}, where the group users hold and the backend under it are "
            f"separate classes. To port {what}: {MIGRATION}. Or install a version of the "
            f"plugin written for plugin API {PLUGIN_API[0]}.x")


def _is_legacy_backend(obj: Any) -> bool:
    """A class written for plugin API 1: a backend class that is no BackendBase (it subclasses
    the ProcessGroup users hold, which carried the native hooks then)."""
    return (isinstance(obj, type) and not _is_backend_base(obj)
            and any(n.startswith("native_") for n in dir(obj)))


def plugin_api_refusal(kind: str, name: str, obj: Any, origin: str,
                       module: str | None = None) -> str | None:
    """Why the ``kind`` plugin ``name`` (``obj``, from ``origin``; ``module``: its entry point's)
    cannot run on this core, or None when it can.

    A plugin declares ``plugin_api = (major, minor)``: the API version it was written for,
    standing for every version from it up to the next major one. The core accepts it when the
    majors are equal and the core's minor is at least the plugin's. A backend factory that is
    a function and declares nothing is judged by what it returns (``build_group`` refuses
    anything but a ``BackendBase``)."""
    if kind == "backend" and not isinstance(obj, type) and _own_declaration(obj, module) is None:
        return None
    declared = declared_plugin_api(obj, module)
    if (not isinstance(declared, tuple) or len(declared) != 2
            or not all(isinstance(v, int) for v in declared)):
        return (f"{kind} {name!r} ({origin}) declares plugin_api = {declared!r}; it must be a "
                f"(major, minor) tuple of ints such as {PLUGIN_API!r}")
    if kind == "backend" and _is_legacy_backend(obj) and declared < PLUGIN_API:
        return legacy_backend_refusal(name, obj, origin)
    if declared[0] == PLUGIN_API[0] and declared[1] <= PLUGIN_API[1]:
        if kind == "plugin" and hasattr(obj, _OLD_WRAP_HOOK):
            return (f"plugin {name!r} ({origin}) implements {_OLD_WRAP_HOOK}, which plugin API "
                    f"2.0 replaced: rename it plugdist_wrap_backend(backend, store, "
                    f"debug_level), which receives a backend and returns a "
                    f"plugdist.backend.BackendWrapper around it (or None)")
        return None
    fix = (f"upgrade plugdist to one that provides plugin API {_api_text(declared)}"
           if declared > PLUGIN_API else
           f"install a version of the plugin written for plugin API {PLUGIN_API[0]}.x")
    return (f"{kind} {name!r} ({origin}) needs plugdist plugin API {_api_text(declared)} "
            f"(up to, not including, {declared[0] + 1}.0), but this plugdist provides plugin API "
            f"{_api_text(PLUGIN_API)}; {fix}")


@dataclass(frozen=True)
class PluginInfo:
    """One plugin as ``plugdist info`` shows it."""

    group: str
    name: str
    distribution: str
    version: str
    target: str
    error: str | None = None  # why it failed to load, if it did
    runtime: bool = False     # registered at runtime rather than through an entry point


def _dist_of(ep: importlib.metadata.EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "?", "?"
    return dist.metadata["Name"], dist.version


def _origin(ep: importlib.metadata.EntryPoint) -> str:
    dist, version = _dist_of(ep)
    return f"{dist} {version}, {ep.value}"


class Registry:
    """Owner of runtime registrations, loaded entry points and the pluggy PluginManager.

    Thread-safe. Nothing is discovered until first asked for.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._runtime: dict[str, dict[str, Any]] = {g: {} for g in GROUPS}
        self._loaded: dict[tuple[str, str], Any] = {}
        self._errors: dict[tuple[str, str], str] = {}
        self._contract_broken: set[tuple[str, str]] = set()  # of _errors: a HookContractError
        self._pm: pluggy.PluginManager | None = None

    # -- registration --------------------------------------------------------------------------
    def register(self, group: str, name: str, obj: Any, *, replace: bool = False) -> None:
        """Register ``obj`` as ``name`` in ``group`` for this process. A second registration of
        the same name is refused unless ``replace`` is true, and so is a backend written for
        another plugin API (:func:`plugin_api_refusal`)."""
        refusal = plugin_api_refusal(_KIND[group], name, obj, "registered at runtime")
        if refusal is not None:
            raise PluginAPIError(refusal)
        with self._lock:
            if name in self._runtime[group] and not replace:
                raise ValueError(f"a {_KIND[group]} named {name!r} is already registered at "
                                 f"runtime; did you register it twice? Pass replace=True to "
                                 f"override it")
            self._runtime[group][name] = obj

    def unregister(self, group: str, name: str) -> None:
        with self._lock:
            self._runtime[group].pop(name, None)

    # -- lookup --------------------------------------------------------------------------------
    def names(self, group: str) -> list[str]:
        """Every name available in ``group``: runtime registrations and entry points."""
        eps = {ep.name for ep in importlib.metadata.entry_points(group=group)}
        return sorted(eps | set(self._runtime[group]))

    def load(self, group: str, name: str) -> Any:
        """The object registered as ``name`` in ``group``; raises PluginNotFoundError."""
        with self._lock:
            if name in self._runtime[group]:
                return self._runtime[group][name]
            key = (group, name)
            if group == PLUGINS:
                self.plugins()  # the pluggy plugins' checks record their refusals
            if key in self._loaded:
                return self._loaded[key]
            if key not in self._errors:
                self._load_driver(group, name)
            if key in self._loaded:
                return self._loaded[key]
        available = ", ".join(n for n in self.names(group) if (group, n) not in self._errors)
        if key in self._errors:
            error = PluginHookError if key in self._contract_broken else PluginNotFoundError
            raise error(
                f"the {_KIND[group]} {name!r} is installed but failed to load:\n"
                f"{self._errors[key]}\nreinstall it or fix the error above (working ones: "
                f"{available or 'none'})")
        hint = ("; to get it, install the distribution that provides it "
                f"(e.g. pip install plugdist-{name})") if group in (BACKENDS, STORES) else ""
        raise PluginNotFoundError(f"no {_KIND[group]} named {name!r} (entry-point group {group}); "
                                  f"installed: {available or 'none'}{hint}")

    def _load_driver(self, group: str, name: str) -> None:
        from stevedore import DriverManager
        from stevedore.exception import NoMatches

        def failed(_manager: Any, ep: Any, err: BaseException) -> None:
            if isinstance(err, HookContractError):  # e.g. a misspelt hook of a backend class
                self._contract_broken.add((group, ep.name))
            self._errors[(group, ep.name)] = "".join(
                traceback.format_exception_only(type(err), err)).strip()

        try:
            mgr = DriverManager(group, name, invoke_on_load=False,
                                on_load_failure_callback=failed)
        except NoMatches:
            return
        except RuntimeError as err:  # stevedore: several entry points share the name
            self._errors[(group, name)] = str(err)
            return
        # stevedore's own entry point may lack its distribution: ask importlib.metadata
        ep = next(iter(importlib.metadata.entry_points(group=group, name=name)),
                  mgr.extensions[0].entry_point)
        refusal = plugin_api_refusal(_KIND[group], name, mgr.driver, _origin(ep), ep.module)
        if refusal is not None:
            self._errors[(group, name)] = refusal
            return
        self._loaded[(group, name)] = mgr.driver

    def describe(self) -> list[PluginInfo]:
        """Every plugin of every group, loading each to report failures. For ``plugdist info``."""
        out = []
        for group in GROUPS:
            for name, obj in sorted(self._runtime[group].items()):
                out.append(PluginInfo(group, name, "(runtime)", "", repr(obj), runtime=True))
            for ep in sorted(importlib.metadata.entry_points(group=group), key=lambda e: e.name):
                dist, version = _dist_of(ep)
                error = None
                if group == PLUGINS:
                    self.plugins()
                    error = self._errors.get((group, ep.name))
                else:
                    try:
                        self.load(group, ep.name)
                    except PluginNotFoundError:
                        error = self._errors.get((group, ep.name), "failed to load")
                out.append(PluginInfo(group, ep.name, dist, version, ep.value, error))
        return out

    def load_error(self, group: str, name: str) -> str | None:
        return self._errors.get((group, name))

    # -- pluggy ----------------------------------------------------------------------------------
    def plugins(self) -> pluggy.PluginManager:
        """The PluginManager, with every ``plugdist.plugins`` entry point registered once."""
        with self._lock:
            if self._pm is None:
                pm = pluggy.PluginManager(hookspecs.PROJECT)
                pm.add_hookspecs(hookspecs)
                eps = {}
                for ep in importlib.metadata.entry_points(group=PLUGINS):
                    try:
                        plugin = ep.load()
                        refusal = plugin_api_refusal("plugin", ep.name, plugin, _origin(ep),
                                                     ep.module)
                        if refusal is not None:
                            self._errors[(PLUGINS, ep.name)] = refusal
                            continue
                        pm.register(plugin, name=ep.name)
                        eps[ep.name] = ep
                    except Exception as err:  # noqa: BLE001 - a broken plugin must not break the rest
                        text = "".join(traceback.format_exception_only(type(err), err)).strip()
                        if isinstance(err, pluggy.PluginValidationError):
                            hint = _argument_refusal(pm, err.plugin, ep)
                            if hint is not None:
                                self._contract_broken.add((PLUGINS, ep.name))
                                text = f"{hint}\n(pluggy: {text})"
                        self._errors[(PLUGINS, ep.name)] = text
                self._check_pending(pm, eps)
                self._pm = pm
            return self._pm

    def _check_pending(self, pm: pluggy.PluginManager,
                       eps: dict[str, importlib.metadata.EntryPoint]) -> None:
        """pluggy's ``check_pending``, plugin by plugin: each plugin implementing a hook that has
        no spec (a misspelt ``@hookimpl``) is unregistered and recorded as failed to load, with
        the hook and the nearest specified one; the others stay registered."""
        specified = [name for name, caller in vars(pm.hook).items()
                     if not name.startswith("_") and caller.has_spec()]
        for _ in range(len(eps) + 1):  # each round leaves out one plugin
            try:
                pm.check_pending()
                return
            except pluggy.PluginValidationError as err:
                plugin = err.plugin
                name = pm.get_name(plugin) or repr(plugin)
                unknown = sorted(caller.name for caller in pm.get_hookcallers(plugin) or ()
                                 if not caller.has_spec() and any(
                                     impl.plugin is plugin and not impl.optionalhook
                                     for impl in caller.get_hookimpls()))
                ep = eps.get(name)
                what = f"plugin {name!r} ({_origin(ep) if ep is not None else 'registered'})"
                fix = ("Rename the function to {nearest!r} (a hookimpl's name is its hook's), or "
                       "keep the name and pass @hookimpl(specname={nearest!r}); the hooks: "
                       "plugdist.hookspecs. The plugin is left out until then.")
                reasons = [unknown_hook(what, hook, specified, fix) for hook in unknown]
                self._errors[(PLUGINS, name)] = (
                    "\n".join(reasons or [f"{what}: {err}"])
                    + f"\n(pluggy's check_pending: {err})")
                self._contract_broken.add((PLUGINS, name))
                pm.unregister(plugin)  # and with it its unknown hooks' implementations

    def wrap_backend(self, backend: Any, **kwargs: Any) -> Any:
        """Apply every plugin's ``plugdist_wrap_backend`` in turn (wrappers chain)."""
        for impl in reversed(self.plugins().hook.plugdist_wrap_backend.get_hookimpls()):
            wrapped = impl.function(backend=backend, **{k: v for k, v in kwargs.items()
                                                        if k in impl.argnames})
            if wrapped is not None:
                backend = wrapped
        return backend

    def has_hook(self, hook_name: str) -> bool:
        return bool(getattr(self.plugins().hook, hook_name).get_hookimpls())


def _argument_refusal(pm: pluggy.PluginManager, plugin: Any,
                      ep: importlib.metadata.EntryPoint) -> str | None:
    """Why pluggy refused to register ``plugin`` when a hookimpl takes arguments its hook does
    not pass (a misspelt argument): each with the nearest one the hook passes; None when that
    is not the trouble."""
    reasons = []
    for attr in dir(plugin):
        opts = pm.parse_hookimpl_opts(plugin, attr)
        if opts is None:
            continue
        hook = opts.get("specname") or attr
        caller = getattr(pm.hook, hook, None)
        if caller is None or caller.spec is None:
            continue
        passed = (*caller.spec.argnames, *caller.spec.kwargnames)
        try:
            params = inspect.signature(getattr(plugin, attr)).parameters.values()
        except (TypeError, ValueError):
            continue
        for p in params:
            if (p.name in passed or p.default is not inspect.Parameter.empty
                    or p.kind in (inspect.Parameter.VAR_POSITIONAL,
                                  inspect.Parameter.VAR_KEYWORD)):
                continue
            near = nearest(p.name, passed)
            fix = (f"did you mean {near!r}? Rename it" if near is not None
                   else "remove it")
            reasons.append(
                f"plugin {ep.name!r} ({_origin(ep)}): its {hook} takes {p.name!r}, which the "
                f"hook does not pass; {fix} (a hookimpl takes any of the hook's arguments: "
                f"{', '.join(passed)}). The plugin is left out until then.")
    return "\n".join(reasons) if reasons else None


registry = Registry()


def _tell_plugins(level: debug_level.DebugLevel) -> None:
    registry.plugins().hook.plugdist_debug_level_changed(level=level)


debug_level.observe(_tell_plugins)


class Backend(str):
    """A backend name, as in torch.distributed: ``Backend("GLOO") == "gloo"``.

    The constants are conveniences; any registered name is a valid backend.
    """

    UNDEFINED = "undefined"
    GLOO = "gloo"
    MPI = "mpi"
    NCCL = "nccl"

    def __new__(cls, name: str) -> Backend:
        if not isinstance(name, str):
            raise ValueError(f"Backend name must be a string, got {type(name).__name__}")
        return super().__new__(cls, name.lower())

    @classmethod
    def register_backend(cls, name: str, func: Callable[..., Any], extended_api: bool = False,
                         devices: str | list[str] | None = None) -> None:
        """Register ``func(store, rank, size, options)`` as backend ``name`` for this process.

        Wins over an installed entry point of the same name. ``devices`` (e.g. ``["cpu"]``) is
        recorded on the factory for ``get_default_backend_for_device``; ``extended_api`` is accepted
        for torch compatibility (plugdist always passes the options object).
        """
        if devices is not None and not hasattr(func, "device_types"):
            try:
                func.device_types = (devices,) if isinstance(devices, str) else tuple(devices)  # type: ignore[attr-defined]
            except AttributeError:
                pass
        registry.register(BACKENDS, name.lower(), func, replace=True)

    @classmethod
    def backend_list(cls) -> list[str]:
        return registry.names(BACKENDS)
