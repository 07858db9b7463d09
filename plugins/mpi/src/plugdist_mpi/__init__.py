"""plugdist-mpi: the MPI backend of plugdist, through mpi4py.

Found by plugdist through the ``plugdist.backends`` entry point ``mpi``. Importing this package
does not initialize MPI; building a group (or ``MPIProcessGroup.is_available()``) does. See the
package README for running under mpiexec, the threading model, dtypes and env vars.
"""

from .process_group import MPIProcessGroup

__all__ = ["MPIProcessGroup", "__version__"]

__version__ = "0.1.0"
