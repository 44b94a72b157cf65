"""Host memory: make glibc give back the block-sized buffers that ZeRO-3 frees and remakes every unit.

ZeRO-3 allocates a unit's gathered weights (and its flat gradient) when the unit runs and frees them right after;
that is the whole point of sharding. On a CPU device these buffers come from glibc's ``malloc``, whose *dynamic*
mmap threshold defeats it: after the first freed buffer of a size (up to 32 MiB) glibc raises the threshold to
that size, so every later buffer of that size is carved from the heap, and a freed heap buffer stays resident,
fragmenting with the activations around it. Measured by benchmarks/checkpoint.py on the issue-12 run (72M
parameters, dp4 ZeRO-3): a rank's resident peak is 0.70x one process's with glibc's dynamic threshold and 0.43x
with the threshold fixed at the unit size, the live tensors being the same.

So FSDP fixes the threshold (``mallopt(M_MMAP_THRESHOLD)``, which also turns the dynamic adjustment off) at its
smallest unit buffer of at least 1 MiB: those buffers are mapped on allocation and unmapped on free; smaller
allocations (most activations) stay on the heap, where reuse is cheap. Nothing changes on an accelerator (its
caching allocator does the pooling), without glibc, or when the user set ``MALLOC_MMAP_THRESHOLD_`` themselves.
"""

from __future__ import annotations

import ctypes
import os
import platform

import torch

M_MMAP_THRESHOLD = -3  # mallopt parameter number (malloc.h)
GLIBC_MAX_THRESHOLD = 32 * 2**20  # mallopt refuses more on 64-bit; larger blocks are always mapped anyway
MIN_UNIT_BYTES = 2**20  # below this, keeping freed buffers on the heap costs little and mapping costs time

_fixed: int | None = None  # the threshold this process set, if any (only ever lowered)


def map_unit_buffers(buffer_bytes: list[int], device: torch.device) -> int | None:
    """Have malloc map (and unmap on free) buffers as large as the smallest of ``buffer_bytes`` that is at least
    ``MIN_UNIT_BYTES``. Returns the threshold in force after the call, or None where nothing was changed."""
    global _fixed
    sizes = [b for b in buffer_bytes if b >= MIN_UNIT_BYTES]
    if device.type != "cpu" or not sizes or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return None
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    threshold = min(min(sizes), GLIBC_MAX_THRESHOLD)
    if _fixed is not None and _fixed <= threshold:
        return _fixed
    if ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, threshold) != 1:
        return None
    _fixed = threshold
    return threshold


def mmap_threshold() -> int | None:
    """The threshold this process fixed with ``map_unit_buffers`` (None: glibc's own, or the environment's)."""
    return _fixed
