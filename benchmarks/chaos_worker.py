"""examples/resilient_train.py as a chaos soak's worker (run by benchmarks/chaos.py).

Adds to the example what the soak's fault injector and invariant checks need, in ``CHAOS_DIR``:

* ``<pid>.start``: written at start (``{"pid", "start_time", "joining", "time"}``): how the
  injector finds the workers (a pid whose start time no longer matches is another process or a
  thread now), and which are replacements not yet in the world;
* ``<pid>.events``: one JSON line per discarded attempt (``shrink``) and, on rank 0 every 25
  committed steps, the store's key count (``keys``);
* SIGUSR1 holds the GIL for ``CHAOS_GIL_S`` seconds (a stall in C code: no thread of the
  process runs, its connections stay open), as torchft's DEADLOCK fault;
* a file ``die_in_transfer`` in ``CHAOS_DIR``: the next process to start a state transfer
  (a joiner receiving, or rank 0 sending; whichever claims the file) SIGKILLs itself there.

The example's ``--sample-log`` records (one per rank per committed step) carry the rest.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import chaos  # noqa: E402
import resilient_train  # noqa: E402
from plugdist.parallel import fault_tolerant  # noqa: E402

OUT = os.environ["CHAOS_DIR"]
PID = os.getpid()


def _event(**fields: Any) -> None:
    with open(os.path.join(OUT, f"{PID}.events"), "a") as f:
        f.write(json.dumps({"time": time.time(), **fields}) + "\n")


def _hold_the_gil(signum: int, frame: Any) -> None:
    # a PyDLL call keeps the GIL for its whole duration: every thread of this process stops
    ctypes.PyDLL(None).sleep(int(float(os.environ.get("CHAOS_GIL_S", "5"))))


def main() -> None:
    with open(os.path.join(OUT, f"{PID}.start"), "w") as f:
        json.dump({"pid": PID, "start_time": chaos.start_time(PID),
                   "joining": os.environ.get("PLUGDIST_JOIN") == "1",
                   "time": time.time()}, f)
    signal.signal(signal.SIGUSR1, _hold_the_gil)
    cls = fault_tolerant.ResilientTraining
    shrink, transfer, run_step = cls._shrink, cls._transfer_state, cls.run_step

    def on_shrink(self: Any) -> None:
        _event(event="shrink", step=self.step)
        shrink(self)

    def on_transfer(self: Any, sending: bool, ready: bool = True) -> None:
        import plugdist as dist

        if not sending or dist.get_rank() == 0:
            claim = os.path.join(OUT, "die_in_transfer")
            try:
                os.rename(claim, f"{claim}.{PID}")   # one process claims it
                _event(event="die_in_transfer", sending=sending)
                os.kill(PID, signal.SIGKILL)
            except FileNotFoundError:
                pass
        transfer(self, sending, ready)

    def step_and_count(self: Any, fn: Any) -> Any:
        result = run_step(self, fn)
        from plugdist._world.state import world

        if world.rank == 0 and self.step % 25 == 0 and world.store is not None:
            _event(event="keys", step=self.step, keys=world.store.num_keys())
        return result

    cls._shrink = on_shrink  # type: ignore[method-assign]
    cls._transfer_state = on_transfer  # type: ignore[method-assign]
    cls.run_step = step_and_count  # type: ignore[method-assign,assignment]
    resilient_train.main()


if __name__ == "__main__":
    main()
