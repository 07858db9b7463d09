"""The membership protocol of a resilient world: liveness, the death log, agreement,
joining. Knows nothing of backends or groups."""
