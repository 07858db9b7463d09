"""pytest plugin (entry point ``pytest11: plugdist``): options to run the conformance suite.

``--plugdist-backend NAME`` (repeatable) picks the backends; without it, every installed backend
whose ``is_available()`` says yes. ``--plugdist-world-sizes 1,2,3,4`` picks the world sizes.
A test (or fixture) asks for ``plugdist_backend`` / ``plugdist_world_size`` to be parametrized.
"""

from __future__ import annotations

from typing import Any


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("plugdist")
    group.addoption("--plugdist-backend", action="append", default=[],
                    help="backend to run the plugdist conformance suite on (repeatable)")
    group.addoption("--plugdist-world-sizes", default="1,2,3,4",
                    help="comma-separated world sizes for the conformance suite")


def available_backends() -> list[str]:
    from plugdist._registry import BACKENDS, registry
    from plugdist._world.groups import is_backend_available

    return [n for n in registry.names(BACKENDS) if is_backend_available(n)]


def pytest_generate_tests(metafunc: Any) -> None:
    names = set(metafunc.fixturenames)
    if "plugdist_backend" in names:
        backends = metafunc.config.getoption("plugdist_backend") or available_backends()
        metafunc.parametrize("plugdist_backend", backends, scope="module")
    if "plugdist_world_size" in names:
        sizes = [int(s) for s in metafunc.config.getoption("plugdist_world_sizes").split(",") if s]
        metafunc.parametrize("plugdist_world_size", sizes, scope="module",
                             ids=[f"world{s}" for s in sizes])
