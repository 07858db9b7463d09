"""What a backend is built from: Work, the abort signal, capabilities, reductions.

Private: backend authors import these names from :mod:`plugdist.backend`."""
