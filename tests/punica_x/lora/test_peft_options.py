"""PEFT's per-module options (punica_x/lora/peft_options.py): rank_pattern, alpha_pattern and
layers_to_transform computed exactly as PEFT computes them (greedy tokens against HF + PEFT
in float32, mixed in one batch with a plain adapter), and their hostile values refused."""

from __future__ import annotations

import pytest
import torch
from helpers import hf_greedy, make_peft_adapter, rewrite_config, tiny_llm
from safetensors.torch import load_file, save_file

from punica_x import AdapterError, SamplingParams

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPTS = ["the quick brown fox", "hello world", "paged attention keeps"]
OPTIONS = {
    "ranks": dict(rank_pattern={"q_proj": 4, "model.layers.1.mlp.down_proj": 12}),
    "alphas": dict(alpha_pattern={"v_proj": 3.0, "layers.0.self_attn.o_proj": 40}),
    "layers": dict(layers_to_transform=[1]),
    "all-three": dict(
        rank_pattern={"gate_proj": 2}, alpha_pattern={"up_proj": 7}, layers_to_transform=0
    ),
}


@pytest.fixture(scope="module")
def option_adapters(tiny_model_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("peft-options")
    out = {}
    for i, (name, extra) in enumerate(OPTIONS.items()):
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        out[name] = make_peft_adapter(base, root / name, 8, ALL, seed=40 + i, alpha=16, **extra)
    return out


def peft_greedy(model_dir, adapter_dir, tokenizer, prompt: str, n: int) -> list[int]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return hf_greedy(PeftModel.from_pretrained(base, adapter_dir).eval(), tokenizer, prompt, n)


def test_options_compute_what_peft_computes(tiny_model_dir, tiny_adapters, option_adapters):
    llm = tiny_llm(tiny_model_dir)
    llm.load_adapter("plain", str(tiny_adapters["r16"]))
    for name, path in option_adapters.items():
        llm.load_adapter(name, str(path))
    names = [*OPTIONS, "plain"]
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    prompts = [p for p in PROMPTS for _ in names]
    adapters = [a for _ in PROMPTS for a in names]
    outs = llm.generate(prompts, adapters, sp)
    for prompt, adapter, out in zip(prompts, adapters, outs):
        path = option_adapters.get(adapter, tiny_adapters["r16"])
        want = peft_greedy(tiny_model_dir, path, llm.tokenizer, prompt, 10)
        assert out.token_ids == want, (adapter, prompt)
    info = llm.engine.adapters.info("ranks")
    assert info.rank == 12  # the largest of its modules'


def _refused(llm, path, code: str, match: str) -> None:
    with pytest.raises(AdapterError, match=match) as err:
        llm.load_adapter("bad", str(path))
    assert err.value.code == code


@pytest.mark.parametrize(
    ("changes", "code", "match"),
    [
        ({"rank_pattern": {"(a+)+$": 4}}, "bad_config", "regular expressions are not accepted"),
        ({"rank_pattern": {"q_proj": 0}}, "bad_config", "positive integer"),
        ({"rank_pattern": {"q_proj": "4"}}, "bad_config", "positive integer"),
        ({"rank_pattern": {"q_proj": True}}, "bad_config", "positive integer"),
        ({"rank_pattern": ["q_proj"]}, "bad_config", "rank_pattern must be an object"),
        ({"rank_pattern": {"x" * 300: 4}}, "bad_config", "rank_pattern key"),
        ({"rank_pattern": {"q_proj": 99}}, "rank_too_large", "exceeds max_lora_rank"),
        ({"alpha_pattern": {"q_proj": float("nan")}}, "bad_config", "finite number"),
        ({"alpha_pattern": {"q_proj": "3"}}, "bad_config", "finite number"),
        ({"layers_to_transform": [5]}, "bad_config", r"layer indices in \[0, 2\)"),
        ({"layers_to_transform": []}, "bad_config", "layers_to_transform"),
        ({"layers_to_transform": True}, "bad_config", "layers_to_transform"),
        ({"layers_to_transform": [0.0]}, "bad_config", "layers_to_transform"),
        ({"layers_to_transform": [0]}, "bad_weights", r"layers \[1\] outside layers_to_transform"),
    ],
    ids=repr,
)
def test_hostile_options_are_refused(tiny_model_dir, tiny_adapters, tmp_path, changes, code, match):
    llm = tiny_llm(tiny_model_dir, max_lora_rank=32)
    path = rewrite_config(tiny_adapters["r8"], tmp_path / "bad", **changes)
    _refused(llm, path, code, match)


def test_a_layer_missing_from_layers_to_transform_is_refused(
    tiny_model_dir, option_adapters, tmp_path
):
    llm = tiny_llm(tiny_model_dir)
    path = rewrite_config(option_adapters["layers"], tmp_path / "gap")
    weights = load_file(path / "adapter_model.safetensors")
    del weights["base_model.model.model.layers.1.mlp.up_proj.lora_A.weight"]
    save_file(weights, path / "adapter_model.safetensors")
    _refused(llm, path, "bad_weights", "missing lora_A of up_proj in layer 1")
