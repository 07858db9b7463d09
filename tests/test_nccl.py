"""The NCCL plugin (plugdist-nccl).

Without a GPU (or without cupy/NCCL) only the first group runs: the package installs and imports,
says why it is unavailable, and refuses to build a group with that reason. With GPUs, the
conformance suite runs on world sizes 1..(number of GPUs), plus stream-ordering, a high-priority
stream, DDP on one rank and NCCL_BLOCKING_WAIT.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import _nccl_workers as workers
import plugdist as dist
import pytest
import torch
from plugdist.reduce_op import ReduceOp
from plugdist.registry import BACKENDS, registry
from plugdist.testing import run_world
from plugdist.testing.checks import check_names, run_checks
from plugdist.testing.conformance import _gpu_shortfall
from plugdist_nccl import NCCLOptions, NCCLProcessGroup, availability, is_nccl_available
from plugdist_nccl.options import ErrorHandling, error_handling_from_env

AVAILABLE, REASON = NCCLProcessGroup.is_available()
needs_gpu = pytest.mark.skipif(not AVAILABLE, reason=f"nccl unavailable: {REASON}")
GPUS = torch.cuda.device_count() if AVAILABLE else 0
WORLD_TIMEOUT = 240.0
VENV_BIN = Path(sys.executable).parent


# -- runs everywhere ---------------------------------------------------------------------------
def test_package_imports_without_touching_cupy_or_the_gpu() -> None:
    code = ("import sys, plugdist_nccl; "
            "print('cupy' in sys.modules, plugdist_nccl.NCCLProcessGroup.backend_name)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "nccl"]


def test_entry_point_loads_the_class() -> None:
    assert registry.load(BACKENDS, "nccl") is NCCLProcessGroup
    caps = NCCLProcessGroup.static_capabilities()
    assert caps.device_types == ("cuda",)
    assert caps.refused_reduce_ops == {ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR}
    assert {ReduceOp.SUM, ReduceOp.AVG, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX} <= caps.reduce_ops
    assert all(caps.is_native(op, "cuda") for op in ("gather", "scatter", "all_to_all_single"))


def test_availability_matches_and_explains() -> None:
    ok, reason = availability()
    assert (ok, reason) == (AVAILABLE, REASON)
    assert is_nccl_available() is ok is dist.is_nccl_available()
    assert reason
    if not torch.cuda.is_available():
        assert not ok and "GPU" in reason


@pytest.mark.skipif(AVAILABLE, reason="checks the message shown when NCCL is unavailable")
def test_plugdist_info_says_why() -> None:
    out = subprocess.run([str(VENV_BIN / "plugdist"), "info"], capture_output=True, text=True,
                         check=True).stdout
    assert f"backend nccl: NOT available: {REASON}" in out
    assert "refused reductions (an error, not composed): BAND, BOR, BXOR" in out


@pytest.mark.skipif(AVAILABLE, reason="checks the refusal when NCCL is unavailable")
def test_init_process_group_refuses_with_the_reason() -> None:
    store = dist.HashStore()
    with pytest.raises(dist.DistError, match="nccl backend cannot run here") as info:
        dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    assert REASON in str(info.value)
    assert not dist.is_initialized()


def test_options() -> None:
    assert NCCLOptions.coerce(None) == NCCLOptions()

    class TorchLike:
        is_high_priority_stream = True

    assert NCCLOptions.coerce(TorchLike()).is_high_priority_stream
    with pytest.raises(TypeError, match="NCCLOptions"):
        NCCLOptions.coerce({"is_high_priority_stream": True})
    assert NCCLOptions(device_id="cuda:1").device() == torch.device("cuda", 1)
    assert NCCLOptions(device_id=2).device() == torch.device("cuda", 2)
    with pytest.raises(ValueError, match="CUDA device"):
        NCCLOptions(device_id="cpu").device()


def test_error_handling_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    monkeypatch.delenv("NCCL_ASYNC_ERROR_HANDLING", raising=False)
    assert error_handling_from_env() is ErrorHandling.OFF
    monkeypatch.setenv("NCCL_ASYNC_ERROR_HANDLING", "1")
    assert error_handling_from_env() is ErrorHandling.TEAR_DOWN
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")  # the TORCH_ spelling wins
    assert error_handling_from_env() is ErrorHandling.CLEAN_UP
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "yes")
    with pytest.raises(ValueError, match="TORCH_NCCL_ASYNC_ERROR_HANDLING"):
        error_handling_from_env()


def test_dtype_views() -> None:
    from plugdist_nccl.dtypes import data_buffer, nccl_op, reduction_buffer

    new = (2, 19, 3)
    assert data_buffer(torch.zeros(3, dtype=torch.int16), new).count == 6      # raw bytes
    assert data_buffer(torch.zeros(3, dtype=torch.bfloat16), (2, 8, 0)).count == 6
    assert reduction_buffer(torch.zeros(3, dtype=torch.complex64), new).count == 6
    assert reduction_buffer(torch.zeros(3, dtype=torch.bool), new).dtype == 1  # uint8
    assert nccl_op(ReduceOp.SUM, torch.bool) == nccl_op(ReduceOp.MAX, torch.bool)
    with pytest.raises(TypeError, match="int16"):
        reduction_buffer(torch.zeros(3, dtype=torch.int16), new)
    with pytest.raises(TypeError, match="bfloat16"):
        reduction_buffer(torch.zeros(3, dtype=torch.bfloat16), (2, 8, 0))


# -- needs GPUs --------------------------------------------------------------------------------
@needs_gpu
@pytest.mark.timeout(WORLD_TIMEOUT + 60)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8], ids=lambda n: f"world{n}")
def test_conformance_on_gpus(world_size: int) -> None:
    short = _gpu_shortfall("nccl", world_size)
    if short:
        pytest.skip(short)
    results = run_world(run_checks, world_size, backend="nccl", timeout=WORLD_TIMEOUT,
                        group_timeout=60.0)
    failures = [r[name] for r in results for name in check_names() if r.get(name)]
    assert not failures, "\n".join(failures)


@needs_gpu
@pytest.mark.parametrize("world_size", [1, 2], ids=lambda n: f"world{n}")
def test_results_ordered_for_another_stream_after_wait(world_size: int) -> None:
    short = _gpu_shortfall("nccl", world_size)
    if short:
        pytest.skip(short)
    results = run_world(workers.stream_ordering, world_size, backend="nccl", timeout=120,
                        group_timeout=60.0)
    assert results == [[]] * world_size, results


@needs_gpu
def test_high_priority_stream() -> None:
    [(priority, total)] = run_world(workers.high_priority, 1, backend="nccl", timeout=120)
    assert priority < 0 and total == 4.0


@needs_gpu
def test_ddp_on_cuda_one_rank() -> None:
    [diffs] = run_world(workers.ddp_one_rank, 1, backend="nccl", timeout=120)
    assert max(diffs) < 1e-6, diffs


@needs_gpu
@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
def test_blocking_wait_raises_timeout() -> None:
    results = run_world(workers.blocking_wait_timeout, 2, backend="nccl", timeout=90,
                        group_timeout=3.0, env={"NCCL_BLOCKING_WAIT": "1"}, expect_errors=True)
    assert results[0].value is not None and results[0].value.startswith("timeout:"), results[0]
    assert "NCCL_BLOCKING_WAIT" in results[0].value


def test_gpu_tests_skip_with_the_reason() -> None:
    ok, reason = NCCLProcessGroup.is_available()  # asked again, not the module's answer
    [skips] = needs_gpu.args
    assert skips is (not ok)
    if not skips:
        pytest.skip("GPU present: the GPU tests run")
    assert reason and REASON
    assert needs_gpu.kwargs["reason"] == f"nccl unavailable: {reason}"
