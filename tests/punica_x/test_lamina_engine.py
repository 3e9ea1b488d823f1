"""Lamina in one engine (punica_x/attention/lamina.py, punica_x/kv/attention_worker.py):
attention and the KV on in-process attention workers give the same greedy tokens and the
same logprobs as the plain engine in float32, with mixed adapters and base rows in one
batch, chunked prefill, prefix-cache hits and MLFQ swaps; refusals of bad worker counts."""

from __future__ import annotations

import random

import pytest
from helpers import tiny_llm

from punica_x import SamplingParams
from punica_x.config import EngineConfig
from punica_x.kv.head_split import HeadSplitKV

SP = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
ADAPTERS = [None, "r8", "r16", None, "r4", "r16", "r8", None]


def prompts(seed: int = 0, shared: int = 0) -> list[list[int]]:
    """Eight prompts of 3-40 tokens; the first `shared` tokens the same in all."""
    rng = random.Random(seed)
    head = [rng.randrange(3, 300) for _ in range(shared)]
    return [head + [rng.randrange(3, 300) for _ in range(rng.randrange(3, 40))] for _ in range(8)]


def make(tiny_model_dir, tiny_adapters, **kwargs):
    llm = tiny_llm(tiny_model_dir, **kwargs)
    for name in ("r4", "r8", "r16"):
        llm.load_adapter(name, str(tiny_adapters[name]))
    return llm


def run(llm, batch, sampling=SP):
    return llm.generate(batch, ADAPTERS[: len(batch)], sampling)


def assert_identical(plain, split, tol: float = 1e-5) -> None:
    """The same tokens and top-k ids, logprobs equal up to float32 rounding: two plain
    engines over the same requests differ by up to ~5e-6 here (steps may batch the rows
    differently, and GEMMs round by row count), so bit equality is not what the plain
    engine itself promises (issue 50 is about that)."""
    for a, b in zip(plain, split, strict=True):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.token_id == y.token_id and [t for t, _ in x.top] == [t for t, _ in y.top]
            assert abs(x.logprob - y.logprob) <= tol
            assert all(abs(p - q) <= tol for (_, p), (_, q) in zip(x.top, y.top))


@pytest.mark.parametrize("workers", [1, 2])
def test_workers_match_the_plain_engine(tiny_model_dir, tiny_adapters, workers):
    batch = prompts(1)
    plain = run(make(tiny_model_dir, tiny_adapters), batch)
    llm = make(tiny_model_dir, tiny_adapters, attention_workers=workers)
    assert isinstance(llm.engine.cache, HeadSplitKV)
    assert llm.engine.cache.kv.numel() == 0  # the model worker holds no KV
    assert_identical(plain, run(llm, batch))
    served = [w.peer.calls for w in llm.engine.cache.workers]
    assert all(c > 0 for c in served) and len(set(served)) == 1


def test_chunked_prefill_and_prefix_hits(tiny_model_dir, tiny_adapters):
    kw = dict(max_batched_tokens=24, prefix_caching=True)
    batch = prompts(2, shared=33)
    plain = make(tiny_model_dir, tiny_adapters, **kw)
    split = make(tiny_model_dir, tiny_adapters, attention_workers=2, **kw)
    for llm in (plain, split):  # the second wave hits the first's cached prefix
        llm.first = run(llm, batch[:2])
        llm.second = run(llm, batch)
    assert_identical(plain.first + plain.second, split.first + split.second)
    assert sum(split.engine.batcher.prefix.stats.hits.values()) > 0


def test_mlfq_swaps_move_the_workers_blocks(tiny_model_dir, tiny_adapters):
    """Preempted requests' KV goes to the host pool and back through the workers."""
    kw = dict(policy="mlfq", num_blocks=12, swap_blocks=64, max_batch_size=8)
    batch = prompts(3)
    plain = run(make(tiny_model_dir, tiny_adapters, **kw), batch)
    llm = make(tiny_model_dir, tiny_adapters, attention_workers=2, **kw)
    split = run(llm, batch)
    assert_identical(plain, split)
    assert llm.engine.swap.stats.swaps_out > 0


@pytest.mark.parametrize("bad", [-1, True, 1.5, "2", None, 65, 10**9])
def test_bad_worker_counts_are_refused(bad):
    with pytest.raises(ValueError, match="attention_workers"):
        EngineConfig(attention_workers=bad)


def test_a_count_that_does_not_divide_the_kv_heads_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match=r"cannot split this model's 2 KV heads.*\[1, 2\]"):
        tiny_llm(tiny_model_dir, attention_workers=3)


def test_a_live_kv_copy_leaves_and_enters_through_the_workers(tiny_model_dir, tiny_adapters):
    """take(with_kv=True) gathers a request's blocks from every worker; a model worker whose
    workers receive it continues without recomputing, to the plain engine's tokens."""
    sp = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    prompt = prompts(4)[0]
    plain = make(tiny_model_dir, tiny_adapters)
    (reference,) = plain.generate([prompt], ["r16"], sp)
    first = make(tiny_model_dir, tiny_adapters, attention_workers=2).engine
    second = make(tiny_model_dir, tiny_adapters, attention_workers=2).engine
    req = first.add_request(prompt, sp, "r16")
    while len(req.output_token_ids) < 5:  # the adapter may still be loading at first
        first.step()
    resume = first.take(req.request_id, with_kv=True)
    assert resume.kv is not None and resume.kv.blocks.shape[3] == 2  # both workers' heads
    moved = second.add_request(prompt, sp, "r16", resume=resume)
    assert moved.num_computed_tokens == resume.kv.num_tokens
    while not moved.finished:
        second.step()
    assert moved.output_token_ids == reference.token_ids


def test_distkv_is_refused_with_attention_workers(tiny_model_dir):
    from punica_x.kv.rmanager import LendCaps

    engine = tiny_llm(tiny_model_dir, attention_workers=2).engine
    with pytest.raises(ValueError, match="attention workers"):
        engine.distkv.enable("r0", borrower=None, caps=LendCaps(max_blocks=4))


@pytest.mark.parametrize("policy", ["fcfs", "mlfq"])
def test_a_lost_worker_is_replaced_and_its_requests_recompute(
    tiny_model_dir, tiny_adapters, policy
):
    """A worker that stops mid-run (its slice of every block gone): the step that meets it
    ends, the worker restarts empty, every request with blocks recomputes, cached prefixes
    are forgotten, and the tokens are the plain engine's."""
    kw = dict(policy=policy, prefix_caching=True)
    batch = prompts(6, shared=20)
    plain = run(make(tiny_model_dir, tiny_adapters, **kw), batch)
    llm = make(tiny_model_dir, tiny_adapters, attention_workers=2, **kw)
    engine = llm.engine
    reqs = [engine.add_request(p, SP, a) for p, a in zip(batch, ADAPTERS)]
    while min(len(r.output_token_ids) for r in reqs) < 4:
        engine.step()
    engine.cache.workers[0].peer.stop()
    while engine.has_unfinished():
        engine.step()
    assert engine.attention_worker_losses == 1 and engine.cache.workers[0].peer.alive
    assert all(r.num_preemptions >= 1 for r in reqs)
    for want, r in zip(plain, reqs):
        assert want.token_ids == r.output_token_ids
        for x, y in zip(want.logprobs, r.logprobs, strict=True):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) <= 1e-5


class _DiesOnSwap:
    """A worker peer that dies at its first block read (an MLFQ swap-out between steps)."""

    def __init__(self, peer) -> None:
        self.peer = peer
        self.reads = 0

    def read_blocks(self, ids):
        self.reads += 1
        if self.reads == 1:
            self.peer.stop()
        return self.peer.read_blocks(ids)

    def __getattr__(self, name):
        return getattr(self.peer, name)


def test_a_worker_lost_in_a_swap_between_steps_is_replaced(tiny_model_dir, tiny_adapters):
    """The loss meets the batcher's swap-out, not the model's step: the step ends, the
    worker is replaced, the host blocks the swap took are given back, and the tokens are the
    plain engine's."""
    kw = dict(policy="mlfq", num_blocks=12, swap_blocks=64, max_batch_size=8)
    batch = prompts(3)
    plain = run(make(tiny_model_dir, tiny_adapters, **kw), batch)
    llm = make(tiny_model_dir, tiny_adapters, attention_workers=2, **kw)
    ref = llm.engine.cache.workers[1]
    dying = _DiesOnSwap(ref.peer)
    llm.engine.cache.workers[1] = type(ref)(dying, ref.heads)
    split = run(llm, batch)
    assert dying.reads >= 1 and llm.engine.attention_worker_losses == 1
    assert_identical(plain, split)
    swap = llm.engine.swap
    assert swap.host.allocator.num_free == swap.host.allocator.num_blocks  # none leaked
