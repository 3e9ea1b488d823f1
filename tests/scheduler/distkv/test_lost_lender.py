"""A lender lost under a borrowing request: the request keeps its KV before the first block
that runner lent (its local prefix and the extents on runners still up), recomputes only
from there, and its greedy output equals one runner with room for all of it."""

from __future__ import annotations

import pytest
from kv_engines import PROMPT, engine, network, run

from punica_x.core import FinishReason


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
