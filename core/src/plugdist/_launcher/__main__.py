"""``python -m plugdist._launcher``: the same as ``plugdist-run`` (but it imports torch through
``plugdist/__init__.py``; ``python -m plugdist_run`` does not)."""

import sys

from plugdist._launcher import main

sys.exit(main())
