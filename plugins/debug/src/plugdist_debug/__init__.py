"""plugdist-debug: ``TORCH_DISTRIBUTED_DEBUG`` for plugdist, as a plugin the core never imports.

* DETAIL wraps the backend of every group from ``init_process_group`` and ``new_group`` in a
  :class:`DebugBackend` that checks each collective's fingerprint across the group before
  running it (:class:`CollectiveMismatchError` on every rank on a mismatch, ``DistTimeoutError``
  naming the ranks that never arrived), and keeps a flight recorder
  (:func:`dump_flight_recorder`, ``plugdist debug analyze DIR``).
* INFO and DETAIL log DDP's construction data; DETAIL adds DDP runtime statistics.

The level comes from ``TORCH_DISTRIBUTED_DEBUG`` / ``PLUGDIST_DEBUG`` or the core's
``set_debug_level`` (re-exported here); groups follow the level in force when they are created.
"""

from plugdist import get_debug_level, set_debug_level, set_debug_level_from_env

from .analyze import analyze, load_dumps
from .exchange import CollectiveMismatchError
from .flight_recorder import dump_flight_recorder, recorders
from .wrapper import DebugBackend

__all__ = ["CollectiveMismatchError", "DebugBackend", "analyze", "dump_flight_recorder",
           "get_debug_level", "load_dumps", "recorders", "set_debug_level",
           "set_debug_level_from_env"]
