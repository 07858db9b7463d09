"""plugdist-gloo: the CPU backend of plugdist, over torch's built-in Gloo.

Found by plugdist through the ``plugdist.backends`` entry point ``gloo``; importing this package
has no side effects. See the package README for what is native, env vars and dtypes.
"""

from .options import GlooOptions
from .process_group import GlooProcessGroup

__all__ = ["GlooProcessGroup", "GlooOptions", "__version__"]

__version__ = "0.1.0"
