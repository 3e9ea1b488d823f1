"""A prompt too long for its runner beside short requests (tiny model, in-process runners):
it borrows from its first chunk on, never preempts the short ones to grow, and leaves them a
quarter of the runner's cache (punica_x/kv/borrowing.py HEADROOM)."""

from __future__ import annotations

import pytest
from kv_engines import GREEDY, PROMPT, engine, network, run

from punica_x.config import BatchConfig, CacheConfig, EngineConfig, ModelConfig
from punica_x.core import SamplingParams
from punica_x.engine import Engine

SHORT = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
SHORTS = [PROMPT[:20], PROMPT[30:50]]  # 40 tokens with their output: 3 blocks each


def serve(e) -> tuple[list[str], dict, int]:
    """The two shorts, prefilled in a first step, then the long prompt; run to the end.
    Returns the order they finished in, their tokens, and the most blocks of e's cache the
    long prompt held while both short ones ran."""
    for i, p in enumerate(SHORTS):
        e.add_request(p, SHORT, request_id=f"q{i}")
    e.step()
    e.add_request(PROMPT, GREEDY, request_id="long")
    order, tokens, most = [], {}, 0
    while e.has_unfinished():
        for out in e.step():
            if out.finished:
                order.append(out.request_id)
                tokens[out.request_id] = out.token_ids
        r = e.requests.get("long")
        if r is not None and not order:
            home = sum(len(x.block_ids) for x in r.remote if x.owner == "a")
            most = max(most, len(r.block_ids) + home)
    return order, tokens, most


def test_a_long_prompt_beside_short_ones_borrows_without_preempting_them(shared):
    """a holds 8 blocks; the shorts take 2 each as they prefill (3 each by their end). The
    long prompt (12 blocks, chunks of 32 tokens) takes a's free blocks down to a quarter of
    a's cache (2 of the 4 free) and borrows the rest on b: the shorts grow into the 2 left,
    nothing is preempted, and the shorts finish first with one big runner's tokens. (Before,
    it took a's blocks chunk by chunk and preempted both shorts, which then recomputed
    behind it.)"""
    _, want, _ = serve(engine(shared, 64))
    a, b = engine(shared, 8, chunk=32), engine(shared, 10)
    network({"a": a, "b": b})
    order, tokens, most = serve(a)
    assert a.batcher.num_preemptions == 0
    assert order == ["q0", "q1", "long"]
    assert tokens == want
    assert most == 3  # q0's first block (their prompts share it: prefix caching) and 2
    assert b.distkv.rmanager.calls > 0  # its attention ran on b's blocks too


def test_when_its_peers_cannot_lend_the_rest_it_takes_the_headroom_too(shared):
    """b's own work holds 6 of its 10 blocks: it lends 4. The long prompt (12 blocks) on a
    (8) leaves 2 free, gets 4 on b and is refused the last 2: it takes the headroom rather
    than wait (before this fallback: refused until give_up_s, then an error)."""
    (want,) = [o.token_ids for o in run(engine(shared, 64), [PROMPT]).values()]
    a, b = engine(shared, 8), engine(shared, 10)
    network({"a": a, "b": b})
    b.cache.allocator.allocate(6)
    a.batcher.borrowing.give_up_s = 2.0
    (out,) = run(a, [PROMPT]).values()
    assert out.error is None and out.token_ids == want
    assert a.cache.allocator.num_free == 8 and b.cache.allocator.num_free == 4


@pytest.mark.parametrize("bad", [-0.1, 1, 1.5, float("nan"), float("inf"), "0.25", True, None])
def test_borrow_headroom_refuses_what_is_not_a_fraction(bad):
    with pytest.raises(ValueError, match="borrow_headroom must be a number in"):
        BatchConfig(borrow_headroom=bad)


def test_borrow_headroom_reaches_the_engines_borrowing(shared):
    e = Engine(
        EngineConfig(
            model=ModelConfig(model="unused", dtype="float32"),
            cache=CacheConfig(num_blocks=8),
            batch=BatchConfig(borrow_headroom=0.5),
        ),
        shared,
    )
    network({"e": e, "peer": engine(shared, 8)})
    assert e.batcher.borrowing.headroom_fraction == 0.5
