"""A lender lost under a borrowing request: the request keeps its KV before the first block
that runner lent (its local prefix and the extents on runners still up), recomputes only
from there, and its greedy output equals one runner with room for all of it."""

from __future__ import annotations

import pytest
from kv_engines import PROMPT, engine, network, run

from punica_x.core import FinishReason
from scheduler.distkv.network import default_caps


@pytest.fixture(scope="module")
def reference(shared):
    return run(engine(shared, 64), [PROMPT])["q0"].token_ids


@pytest.mark.parametrize("which", [0, -1])
def test_a_lost_lender_recomputes_only_after_the_kv_kept(shared, reference, which):
    """which: the first lender (the extents after it, on runners still up, go back to them)
    or the last one (every extent before it is kept)."""
    a, b, c, d = engine(shared, 4), engine(shared, 6), engine(shared, 6), engine(shared, 6)
    net = network({"a": a, "b": b, "c": c, "d": d})
    seen = {}

    def kill(steps):
        r = a.requests.get("q0")
        if "kept" in seen or r is None or len(r.output_token_ids) < 30:
            return
        owners = [e.owner for e in r.remote if e.owner != "a"]
        assert len(set(owners)) >= 2, owners  # it borrowed from both peers
        lost = owners[which]
        before = r.num_computed_tokens
        net.remove(lost, dead=True)
        a.step()  # meets the loss: cut, nothing computed this step
        blocks = len(r.block_ids) + sum(len(e.block_ids) for e in r.remote)
        local = len(r.block_ids)
        seen.update(
            kept=r.num_computed_tokens, blocks=blocks, local=local, before=before, lost=lost
        )
        assert all(e.owner != lost for e in r.remote)

    out = run(a, [PROMPT], on_step=kill)
    assert out["q0"].token_ids == reference
    assert out["q0"].finish_reason is FinishReason.LENGTH
    assert a.distkv.peer_losses == 1
    # it kept every block before the lost runner's: more than its local prefix, less than all
    assert len(a.requests) == 0 and seen["kept"] == seen["blocks"] * 16
    assert seen["local"] == 3 and seen["kept"] < seen["before"]
    if which == 0:
        assert seen["blocks"] == seen["local"]
    else:
        assert seen["blocks"] > seen["local"]
    survivors = [e for rid, e in (("b", b), ("c", c), ("d", d)) if rid != seen["lost"]]
    assert [e.cache.allocator.num_free for e in survivors] == [6, 6]
    assert net.ledger.debts() == {} and a.cache.allocator.num_free == 4


def test_a_request_the_others_cannot_hold_waits_for_a_new_runner(shared, reference):
    """Its lender lost, a request the runners left cannot hold goes back to the queue (it
    would otherwise end with length, truncated), and completes once a runner joins."""
    a, b, c = engine(shared, 4), engine(shared, 10), engine(shared, 6)
    net = network({"a": a, "b": b, "c": c})
    seen = {}

    def kill(steps):
        r = a.requests.get("q0")
        if seen or r is None or len(r.output_token_ids) < 30:
            return
        lost = r.remote[0].owner
        net.remove(lost, dead=True)
        a.step()  # meets the loss: the runners left lend too little for its 12 blocks
        seen["waiting"] = r in a.batcher.waiting and not r.remote and not r.block_ids
        d = engine(shared, 10)
        caps = default_caps(10)
        net.attach("d", d.distkv.enable("d", net.add_runner("d"), caps, False, pool=net.pool))
        seen["lost"] = lost

    out = run(a, [PROMPT], on_step=kill)
    assert seen == {"waiting": True, "lost": "b"}
    assert out["q0"].token_ids == reference


def test_a_ray_runner_counts_a_lost_lender_out_before_the_group_says_so():
    """A Ray runner learns of members from the group, after the fleet notices a death; the
    engine meets the loss first (PeerLost) and must not count the dead lender's blocks in
    between (it would keep a request running that the others cannot hold)."""
    from scheduler.distkv.ray_group import RayBorrower

    borrower = RayBorrower("a", None, {}, 0, None)
    borrower.set_peers({"b": None, "c": None}, {}, 20, {"b": 9, "c": 11})
    assert borrower.capacity_blocks() == 20
    borrower.lost("b")
    assert borrower.capacity_blocks() == 11
    borrower.set_peers({"c": None}, {}, 11, {"c": 11})  # the group's update
    assert borrower.capacity_blocks() == 11 and borrower.gone == set()


def test_a_request_whose_peers_lend_less_than_it_got_waits_instead_of_ending(shared, reference):
    """Its peers lend less than when it got blocks (here a cap lowered; a lender that died
    and has no replacement yet, in the campaign): growing past what they hold now, it goes
    back to the queue (before: it ended with length, truncated) and ends
    with its whole output once they lend again."""
    import dataclasses

    a, b = engine(shared, 4), engine(shared, 10)
    network({"a": a, "b": b})
    rm = b.distkv.rmanager
    full = rm.caps
    seen = []

    def squeeze(steps):
        r = a.requests.get("q0")
        if r is None:
            return
        if not seen and r.remote and len(r.output_token_ids) == 5:
            rm.caps = dataclasses.replace(full, max_blocks=rm.lent_blocks)  # no more
            seen.append("squeezed")
        elif seen == ["squeezed"] and r.num_preemptions:
            rm.caps = full
            seen.append(("waited after", len(r.output_token_ids)))

    out = run(a, [PROMPT], on_step=squeeze)
    assert seen[0] == "squeezed" and seen[1][0] == "waited after"
    assert out["q0"].token_ids == reference
