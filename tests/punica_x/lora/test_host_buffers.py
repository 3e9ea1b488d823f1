"""An adapter's host buffers: zeros of the asked shape and dtype, writable; large ones in a
map of their own (returned to the system whole when freed), small ones on the heap."""

from __future__ import annotations

import gc
import mmap

import pytest
import torch

from punica_x.lora.host_buffers import MIN_MAPPED_BYTES, host_zeros


def _mapped(t: torch.Tensor) -> bool:
    """Whether the tensor's memory starts a page of an anonymous map listed in /proc/self/maps."""
    start = t.untyped_storage().data_ptr()
    with open("/proc/self/maps") as f:
        return any(int(line.split("-")[0], 16) == start for line in f)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_large_buffers_are_mapped_zeros(dtype):
    shape = (3, 40, MIN_MAPPED_BYTES // 40 // dtype.itemsize + 1)
    t = host_zeros(shape, dtype)
    assert (t.shape, t.dtype, t.device.type) == (shape, dtype, "cpu")
    assert t.is_contiguous() and not t.any()
    t[1, 2, 3] = 5
    assert t.sum().item() == 5
    assert _mapped(t) and t.untyped_storage().data_ptr() % mmap.PAGESIZE == 0
    small = host_zeros((4, 4), dtype)
    assert not small.any() and small.shape == (4, 4)


def test_a_freed_buffer_is_unmapped():
    t = host_zeros((8 << 20,), torch.uint8)
    start = t.untyped_storage().data_ptr()
    t.fill_(1)
    assert _mapped(t)
    del t
    gc.collect()
    with open("/proc/self/maps") as f:
        assert not any(int(line.split("-")[0], 16) == start for line in f)
