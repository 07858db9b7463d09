"""``plugdist new-backend NAME``: write a backend package that installs and passes the
conformance suite as written.

The package is made from a real one that ships with plugdist, ``plugdist/_tools/
backend_template/``: its module (``__init__.py``, the backend ``template``: send/recv over TCP
sockets, every collective composed by the core) is plugdist's own code, so lint, type checks and
the backend-kit test cover it; the scaffold copies it with the names replaced. Beside it:
``pyproject.toml.in`` (the ``plugdist.backends`` entry point, a ``testing`` extra), ``README.md.in``
and ``test_conformance.py.in`` (runs the conformance suite on it), filled with
:class:`string.Template`. Their pins come from here (:data:`SETUPTOOLS_FLOOR`, the core's own
version), and a test holds them to the repository's.
"""

from __future__ import annotations

import re
from importlib import resources
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from string import Template

from plugdist._registry import PLUGIN_API

__all__ = ["scaffold", "package_files", "NAME_PATTERN", "SETUPTOOLS_FLOOR", "core_requirement"]

# a backend name: what users pass to init_process_group, and the module's suffix
NAME_PATTERN = re.compile(r"[a-z][a-z0-9_]*")
# the oldest setuptools that builds plugdist's own distributions (and so a scaffolded one)
SETUPTOOLS_FLOOR = "77.0.3"
_TEMPLATE = "template"  # the backend name the template package is written with


def core_requirement() -> str:
    """``plugdist>=X.Y,<X.Y+1``: the core of this minor release (0.x minors may break
    plugins), as the repository's own plugins require it."""
    try:
        major, minor = (int(p) for p in version("plugdist").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        major, minor = 0, 1
    return f"plugdist>={major}.{minor},<{major}.{minor + 1}"


def _names(name: str) -> dict[str, str]:
    camel = "".join(part.capitalize() for part in name.split("_"))
    return {"name": name, "module": f"plugdist_{name}",
            "dist": f"plugdist-{name.replace('_', '-')}", "cls": f"{camel}ProcessGroup",
            "host_env": f"PLUGDIST_{name.upper()}_HOST",
            "setuptools_floor": SETUPTOOLS_FLOOR, "core_requirement": core_requirement(),
            "core_requirement_testing": core_requirement().replace("plugdist", "plugdist[testing]",
                                                                   1)}


def _module(names: dict[str, str]) -> str:
    """The template backend's source with ``names`` in place of the template's own."""
    source = (resources.files(__package__) / "backend_template" / "__init__.py").read_text()
    replaced = (("TemplateProcessGroup", names["cls"]),
                ("PLUGDIST_TEMPLATE_HOST", names["host_env"]),
                (f'"{_TEMPLATE}"', f'"{names["name"]}"'),
                (f"``{_TEMPLATE}``", f"``{names['name']}``"),
                ("plugin_api: ClassVar[tuple[int, int]] = (2, 0)",
                 f"plugin_api: ClassVar[tuple[int, int]] = {PLUGIN_API!r}"))
    for old, new in replaced:
        source = source.replace(old, new)
    # outside plugdist's tree, isort counts plugdist with torch among the third-party imports
    source = source.replace("import torch\n\nfrom plugdist", "import torch\nfrom plugdist", 1)
    # the note meant for plugdist's own copy
    return re.sub(r"\n\(In plugdist itself this module is .*?\)\n", "\n", source, flags=re.S)


def package_files(name: str) -> dict[str, str]:
    """The package for backend ``name``: relative path -> text."""
    if not NAME_PATTERN.fullmatch(name):
        raise ValueError(f"backend name {name!r}: use lowercase letters, digits and underscores, "
                         f"starting with a letter (it becomes the module plugdist_<name>)")
    names = _names(name)
    folder = resources.files(__package__) / "backend_template"

    def filled(template: str) -> str:
        return Template((folder / template).read_text()).substitute(names)

    return {"pyproject.toml": filled("pyproject.toml.in"), "README.md": filled("README.md.in"),
            f"src/{names['module']}/__init__.py": _module(names),
            "tests/test_conformance.py": filled("test_conformance.py.in")}


def scaffold(name: str, directory: Path) -> list[Path]:
    """Write backend ``name``'s package into ``directory`` (created; it must not exist or be
    empty) and return the files written."""
    files = package_files(name)
    if directory.exists() and any(directory.iterdir()):
        raise FileExistsError(f"{directory} exists and is not empty; pass --dir with a new "
                              f"folder, or remove it")
    written = []
    for rel, text in files.items():
        path = directory / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written
