"""One error tree: every DistError subclass of the core lives in plugdist/errors.py, is
exported by ``plugdist``, and no two error classes of the repository share a name."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import plugdist
import plugdist.errors

REPO = Path(__file__).resolve().parent.parent
CORE = REPO / "core" / "src" / "plugdist"
EVERY_SOURCE = [CORE, *sorted((REPO / "plugins").glob("*/src")),
                *sorted((REPO / "integrations").glob("*/src"))]


def _classes(roots: list[Path]) -> list[tuple[Path, str, list[str]]]:
    found = []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef):
                    bases = [b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "")
                             for b in node.bases]
                    found.append((path, node.name, bases))
    return found


def _dist_errors(classes: list[tuple[Path, str, list[str]]]) -> dict[str, Path]:
    """Name -> file of every class that derives, through names, from DistError."""
    derived = {"DistError": CORE / "errors.py"}
    changed = True
    while changed:
        changed = False
        for path, name, bases in classes:
            if name not in derived and any(b in derived for b in bases):
                derived[name] = path
                changed = True
    return derived


def test_every_dist_error_of_the_core_is_in_errors_py_and_exported() -> None:
    errors = _dist_errors(_classes([CORE]))
    assert {"DistTimeoutError", "RendezvousError", "LaunchError", "WorldError"} <= set(errors)
    elsewhere = {name: str(path.relative_to(REPO)) for name, path in errors.items()
                 if path != CORE / "errors.py"}
    assert not elsewhere, f"DistError subclasses outside plugdist/errors.py: {elsewhere}"
    unexported = sorted(set(errors) - set(plugdist.__all__))
    assert not unexported, f"errors that plugdist does not export: {unexported}"
    assert set(errors) <= set(plugdist.errors.__all__)
    for name in errors:
        assert getattr(plugdist, name) is getattr(plugdist.errors, name)


def test_no_two_error_classes_share_a_name() -> None:
    names = Counter(name for _, name, _ in _classes(EVERY_SOURCE)
                    if name.endswith(("Error", "Exception")))
    twice = sorted(name for name, n in names.items() if n > 1)
    assert not twice, f"error classes defined more than once: {twice}"
