"""The command-line tools: ``plugdist`` (``cli``), ``plugdist-bench`` (``bench``) and the
backend scaffold (``scaffold``)."""
