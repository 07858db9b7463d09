"""No import cycles among the modules of the core and of every plugin.

Every import counts: at module level, under ``if TYPE_CHECKING:``, and inside a function. Each
is a dependency a reader follows to understand the module, so a cycle through a deferred import
is still a cycle of meaning, only one whose import order happens to work today.
"""

from __future__ import annotations

import ast
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
    assert "plugdist.process_group" in known and "plugdist_gloo.work" in known
    graph = {name: _imports(name, path, known) for name, path in known.items()}
    cycles = find_cycles(graph)
    assert not cycles, "import cycles (move what both need into the lower module, or split " \
        "one by concept):\n" + "\n".join(" -> ".join(c) for c in cycles)
