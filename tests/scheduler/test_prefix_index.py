"""The scheduler's belief of each runner's prefix cache (scheduler/prefix_index.py): names
as the runners give them, LRU up to the runner's pool, and the tracker fed by placements."""

from __future__ import annotations

from types import SimpleNamespace

from punica_x.core import SamplingParams
from punica_x.kv.blocks import BlockAllocator
from punica_x.kv.prefix import PrefixCache, cache_key
from punica_x.runtime import Request
from scheduler.prefix_index import PrefixIndex, PrefixTracker, block_names


def test_names_are_the_runners_names():
    """A runner's cache, fed the same tokens, finds every name the scheduler computes."""
    tokens = list(range(3, 40))
    r = Request(tokens, SamplingParams())
    r.cache_key = cache_key("t1/a@7", "tenant:1")
    runner = PrefixCache(BlockAllocator(8), 4)
    assert runner.names(r, 9) == block_names(tokens, 4, "t1/a@7", "tenant:1")
    assert block_names(tokens, 4, "t1/a@8", "tenant:1")[0] != runner.names(r, 1)[0]
    assert block_names(tokens, 4, "t1/a@7", "tenant:2")[0] != runner.names(r, 1)[0]
    assert len(block_names(tokens[:7], 4, None, None)) == 1  # full blocks only


def test_the_index_matches_prefixes_and_forgets_the_least_recent():
    index = PrefixIndex(capacity=4)
    a = block_names(range(12), 4, None, "s")
    b = block_names(range(100, 112), 4, None, "s")
    index.record(a)
    assert index.match(a) == 3 and index.match(a[1:]) == 2 and index.match(b) == 0
    index.record(b[:2])  # 5 names for 4 places: a[0], the least recent, goes
    assert index.match(a) == 0 and index.match(a[1:]) == 2 and index.match(b) == 2
    index.clear()
    assert len(index) == 0


def _slot(rid, caching=True, total=64):
    info = SimpleNamespace(block_size=4, kv_blocks_total=total, prefix_caching=caching)
    return SimpleNamespace(runner_id=rid, handle=SimpleNamespace(info=info), prefix=None)


def test_the_tracker_follows_placements_and_endings():
    versions = {"t1/a": 3}
    tracker = PrefixTracker(versions.get)
    system = list(range(3, 23))  # 5 blocks
    turn1 = SimpleNamespace(
        adapter="t1/a", cache_salt="tenant:1", prompt=system + [90, 91], token_ids=[]
    )
    slots = [_slot("r0"), _slot("r1"), _slot("r2", caching=False)]
    assert tracker.cached(turn1, slots) == {}
    tracker.placed(turn1, slots[1])
    turn1.token_ids = [50, 51, 52, 53, 54, 55]  # what it generated before it ended
    tracker.left(turn1, slots[1])
    turn2 = SimpleNamespace(
        adapter="t1/a",
        cache_salt="tenant:1",
        prompt=turn1.prompt + turn1.token_ids + [92, 93, 94],
        token_ids=[],
    )
    assert tracker.cached(turn2, slots) == {"r1": 28}  # 7 full blocks of prompt + output
    other_tenant = SimpleNamespace(
        **{**vars(turn2), "cache_salt": "tenant:2", "prefix_names": None}
    )
    assert tracker.cached(other_tenant, slots) == {}
    versions["t1/a"] = 4  # a new version: a new cache
    turn2.prefix_names = None
    assert tracker.cached(turn2, slots) == {}
    tracker.placed(turn2, slots[2])  # a runner without prefix caching keeps no index
    assert slots[2].prefix is None
