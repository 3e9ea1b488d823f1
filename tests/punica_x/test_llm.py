"""Offline API and engine behaviour on the tiny random Llama, against HF transformers + PEFT."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import hf_greedy, tiny_llm

from punica_x import SamplingParams
from punica_x.core import FinishReason

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PROMPTS = [
    "the quick brown fox",
    "hello world",
    "paged attention keeps",
    "a multi tenant lora",
    "numbers 0123",
    "the lazy dog jumps",
    "one backbone",
    "kv cache in blocks",
]


def peft_greedy(model_dir, adapter_dir, tokenizer, prompts, n):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    return [hf_greedy(model, tokenizer, p, n) for p in prompts]


@pytest.fixture(scope="module")
def llm(tiny_model_dir, tiny_adapters):
    llm = tiny_llm(tiny_model_dir)
    for name, path in tiny_adapters.items():
        llm.load_adapter(name, str(path))
    return llm


@pytest.fixture(scope="module")
def references(tiny_model_dir, tiny_adapters, tiny_hf, llm):
    """HF + PEFT greedy outputs, one adapter at a time: {(adapter, prompt): tokens}."""
    tok = llm.tokenizer
    refs = {(None, p): hf_greedy(tiny_hf, tok, p, GREEDY.max_tokens) for p in PROMPTS}
    for name, path in tiny_adapters.items():
        for p, toks in zip(
            PROMPTS, peft_greedy(tiny_model_dir, path, tok, PROMPTS, GREEDY.max_tokens)
        ):
            refs[(name, p)] = toks
    return refs


def test_mixed_batch_matches_hf_peft(llm, references):
    adapters = ["r4", "r4", "r8", "r8", "r16", "r16", "r64", "r64", None, None]
    prompts = PROMPTS + PROMPTS[:2]
    outs = llm.generate(prompts, adapters, GREEDY)
    for p, a, out in zip(prompts, adapters, outs):
        assert out.token_ids == references[(a, p)], f"adapter={a} prompt={p!r}"
    for a in ("r4", "r8", "r16", "r64"):  # the adapters really change the output
        assert any(references[(a, p)] != references[(None, p)] for p in PROMPTS), a


def test_requests_joining_mid_way_match(llm, references):
    engine = llm.engine
    plan = [
        (0, "r16", PROMPTS[0]),
        (0, None, PROMPTS[1]),
        (3, "r4", PROMPTS[2]),
        (5, "r64", PROMPTS[3]),
        (5, "r16", PROMPTS[4]),
        (11, "r8", PROMPTS[5]),
        (11, None, PROMPTS[6]),
    ]
    outputs, reqs, step = {}, {}, 0
    builds = engine.planner.lora.builds
    while len(outputs) < len(plan):
        for at, adapter, prompt in plan:
            if at == step:
                reqs[engine.add_request(prompt, GREEDY, adapter).request_id] = (adapter, prompt)
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        step += 1
    for rid, (adapter, prompt) in reqs.items():
        assert outputs[rid].token_ids == references[(adapter, prompt)], f"{adapter} {prompt!r}"
    # the LoRA plan was reused on the steady steps and rebuilt as requests came and went
    # (lora_plan.LoraPlanner), and the outputs above hold for both
    builds = engine.planner.lora.builds - builds
    assert 5 <= builds < step // 2, (builds, step)
    engine.step()  # idle: the kept plan no longer holds adapter tensors
    assert engine.planner.lora._meta is None


def test_chunked_prefill_and_preemption_keep_outputs(tiny_model_dir, tiny_adapters, references):
    """A tiny token budget (prompts split over steps) and a KV cache so small that requests
    are preempted and recomputed must not change a single token."""
    llm = tiny_llm(tiny_model_dir, max_batched_tokens=5, num_blocks=14, block_size=4)
    for name, path in tiny_adapters.items():
        llm.load_adapter(name, str(path))
    adapters = ["r16", None, "r8", "r64"]
    outs = llm.generate(PROMPTS[:4], adapters, GREEDY)
    assert llm.engine.batcher.num_preemptions > 0
    for p, a, out in zip(PROMPTS[:4], adapters, outs):
        assert out.token_ids == references[(a, p)]
    assert llm.engine.cache.allocator.num_free == 14


def test_streaming_callback_sees_every_token(llm):
    seen = []
    req = llm.engine.add_request("hello world", GREEDY, "r8", on_output=seen.append)
    while llm.engine.has_unfinished():
        llm.engine.step()
    assert [t for o in seen for t in o.new_token_ids] == seen[-1].token_ids
    assert "".join(o.new_text for o in seen) == seen[-1].text
    assert seen[-1].finished and not any(o.finished for o in seen[:-1])
    assert req.finish_reason is FinishReason.LENGTH


def test_cancel_frees_blocks_immediately(llm):
    engine = llm.engine
    free = engine.cache.allocator.num_free
    req = engine.add_request(
        "the quick brown fox", SamplingParams(max_tokens=200, ignore_eos=True), "r16"
    )
    engine.step()
    engine.step()
    assert engine.cache.allocator.num_free < free
    out = engine.abort(req.request_id)
    assert out.finished and out.finish_reason is FinishReason.ABORT
    assert engine.cache.allocator.num_free == free
    assert not engine.has_unfinished()


def test_stop_strings_and_stop_tokens(llm, references):
    ref = references[(None, PROMPTS[0])]
    text = llm.tokenizer.decode(ref)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    out = llm.generate(
        [PROMPTS[0]], sampling=SamplingParams(max_tokens=24, temperature=0, stop=(stop,))
    )[0]
    assert out.finish_reason is FinishReason.STOP and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]
    out = llm.generate(
        [PROMPTS[0]],
        sampling=SamplingParams(max_tokens=24, temperature=0, stop_token_ids=(ref[5],)),
    )[0]
    assert out.token_ids == ref[: ref.index(ref[5]) + 1] and out.stop_reason == ref[5]


def test_sampling_seed_is_reproducible(llm):
    sp = SamplingParams(
        max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True
    )
    a = llm.generate(["hello world", "the quick"], ["r4", None], sp)
    b = llm.generate(["the quick", "hello world"], [None, "r4"], sp)
    assert a[0].token_ids == b[1].token_ids and a[1].token_ids == b[0].token_ids
    c = llm.generate(
        ["hello world"],
        ["r4"],
        SamplingParams(max_tokens=16, temperature=1.0, seed=99, ignore_eos=True),
    )
    assert c[0].token_ids != a[0].token_ids


def test_prompt_token_ids_accepted(llm, references):
    ids = llm.tokenizer.encode(PROMPTS[1])
    assert llm.generate([ids], ["r64"], GREEDY)[0].token_ids == references[("r64", PROMPTS[1])]


def test_bad_requests_are_refused_clearly(llm):
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="context is 512"):
        llm.generate([[5] * 600])
    with pytest.raises(KeyError, match="not registered"):
        llm.generate(["hi"], ["nope"])
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    assert not llm.engine.has_unfinished()
    assert llm.generate(["hello"], ["r4"], GREEDY)[0].finish_reason is FinishReason.LENGTH


def test_seeded_sampling_ignores_the_batch_around_it(llm):
    sp = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    other = SamplingParams(max_tokens=20, temperature=0.7, ignore_eos=True)
    alone = llm.generate(["hello world"], ["r8"], sp)[0].token_ids
    crowded = llm.generate(
        ["the lazy dog", "hello world", "numbers 0123"], ["r4", "r8", None], [other, sp, other]
    )[1].token_ids
    assert alone == crowded
    assert (
        llm.generate(["hello world"], ["r8"], SamplingParams(**{**sp.__dict__, "seed": 7}))[
            0
        ].token_ids
        != alone
    )


def test_a_dtype_a_named_kernel_cannot_run_is_refused_at_build(tiny_model_dir):
    """float16 on CPU: no compiled CPU kernel takes it. Named, each is refused when the
    engine is built (naming the backend and what it runs), never at the first request; left
    to the defaults, the PyTorch paths serve it."""
    for option in ("sgmv_backend", "attention_backend", "dense_backend", "fused_backend"):
        with pytest.raises(ValueError, match=r"runs float32 or bfloat16 on cpu, not float16"):
            tiny_llm(tiny_model_dir, dtype="float16", **{option: "cpu"})
    llm = tiny_llm(tiny_model_dir, dtype="float16")
    assert llm.engine.cache.kv.dtype == torch.float16
    assert llm.engine.sgmv.name == "torch_ref"
    out = llm.generate([PROMPTS[0]], sampling=GREEDY)[0]
    assert out.finish_reason == FinishReason.LENGTH and len(out.token_ids) == GREEDY.max_tokens


def test_bfloat16_runs_the_compiled_kernels_in_bf16(tiny_model_dir, tiny_adapters):
    llm = tiny_llm(tiny_model_dir, dtype="bfloat16")
    engine = llm.engine
    assert engine.cache.kv.dtype == torch.bfloat16
    if engine.device.type == "cpu" and "PUNICA_X_SGMV_BACKEND" not in os.environ:
        from punica_x.ops import isa

        if isa.tuned():  # x86: the compiled kernels take bf16, no fallback to the torch paths
            assert engine.sgmv.name == "cpu"
            assert engine.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    llm.load_adapter("r16", str(tiny_adapters["r16"]))
    outs = llm.generate(PROMPTS[:3], ["r16", None, "r16"], GREEDY)
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)
