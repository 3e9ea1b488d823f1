"""A long prefill beside other requests (BatchConfig.long_prefill_tokens): while other
requests share the runner, a long prompt takes at most long_prefill_tokens a step, so the
requests that arrive behind it join in the same step and the ones decoding get a token
every step, each step costing one capped chunk; alone, it takes the whole token budget.
The greedy output is the same either way."""

from __future__ import annotations

import pytest
import torch
from helpers import compute_scheduled, tiny_llm

from punica_x import SamplingParams
from punica_x.batching.batcher import Batcher
from punica_x.config import BatchConfig
from punica_x.kv.blocks import KVCache, KVCacheSpec
from punica_x.runtime import Request

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=4, block_size=4, dtype=torch.float32)


def request(rid: str, prompt_len: int, max_tokens: int = 4) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(prompt_token_ids=list(range(1, prompt_len + 1)), sampling=sp, request_id=rid)


def batcher(cap: int) -> Batcher:
    config = BatchConfig(max_batched_tokens=64, long_prefill_tokens=cap)
    return Batcher(KVCache(SPEC, 256, torch.device("cpu")), config)


def rows(b: Batcher) -> dict[str, int]:
    schedule = b.schedule()
    compute_scheduled(schedule.rows)
    return {s.request.request_id: s.num_new_tokens for s in schedule.rows}


def test_alone_a_long_prompt_takes_the_whole_budget():
    b = batcher(16)
    b.add(request("long", 200))
    assert [rows(b) for _ in range(3)] == [{"long": 64}] * 3


def test_beside_others_a_long_prompt_takes_capped_chunks_and_they_join_at_once():
    b = batcher(16)
    b.add(request("decoding", 3, max_tokens=50))
    assert rows(b) == {"decoding": 3}
    b.add(request("long", 200))
    b.add(request("short", 10))
    # uncapped, the long prompt would take the 63 tokens the decode leaves and "short" waits
    assert rows(b) == {"decoding": 1, "long": 16, "short": 10}
    assert rows(b) == {"decoding": 1, "long": 16, "short": 1}


def test_a_cap_of_zero_is_off():
    b = batcher(0)
    b.add(request("decoding", 3, max_tokens=50))
    rows(b)
    b.add(request("long", 200))
    b.add(request("short", 10))
    assert rows(b) == {"decoding": 1, "long": 63}


def test_the_output_is_the_same_with_and_without_the_cap(tiny_model_dir):
    """Greedy: a long prompt prefilled in capped chunks beside a short one (float32) gives
    what it gives in full budget chunks."""
    prompts = [[(i * 7) % 200 + 3 for i in range(300)], [5, 6, 7, 8]]
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = {}
    for cap in (0, 32):
        llm = tiny_llm(tiny_model_dir, long_prefill_tokens=cap)
        outs[cap] = [o.token_ids for o in llm.generate(prompts, sampling=sp)]
    assert outs[0] == outs[32]


@pytest.mark.parametrize("bad", [-1, 1.5, float("nan"), "512", True, None])
def test_long_prefill_tokens_refuses_what_is_not_a_count(bad):
    with pytest.raises(ValueError, match="long_prefill_tokens must be an int >= 0"):
        BatchConfig(long_prefill_tokens=bad)
