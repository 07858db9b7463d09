"""Settings for every test of the repository: the cross-package tests under tests/ and each
plugin's own under plugins/*/tests."""

from __future__ import annotations

import os
import tempfile

# flight-recorder dumps of worlds under DETAIL (every rank dumps on a planted error) go to a folder
# of this session, not to torch's default /tmp/nccl_trace_rank_<rank>
os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE",
                      os.path.join(tempfile.mkdtemp(prefix="plugdist-fr-"), "rank_"))
