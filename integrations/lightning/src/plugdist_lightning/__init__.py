"""Lightning training that survives a SIGKILLed rank, on plugdist's resilient groups.

    from plugdist_lightning import ResilientDDPStrategy
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=ResilientDDPStrategy())

and start the script with ``plugdist-run --nproc-per-node 4 [--replace-failed] train.py``.
"""

from .environment import PlugdistEnvironment
from .strategy import ResilientDDPStrategy, WorldChangeHook

__all__ = ["ResilientDDPStrategy", "PlugdistEnvironment", "WorldChangeHook"]
