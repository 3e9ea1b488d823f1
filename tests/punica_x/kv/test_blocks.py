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


# -- prefix caching: reference counts, names, LRU eviction -----------------------------------
def test_a_named_block_is_cached_when_freed_and_found_again():
    a = BlockAllocator(3)
    [b] = a.allocate(1)
    assert a.name(b, b"x")
    a.free([b])
    assert a.num_free == 3 and a.num_used == 0 and a.num_cached == 1
    assert a.lookup([b"x", b"y"]) == [b]  # the longest cached prefix, referenced
    assert a.num_cached == 0 and a.num_used == 1
    assert a.lookup([b"x"]) == [b]  # two holders
    a.free([b])
    assert a.num_used == 1  # still held once
    a.free([b])
    assert a.num_cached == 1
    with pytest.raises(RuntimeError, match="freed twice"):
        a.free([b])


def test_free_blocks_go_before_cached_ones_and_the_oldest_cached_first():
    a = BlockAllocator(4)
    ids = a.allocate(3)
    for i, name in zip(ids, (b"a", b"b", b"c")):
        a.name(i, name)
    a.free(ids)  # released tail first: c is the least recently used, then b, then a
    assert a.num_cached == 3
    [fresh] = a.allocate(1)
    assert fresh not in ids and a.num_cached == 3  # the never-used block first
    [evicted] = a.allocate(1)
    assert evicted == ids[2] and a.num_cached == 2
    assert a.lookup([b"c"]) == []  # forgotten with its eviction
    assert a.lookup([b"a"]) == [ids[0]]  # a lookup takes a block out of the LRU
    assert a.allocate(2) is None  # only b is evictable now
    assert a.allocate(1) == [ids[1]]


def test_a_name_is_given_once():
    a = BlockAllocator(2)
    x, y = a.allocate(2)
    assert a.name(x, b"n") and not a.name(y, b"n") and not a.name(x, b"m")
    a.free([x, y])
    assert a.num_cached == 1  # y was never named: free
    with pytest.raises(RuntimeError, match="not held"):
        a.name(x, b"z")
    assert a.allocate(2) is not None  # the cached block goes last, and with it its name
    assert a.lookup([b"n"]) == []
