"""Rank functions for tests/test_harness.py (module level, so run_world can import them)."""

from __future__ import annotations

import os
import time


def one_raises_one_dies_one_waits(rank: int, world_size: int) -> str:
    """Rank 0 raises, rank 1 exits without a result, the rest wait for a peer that never comes."""
    if rank == 0:
        raise ValueError("planted failure on rank 0")
    if rank == 1:
        os._exit(7)
    time.sleep(600)
    return "never"


def last_raises_others_wait(rank: int, world_size: int) -> str:
    if rank == world_size - 1:
        raise RuntimeError(f"planted failure on rank {rank}")
    time.sleep(600)
    return "never"


def first_raises_second_returns_later(rank: int, world_size: int, delay: float) -> str:
    if rank == 0:
        raise ValueError("planted failure on rank 0")
    time.sleep(delay)
    return "finished"


def frees_a_block_twice(rank: int, world_size: int) -> str:
    """The last rank corrupts its C heap for real (frees one malloc block twice: glibc aborts
    the process); the others return."""
    if rank == world_size - 1:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.malloc.restype = ctypes.c_void_p
        libc.free.argtypes = [ctypes.c_void_p]
        block = libc.malloc(48)
        libc.free(block)
        libc.free(block)
        return "glibc missed the double free"
    return "fine"
