"""The backend author's contract stays complete: every hook a backend may define
(``plugdist.backend.BACKEND_HOOKS``, which must name every ``native_*`` hook of
``BackendBase``) has a row in docs/backends.md and, where the base class defines it, a docstring
of its own; every row of that page names a real hook or helper. Fails on a new hook added without
its documentation, as pluggy's and datasette's hook references are checked."""

import inspect
import re
from pathlib import Path

import pytest
from plugdist._group.process_group import BACKEND_HELPERS, BACKEND_HOOKS
from plugdist.backend import BackendBase

pytestmark = pytest.mark.timeout(60)

PAGE = Path(__file__).parents[1] / "docs" / "backends.md"
ROW = re.compile(r"^\| `([A-Za-z_]+)")  # a table row whose first cell names a member


def _documented() -> list[str]:
    return [m.group(1) for line in PAGE.read_text().splitlines() if (m := ROW.match(line))]


def test_every_native_hook_is_a_listed_backend_hook() -> None:
    natives = {name for name in dir(BackendBase) if name.startswith("native_")}
    missing = sorted(natives - set(BACKEND_HOOKS))
    assert not missing, (f"BackendBase hooks missing from BACKEND_HOOKS "
                         f"(core/src/plugdist/_backend/base.py): {missing}")


def test_every_hook_and_helper_has_a_row_on_the_page() -> None:
    rows = set(_documented())
    missing = [name for name in (*BACKEND_HOOKS, *BACKEND_HELPERS) if name not in rows]
    assert not missing, f"add a row to docs/backends.md for: {missing}"


def test_every_row_on_the_page_names_a_hook_or_helper() -> None:
    known = {*BACKEND_HOOKS, *BACKEND_HELPERS}
    stale = [name for name in _documented() if name not in known]
    assert not stale, f"docs/backends.md documents members BACKEND_HOOKS does not name: {stale}"
    rows = _documented()
    assert len(rows) == len(set(rows)), "a member has two rows on docs/backends.md"


def test_every_hook_the_base_class_defines_has_its_own_docstring() -> None:
    undocumented = []
    for name in (*BACKEND_HOOKS, *BACKEND_HELPERS):
        member = inspect.getattr_static(BackendBase, name, None)
        if isinstance(member, (classmethod, staticmethod)):
            member = member.__func__
        if not callable(member):
            continue  # attributes (documented on the page), hooks the base class lacks
        if not (member.__doc__ or "").strip():
            undocumented.append(name)
    assert not undocumented, f"BackendBase members without a docstring: {undocumented}"


def test_the_page_states_the_current_plugin_api() -> None:
    from plugdist import PLUGIN_API

    assert f"`plugdist.PLUGIN_API == {PLUGIN_API!r}`" in PAGE.read_text()
