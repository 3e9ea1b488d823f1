"""Prompt and sampled logprobs against HF transformers + PEFT (full forward, log_softmax),
for mixed adapters in one batch, across chunked prefill and preemption/recompute."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_llm

from punica_x import SamplingParams

PROMPTS = [
    "the quick brown fox jumps over the lazy dog and keeps on running far away",
    "hello world",
    "paged attention keeps every block of the cache in use",
    "a multi tenant lora server batches many adapters",
]
ADAPTERS = [None, "r4", "r16", "r64"]
K = 3


def reference(model_dir, adapter_dir, ids: list[int]) -> torch.Tensor:
    """log_softmax of HF (+ PEFT) logits over the whole sequence: [len(ids), V]."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    with torch.no_grad():
        logits = model.eval()(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def check(entry, logp_row: torch.Tensor, token: int, k: int) -> None:
    assert entry.token_id == token
    assert entry.logprob == pytest.approx(logp_row[token].item(), abs=1e-4)
    top = logp_row.topk(k)
    assert [t for t, _ in entry.top] == top.indices.tolist()
    assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)


@pytest.mark.parametrize(
    "engine_args",
    [{}, {"max_batched_tokens": 5, "num_blocks": 14, "block_size": 4}],
    ids=["one-step-prefill", "chunked-and-preempted"],
)
def test_logprobs_match_hf_peft_for_mixed_adapters(tiny_model_dir, tiny_adapters, engine_args):
    llm = tiny_llm(tiny_model_dir, **engine_args)
    for name in ADAPTERS[1:]:
        llm.load_adapter(name, str(tiny_adapters[name]))
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=K, prompt_logprobs=K)
    outs = llm.generate(PROMPTS, ADAPTERS, sp)
    if engine_args:
        assert llm.engine.batcher.num_preemptions > 0
    for out, adapter in zip(outs, ADAPTERS):
        ids = out.prompt_token_ids + out.token_ids
        logp = reference(tiny_model_dir, tiny_adapters[adapter] if adapter else None, ids)
        assert out.prompt_logprobs[0] is None
        assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
        for t in range(1, len(out.prompt_token_ids)):
            check(out.prompt_logprobs[t], logp[t - 1], ids[t], K)
        assert len(out.logprobs) == len(out.token_ids)
        p = len(out.prompt_token_ids)
        for i, token in enumerate(out.token_ids):
            check(out.logprobs[i], logp[p + i - 1], token, K)
            assert out.logprobs[i].top[0][0] == token  # greedy picks the top token


def test_only_requests_that_ask_get_logprobs(tiny_model_dir, tiny_adapters):
    llm = tiny_llm(tiny_model_dir)
    llm.load_adapter("r8", str(tiny_adapters["r8"]))
    plain = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    asking = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=0)
    alone = llm.generate(PROMPTS[:2], ["r8", None], plain)
    mixed = llm.generate(PROMPTS[:2], ["r8", None], [plain, asking])
    assert [o.token_ids for o in mixed] == [o.token_ids for o in alone]
    assert mixed[0].logprobs is None and mixed[0].prompt_logprobs is None
    assert len(mixed[1].logprobs) == 5 and all(e.top == () for e in mixed[1].logprobs)
    assert mixed[1].prompt_logprobs is None


def test_streamed_deltas_carry_their_logprobs(tiny_model_dir):
    llm = tiny_llm(tiny_model_dir)
    seen = []
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=1)
    llm.engine.add_request("hello world", sp, on_output=seen.append)
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert [e for o in seen for e in o.new_logprobs] == seen[-1].logprobs
    assert [e.token_id for e in seen[-1].logprobs] == seen[-1].token_ids


def test_logprobs_out_of_range_refused():
    with pytest.raises(ValueError, match="logprobs must be in"):
        SamplingParams(logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs must be in"):
        SamplingParams(prompt_logprobs=-1)
