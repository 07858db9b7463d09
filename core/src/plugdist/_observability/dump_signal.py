"""A flight recorder's dump on a signal: ``kill -USR1 <pid>`` dumps a live process's recent ops
without stopping it (the core's recorder, and plugdist-debug's on its own signal)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from plugdist._log import get_logger

__all__ = ["dump_on_signal"]

_installed: set[str] = set()  # the settings whose handler was installed (or declined) already


def dump_on_signal(setting: str, default: str, dump: Callable[[str], Any]) -> None:
    """Call ``dump("signal SIGNAME")`` when the process receives the signal named by the
    environment variable ``setting`` (``default`` when unset; ``OFF``, ``NONE``, ``0`` or empty:
    none). Installed once per ``setting``, only from the main thread (Python's rule for
    handlers; another thread's call does nothing), and only when nobody handles that signal
    already (the program's own handler is never replaced). A name that is not a signal is
    logged once, with the fix. The dump runs in the main thread, between two bytecodes."""
    if setting in _installed or threading.current_thread() is not threading.main_thread():
        return
    _installed.add(setting)
    name = os.environ.get(setting, default).strip().upper()
    if name in ("", "0", "OFF", "NONE"):
        return
    signum = getattr(signal, name if name.startswith("SIG") else "SIG" + name, None)
    if not isinstance(signum, signal.Signals):
        get_logger().warning("flight_recorder_bad_signal", setting=f"{setting}={name!r}",
                             hint=f"use a signal name such as {default}, or OFF")
        return

    def on_signal(num: int, _frame: Any) -> None:
        dump(f"signal {signal.Signals(num).name}")

    with contextlib.suppress(ValueError, OSError):
        if signal.getsignal(signum) in (signal.SIG_DFL, None):
            signal.signal(signum, on_signal)
