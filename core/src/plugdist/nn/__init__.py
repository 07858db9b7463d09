"""Layers that communicate: ``plugdist.nn.SyncBatchNorm``, batch norm over a process group.

``import plugdist.nn`` (like ``plugdist.parallel``, not imported by ``import plugdist``).
"""

from plugdist.nn.sync_batchnorm import SyncBatchNorm

__all__ = ["SyncBatchNorm"]
