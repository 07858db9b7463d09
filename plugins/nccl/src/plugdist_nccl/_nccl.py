"""Finding NCCL: a lazy import of ``cupy.cuda.nccl`` and the reason when it cannot be used.

Nothing here runs at import time; cupy is imported on the first :func:`availability` or
:func:`load` call, so the package imports on machines without cupy, CUDA or a GPU.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["availability", "is_nccl_available", "load", "version", "format_version",
           "MIN_VERSION", "MIN_CUPY"]

# cupy 14 is built against NCCL >= 2.18 and creates communicators with ncclCommInitRankConfig
# (new in 2.18), so an older libnccl cannot serve it; cupy 14 also passes the unique id as bytes
MIN_VERSION = (2, 18, 1)
MIN_CUPY = 14

_INSTALL_HINT = ("pip install 'plugdist-nccl[cuda12]' (or [cuda13], matching the CUDA runtime of "
                 "your torch build)")


def format_version(code: int) -> tuple[int, int, int]:
    """NCCL's integer version code as (major, minor, patch); the encoding changed at 2.9."""
    if code >= 10000:
        return code // 10000, code % 10000 // 100, code % 100
    return code // 1000, code % 1000 // 100, code % 100


@functools.cache
def availability() -> tuple[bool, str]:
    """``(True, "NCCL x.y.z ...")`` when NCCL can run here, else ``(False, why)``. Cached.

    Checks, in order: a CUDA device visible to torch, cupy importable and at least 14, cupy able
    to load NCCL, NCCL's runtime version at least 2.18.1. Never raises.
    """
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - torch is a dependency
        return False, f"torch cannot be imported: {exc}"
    if not torch.cuda.is_available():
        build = "a CPU-only torch build" if torch.version.cuda is None else \
            f"torch built for CUDA {torch.version.cuda}, but no usable GPU or driver"
        return False, (f"no CUDA GPU is visible to torch (torch.cuda.is_available() is False: "
                       f"{build}); NCCL needs one GPU per rank")
    try:
        from cupy.cuda import nccl
    except ImportError as exc:
        return False, f"cupy is not installed ({exc}); {_INSTALL_HINT}"
    except Exception as exc:  # noqa: BLE001 - a broken cupy install must not break plugdist
        return False, f"cupy failed to import: {type(exc).__name__}: {exc}"
    import cupy

    cupy_major = _major(getattr(cupy, "__version__", "0"))
    if cupy_major < MIN_CUPY:
        return False, (f"cupy {cupy.__version__} is too old; plugdist-nccl needs cupy {MIN_CUPY} "
                       f"or later (NCCL's unique id as bytes); {_INSTALL_HINT}")
    if not getattr(nccl, "available", False):
        return False, ("cupy cannot load the NCCL library (cupy wheels do not ship it); "
                       f"{_INSTALL_HINT}, which installs nvidia-nccl-cu12/-cu13 >= 2.18.1")
    try:
        found = format_version(int(nccl.get_version()))
    except Exception as exc:  # noqa: BLE001
        return False, f"NCCL is present but ncclGetVersion failed: {exc}"
    if found < MIN_VERSION:
        return False, (f"NCCL {'.'.join(map(str, found))} is too old; plugdist-nccl needs "
                       f"{'.'.join(map(str, MIN_VERSION))} or later (cupy {cupy_major} creates "
                       f"communicators with ncclCommInitRankConfig)")
    gpus = torch.cuda.device_count()
    return True, f"NCCL {'.'.join(map(str, found))} through cupy {cupy.__version__}, {gpus} GPU(s)"


def _major(version: str) -> int:
    head = version.split(".", 1)[0]
    return int(head) if head.isdigit() else 0


def is_nccl_available() -> bool:
    """True when this machine can build NCCL groups (see :func:`availability` for why not)."""
    return availability()[0]


def load() -> Any:
    """The ``cupy.cuda.nccl`` module. Call only after :func:`availability` said yes."""
    from cupy.cuda import nccl
    return nccl


@functools.cache
def version() -> tuple[int, int, int]:
    """The NCCL runtime version (needs NCCL)."""
    return format_version(int(load().get_version()))
