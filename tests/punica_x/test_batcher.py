"""The FCFS batcher (punica_x/batching/batcher.py): when KV runs out the NEWEST running request is
preempted (on its own, step by step); a request that cannot fit even alone ends with
finish_reason length and an error saying so (in the engine), while the request it pushed
out still completes exactly as it would alone."""

from __future__ import annotations

import torch
from helpers import compute_scheduled, tiny_llm

from punica_x import SamplingParams
from punica_x.batching.batcher import Batcher
from punica_x.config import BatchConfig
from punica_x.core import FinishReason
from punica_x.kv.blocks import KVCache, KVCacheSpec
from punica_x.runtime import Request, RequestStatus

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=4, block_size=4, dtype=torch.float32)


def request(rid: str, prompt_len: int, max_tokens: int) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(prompt_token_ids=list(range(1, prompt_len + 1)), sampling=sp, request_id=rid)


def run_step(b: Batcher, preempted: list | None = None) -> list[str]:
    """One engine step as the engine runs it: schedule, compute (KV written, a token
    sampled once the prompt is done), finish at max_tokens; returns who ran (and puts the
    schedule's preempted requests in `preempted`)."""
    schedule = b.schedule()
    scheduled = schedule.rows
    assert not schedule.overflow and not schedule.starved
    if preempted is not None:
        preempted += schedule.preempted
    for r in compute_scheduled(scheduled):
        if len(r.output_token_ids) >= r.sampling.max_tokens:
            r.status = RequestStatus.FINISHED
            b.remove(r)
    return [s.request.request_id for s in scheduled]


def test_the_newest_running_request_is_preempted_every_time():
    """Five requests arrive in order and all fit at first; as they grow, KV runs out again
    and again. Every preemption takes the newest arrival among those running at that moment
    (never the oldest, the one asking for the block, or any other), and it goes back to the
    head of the queue with its KV released, to be recomputed."""
    arrival = {f"r{i}": i for i in range(5)}
    b = Batcher(KVCache(SPEC, 12, torch.device("cpu")), BatchConfig(max_batched_tokens=64))
    for rid in arrival:
        b.add(request(rid, prompt_len=7, max_tokens=12))  # 19 tokens: 5 of the 12 blocks
    victims = []
    for _ in range(200):
        if not b.num_unfinished:
            break
        before = sorted((r for r in b.running), key=lambda r: arrival[r.request_id])
        preempted = []
        run_step(b, preempted)
        if preempted:
            # the k newest of those running before the step, newest first
            assert preempted == before[::-1][: len(preempted)], (
                [r.request_id for r in before],
                [r.request_id for r in preempted],
            )
            assert list(b.waiting)[: len(preempted)] == preempted[::-1]
            for r in preempted:
                assert r.block_ids == [] and r.num_computed_tokens == 0
                assert r.status is RequestStatus.WAITING
            victims += [r.request_id for r in preempted]
    assert not b.num_unfinished, "the requests did not all finish"
    assert b.num_preemptions == len(victims) >= 3
    assert len(set(victims)) >= 2  # not one request pushed out over and over by chance
    assert b.cache.allocator.num_free == 12


def test_a_request_that_cannot_fit_even_alone_ends_with_length_and_an_error(
    tiny_model_dir, tmp_path
):
    """6 blocks of 4 tokens: `big` (prompt + 40 tokens) cannot fit even alone; `small`
    (prompt + 6) fits. big, the older, pushes small out as it grows, then runs alone until
    the cache is full: it ends there with LENGTH and an error naming the cache's size, its
    tokens those of an unconstrained run as far as they go; small completes as it would
    alone and the cache is empty again."""
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    short = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    roomy = tiny_llm(tiny_model_dir)
    alone = {
        "big": roomy.generate(["the quick brown fox"], sampling=greedy)[0].token_ids,
        "small": roomy.generate(["hello world"], sampling=short)[0].token_ids,
    }
    llm = tiny_llm(tiny_model_dir, num_blocks=6, block_size=4)
    engine = llm.engine
    big = engine.add_request("the quick brown fox", greedy, request_id="big")
    engine.add_request("hello world", short, request_id="small")
    finals = {}
    for _ in range(200):  # bounded: a request that could never end must not hang the test
        if not engine.has_unfinished():
            break
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    assert not engine.has_unfinished()
    assert engine.batcher.num_preemptions >= 1  # small was pushed out for big
    out = finals["big"]
    assert out.finish_reason is FinishReason.LENGTH
    assert out.error is not None and "KV cache" in out.error and "24 tokens" in out.error
    assert "even alone" in out.error
    capacity = 6 * 4
    # it ran as far as the cache allows: the newest token's KV is the one that did not fit
    assert len(big.prompt_token_ids) + len(out.token_ids) == capacity + 1
    assert out.token_ids == alone["big"][: len(out.token_ids)]
    assert finals["small"].finish_reason is FinishReason.LENGTH
    assert finals["small"].error is None
    assert finals["small"].token_ids == alone["small"]
    assert engine.cache.allocator.num_free == 6
