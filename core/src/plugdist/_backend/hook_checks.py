"""Checked hook contracts: a backend class is checked once, when it is created.

A backend overrides hooks by name, and a misspelt name is not an error Python would catch: a
class defining ``native_allreduce`` (for ``native_all_reduce``) works, slowly, with all_reduce
composed from the backend's other ops. :func:`check_backend_class` refuses such a class when it
is created (``BackendBase.__init_subclass__`` calls it), naming the class, the hook, the nearest
valid name and the fix:

* every name that looks like a hook (``native_*``, ``*_blocking``; not private ones, not the
  base class's own members) must be a hook;
* every hook the class overrides that the base class defines as a method must take the base
  method's parameters: the same names of the same kinds (keyword-only where the hook's are),
  further parameters only with defaults, ``**kwargs`` standing for any keyword-only ones and
  ``*args`` for positional ones; a classmethod stays a classmethod.

This module knows nothing of ``BackendBase``: the caller passes the base class and the names
of its hooks. Nothing here runs per op. :func:`nearest` and :func:`unknown_hook` also word the
registry's refusal of a pluggy plugin implementing a hook that has no spec.
"""

from __future__ import annotations

import difflib
import fnmatch
import inspect
from collections.abc import Collection, Iterable
from typing import Any

from plugdist.errors import HookContractError

__all__ = ["check_backend_class", "backend_class_problems", "nearest", "unknown_hook",
           "HOOK_PATTERNS", "DOCS"]

# names a backend author means as hooks (private names, ``_...``, never are)
HOOK_PATTERNS: tuple[str, ...] = ("native_*", "*_blocking")
# where every hook is documented
DOCS = "docs/backends.md"

_P = inspect.Parameter
_POSITIONAL = (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD)


def nearest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate most like ``name`` (difflib), or None when none is close."""
    found = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return found[0] if found else None


def unknown_hook(what: str, name: str, valid: Iterable[str], fix: str) -> str:
    """``<what> defines <name>, which is not a hook ...; did you mean <nearest>? <fix>``: the
    refusal of a hook-like name that is no hook. ``fix`` words the change for the nearest name
    (``{nearest}`` in it is filled in) when there is one."""
    near = nearest(name, valid)
    if near is None:
        return (f"{what} defines {name!r}, which is not a hook, so it is never called (and no "
                f"hook's name is close to it); remove it or rename it to one of the hooks in "
                f"{DOCS}")
    return (f"{what} defines {name!r}, which is not a hook, so it is never called; did you "
            f"mean {near!r}? {fix.format(nearest=near)}")


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _binding(attr: Any) -> str | None:
    """How a class attribute binds: "classmethod", "staticmethod", "method" (any other
    callable), or None (data: a constant, a property)."""
    if isinstance(attr, classmethod):
        return "classmethod"
    if isinstance(attr, staticmethod):
        return "staticmethod"
    return "method" if callable(attr) else None


def _parameters(attr: Any, binding: str) -> list[inspect.Parameter] | None:
    """The parameters of a method as callers pass them (``self``/``cls`` dropped), or None when
    Python cannot tell (a builtin)."""
    func = attr.__func__ if binding in ("classmethod", "staticmethod") else attr
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return None
    if binding != "staticmethod" and params and params[0].kind in _POSITIONAL:
        params = params[1:]
    return params


def _shape(name: str, params: list[inspect.Parameter], binding: str) -> str:
    """``name(self, *, tensor, op)``: a signature without annotations, as a reader writes it."""
    parts = [] if binding == "staticmethod" else ["cls" if binding == "classmethod" else "self"]
    star = False
    for i, p in enumerate(params):
        if p.kind is _P.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        text = (f"*{p.name}" if p.kind is _P.VAR_POSITIONAL
                else f"**{p.name}" if p.kind is _P.VAR_KEYWORD else p.name)
        if p.kind is _P.VAR_POSITIONAL:
            star = True
        if p.default is not _P.empty:
            text += "=..."
        parts.append(text)
        if p.kind is _P.POSITIONAL_ONLY and (i + 1 == len(params)
                                             or params[i + 1].kind is not _P.POSITIONAL_ONLY):
            parts.append("/")
    return f"{name}({', '.join(parts)})"


def _signature_problems(spec: list[inspect.Parameter],
                        impl: list[inspect.Parameter]) -> list[str]:
    """What keeps ``impl`` (an override's parameters) from accepting every call the hook's
    ``spec`` allows: each a clause naming the parameter and the change."""
    problems: list[str] = []
    spec_pos = [p for p in spec if p.kind in _POSITIONAL]
    spec_kw = [p for p in spec if p.kind is _P.KEYWORD_ONLY]
    impl_pos = [p for p in impl if p.kind in _POSITIONAL]
    impl_kw = {p.name: p for p in impl if p.kind is _P.KEYWORD_ONLY}
    var_pos = any(p.kind is _P.VAR_POSITIONAL for p in impl)
    var_kw = any(p.kind is _P.VAR_KEYWORD for p in impl)
    spec_names = {p.name for p in spec}
    matched: set[str] = set()

    def needs_default(sp: inspect.Parameter, ip: inspect.Parameter) -> None:
        if sp.default is not _P.empty and ip.default is _P.empty:
            problems.append(f"'{ip.name}' has no default, but the hook's has one (the core may "
                            f"leave it out); give it a default")

    for i, sp in enumerate(spec_pos):
        if i < len(impl_pos):
            ip = impl_pos[i]
            matched.add(ip.name)
            if sp.kind is _P.POSITIONAL_OR_KEYWORD and ip.name != sp.name:
                problems.append(f"positional parameter {i + 1} is named {ip.name!r}, the hook's "
                                f"is {sp.name!r}; rename it to {sp.name!r}")
            elif sp.kind is _P.POSITIONAL_OR_KEYWORD and ip.kind is _P.POSITIONAL_ONLY:
                problems.append(f"{ip.name!r} is positional-only, the hook's may be passed by "
                                f"name; remove the '/'")
            needs_default(sp, ip)
        elif not var_pos:
            if sp.name in impl_kw:
                matched.add(sp.name)
                problems.append(f"{sp.name!r} is keyword-only, but the hook passes it by "
                                f"position; move it before the '*'")
            else:
                problems.append(f"it lacks the positional parameter {sp.name!r}; add it")
    for sp in spec_kw:
        if sp.name in impl_kw:
            matched.add(sp.name)
            needs_default(sp, impl_kw[sp.name])
        elif any(p.name == sp.name for p in impl_pos):
            matched.add(sp.name)
            problems.append(f"{sp.name!r} is positional, the hook's is keyword-only; move it "
                            f"after a '*'")
        elif not var_kw:
            spare = [p.name for p in impl if p.name not in spec_names and p.name not in matched
                     and p.kind not in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD)]
            near = nearest(sp.name, spare)
            if near is None:
                problems.append(f"it lacks the keyword-only parameter {sp.name!r}; add it "
                                f"(or take **kwargs)")
            else:
                matched.add(near)
                problems.append(f"it lacks the keyword-only parameter {sp.name!r} (nearest: "
                                f"{near!r}); rename {near!r} to {sp.name!r}")
    for i, ip in enumerate(impl_pos[len(spec_pos):], start=len(spec_pos)):
        if ip.name not in matched and ip.default is _P.empty:
            problems.append(f"positional parameter {i + 1}, {ip.name!r}, has no default and the "
                            f"hook never passes it; give it a default or remove it")
    for name, ip in impl_kw.items():
        if name not in matched and name not in spec_names and ip.default is _P.empty:
            near = nearest(name, [p.name for p in spec_kw])
            hint = f" (did you mean {near!r}?)" if near else ""
            problems.append(f"{name!r}{hint} is not a parameter of the hook and has no default, "
                            f"so the core's call fails; give it a default or remove it")
    return problems


def _own_names(cls: type, base: type) -> dict[str, type]:
    """Every name ``cls`` defines or inherits from classes other than ``base`` and its own
    bases (mixins included), with the class whose definition wins."""
    inherited = set(base.__mro__)
    found: dict[str, type] = {}
    for klass in cls.__mro__:
        if klass in inherited:
            continue
        for name in vars(klass):
            found.setdefault(name, klass)
    return found


def backend_class_problems(cls: type, base: type, hooks: Collection[str], *,
                           patterns: Iterable[str] = HOOK_PATTERNS,
                           free_signatures: Collection[str] = ("__init__",)) -> list[str]:
    """Every way ``cls`` (a subclass of ``base``) breaks the hook contract, each a full
    sentence; empty when it keeps it. ``hooks``: every name a backend may define;
    ``free_signatures``: hooks whose parameters are the backend's own (``__init__``, whose
    signature is the factory's, not the base class's)."""
    patterns = tuple(patterns)
    problems = []
    for name, owner in _own_names(cls, base).items():
        where = f"backend class {_qualified(cls)}"
        if owner is not cls:
            where += f" (through {_qualified(owner)})"
        if name not in hooks:
            if (name.startswith("_") or hasattr(base, name)
                    or not any(fnmatch.fnmatchcase(name, p) for p in patterns)):
                continue
            problems.append(unknown_hook(
                where, name, hooks,
                f"Rename it to {{nearest!r}}; if it is a helper of the backend's own, give it a "
                f"private name ('_{name}'). Every hook: {DOCS}."))
            continue
        if name in free_signatures:
            continue
        spec_attr = inspect.getattr_static(base, name, None)
        spec_binding = _binding(spec_attr)
        if spec_binding is None:
            continue  # a class attribute (a wrapper may make it a property), or no default
        impl_attr = vars(owner)[name]
        impl_binding = _binding(impl_attr)
        if impl_binding != spec_binding:
            now = "not callable" if impl_binding is None else f"a {impl_binding}"
            problems.append(f"{where}: {name} is {now}, but the hook is a {spec_binding}; "
                            f"define it as a {spec_binding}, as {_qualified(base)} does")
            continue
        spec = _parameters(spec_attr, spec_binding)
        impl = _parameters(impl_attr, impl_binding)
        if spec is None or impl is None:
            continue
        clauses = _signature_problems(spec, impl)
        if clauses:
            problems.append(f"{where}: {_shape(name, impl, impl_binding)} does not match the "
                            f"hook {_shape(name, spec, spec_binding)}: " + "; ".join(clauses)
                            + f" (the hook's contract: {DOCS})")
    return problems


def check_backend_class(cls: type, base: type, hooks: Collection[str], *,
                        patterns: Iterable[str] = HOOK_PATTERNS,
                        free_signatures: Collection[str] = ("__init__",)) -> None:
    """Refuse ``cls`` with :class:`~plugdist.errors.HookContractError` naming every problem
    :func:`backend_class_problems` finds; called once per class, at its creation."""
    problems = backend_class_problems(cls, base, hooks, patterns=patterns,
                                      free_signatures=free_signatures)
    if len(problems) == 1:
        raise HookContractError(problems[0])
    if problems:
        raise HookContractError(f"backend class {_qualified(cls)} breaks the hook contract in "
                                f"{len(problems)} ways:\n" + "\n".join(f"- {p}" for p in problems))
