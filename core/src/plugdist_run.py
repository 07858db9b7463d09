"""``plugdist-run``'s entry point: runs :mod:`plugdist._launcher` without importing torch.

``import plugdist._launcher`` would first execute ``plugdist/__init__.py``, which imports torch
(~1-2 s). The launcher needs none of it, so when ``plugdist`` is not imported yet this module
registers a bare package object for it (its ``__path__`` only, from the installed package's
spec, nothing executed) and imports the launcher through that. The launcher process never
imports anything else from plugdist but the store; its workers are new interpreters that
import plugdist normally.

    plugdist-run ...          # the console script
    python -m plugdist_run ...
"""

from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Sequence


def _bare_plugdist() -> None:
    if "plugdist" in sys.modules:
        return
    spec = importlib.util.find_spec("plugdist")
    if spec is None or spec.submodule_search_locations is None:
        return   # let the import below raise its own clear error
    pkg = types.ModuleType("plugdist", "plugdist, loaded bare by plugdist-run (no torch)")
    pkg.__path__ = list(spec.submodule_search_locations)
    pkg.__spec__ = spec
    pkg.__file__ = spec.origin
    sys.modules["plugdist"] = pkg


def main(argv: Sequence[str] | None = None) -> int:
    _bare_plugdist()
    from plugdist._launcher import main as launcher_main
    return launcher_main(argv)


if __name__ == "__main__":
    sys.exit(main())
