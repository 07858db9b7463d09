"""Making the debug level audible: INFO and DETAIL lower plugdist's log threshold to INFO.

plugdist logs nothing below WARNING by default. An explicit ``PLUGDIST_LOG_LEVEL`` always wins;
otherwise this module raises the verbosity while the debug level is INFO or DETAIL and puts it
back when the level returns to OFF. Thread-safe.
"""

from __future__ import annotations

import os
import threading

from plugdist import DebugLevel
from plugdist.backend import set_log_level

__all__ = ["follow_debug_level"]

_lock = threading.Lock()
_raised = False


def follow_debug_level(level: DebugLevel | int) -> None:
    """Print INFO events while ``level`` is INFO or DETAIL (unless PLUGDIST_LOG_LEVEL is set)."""
    global _raised
    if os.environ.get("PLUGDIST_LOG_LEVEL"):
        return
    want = DebugLevel(level) >= DebugLevel.INFO
    with _lock:
        if want and not _raised:
            set_log_level("INFO")
            _raised = True
        elif not want and _raised:
            set_log_level("WARNING")
            _raised = False
