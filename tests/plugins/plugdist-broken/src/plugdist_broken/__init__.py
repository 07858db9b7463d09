"""Fails on import on purpose, as a plugin with a missing dependency would."""

import plugdist_dependency_that_does_not_exist  # noqa: F401
