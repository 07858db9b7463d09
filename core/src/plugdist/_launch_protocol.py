"""What a worker tells the launcher that started it, through files the launcher names in the
environment: why it failed (the error file), and that it runs resilient groups, so its death
need not end the others (the resilient mark). Shared by the launcher (``plugdist._launcher``)
and the world (``plugdist._world.groups`` sets the mark), so neither imports the other.

The launcher gives every worker ``TORCHELASTIC_ERROR_FILE``, a path of its own. A worker
function decorated with :func:`record` (or torch's ``torch.distributed.elastic.multiprocessing
.errors.record``: the format is the same) writes the exception it dies of there as JSON; the
failure summary prints that message and traceback, which beats scraping stderr.

Standard library only: the launcher imports it without torch. Users decorate their entry
function with ``plugdist.record``.
"""

from __future__ import annotations

import functools
import json
import os
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["ERROR_FILE_VAR", "RESILIENT_MARK_VAR", "PAGE_VAR", "mark_resilient", "read_error_file",
           "record", "write_error_file"]

ERROR_FILE_VAR = "TORCHELASTIC_ERROR_FILE"
RESILIENT_MARK_VAR = "PLUGDIST_RESILIENT_MARK"
# "1": the launcher serves a live page (plugdist-run --page); each rank reports its status to it
PAGE_VAR = "PLUGDIST_PAGE"
F = TypeVar("F", bound=Callable[..., Any])


def write_error_file(exc: BaseException, path: str | None = None) -> str | None:
    """Write ``exc`` (with its traceback) to ``path`` (default: ``$TORCHELASTIC_ERROR_FILE``) in
    torchelastic's format. Returns the path written, or None when there is none. Never raises:
    a failure to report must not hide the failure itself."""
    path = path or os.environ.get(ERROR_FILE_VAR)
    if not path:
        return None
    data = {"message": {
        "message": f"{type(exc).__name__}: {exc}",
        "extraInfo": {
            "py_callstack": "".join(traceback.format_exception(type(exc), exc,
                                                               exc.__traceback__)),
            "timestamp": str(int(time.time())),
        }}}
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        return None
    return path


def record(fn: F) -> F:
    """Decorate a worker's main function: an exception that escapes it is written to the error
    file, then re-raised unchanged. ``SystemExit`` with code 0 or None is not an error."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except SystemExit as exc:
            if exc.code not in (0, None):
                write_error_file(exc)
            raise
        except BaseException as exc:
            write_error_file(exc)
            raise
    return wrapper  # type: ignore[return-value]


def read_error_file(path: str) -> tuple[str, list[str]] | None:
    """(message, traceback lines) from an error file, or None if it is missing or unreadable.

    Reads torchelastic's layout (``message.message``, ``message.extraInfo.py_callstack``) and a
    plain string message.
    """
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    msg = data.get("message") if isinstance(data, dict) else None
    if isinstance(msg, str):
        return msg, []
    if not isinstance(msg, dict):
        return None
    extra = msg.get("extraInfo") or {}
    tb = str(extra.get("py_callstack") or "")
    return str(msg.get("message", "")), tb.rstrip("\n").splitlines()


def mark_resilient(uid: str) -> None:
    """Tell the launcher that this process runs resilient groups (as member ``uid``): creates
    the file named by ``PLUGDIST_RESILIENT_MARK``, where the launcher set it. The launcher then
    lets the others go on past this worker's death, and past theirs this one. Never raises."""
    path = os.environ.get(RESILIENT_MARK_VAR)
    if not path:
        return
    try:
        with open(path, "w") as f:
            f.write(uid)
    except OSError:
        pass  # the launcher then ends the round on a peer's death, as without resilience
