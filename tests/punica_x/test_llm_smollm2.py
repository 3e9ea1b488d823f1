"""Integration: the real default model (SmolLM2-135M-Instruct from its GGUF file) with four
PEFT adapters in one mixed batch, token for token against HF transformers + PEFT."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    SMOL_ADAPTERS,
    chat_prompts,
    hf_default_model,
    llm_with_adapters,
    make_smol_adapters,
)

from punica_x import SamplingParams

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity in one sentence.",
    "List three fruits.",
    "What is 2+2?",
    "Tell me a joke about cats.",
    "Who wrote Hamlet?",
    "Describe a rainy day.",
    "What color is the sky?",
    "Give me a tip for sleeping well.",
]
ADAPTERS = SMOL_ADAPTERS
GREEDY = SamplingParams(max_tokens=32, temperature=0)


@pytest.fixture(scope="module")
def hf_base():
    return hf_default_model()  # transformers' own reading of the GGUF file


@pytest.fixture(scope="module")
def adapters(hf_base, tmp_path_factory):
    root = tmp_path_factory.mktemp("smol-adapters")
    return make_smol_adapters(hf_base, root, seed=10)


@pytest.fixture(scope="module")
def llm(adapters):
    return llm_with_adapters(adapters)


@pytest.fixture(scope="module")
def prompts(llm):
    return chat_prompts(llm.tokenizer, QUESTIONS)


@pytest.fixture(scope="module")
def references(hf_base, adapters, llm, prompts):
    """{(adapter, prompt index): tokens} from HF (+ PEFT, one adapter at a time)."""
    from peft import PeftModel

    tok = llm.tokenizer

    def greedy(model, i):
        ids = tok(prompts[i], return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False
            )
        return out[0, ids.shape[1] :].tolist()

    refs = {(None, i): greedy(hf_base, i) for i in range(len(prompts))}
    for name, path in adapters.items():
        model = PeftModel.from_pretrained(hf_base, path).eval()
        for adapter, i in ROWS:
            if adapter == name:
                refs[(name, i)] = greedy(model, i)
        model.unload()
    return refs


ROWS = [
    ("r4", 0),
    ("r4", 1),
    ("r8", 2),
    ("r8", 3),
    ("r16", 4),
    ("r16", 5),
    ("r64", 6),
    ("r64", 7),
    (None, 8),
    (None, 9),
]


def test_default_model_answers(llm, prompts):
    out = llm.generate([prompts[0]], sampling=GREEDY)[0]
    assert "Paris" in out.text


def test_mixed_batch_matches_hf_peft(llm, prompts, references):
    outs = llm.generate([prompts[i] for _, i in ROWS], [a for a, _ in ROWS], GREEDY)
    for (adapter, i), out in zip(ROWS, outs):
        assert out.token_ids == references[(adapter, i)], f"adapter={adapter} q={QUESTIONS[i]!r}"
    for name in ADAPTERS:  # each adapter really changes what the model says
        assert any(references[(name, i)] != references[(None, i)] for a, i in ROWS if a == name), (
            name
        )


def test_requests_joining_mid_way_match(llm, prompts, references):
    engine = llm.engine
    arrivals = {0: ROWS[:3], 4: ROWS[3:6], 9: ROWS[6:8], 15: ROWS[8:]}
    reqs, step = [], 0
    while step <= max(arrivals) or engine.has_unfinished():
        for adapter, i in arrivals.get(step, []):
            reqs.append(((adapter, i), engine.add_request(prompts[i], GREEDY, adapter)))
        engine.step()
        step += 1
    for key, req in reqs:
        assert req.output_token_ids == references[key], key
    assert engine.cache.allocator.num_used == 0
