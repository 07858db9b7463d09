"""No import cycles among the modules of the core and of every plugin.

Every import counts: at module level, under ``if TYPE_CHECKING:``, and inside a function. Each
is a dependency a reader follows to understand the module, so a cycle through a deferred import
is still a cycle of meaning, only one whose import order happens to work today.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SOURCE_ROOTS = [REPO / "core" / "src", *sorted((REPO / "plugins").glob("*/src")),
                *sorted((REPO / "integrations").glob("*/src"))]


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module under the source roots."""
    found = {}
    for root in SOURCE_ROOTS:
        for path in root.rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of ``known`` that ``name`` imports anywhere in its source."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            for alias in node.names:
                # ``from pkg import sub`` imports the submodule; ``from mod import name`` the module
                sub = f"{module}.{alias.name}"
                if sub in known:
                    out.add(sub)
                elif module in known:
                    out.add(module)
    out.discard(name)
    return out


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path that returns to its start) per strongly connected component."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan; the graph is a few hundred modules at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for component in components:
        start = min(component)
        path, seen = [start], {start}
        while True:  # walk inside the component until a module repeats
            nxt = min(w for w in graph[path[-1]] if w in component)
            if nxt in seen:
                cycles.append(path[path.index(nxt):] + [nxt])
                break
            path.append(nxt)
            seen.add(nxt)
    return cycles


def test_the_finder_sees_a_cycle_through_a_deferred_import() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_the_parser_reads_every_kind_of_import(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    for name in ("__init__", "low", "mid", "top"):
        (pkg / f"{name}.py").write_text("")
    (pkg / "top.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .mid import X\n"
        "def f():\n    from . import low\n")
    known = {"pkg": pkg / "__init__.py", "pkg.low": pkg / "low.py", "pkg.mid": pkg / "mid.py",
             "pkg.top": pkg / "top.py"}
    assert _imports("pkg.top", known["pkg.top"], known) == {"pkg.mid", "pkg.low"}


def test_no_import_cycles_in_core_or_plugins() -> None:
    known = _modules()
    assert "plugdist._group.process_group" in known and "plugdist_gloo.work" in known
    graph = {name: _imports(name, path, known) for name, path in known.items()}
    cycles = find_cycles(graph)
    assert not cycles, "import cycles (move what both need into the lower module, or split " \
        "one by concept):\n" + "\n".join(" -> ".join(c) for c in cycles)


# what code outside the core may import of plugdist: the user API, the backend API and the
# public subpackages (docs/core.md, "The plugin boundary"); everything else is private
PUBLIC_MODULES = frozenset({
    "plugdist", "plugdist.backend", "plugdist.errors", "plugdist.hookspecs", "plugdist.store",
    "plugdist.testing", "plugdist.parallel", "plugdist.nn",
})
OUTSIDE_ROOTS = [*sorted((REPO / "plugins").glob("*/src")),
                 *sorted((REPO / "integrations").glob("*/src"))]


def _plugdist_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of a plugdist module in ``path`` (absolute imports only:
    a plugin's relative imports stay inside the plugin)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module]
        else:
            continue
        found += [(node.lineno, n) for n in names if n == "plugdist" or n.startswith("plugdist.")]
    return found


def _core_private_members() -> dict[str, set[str]]:
    """Per public core class: the underscore names it and its core bases define (methods,
    class attributes, ``self._x``)."""
    import inspect

    from plugdist.backend import AbortSignal, BackendBase, BackendWrapper, ProcessGroup, Store, Work
    from plugdist.store import FileStore, HashStore, PrefixStore, TCPStore

    members: dict[str, set[str]] = {}
    for cls in (BackendBase, BackendWrapper, ProcessGroup, Work, AbortSignal, Store, PrefixStore,
                TCPStore, HashStore,
                FileStore):
        names = members.setdefault(cls.__name__, set())
        for klass in cls.__mro__:
            if klass.__module__.startswith("plugdist"):
                names.update(n for n in vars(klass) if n.startswith("_") and not n.startswith("__"))
                source = Path(inspect.getfile(klass)).read_text()
                body = source[source.index(f"class {klass.__name__}"):]
                end = re.search(r"\n(class |def )", body[1:])
                body = body[: end.start() + 1] if end else body
                names.update(re.findall(r"self\.(_[a-z]\w*)\s*(?::[^=\n]*)?=", body))
    return members


def test_plugins_and_integrations_import_only_public_plugdist_modules() -> None:
    assert OUTSIDE_ROOTS, "no plugin sources found"
    bad = []
    for root in OUTSIDE_ROOTS:
        for path in sorted(root.rglob("*.py")):
            bad += [f"{path.relative_to(REPO)}:{line}: {module}"
                    for line, module in _plugdist_imports(path) if module not in PUBLIC_MODULES]
    assert not bad, ("code outside the core imports private plugdist modules (import the name "
                     "from plugdist.backend, or ask for it to be made public):\n"
                     + "\n".join(bad))


def _private_uses_in_core_subclasses(path: Path, private: dict[str, set[str]]) -> list[str]:
    """``self._x`` in a class of ``path`` that derives (in the file) from a core class, where
    ``_x`` is that core class's private member: read and not defined by the subclass, or
    written (which shadows or changes the core's state)."""
    tree = ast.parse(path.read_text(), str(path))
    classes = {node.name: node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}

    def core_base(node: ast.ClassDef, seen: frozenset[str] = frozenset()) -> str | None:
        for base in node.bases:
            name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")
            if name in private:
                return name
            if name in classes and name not in seen:
                found = core_base(classes[name], seen | {name})
                if found:
                    return found
        return None

    bad = []
    for node in classes.values():
        base = core_base(node)
        if base is None:
            continue
        theirs = private[base]
        own = {n.name for n in node.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
        for sub in ast.walk(node):
            if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store) \
                    and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                own.add(sub.attr)
            elif isinstance(sub, ast.AnnAssign | ast.Assign):
                for target in sub.targets if isinstance(sub, ast.Assign) else [sub.target]:
                    if isinstance(target, ast.Name):
                        own.add(target.id)
        for sub in ast.walk(node):
            if (isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name)
                    and sub.value.id == "self" and sub.attr in theirs
                    and (sub.attr not in own or isinstance(sub.ctx, ast.Store))):
                bad.append(f"{path.relative_to(REPO)}:{sub.lineno}: {node.name} uses "
                           f"self.{sub.attr}")
    return bad


def test_plugins_and_integrations_touch_no_private_member_of_a_core_class() -> None:
    private = _core_private_members()
    # the scan sees the base classes' own state
    assert "_lean_checked" in private["ProcessGroup"] and "_source_rank" in private["Work"]
    bad = []
    for root in OUTSIDE_ROOTS:
        for path in sorted(root.rglob("*.py")):
            bad += _private_uses_in_core_subclasses(path, private)
    assert not bad, ("a plugin's subclass of a core class reads or writes the core's private "
                     "state (use the public helper docs/backends.md names):\n" + "\n".join(bad))


def test_the_private_member_scan_sees_a_subclass_writing_the_base_class_state(
        tmp_path: Path) -> None:
    source = tmp_path / "plugin.py"
    source.write_text("from plugdist.backend import ProcessGroup\n"
                      "class Mid(ProcessGroup):\n    pass\n"
                      "class Mine(Mid):\n    def f(self):\n        self._caps = None\n"
                      "        return self._lean_checked\n"
                      "class Other:\n    def g(self):\n        return self._lean_checked\n")
    global REPO
    saved, REPO = REPO, tmp_path
    try:
        found = _private_uses_in_core_subclasses(
            source, {"ProcessGroup": {"_caps", "_lean_checked"}})
    finally:
        REPO = saved
    assert found == ["plugin.py:6: Mine uses self._caps",
                     "plugin.py:7: Mine uses self._lean_checked"]


def test_the_module_map_in_docs_core_md_matches_the_tree() -> None:
    package = REPO / "core" / "src" / "plugdist"
    page = (REPO / "docs" / "core.md").read_text()
    table = page[page.index("### Module map"):]
    table = table[: table.index("\n\n", table.index("| module |"))]
    mapped = set(re.findall(r"^\| `([\w/.]+\.py)` \|", table, re.M))
    actual = {str(p.relative_to(package)) for p in package.rglob("*.py")}
    assert not actual - mapped, f"docs/core.md's module map lacks {sorted(actual - mapped)}"
    assert not mapped - actual, f"docs/core.md maps modules that do not exist: " \
        f"{sorted(mapped - actual)}"
