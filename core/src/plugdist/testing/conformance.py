"""The plugdist backend conformance suite, as a pytest module.

Run it against any installed backend (yours included) with::

    pip install "plugdist[testing]"   # pytest, pytest-timeout, numpy
    pytest --pyargs plugdist.testing.conformance --plugdist-backend NAME \\
        [--plugdist-world-sizes 1,2,3,4]

Each (backend, world size) starts one real world that runs every check of
:mod:`plugdist.testing.checks` on every rank; each check is then reported as its own test, failing
with the message of every rank where it failed. It refuses to start without pytest-timeout
(its limits would silently do nothing) or numpy (ranks would time out check after check).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from plugdist.testing.checks import check_names, gpu_shortfall, run_checks
from plugdist.testing.harness import run_world

WORLD_TIMEOUT = 240.0


def _gpu_shortfall(backend: str, world_size: int) -> str | None:
    """Why a CUDA-only backend cannot run ``world_size`` ranks here (one GPU each), or None."""
    from plugdist._registry import BACKENDS, registry

    types = tuple(getattr(registry.load(BACKENDS, backend), "device_types", ("cpu",)))
    return gpu_shortfall(backend, types, world_size)


INSTALL = 'pip install "plugdist[testing]"'


def missing_requirements(config: Any) -> list[str]:
    """What the suite needs and this pytest run lacks, each with why."""
    missing = []
    if not config.pluginmanager.hasplugin("timeout"):
        missing.append("pytest-timeout (without it the suite's time limits silently do nothing, "
                       "and a hung backend hangs the run)")
    if importlib.util.find_spec("numpy") is None:
        missing.append("numpy (torch's Tensor.numpy() fails without it, and every rank then "
                       "times out check after check)")
    return missing


@pytest.fixture(scope="module")
def conformance_results(request: pytest.FixtureRequest, plugdist_backend: str,
                        plugdist_world_size: int) -> list[dict]:
    missing = missing_requirements(request.config)
    if missing:
        pytest.exit("the plugdist conformance suite refuses to run without "
                    + "; ".join(missing) + f". Install them: {INSTALL}", returncode=4)
    short = _gpu_shortfall(plugdist_backend, plugdist_world_size)
    if short:
        pytest.skip(short)
    return run_world(run_checks, plugdist_world_size, backend=plugdist_backend,
                     timeout=WORLD_TIMEOUT, group_timeout=60.0)


@pytest.mark.timeout(WORLD_TIMEOUT + 60)
@pytest.mark.parametrize("check", check_names())
def test_conformance(conformance_results: list[dict], check: str) -> None:
    failures = [r[check] for r in conformance_results if r.get(check)]
    assert not failures, "\n".join(failures)
    assert all(check in r for r in conformance_results)
