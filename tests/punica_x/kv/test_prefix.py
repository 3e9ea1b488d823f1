"""The runner's prefix cache on its own (punica_x/kv/prefix.py): names, how much a hit may
cover, in-batch deferral, and what is never named."""

from __future__ import annotations

from punica_x.core import RemoteExtent, SamplingParams
from punica_x.kv.blocks import BlockAllocator
from punica_x.kv.prefix import PrefixCache, block_name, cache_key
from punica_x.runtime import Request


def request(tokens, key=b"k" * 16, **sampling) -> Request:
    r = Request(list(tokens), SamplingParams(**sampling))
    r.cache_key = key
    return r


def computed(cache: PrefixCache, r: Request) -> None:
    """As a step that computes all of r's tokens would leave it."""
    r.block_ids = cache.allocator.allocate(-(-r.num_tokens // cache.block_size))
    cache.computed(r, 0, r.num_tokens)
    r.num_computed_tokens = r.num_tokens


def test_names_chain_from_the_key():
    cache = PrefixCache(BlockAllocator(8), 4)
    r = request(range(10, 20))
    a, b = cache.names(r, 2)
    assert a == block_name(r.cache_key, [10, 11, 12, 13]) and b == block_name(a, [14, 15, 16, 17])
    assert cache_key(None, None) == cache_key(None, "") != cache_key(None, "x")
    assert cache_key("1:sha", None) != cache_key(None, None)


def test_a_hit_leaves_the_last_token_and_unscored_prompt_positions_to_compute():
    cache = PrefixCache(BlockAllocator(16), 4)
    first = request(range(10, 22))  # 12 tokens: 3 full blocks
    computed(cache, first)
    same = request(range(10, 22))
    assert cache.reusable_blocks(same) == 2  # 11 tokens at most: 2 whole blocks
    assert cache.reuse(same) and same.num_computed_tokens == 8
    assert same.block_ids == first.block_ids[:2]
    scored = request(range(10, 22), prompt_logprobs=1)
    scored.prompt_logprobs.append(None)
    assert cache.reusable_blocks(scored) == 0
    longer = request(range(10, 30))
    assert cache.reuse(longer) and longer.num_computed_tokens == 12
    cache.undo(longer)
    assert longer.block_ids == [] and longer.num_computed_tokens == 0


def test_a_request_waits_for_a_block_being_computed_this_step():
    cache = PrefixCache(BlockAllocator(16), 4)
    running = request(range(10, 30))
    running.block_ids = cache.allocator.allocate(5)
    cache.computing(running, 20)
    sibling = request(range(10, 30))
    assert not cache.reuse(sibling) and sibling.block_ids == []
    cache.pending.clear()  # the next step: the blocks are computed and named
    cache.computed(running, 0, 20)
    assert cache.reuse(sibling) and sibling.num_computed_tokens == 16


def test_borrowed_and_uncached_requests_name_nothing():
    cache = PrefixCache(BlockAllocator(16), 4)
    borrowing = request(range(10, 30))
    borrowing.block_ids = cache.allocator.allocate(2)
    borrowing.remote = [RemoteExtent("runner-1", (0, 1, 2))]
    cache.computed(borrowing, 0, 20)
    off = request(range(10, 30), key=None)
    off.block_ids = cache.allocator.allocate(5)
    cache.computed(off, 0, 20)
    cache.allocator.free(borrowing.block_ids + off.block_ids)
    assert cache.allocator.num_cached == 0
    assert cache.reuse(off) and off.num_computed_tokens == 0
    cache.admitted(off)
    assert not cache.stats.queries  # a request with no key is not counted
