"""Fixtures shared by several test modules."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.fixture(scope="session")
def broken_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the test-only ``plugdist-broken`` distribution (a plugin whose import
    fails), for a subprocess to put on its PYTHONPATH. Installed once per test session."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--target", str(target),
                    str(HERE / "plugins" / "plugdist-broken")], check=True, timeout=160)
    return target
