"""DDP's reducer runs its own bookkeeping collectives (the bucket-rebuild agreement, the
unused-parameter all_reduce of find_unused_parameters and static_graph) on the parameters'
device, so a CUDA-only backend accepts them. A world of one never reaches those paths; this test
runs them at world size 2 on real Gloo.

Without a GPU the parameters' device is the CPU, so the test makes ``meta`` torch's default
device during forward and backward: a tensor the reducer creates without naming the parameters'
device lands on ``meta`` and Gloo refuses it (the bucket-rebuild broadcast did, before the fix).
The unused-parameter tensor is built from the CPU bitmap and moved to the parameters' device,
which on CPU changes nothing:
``plugins/nccl/tests/test_nccl.py::test_ddp_on_cuda_two_ranks`` checks that path on a GPU
(part of ``make gpu-check``)."""

from __future__ import annotations

import _reducer_workers as workers
import pytest
from plugdist.testing import run_world


@pytest.mark.timeout(150)
def test_reducer_bookkeeping_follows_the_parameters_device() -> None:
    results = run_world(workers.bookkeeping_on_the_parameters_device, 2, backend="gloo",
                        timeout=120)
    assert results == [[], []], results
