"""--quantization int8 / int4 on a float checkpoint: its projections and head become blocks
and the model computes what the same blocks dequantized compute; refusals name the tensor."""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers import make_tiny_llama, tiny_llm
from safetensors.torch import load_file, save_file

from punica_x import SamplingParams
from punica_x.layers.linear import Dense
from punica_x.models.quantize import quantize_blocks
from punica_x.ops.quant_dense import QuantCpuDense, dequantize_blocks

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize(("mode", "proj"), [("int8", "Q8_0"), ("int4", "Q4_1")])
def test_on_load_quantization_serves_blocks(mode, proj, tied, dtype, tmp_path):
    src = make_tiny_llama(tmp_path / "m", tie_word_embeddings=tied)
    llm = tiny_llm(src, quantization=mode, dtype=dtype)
    model = llm.engine.model
    dense = {n: m for n, m in model.named_modules() if isinstance(m, Dense)}
    assert all(isinstance(m.backend, QuantCpuDense) for m in dense.values())
    assert {m.backend.format for n, m in dense.items() if n != "lm_head"} == {proj}
    assert dense["lm_head"].backend.format == "Q8_0"
    assert model.weight_formats() == ",".join(sorted({proj, "Q8_0"}))
    assert model.embed_from_head == tied  # an untied embedding stays a float table
    out = llm.generate(["hello world"], sampling=SamplingParams(max_tokens=8, temperature=0))
    assert len(out[0].token_ids) == 8


@pytest.mark.parametrize(("mode", "proj"), [("int8", "Q8_0"), ("int4", "Q4_1")])
def test_quantized_model_matches_its_dequantized_weights(mode, proj, tmp_path):
    """Greedy tokens and prompt logprobs of the quantized model equal those of a float
    checkpoint holding the same blocks' dequantized values: the quantization is the only
    difference from the float model."""
    src = make_tiny_llama(tmp_path / "m")
    ref_dir = tmp_path / "dequantized"
    shutil.copytree(src, ref_dir)
    state = load_file(str(src / "model.safetensors"))
    for name, w in state.items():
        fmt = proj if any(f".{p}." in name for p in PROJECTIONS) else None
        fmt = "Q8_0" if name == "lm_head.weight" else fmt
        if fmt:
            state[name] = dequantize_blocks(quantize_blocks(name, w, fmt), torch.float32)
    save_file(state, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    prompts = ["the quick brown fox", "hello world, this is", "paged attention keeps"]
    greedy = SamplingParams(max_tokens=12, temperature=0)
    scored = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    runs = {}
    quantized = tiny_llm(src, quantization=mode, quant_activations="float")
    for label, llm in (("q", quantized), ("ref", tiny_llm(ref_dir))):
        tokens = [o.token_ids for o in llm.generate(prompts, sampling=greedy)]
        lps = llm.generate([prompts[1]], sampling=scored)[0].prompt_logprobs[1:]
        runs[label] = (tokens, [p.logprob for p in lps])
    assert runs["q"][0] == runs["ref"][0]
    deltas = [abs(a - b) for a, b in zip(runs["q"][1], runs["ref"][1])]
    assert deltas and max(deltas) < 1e-4, deltas


def test_refusals_name_the_tensor():
    with pytest.raises(ValueError, match="w.q: cannot quantize 48 input features"):
        quantize_blocks("w.q", torch.zeros(4, 48), "Q8_0")
    bad = torch.zeros(4, 64)
    bad[1, 3] = float("nan")
    with pytest.raises(ValueError, match="w.k: non-finite weights"):
        quantize_blocks("w.k", bad, "Q4_1")
    ok = quantize_blocks("w.v", torch.ones(2, 32), "Q4_1")
    assert (ok.n, ok.k, ok.format) == (2, 32, "Q4_1")


def test_a_model_that_cannot_be_blocked_is_refused_at_load(tmp_path):
    src = make_tiny_llama(tmp_path / "m", hidden_size=48, num_attention_heads=4)
    with pytest.raises(ValueError, match="cannot quantize 48 input features"):
        tiny_llm(src, quantization="int8")
