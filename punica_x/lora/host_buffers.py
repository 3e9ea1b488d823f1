"""Where an adapter's host copy lives: each large buffer in an anonymous memory map of its
own, not on the C heap.

A server registering thousands of adapters keeps some in its host LRU (LoraConfig.host_bytes)
and frees the rest, in no order, while it reads each adapter's files through transient
buffers of the same sizes. On glibc's heap that leaves long-lived buffers among freed holes:
once the host LRU was full, every further adapter registered grew the process by ~440 KB
(3,000 rank 8-64 adapters of SmolLM2, a 4 GiB LRU) though it held nothing more. A buffer
mapped on its own is returned to the system whole when its tensor is freed (the map is the
tensor's buffer): ~60 KB per further adapter in that in-process run, and 0.9-9.6 KB per
registered-but-cold adapter in a server holding 10,000 (benchmarks/bench_adapters.py)."""

from __future__ import annotations

import math
import mmap

import torch

MIN_MAPPED_BYTES = 64 << 10  # smaller buffers come from the heap (a map costs a page or more)


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor of `shape` and `dtype` on the CPU; one of MIN_MAPPED_BYTES or more in an
    anonymous map of its own (zero-filled by the system, unmapped when the tensor goes)."""
    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    if nbytes < MIN_MAPPED_BYTES:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype, count=count).view(shape)
