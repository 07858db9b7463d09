"""examples/resilient_train.py with failures placed where the fault-tolerance tests need them.

``FT_KILLS="RANK:STEP,..."``: the first-generation worker of that rank SIGKILLs itself when it
reaches that step (the example's own --kill-rank does one). ``FT_DIE=joiner_receive``: the first
replacement SIGKILLs itself as it starts receiving the state; ``FT_DIE=source_send``: rank 0
SIGKILLs itself as it starts sending the state to a joiner (once per run). Every kill is a real
SIGKILL.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import resilient_train  # noqa: E402
from plugdist.parallel import fault_tolerant  # noqa: E402


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    first_generation = os.environ.get("PLUGDIST_JOIN") != "1"
    kills = {}
    for item in filter(None, os.environ.get("FT_KILLS", "").split(",")):
        rank, step = item.split(":")
        kills[int(rank)] = int(step)
    die = os.environ.get("FT_DIE", "")
    transfer = fault_tolerant.ResilientTraining._transfer_state
    run_step = fault_tolerant.ResilientTraining.run_step

    def transfer_state(self: Any, sending: bool, ready: bool = True) -> None:
        import plugdist as dist
        from plugdist._world.state import world

        def first_time() -> bool:  # once per run, whichever process gets there
            assert world.store is not None
            return world.store.add("test/ft_died", 1) == 1

        if die == "joiner_receive" and not sending \
                and os.environ.get("PLUGDIST_REPLACEMENT") == "1" and first_time():
            _die()
        if die == "source_send" and sending and dist.get_rank() == 0 and first_time():
            _die()
        transfer(self, sending, ready)

    def step_with_kills(self: Any, fn: Any) -> Any:
        if first_generation and kills.get(int(os.environ.get("PLUGDIST_FIRST_RANK", "-1"))) \
                == self.step:
            _die()
        return run_step(self, fn)

    if first_generation:
        os.environ["PLUGDIST_FIRST_RANK"] = os.environ.get("RANK", "-1")
    fault_tolerant.ResilientTraining._transfer_state = transfer_state  # type: ignore[method-assign]
    fault_tolerant.ResilientTraining.run_step = step_with_kills  # type: ignore[method-assign]
    resilient_train.main()


if __name__ == "__main__":
    main()
