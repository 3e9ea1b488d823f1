"""Integration: the real default model served in bfloat16 (weights, KV cache, adapters and
activations; float32 accumulation) with PEFT adapters in one mixed batch, against HF
transformers + PEFT run in bfloat16.

bf16 is not token-exact: two implementations that round in different places pick different
tokens after a near-tie, and from there the texts differ. What is checked:
* logits: every prompt token's logprob (prompt_logprobs=0: log_softmax of the logits at the
  previous position) within a stated tolerance of HF's in bf16, mean and max over all prompts.
  For scale, the same numbers for HF bf16 against HF float32 are reported beside them.
* greedy tokens: the fraction of generated tokens equal to HF bf16's before the first
  difference, over every (adapter, prompt) pair, reported and held above a floor.
"""

from __future__ import annotations

import pytest
import torch
from helpers import (
    CHAT_QUESTIONS,
    chat_prompts,
    hf_default_model,
    llm_with_adapters,
    make_peft_adapter,
)

from punica_x import SamplingParams

pytestmark = pytest.mark.slow

QUESTIONS = CHAT_QUESTIONS
ADAPTERS = {
    "r8": (8, ["q_proj", "k_proj", "v_proj", "o_proj"]),
    "r16": (16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
}
ROWS = [("r8", 0), ("r8", 1), ("r16", 2), ("r16", 3), (None, 4), (None, 5)]
MAX_TOKENS = 24
# Stated tolerance for prompt-token logprobs, ours bf16 vs HF bf16: bf16 itself moves them by
# ~0.08 nats on average (HF bf16 vs HF float32, measured in the same test), so ours may differ
# from HF bf16 by at most 1.5x that + 0.02 on average and by MAX_TOL at worst. Measured
# (AMD EPYC, AVX2): 0.086 mean, 0.55 max against 0.080 / 0.48 for HF bf16 vs HF float32.
MEAN_FACTOR, MEAN_SLACK, MAX_TOL = 1.5, 0.02, 1.5
GREEDY_FLOOR = 0.5  # fraction of tokens equal before the first difference


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    base32 = hf_default_model()
    root = tmp_path_factory.mktemp("bf16-adapters")
    adapters = {
        name: make_peft_adapter(base32, root / name, rank, targets, seed=20 + i, alpha=rank / 2)
        for i, (name, (rank, targets)) in enumerate(ADAPTERS.items())
    }
    return base32, adapters


@pytest.fixture(scope="module")
def llm(hf_models):
    return llm_with_adapters(hf_models[1], dtype="bfloat16")


@pytest.fixture(scope="module")
def prompt_ids(llm):
    return [llm.tokenizer(text).input_ids for text in chat_prompts(llm.tokenizer, QUESTIONS)]


def _hf_run(model, ids: list[int], generate: bool) -> tuple[list[float], list[int]]:
    """(logprob of every prompt token after the first, greedy continuation if `generate`)."""
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(x).logits[0, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(1, x[0, 1:, None])[:, 0].tolist()
        if not generate:
            return lp, []
        out = model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_TOKENS, do_sample=False
        )
    return lp, out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def references(hf_models, prompt_ids):
    """{(adapter, i): (prompt logprobs, tokens)} for HF bf16, and HF float32's prompt logprobs."""
    from peft import PeftModel

    base32, adapters = hf_models
    ref16, ref32 = {}, {}
    for name in (None, *ADAPTERS):
        rows = [i for a, i in ROWS if a == name]
        for dtype, out in ((torch.bfloat16, ref16), (torch.float32, ref32)):
            base = base32.to(dtype)
            model = PeftModel.from_pretrained(base, adapters[name]).eval() if name else base
            for i in rows:
                lp, tokens = _hf_run(model, prompt_ids[i], generate=dtype == torch.bfloat16)
                out[(name, i)] = (lp, tokens)
            if name:
                model.unload()
    base32.to(torch.float32)
    return ref16, ref32


def test_serving_dtype_is_bfloat16_throughout(llm):
    engine = llm.engine
    assert engine.dtype == torch.bfloat16
    assert engine.cache.kv.dtype == torch.bfloat16
    assert engine.model.embed_tokens.weight.dtype == torch.bfloat16
    ref = engine.adapters.acquire("r16")
    try:
        engine.adapters.wait_ready(ref)
        weights = ref.weights
        assert all(a.dtype == b.dtype == torch.bfloat16 for a, b in weights.groups.values())
        info = engine.adapters.info("r16")
        assert info.nbytes == weights.nbytes  # the device budget counts 2-byte weights
    finally:
        engine.adapters.release(ref)


def test_bf16_matches_hf_peft_in_bf16(llm, prompt_ids, references, record_property):
    ref16, ref32 = references
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, prompt_logprobs=0)
    outs = llm.generate([prompt_ids[i] for _, i in ROWS], [a for a, _ in ROWS], params)
    ours_vs_hf, hf16_vs_hf32, ours_vs_hf32, equal_fraction = [], [], [], []
    for (adapter, i), out in zip(ROWS, outs):
        ours = [p.logprob for p in out.prompt_logprobs[1:]]
        lp16, tokens16 = ref16[(adapter, i)]
        lp32, _ = ref32[(adapter, i)]
        assert len(ours) == len(lp16)
        ours_vs_hf += [abs(a - b) for a, b in zip(ours, lp16)]
        hf16_vs_hf32 += [abs(a - b) for a, b in zip(lp16, lp32)]
        ours_vs_hf32 += [abs(a - b) for a, b in zip(ours, lp32)]
        same = 0
        for a, b in zip(out.token_ids, tokens16):
            if a != b:
                break
            same += 1
        equal_fraction.append(same / len(tokens16))
    mean = sum(ours_vs_hf) / len(ours_vs_hf)
    scale = sum(hf16_vs_hf32) / len(hf16_vs_hf32)
    greedy = sum(equal_fraction) / len(equal_fraction)
    report = (
        f"prompt logprobs |ours bf16 - HF bf16|: mean {mean:.4f} max {max(ours_vs_hf):.3f} "
        f"(|HF bf16 - HF fp32|: mean {scale:.4f} max {max(hf16_vs_hf32):.3f}; |ours bf16 - "
        f"HF fp32|: mean {sum(ours_vs_hf32) / len(ours_vs_hf32):.4f}); greedy tokens "
        f"equal to HF bf16 before the first difference: {greedy:.0%} "
        f"({', '.join(f'{f:.0%}' for f in equal_fraction)})"
    )
    print(report)
    record_property("bf16_report", report)
    assert mean <= MEAN_FACTOR * scale + MEAN_SLACK and max(ours_vs_hf) <= MAX_TOL, report
    assert greedy >= GREEDY_FLOOR, report
