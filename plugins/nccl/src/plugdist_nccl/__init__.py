"""plugdist-nccl: the GPU backend of plugdist, over NCCL through ``cupy.cuda.nccl``.

Found by plugdist through the ``plugdist.backends`` entry point ``nccl``. Importing this package
imports neither cupy nor NCCL and touches no GPU; that happens when a group is built or
:func:`availability` is asked. See the package README for stream semantics and env vars.
"""

from ._nccl import availability, is_nccl_available
from .cupy_interop import from_cupy
from .options import NCCLOptions
from .process_group import NCCLProcessGroup
from .work import NCCLWork

__all__ = ["NCCLProcessGroup", "NCCLOptions", "NCCLWork", "availability", "is_nccl_available",
           "from_cupy", "__version__"]

__version__ = "0.1.0"
