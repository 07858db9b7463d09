"""Entry point of one rank started by :func:`plugdist.testing.run_world`."""

from __future__ import annotations

import faulthandler
import importlib
import os
import pickle
import resource
import signal
import sys
import traceback
from datetime import timedelta
from typing import Any


def _rank_from_env() -> tuple[int, int]:
    for rank_var, size_var in (("RANK", "WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"),
                               ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")):
        if rank_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ[size_var])
    raise RuntimeError("plugdist.testing.worker: no RANK/PMI_RANK in the environment")


def _dump_core_into(directory: str) -> None:
    """Let a fatal signal dump this process's core into ``directory`` (its new working
    directory: the kernel's default ``core_pattern`` is relative to it), as far as the hard
    limit allows."""
    os.makedirs(directory, exist_ok=True)
    _, hard = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (hard, hard))
    os.chdir(directory)


def main(spec_path: str) -> int:
    # a hung rank is stopped with SIGTERM: print where every thread was, for the parent's report
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    # a rank that crashes (SIGSEGV, SIGABRT from a heap check, ...) prints every thread's Python
    # stack before it dies; the signal is raised again, so its exit status stays the signal's
    faulthandler.enable(all_threads=True)
    with open(spec_path, "rb") as f:
        spec = pickle.load(f)
    rank, world_size = _rank_from_env()
    out = os.path.join(spec["out_dir"], f"rank{rank}.pkl")
    here = os.getcwd()
    for p in reversed(spec["sys_path"]):
        p = p or here  # "" is the parent's working directory, which core_dir changes
        if p not in sys.path:
            sys.path.insert(0, p)
    if spec.get("core_dir"):
        _dump_core_into(os.path.join(spec["core_dir"], f"rank{rank}"))
    try:
        import plugdist as dist

        module = importlib.import_module(spec["module"])
        fn: Any = module
        for part in spec["name"].split("."):
            fn = getattr(fn, part)
        if spec["backend"] is not None:
            extra: dict[str, Any] = {}
            if spec["group_timeout"] is not None:
                extra["timeout"] = timedelta(seconds=spec["group_timeout"])
            dist.init_process_group(spec["backend"], init_method=spec["init_method"], **extra)
        try:
            value = fn(rank, world_size, *spec["args"], **spec["kwargs"])
        finally:
            if spec["backend"] is not None and dist.is_initialized():
                dist.destroy_process_group()
        result: tuple[str, Any, str | None] = ("ok", value, None)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, then exit non-zero
        result = ("error", traceback.format_exc(), type(exc).__name__)
    try:
        payload = pickle.dumps(result)
    except Exception as exc:  # noqa: BLE001
        payload = pickle.dumps(("error", f"result not picklable: {exc!r}", type(exc).__name__))
    with open(out + ".tmp", "wb") as f:
        f.write(payload)
    os.replace(out + ".tmp", out)
    sys.stdout.flush()
    sys.stderr.flush()
    return 0 if result[0] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
