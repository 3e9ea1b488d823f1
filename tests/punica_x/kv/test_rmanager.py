"""rManager, creditor side: loans within the caps, refusals beyond them, blocks given back,
plans that touch blocks not lent to the caller refused, a stopped runner raises PeerLost."""

from __future__ import annotations

import pytest
import torch

from punica_x.attention import get_attention_backend
from punica_x.attention.paged import SeqSpan
from punica_x.kv.blocks import KVCache, KVCacheSpec
from punica_x.kv.rmanager import LendCaps, MicroPlan, PeerLost, RManager


def manager(num_blocks=10, caps: LendCaps | None = None) -> RManager:
    caps = caps or LendCaps(6, 2)
    spec = KVCacheSpec(1, 1, 4, 2, torch.float32)
    cache = KVCache(spec, num_blocks, torch.device("cpu"))
    return RManager("c", cache, get_attention_backend("cpu", "torch"), caps)


def test_lends_within_the_block_cap_and_refuses_beyond():
    rm = manager()
    a = rm.lend("d1", "r1", 4)
    assert len(a) == 4 and rm.lent_blocks == 4 and rm.lendable() == 2
    b = rm.lend("d1", "r1", 5)  # partial: only 2 left under the cap of 6
    assert len(b) == 2 and rm.lendable() == 0
    assert rm.lend("d2", "r2", 1) is None and rm.refusals == 1
    assert rm.cache.allocator.num_free == 4  # the runner's own blocks stay
    rm.reclaim("d1", "r1", a + b)
    assert rm.lent_blocks == 0 and rm.cache.allocator.num_free == 10


def test_refuses_more_debtor_requests_than_the_cap():
    rm = manager()
    assert rm.lend("d1", "r1", 1) and rm.lend("d2", "r2", 1)
    assert rm.lend("d1", "r3", 1) is None  # a third request: compute cap of 2
    assert rm.lend("d1", "r1", 1)  # more for one already served is fine


def test_lendable_is_bounded_by_free_blocks():
    rm = manager(caps=LendCaps(10, 8))
    own = rm.cache.allocator.allocate(7)  # the runner's own requests
    assert rm.lendable() == 3 and len(rm.lend("d", "r", 5)) == 3
    rm.cache.allocator.free(own)


def test_reclaim_debtor_frees_everything_it_held():
    rm = manager()
    rm.lend("d1", "r1", 2)
    rm.lend("d1", "r2", 1)
    assert rm.reclaim_debtor("d1") == 3
    assert rm.lent_blocks == 0 and rm.cache.allocator.num_free == 10


def test_plans_only_touch_blocks_lent_to_the_caller():
    rm = manager()
    ids = rm.lend("d1", "r1", 2)
    other = rm.lend("d2", "r2", 1)
    ok = MicroPlan(("r1",), (SeqSpan(0, 1, 3, list(ids)),), (ids[1],), (0,))
    micro = rm.prepare("d1", ok)
    q, kv_rows = torch.randn(1, 1, 4), torch.randn(1, 1, 4)
    out, lse = micro.run(0, q, kv_rows, kv_rows, 0.5)
    assert out.shape == (1, 1, 4) and lse.shape == (1, 1)
    assert torch.equal(rm.cache.kv[ids[1], 0, 0, :, 0], kv_rows[0])  # written in place
    stray = MicroPlan(("r1",), (SeqSpan(0, 1, 2, list(other)),), (), ())
    with pytest.raises(ValueError, match="not lent to d1"):
        rm.prepare("d1", stray)
    rm.stop()
    with pytest.raises(PeerLost):
        micro.run(0, q, kv_rows, kv_rows, 0.5)
    with pytest.raises(PeerLost):
        rm.lend("d1", "r1", 1)


def test_lends_nothing_new_while_serving_peers_took_its_compute_share():
    """Once micro-attention for peers took more than max_compute_share of the last window,
    no new blocks are lent and the heartbeat offers none; calls on existing loans are still
    served, and lending resumes when the window has moved past them."""
    now = [100.0]
    spec = KVCacheSpec(1, 1, 4, 2, torch.float32)
    cache = KVCache(spec, 10, torch.device("cpu"))
    caps = LendCaps(8, 4, max_compute_share=0.25, window_s=2.0)
    rm = RManager("c", cache, get_attention_backend("cpu", "torch"), caps, clock=lambda: now[0])
    ids = rm.lend("d1", "r1", 2)
    micro = rm.prepare("d1", MicroPlan(("r1",), (SeqSpan(0, 1, 3, list(ids)),), (), ()))
    q, none = torch.randn(1, 1, 4), torch.empty(0, 1, 4)
    micro.run(0, q, none, none, 0.5)
    assert 0 < rm.compute_share() < 0.25 and rm.busy_seconds > 0  # measured, and small
    rm._served(0.6)  # a burst of peers' work: 0.6 s of the last 2 s
    assert rm.compute_share() > 0.25
    assert rm.lendable() == 0 and rm.lend("d2", "r2", 1) is None
    out, _ = micro.run(0, q, none, none, 0.5)  # the loan it has is still served
    assert out.shape == (1, 1, 4)
    now[0] += 2.5  # the burst left the window
    assert rm.compute_share() == 0 and rm.lendable() == 6
    assert rm.lend("d2", "r2", 1)


def test_its_own_blocks_are_not_counted_as_peers_compute():
    rm = manager()
    own = rm.cache.allocator.allocate(2)  # a DGFM swap brought a request's blocks home
    micro = rm.prepare("c", MicroPlan(("r",), (SeqSpan(0, 1, 3, own),), (), ()))
    micro.run(0, torch.randn(1, 1, 4), torch.empty(0, 1, 4), torch.empty(0, 1, 4), 0.5)
    assert rm.busy_seconds == 0


def test_caps_refuse_a_compute_share_outside_0_1():
    with pytest.raises(ValueError, match="max_compute_share"):
        LendCaps(4, max_compute_share=0)
    with pytest.raises(ValueError, match="max_compute_share"):
        LendCaps(4, max_compute_share=1.5)
