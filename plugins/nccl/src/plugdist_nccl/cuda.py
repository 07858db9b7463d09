"""The raw CUDA calls of the hot path: stream and event handles as integers, no torch wrappers.

torch's Python ``Stream``/``Event`` objects resolve the current device and stream on every use
(tens of microseconds per op together); an op needs only the caller's raw stream, one event
record and, for the watchdog, one event query. These go through cupy's CUDA runtime bindings
(Cython: well under a microsecond each) on the same driver context torch uses. Nothing here
runs at import time: :func:`runtime` loads cupy on first use (after ``availability()`` said yes).

Graph capture: ``stream_capturing`` tells whether a stream is being captured, so an op can be
captured instead of tracked; ``relax_capture_mode`` makes the calling thread exempt from a
capture running on another thread (the watchdog queries events while the user captures).
"""

from __future__ import annotations

import collections
import ctypes
import functools
from typing import Any

import torch

__all__ = ["runtime", "current_stream", "stream_capturing", "event_done", "EventPool",
           "relax_capture_mode", "NOT_READY"]

NOT_READY = 600  # cudaErrorNotReady
_DISABLE_TIMING = 0x2  # cudaEventDisableTiming: the cheapest event to record and query
_CAPTURE_MODE_RELAXED = 2  # CU_STREAM_CAPTURE_MODE_RELAXED



def _no_cuda(_index: int) -> int:
    raise RuntimeError("this torch build has no CUDA")


# (device index) -> the caller's current stream there, as a raw cudaStream_t
current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", _no_cuda)


@functools.cache
def runtime() -> Any:
    """``cupy.cuda.runtime`` (needs cupy: call after ``availability()`` said yes)."""
    from cupy.cuda import runtime as rt
    return rt


def stream_capturing(stream: int) -> bool:
    """Whether ``stream`` is being captured into a CUDA graph."""
    return bool(runtime().streamIsCapturing(stream))


def event_done(event: int) -> bool:
    """Whether every work recorded before ``event`` finished. Raises the CUDA error of a broken
    context (an illegal access, say) as cupy's ``CUDARuntimeError``."""
    rt = runtime()
    try:
        status = rt.eventQuery(event)
    except rt.CUDARuntimeError as exc:  # cupy versions that raise on cudaErrorNotReady
        if exc.status == NOT_READY:
            return False
        raise
    if status == 0:
        return True
    if status == NOT_READY:
        return False
    raise rt.CUDARuntimeError(status)


class EventPool:
    """Reusable CUDA events (timing disabled) of one device. Thread-safe without a lock:
    ``take`` and ``give`` are single deque operations."""

    def __init__(self) -> None:
        self._free: collections.deque[int] = collections.deque()
        self._made: list[int] = []

    def take(self) -> int:
        try:
            return self._free.pop()
        except IndexError:
            event = int(runtime().eventCreateWithFlags(_DISABLE_TIMING))
            self._made.append(event)
            return event

    def give(self, event: int) -> None:
        self._free.append(event)

    def destroy(self) -> None:
        """Free every event made here; call once nothing records or waits on them."""
        rt = runtime()
        made, self._made = self._made, []
        self._free.clear()
        for event in made:
            try:
                rt.eventDestroy(event)
            except Exception:  # noqa: BLE001 - a broken context: the process frees them
                pass


@functools.cache
def _driver() -> Any:
    return ctypes.CDLL("libcuda.so.1")


def relax_capture_mode() -> bool:
    """Exempt the calling thread from stream captures of other threads (``cudaStreamCapture
    ModeRelaxed`` for this thread): in the default (global) mode a capture elsewhere makes an
    event query here invalidate that capture. True when the driver took it."""
    try:
        mode = ctypes.c_int(_CAPTURE_MODE_RELAXED)
        return _driver().cuThreadExchangeStreamCaptureMode(ctypes.byref(mode)) == 0
    except (OSError, AttributeError):
        return False
