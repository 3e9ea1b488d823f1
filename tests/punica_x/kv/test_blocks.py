"""Block allocator and KV cache bookkeeping."""

import pytest
import torch

from punica_x.kv.blocks import BlockAllocator, KVCache, KVCacheSpec, blocks_needed


def test_allocate_is_all_or_nothing():
    a = BlockAllocator(4)
    first = a.allocate(3)
    assert len(set(first)) == 3 and a.num_free == 1
    assert a.allocate(2) is None and a.num_free == 1
    a.free(first)
    assert a.num_free == 4 and a.num_used == 0


def test_double_free_is_an_error():
    a = BlockAllocator(2)
    ids = a.allocate(1)
    a.free(ids)
    with pytest.raises(RuntimeError, match="freed twice"):
        a.free(ids)


def test_cache_layout_and_growth():
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
    cache = KVCache(spec, num_blocks=5, device=torch.device("cpu"))
    assert cache.kv.shape == (5, 3, 2, 2, 4, 8)  # [blocks, L, 2, N_kv, P, D], blocks outermost
    assert spec.bytes_per_block == 3 * 2 * 2 * 4 * 8 * 4
    table: list[int] = []
    assert cache.ensure_capacity(table, 9) and len(table) == blocks_needed(9, 4) == 3
    assert cache.ensure_capacity(table, 12) and len(table) == 3
    assert not cache.ensure_capacity(table, 21) and len(table) == 3  # needs 6 blocks, 5 exist
    cache.release(table)
    assert table == [] and cache.allocator.num_free == 5
