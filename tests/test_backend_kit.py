"""The backend author's kit, as an author meets it: ``plugdist new-backend`` writes a package
that installs and passes the conformance suite on its first run, and the suite refuses to start
without what it needs, saying which ``pip install`` fixes it.

The scaffolded package is pip-installed for real (a wheel built from its pyproject, no build
isolation, no dependencies: the dev venv has them) into a scratch folder that the subprocesses
put on their path, so the dev venv itself never changes; its own test then runs the conformance
suite, which starts real worlds of 1, 2 and 3 ranks talking over the package's TCP sockets."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from plugdist._tools.cli import main
from plugdist._tools.scaffold import package_files
from plugdist.testing import free_port

REPO = Path(__file__).parents[1]


def _env(site: Path | None = None) -> dict[str, str]:
    # the outer run's PYTEST_ADDOPTS (say -q or --durations) would change the inner summary line
    env = {**os.environ, "PYTEST_ADDOPTS": ""}
    if site is not None:
        env["PYTHONPATH"] = f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    return env


# Each rank joins a world of 2; rank 1 sends one message (so connections and reader threads
# exist), rank 0 receives it and then posts a receive nobody will match; both then leave the
# script without destroy_process_group. The backend's threads must not hold the exit up, nor
# crash it.
_EXIT_WITHOUT_DESTROY = """
import sys, torch, plugdist as dist
backend, rank, port = sys.argv[1], int(sys.argv[2]), sys.argv[3]
dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
if rank == 1:
    dist.send(torch.ones(4), dst=0, tag=1)
else:
    got = torch.zeros(4)
    dist.recv(got, src=1, tag=1)
    assert got.tolist() == [1.0] * 4, got
    pending = dist.irecv(torch.zeros(4), src=1, tag=2)
dist.barrier()
print("leaving", rank, flush=True)
"""


def exits_without_destroy(backend: str, env: dict[str, str]) -> None:
    """Both ranks of the script above exit at once, cleanly, on ``backend``."""
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", _EXIT_WITHOUT_DESTROY, backend, str(r), port],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    for rank, proc in enumerate(procs):
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"{backend}: rank {rank} did not exit within 60 s of leaving its script "
                        f"without destroy_process_group: a backend thread holds the exit up")
        assert proc.returncode == 0, f"{backend} rank {rank}: exit {proc.returncode}\n{err}"
        assert f"leaving {rank}" in out, (out, err)
        assert "terminate called" not in err, err


@pytest.mark.timeout(150)
def test_the_example_backend_lets_a_program_exit_without_destroy() -> None:
    exits_without_destroy("toy", _env())


# about 80 s on an idle 2-core machine; the limits leave room for a machine shared with others
@pytest.mark.timeout(600)
def test_a_scaffolded_backend_installs_and_passes_the_conformance_suite(tmp_path: Path) -> None:
    package, site = tmp_path / "plugdist-kitcheck", tmp_path / "site"
    assert main(["new-backend", "kitcheck", "--dir", str(package)]) == 0
    lint = subprocess.run([sys.executable, "-m", "ruff", "check", "--config",
                           str(REPO / "pyproject.toml"), str(package)],
                          capture_output=True, text=True, timeout=60)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--target", str(site), str(package)],
                   check=True, timeout=120)
    info = subprocess.run([sys.executable, "-m", "plugdist._tools.cli", "info"], env=_env(site),
                          capture_output=True, text=True, timeout=60)
    assert info.returncode == 0, info.stderr
    assert "plugdist-kitcheck 0.1.0" in info.stdout and "backend kitcheck: available" in info.stdout
    # the package's own test: the conformance suite at world sizes 1, 2, 3
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "--rootdir", str(package), str(package / "tests")], cwd=package,
                         env=_env(site), capture_output=True, text=True, timeout=420)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "1 passed" in run.stdout, run.stdout[-2000:]
    exits_without_destroy("kitcheck", _env(site))


def test_the_scaffold_refuses_a_bad_name_and_a_used_folder(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture) -> None:
    assert main(["new-backend", "My-Backend", "--dir", str(tmp_path / "a")]) == 2
    assert "use lowercase letters, digits and underscores" in capsys.readouterr().err
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "keep.txt").write_text("mine")
    assert main(["new-backend", "fine", "--dir", str(tmp_path / "b")]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert main(["new-backend", "gloo", "--dir", str(tmp_path / "c")]) == 0
    assert "a backend named 'gloo' is installed already" in capsys.readouterr().out


def test_the_package_names_its_entry_point_and_plugin_api() -> None:
    files = package_files("my_net")
    assert 'my_net = "plugdist_my_net:MyNetProcessGroup"' in files["pyproject.toml"]
    assert 'name = "plugdist-my-net"' in files["pyproject.toml"]
    module = files["src/plugdist_my_net/__init__.py"]
    assert 'backend_name = "my_net"' in module and "plugin_api" in module
    assert "def shutdown(self)" in module and "self._threads.join()" in module
    assert "template" not in module.lower(), "a name of the template package was left"
    from plugdist import PLUGIN_API
    assert f"plugin_api: ClassVar[tuple[int, int]] = {PLUGIN_API!r}" in module


def test_the_template_package_is_a_real_backend_written_for_this_plugin_api() -> None:
    """The scaffold copies plugdist._tools.backend_template: real code (lint and mypy cover
    it), a backend class that passes the core's class checks, written for the current API."""
    from plugdist import PLUGIN_API
    from plugdist._tools.backend_template import TemplateProcessGroup

    assert TemplateProcessGroup.backend_name == "template"
    assert TemplateProcessGroup.plugin_api == PLUGIN_API, (
        "bump the template's plugin_api with PLUGIN_API")
    assert TemplateProcessGroup.static_capabilities().is_native("send", "cpu")


def test_the_scaffold_pins_what_the_repository_pins() -> None:
    """The scaffolded pyproject builds with the setuptools floor and requires the core range
    that the repository's own plugins do (they drifted apart once)."""
    import re

    from plugdist._tools.scaffold import SETUPTOOLS_FLOOR, core_requirement

    pyproject = package_files("pins")["pyproject.toml"]
    for dist in ("core", "plugins/toy", "plugins/gloo"):
        text = (REPO / dist / "pyproject.toml").read_text()
        floor = re.search(r'"setuptools>=([\d.]+)"', text)
        assert floor is not None and floor.group(1) == SETUPTOOLS_FLOOR, dist
    toy = (REPO / "plugins/toy/pyproject.toml").read_text()
    assert f'"{core_requirement()}"' in toy, (core_requirement(), "plugins/toy/pyproject.toml")
    assert f'"setuptools>={SETUPTOOLS_FLOOR}"' in pyproject
    assert f'"{core_requirement()}"' in pyproject and '"torch>=2.3"' in pyproject


@pytest.mark.timeout(120)
def test_the_conformance_suite_refuses_to_run_without_pytest_timeout(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:timeout",
                          "-p", "no:cacheprovider", "--pyargs", "plugdist.testing.conformance",
                          "--plugdist-backend", "gloo", "--plugdist-world-sizes", "1"],
                         cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=100)
    out = run.stdout + run.stderr
    assert run.returncode == 4, out[-3000:]
    assert "refuses to run without pytest-timeout" in out, out[-3000:]
    assert 'pip install "plugdist[testing]"' in out, out[-3000:]


def test_the_conformance_suite_names_numpy_when_it_is_missing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util
    from types import SimpleNamespace

    from plugdist.testing import conformance

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "numpy" else real(name, *a))
    config = SimpleNamespace(pluginmanager=SimpleNamespace(hasplugin=lambda name: True))
    [missing] = conformance.missing_requirements(config)
    assert missing.startswith("numpy (torch's Tensor.numpy() fails without it"), missing
    config.pluginmanager.hasplugin = lambda name: False
    assert conformance.missing_requirements(config)[0].startswith("pytest-timeout (")
