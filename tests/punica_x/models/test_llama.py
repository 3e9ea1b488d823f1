"""Our batched Llama against HF transformers on the same weights: logits of every position,
for the config variants we claim (GQA, tied embeddings, biases, RoPE scaling, Mistral)."""

from __future__ import annotations

import pytest
import torch
from helpers import make_tiny_llama, tiny_llm

from punica_x import SamplingParams
from punica_x.attention.paged import AttentionMeta, SeqSpan
from punica_x.config import ModelConfig
from punica_x.kv.blocks import KVCache, KVCacheSpec
from punica_x.models.loader import load_model
from punica_x.runtime import Batch


def our_logits(loaded, ids: list[int], split: int) -> torch.Tensor:
    """Logits of every position: a prefill of ids[:split], then one decode step per token."""
    d = loaded.model.dims
    spec = KVCacheSpec(d.num_layers, d.num_kv_heads, d.head_dim, 4, torch.float32)
    cache = KVCache(spec, 64, torch.device("cpu"))
    blocks = cache.allocator.allocate(-(-len(ids) // 4))
    rows = []
    for lo, hi in [(0, split)] + [(i, i + 1) for i in range(split, len(ids))]:
        meta = AttentionMeta.plan([SeqSpan(0, hi - lo, hi, blocks)], 4, torch.device("cpu"))
        batch = Batch(
            torch.tensor(ids[lo:hi]), torch.arange(lo, hi), meta, None, torch.arange(hi - lo)
        )
        rows.append(loaded.model(batch, cache.kv))
    return torch.cat(rows)


def hf_logits(folder, ids, cls_name="AutoModelForCausalLM"):
    import transformers

    model = getattr(transformers, cls_name).from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


VARIANTS = {
    "gqa": {},
    "mha-tied": dict(num_key_value_heads=4, tie_word_embeddings=True),
    "bias": dict(attention_bias=True, mlp_bias=True),
    "linear-rope": dict(
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
    ),
    "llama3-rope": dict(
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
    ),
    "yarn-rope": dict(
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
        }
    ),
    "head-dim": dict(head_dim=32),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_hf(tmp_path, variant):
    folder = make_tiny_llama(tmp_path / variant, seed=7, **VARIANTS[variant])
    if variant == "bias":  # HF initialises biases to zero; make them matter
        from transformers import AutoModelForCausalLM

        m = AutoModelForCausalLM.from_pretrained(folder)
        with torch.no_grad():
            for name, p in m.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.5)
        m.save_pretrained(folder)
    loaded = load_model(ModelConfig(model=str(folder), dtype="float32"))
    ids = torch.randint(
        3, loaded.model.dims.vocab_size, (70,), generator=torch.Generator().manual_seed(1)
    ).tolist()
    torch.testing.assert_close(
        our_logits(loaded, ids, split=50), hf_logits(folder, ids), rtol=1e-4, atol=1e-4
    )


def test_mistral_config(tmp_path):
    from transformers import MistralConfig, MistralForCausalLM

    folder = make_tiny_llama(tmp_path / "m")  # tokenizer files
    cfg = MistralConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        sliding_window=96,
        initializer_range=0.25,
    )
    torch.manual_seed(3)
    MistralForCausalLM(cfg).save_pretrained(folder)
    loaded = load_model(ModelConfig(model=str(folder), dtype="float32"))
    assert loaded.max_model_len == 512  # the window slides; it does not cap the context
    ids = list(range(5, 255))  # 250 tokens: rows attend within their last 96 keys
    torch.testing.assert_close(
        our_logits(loaded, ids, 140),
        hf_logits(folder, ids, "MistralForCausalLM"),
        rtol=1e-4,
        atol=1e-4,
    )


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (
            dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
            "rope_type 'dynamic' is not supported",
        ),
        (dict(hidden_act="gelu"), "unsupported activation 'gelu'"),
    ],
)
def test_unsupported_configs_refused(tmp_path, overrides, match):
    folder = make_tiny_llama(tmp_path / "x", **overrides)
    with pytest.raises(ValueError, match=match):
        load_model(ModelConfig(model=str(folder), dtype="float32"))


def test_pickle_checkpoints_refused(tmp_path, tiny_model_dir):
    folder = tmp_path / "pickle"
    folder.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.suffix != ".safetensors":
            (folder / f.name).write_bytes(f.read_bytes())
    (folder / "pytorch_model.bin").write_bytes(b"not really")
    with pytest.raises(ValueError, match="only pickle weights"):
        load_model(ModelConfig(model=str(folder), dtype="float32"))


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="model not found"):
        load_model(ModelConfig(model=str(tmp_path / "nope")))


def test_the_index_names_the_checkpoint_files(tmp_path, tiny_model_dir):
    """model.safetensors.index.json decides which files are read: a sharded checkpoint loads,
    and a stray *.safetensors beside the shards (a Mistral download's consolidated copy) is
    left alone; an index naming missing or outside files is a clear error."""
    import json

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "sharded"
    folder.mkdir()
    for f in tiny_model_dir.iterdir():
        if f.suffix != ".safetensors":
            (folder / f.name).write_bytes(f.read_bytes())
    state = {}
    for f in sorted(tiny_model_dir.glob("*.safetensors")):
        state.update(load_file(f))
    names = sorted(state)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(folder / file))
    save_file({"not.a.model.tensor": torch.zeros(1)}, str(folder / "consolidated.safetensors"))
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    loaded = load_model(ModelConfig(model=str(folder), dtype="float32"))
    ids = list(range(5, 40))
    torch.testing.assert_close(
        our_logits(loaded, ids, 20), hf_logits(folder, ids), rtol=1e-4, atol=1e-4
    )
    for bad, match in (
        ({"a": "missing.safetensors"}, "not there"),
        ({"a": "../model.safetensors"}, "must name files"),
        ({}, "must name files"),
    ):
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": bad}))
        with pytest.raises((ValueError, FileNotFoundError), match=match):
            load_model(ModelConfig(model=str(folder), dtype="float32"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_native_attention_call_changes_no_output(tiny_model_dir, monkeypatch, dtype):
    """With the cpu fused and attention backends, a layer's RoPE, K/V write and attention run
    as one native call (CpuAttentionPlan.rope_write_attend) in steps without long prefills;
    the separate calls give the same tokens and logprobs, bit for bit, prompt rows included."""
    from punica_x.attention.cpu import CpuAttentionPlan

    monkeypatch.setenv("PUNICA_X_ATTENTION_BACKEND", "cpu")
    calls = []
    fused_call = CpuAttentionPlan.rope_write_attend

    def counted(self, *args, **kwargs):
        calls.append(1)
        return fused_call(self, *args, **kwargs)

    monkeypatch.setattr(CpuAttentionPlan, "rope_write_attend", counted)
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    sp_prompt = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=2)
    prompts = ["hello world", "paged attention keeps every block of the cache in use"]

    def run():
        llm = tiny_llm(tiny_model_dir, dtype=dtype, fused_backend="cpu")
        return llm.generate(prompts, sampling=[sp, sp_prompt])

    fused = run()
    assert calls, "the fused call did not run"
    monkeypatch.setattr(CpuAttentionPlan, "fuses_rope", property(lambda self: False))
    calls.clear()
    separate = run()
    assert not calls
    for a, b in zip(fused, separate):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs and a.prompt_logprobs == b.prompt_logprobs
