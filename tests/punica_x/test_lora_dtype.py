"""LoraConfig.lora_dtype: adapters stored in bfloat16 under a float32 model (half the bytes a
step of distinct adapters reads), the same results as the adapters' weights rounded to
bfloat16 once and served in float32; every other pair refused before anything loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import tiny_llm
from safetensors.torch import load_file, save_file

from punica_x import SamplingParams
from punica_x.config import LoraConfig

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)
PROMPTS = ["the quick brown fox", "hello world", "paged attention keeps", "one backbone"]


def rounded_copy(src: Path, dst: Path) -> Path:
    """The adapter with every weight rounded to bfloat16 and stored back as float32 (its
    scaling is 1: lora_alpha = r, so rounding before or after folding it in is the same)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            tensors = load_file(f)
            save_file({k: t.bfloat16().float() for k, t in tensors.items()}, dst / f.name)
        else:
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_bfloat16_adapters_give_the_rounded_weights_results(
    tiny_model_dir, tiny_adapters, tmp_path
):
    """A mixed batch (four adapters of ranks 4-64 on different targets, base rows) with
    lora_dtype bfloat16 gives the greedy tokens of float32 adapters holding the same rounded
    values, logprobs within float32 noise, with half the adapter bytes in the pool."""
    half = tiny_llm(tiny_model_dir, lora_dtype="bfloat16")
    ref = tiny_llm(tiny_model_dir)
    assert half.engine.lora_dtype == torch.bfloat16 and ref.engine.lora_dtype == torch.float32
    for name, path in tiny_adapters.items():
        half.load_adapter(name, str(path))
        ref.load_adapter(name, str(rounded_copy(path, tmp_path / name)))
    names = [*tiny_adapters, None] * 2
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    ours, theirs = half.generate(prompts, names, GREEDY), ref.generate(prompts, names, GREEDY)
    for a, b, name in zip(ours, theirs, names):
        assert a.token_ids == b.token_ids, name
        lp_a = torch.tensor([lp.logprob for lp in a.logprobs])
        lp_b = torch.tensor([lp.logprob for lp in b.logprobs])
        torch.testing.assert_close(lp_a, lp_b, rtol=1e-4, atol=1e-4)
    used_half = half.engine.stats().adapter_device_bytes
    assert used_half * 2 == ref.engine.stats().adapter_device_bytes > 0


def test_bfloat16_adapters_differ_from_the_float32_ones_only_by_rounding(
    tiny_model_dir, tiny_adapters
):
    """Against the unrounded float32 adapters the logprobs move by bfloat16's rounding of
    the weights, not more (a wrong read of the bytes would move them by whole units)."""
    half = tiny_llm(tiny_model_dir, lora_dtype="bfloat16")
    full = tiny_llm(tiny_model_dir)
    for llm in (half, full):
        llm.load_adapter("r16", str(tiny_adapters["r16"]))
    one = SamplingParams(max_tokens=1, temperature=0, logprobs=1)
    for p in PROMPTS:
        a, b = half.generate([p], ["r16"], one)[0], full.generate([p], ["r16"], one)[0]
        assert abs(a.logprobs[0].logprob - b.logprobs[0].logprob) < 0.05, p


@pytest.mark.parametrize("bad", ["fp8", "bf16", "", "AUTO", None, 16, torch.bfloat16, ["auto"]])
def test_lora_dtype_values_are_checked(bad):
    with pytest.raises(ValueError, match="lora_dtype must be one of"):
        LoraConfig(lora_dtype=bad)


@pytest.mark.parametrize(
    "lora, serving, device, served",
    [
        ("auto", torch.float32, "cpu", torch.float32),
        ("auto", torch.bfloat16, "cpu", torch.bfloat16),
        ("float32", torch.float32, "cpu", torch.float32),
        ("bfloat16", torch.bfloat16, "cpu", torch.bfloat16),
        ("bfloat16", torch.float32, "cpu", torch.bfloat16),
        ("float16", torch.float16, "cuda", torch.float16),
        ("float32", torch.bfloat16, "cpu", None),  # more bytes and no kernel
        ("float16", torch.float32, "cpu", None),
        ("bfloat16", torch.float32, "cuda", None),  # the CUDA kernels take x's dtype only
        ("bfloat16", torch.float16, "cuda", None),
    ],
)
def test_lora_dtype_pairs(lora, serving, device, served):
    config = LoraConfig(lora_dtype=lora)
    if served is None:
        with pytest.raises(ValueError, match=f"lora_dtype {lora} with a"):
            config.torch_dtype(serving, torch.device(device))
    else:
        assert config.torch_dtype(serving, torch.device(device)) == served


def test_an_engine_refuses_an_unserved_pair_before_loading(monkeypatch):
    """The refusal comes before the model is read (a wrong flag costs no load)."""
    from punica_x import LLM
    from punica_x.engine import engine as engine_mod

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    monkeypatch.setattr(engine_mod, "load_model", no_load)
    with pytest.raises(ValueError, match="lora_dtype float32 with a bfloat16 model on cpu"):
        LLM(dtype="bfloat16", lora_dtype="float32")
