"""LoRA on the embedding and the LM head (PEFT's target_modules embed_tokens / lm_head),
against HF + PEFT in float32: a mixed batch of the base model, an adapter on the embedding
only, one on the head only and one on both with the layers, on an untied Llama, a tied one
(the embedding read from the head's packed layout) and a Gemma 2 (its embedding scale
scales the delta too, and the final soft-capping comes after the head's delta). PEFT saves
the base embedding / head beside such adapters: accepted as copies of the base model's,
refused when they differ."""

from __future__ import annotations

import json

import pytest
import safetensors.torch as st
import torch
from helpers import (
    assert_matches_hf_fp32,
    assert_within_bf16_of_hf,
    make_peft_adapter,
    make_tiny_family,
    make_tiny_llama,
    tiny_llm,
)

from punica_x import SamplingParams
from punica_x.lora.adapter import AdapterError

TARGETS = {
    "embed": ["embed_tokens"],
    "head": ["lm_head"],
    "both": ["embed_tokens", "lm_head", "q_proj", "down_proj"],
    "layers": ["q_proj", "v_proj"],
}
PROMPTS = ["the quick brown fox", "hello world", "paged attention keeps", "a multi tenant lora"]
ADAPTERS = [None, "embed", "head", "both"]
CASES = {
    "llama": lambda d: make_tiny_llama(d),
    "llama-tied": lambda d: make_tiny_llama(d, tie_word_embeddings=True),
    "gemma2": lambda d: make_tiny_family(
        d, "gemma2", head_dim=16, final_logit_softcapping=5.0, tie_word_embeddings=True
    ),
}


@pytest.fixture(scope="module", params=list(CASES))
def edge_model(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    folder = CASES[request.param](tmp_path_factory.mktemp(request.param) / "model")
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    adapters = {
        name: make_peft_adapter(base, folder.parent / name, 4, targets, seed=11 + i, alpha=2)
        for i, (name, targets) in enumerate(TARGETS.items())
    }
    return request.param, folder, adapters


def test_peft_saved_the_base_copies_these_tests_rely_on(edge_model):
    _, _, adapters = edge_model
    keys = st.load_file(adapters["both"] / "adapter_model.safetensors").keys()
    assert any("embed_tokens.base_layer.weight" in k for k in keys)
    assert any("lora_embedding_A" in k for k in keys)


def test_edge_lora_matches_hf_peft_in_float32(edge_model):
    case, folder, adapters = edge_model
    llm = tiny_llm(folder)
    for name, path in adapters.items():
        llm.load_adapter(name, str(path))
    if case.endswith("tied") or case == "gemma2":
        assert llm.engine.model.embed_from_head  # the delta lands on the head's rows
    assert_matches_hf_fp32(llm, folder, adapters, PROMPTS, ADAPTERS, 10, case)


def test_edge_lora_within_bf16_tolerance(edge_model):
    """bfloat16 (the default on CPUs with AVX512-BF16 / AMX and on GPUs): the deltas in
    bf16 weights, the tied head's rows read from its bf16 panels. The untied tiny Llama's
    own bf16 rounding on one prompt (0.19 against HF bf16's 0.10, base model alone) is
    above the plain budget, so the budget takes our base model's rounding into account."""
    case, folder, adapters = edge_model
    assert_within_bf16_of_hf(folder, adapters, PROMPTS, ADAPTERS, case, own_base=True)


def test_only_batches_with_edge_lora_pay_for_it(edge_model, monkeypatch):
    """A batch whose adapters have no edge LoRA plans no edge segments: the forward does
    nothing extra; an adapter with it adds its delta on its own rows only."""
    from punica_x.models import llama

    _, folder, adapters = edge_model
    llm = tiny_llm(folder)
    for name in ("layers", "embed", "head"):
        llm.load_adapter(name, str(adapters[name]))
    calls = {"embed": [], "head": []}
    add_embed, add_head = llama._add_embed_lora, llama._add_head_lora

    def count(kind, real):
        def wrapper(*args):
            calls[kind].append(len(args[2 if kind == "embed" else 3]))  # the segments
            return real(*args)

        return wrapper

    monkeypatch.setattr(llama, "_add_embed_lora", count("embed", add_embed))
    monkeypatch.setattr(llama, "_add_head_lora", count("head", add_head))
    sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    llm.generate(PROMPTS[:2], [None, "layers"], sp)
    assert calls == {"embed": [], "head": []}
    llm.generate(PROMPTS[:3], [None, "embed", "layers"], sp)
    assert calls["embed"] and set(calls["embed"]) == {1} and calls["head"] == []


def _rewrite(src, dst, change):
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "adapter_config.json").write_text((src / "adapter_config.json").read_text())
    tensors = st.load_file(src / "adapter_model.safetensors")
    change(tensors)
    st.save_file(tensors, str(dst / "adapter_model.safetensors"))
    return dst


def test_a_different_base_copy_is_refused(edge_model, tmp_path):
    """A retrained or resized embedding travelling with the adapter is not served (it would
    replace the base model's per adapter): refused by name; so are bad edge tensors."""
    _, folder, adapters = edge_model
    llm = tiny_llm(folder)
    src = adapters["both"]

    def embed_key(tensors, suffix):
        return next(k for k in tensors if k.endswith(suffix))

    def retrained(t):
        k = embed_key(t, "embed_tokens.base_layer.weight")
        t[k] = t[k].clone()
        t[k][5, 3] += 0.5

    def resized(t):
        k = embed_key(t, "embed_tokens.base_layer.weight")
        t[k] = torch.cat([t[k], t[k][:2]])

    def bad_shape(t):
        k = embed_key(t, "lora_embedding_A")
        t[k] = t[k][:, :-1].contiguous()

    def non_finite(t):
        k = embed_key(t, "lm_head.lora_B.weight")
        t[k] = t[k].clone()
        t[k][0, 0] = float("nan")

    for change, code in [
        (retrained, "modules_to_save_not_supported"),
        (resized, "modules_to_save_not_supported"),
        (bad_shape, "shape_mismatch"),
        (non_finite, "non_finite"),
    ]:
        bad = _rewrite(src, tmp_path / change.__name__, change)
        with pytest.raises(AdapterError) as err:
            llm.load_adapter(change.__name__, str(bad))
        assert err.value.code == code, change.__name__


def test_edge_modules_are_named_in_target_modules(edge_model, tmp_path):
    _, folder, adapters = edge_model
    llm = tiny_llm(folder)
    dst = tmp_path / "undeclared"
    dst.mkdir()
    config = json.loads((adapters["both"] / "adapter_config.json").read_text())
    config["target_modules"] = ["q_proj", "down_proj"]  # the file still has the edges
    (dst / "adapter_config.json").write_text(json.dumps(config))
    (dst / "adapter_model.safetensors").write_bytes(
        (adapters["both"] / "adapter_model.safetensors").read_bytes()
    )
    with pytest.raises(AdapterError, match="not in target_modules"):
        llm.load_adapter("undeclared", str(dst))


def test_the_batch_invariant_mode_holds_for_adapters_on_the_edges(edge_model):
    """batch_invariant=on: a request on an adapter of the embedding or the head gives the
    same tokens and logprob bits alone as beside the others (the deltas' products one row at
    a time: a GEMM library blocks a [rows, hidden] product by its row count). float32, where
    a changed order of additions shows in every logprob."""
    _, folder, adapters = edge_model
    llm = tiny_llm(folder, batch_invariant="on")
    for name in TARGETS:
        llm.load_adapter(name, str(adapters[name]))
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)

    def result(out):
        return out.token_ids, [(lp.logprob, lp.top) for lp in out.logprobs]

    combos = [(p, a) for p in range(len(PROMPTS)) for a in ADAPTERS]
    alone = {c: result(llm.generate([PROMPTS[c[0]]], [c[1]], sp)[0]) for c in combos}
    batch = llm.generate([PROMPTS[p] for p, _ in combos], [a for _, a in combos], sp)
    for c, out in zip(combos, batch):
        assert result(out) == alone[c], c
