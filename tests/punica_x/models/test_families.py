"""Every model family of the registry (punica_x/models/registry.py) against HF transformers +
PEFT on a tiny random model of its own config class: greedy tokens equal in float32 for a
mixed batch of adapters and the base model, and prompt logprobs within bfloat16's tolerance
in bfloat16; the registry's refusals."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    assert_matches_hf_fp32,
    assert_within_bf16_of_hf,
    make_peft_adapter,
    make_tiny_family,
    tiny_llm,
)
from transformers import AutoConfig

from punica_x.models.llama import LlamaDims
from punica_x.models.registry import family_of

PROMPTS = [
    "the quick brown fox",
    "hello world",
    "paged attention keeps the keys and values of every request in blocks, and a sliding "
    "window lets each token see only the last few of them",  # longer than the windows below
    "a multi tenant lora",
]
ADAPTERS = [None, "all", "attn", "all"]
TARGETS = {
    "all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "attn": ["q_proj", "v_proj", "o_proj"],
}
FUSED_TARGETS = {  # Phi-3's adapters name its fused modules
    "all": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    "attn": ["qkv_proj", "o_proj"],
}
CASES = {
    "qwen2": {},  # q/k/v biases, no o bias
    "qwen2-tied": {"tie_word_embeddings": True},  # Qwen2.5-0.5B's
    "qwen3": {"head_dim": 32},  # q/k norms; head_dim other than hidden / heads
    "phi3": {"sliding_window": None},  # fused qkv_proj / gate_up_proj, in adapters too
    # sliding windows shorter than the prompts and generations: every layer's (Mistral,
    # Phi-3), and Qwen2's from max_window_layers on (layer 0 full, layer 1 sliding)
    "mistral-window": {"sliding_window": 6},
    "phi3-window": {"sliding_window": 5},
    "qwen2-window": {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
    # Gemma 2: (1 + w) norms, sandwich norms, embedding scale, GeLU-tanh, query_pre_attn_scalar,
    # local (window 4) / global layers, attention and final soft-capping low enough to bite
    "gemma2-window": {
        "head_dim": 16,
        "query_pre_attn_scalar": 24,
        "sliding_window": 4,
        "attn_logit_softcapping": 3.0,
        "final_logit_softcapping": 5.0,
        "tie_word_embeddings": True,
    },
    # Gemma 3: q/k norms, a RoPE per layer type (the global one linearly scaled)
    "gemma3-window": {
        "head_dim": 16,
        "query_pre_attn_scalar": 24,
        "sliding_window": 5,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
        },
        "tie_word_embeddings": True,
    },
}


@pytest.fixture(scope="module", params=list(CASES))
def family_model(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    family = request.param.split("-")[0]
    folder = make_tiny_family(
        tmp_path_factory.mktemp(request.param), family, **CASES[request.param]
    )
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    targets = FUSED_TARGETS if family == "phi3" else TARGETS
    adapters = {
        name: make_peft_adapter(base, folder.parent / f"{name}-lora", 8, t, seed=3 + i)
        for i, (name, t) in enumerate(targets.items())
    }
    return family, folder, adapters


def test_the_registry_finds_the_family(family_model):
    family, folder, _ = family_model
    config = AutoConfig.from_pretrained(folder)
    dims = LlamaDims.from_hf_config(config)
    assert family_of(config).name == dims.family == family
    assert dims.attention_bias == (family == "qwen2") and not dims.o_bias
    assert dims.qk_norm == (family in ("qwen3", "gemma3"))
    assert dims.sandwich_norms == dims.norm_offset == family.startswith("gemma")
    assert dims.fused_projections == (family == "phi3")
    assert any(dims.layer_windows) == ("window" in folder.name)


def test_a_tied_head_is_the_embedding_itself(family_model):
    """Tied models hold vocab x hidden once: the embedding reads the head's layout (and the
    exactness tests above pass through it); oneDNN's opaque layout keeps the copy."""
    from punica_x.ops.dense import has_rows

    _, folder, _ = family_model
    model = tiny_llm(folder).engine.model
    tied = model.dims.tie_word_embeddings
    assert model.embed_from_head == (tied and has_rows(model.lm_head.backend))
    assert (model.embed_tokens.weight.numel() == 0) == model.embed_from_head
    if tied:
        onednn = tiny_llm(folder, dense_backend="onednn").engine.model
        assert not onednn.embed_from_head and onednn.embed_tokens.weight.numel() > 0


def test_greedy_tokens_and_logprobs_equal_hf_peft_in_float32(family_model):
    """Greedy tokens equal; every prompt token's logprob within 1e-4 of HF + PEFT's."""
    family, folder, adapters = family_model
    llm = tiny_llm(folder)
    for name, path in adapters.items():
        llm.load_adapter(name, str(path))
    assert_matches_hf_fp32(llm, folder, adapters, PROMPTS, ADAPTERS, 12, family)


def test_prompt_logprobs_within_bf16_tolerance(family_model):
    """bf16 is not token-exact: the prompt's logprobs (teacher-forced) against HF + PEFT in
    float32, within what bf16 rounding moves them (HF bf16 against HF float32, measured
    here, times 1.5 plus 0.05)."""
    family, folder, adapters = family_model
    assert_within_bf16_of_hf(folder, adapters, PROMPTS, ADAPTERS, family)


def test_unsupported_families_are_refused_by_name():
    config = AutoConfig.for_model("gpt2")
    with pytest.raises(ValueError, match="unsupported model.*Qwen2ForCausalLM"):
        LlamaDims.from_hf_config(config)


def test_layer_windows_follow_the_config():
    """A window is served, not a cap on the context: Qwen2's only when use_sliding_window
    says so and from max_window_layers on (layer_types), Mistral's on every layer."""
    from transformers import MistralConfig, Qwen2Config

    sizes = dict(max_position_embeddings=512, num_hidden_layers=3)
    off = Qwen2Config(sliding_window=64, use_sliding_window=False, **sizes)
    on = Qwen2Config(sliding_window=64, use_sliding_window=True, max_window_layers=1, **sizes)
    assert LlamaDims.from_hf_config(off).layer_windows == (0, 0, 0)
    assert LlamaDims.from_hf_config(on).layer_windows == (0, 64, 64)
    assert LlamaDims.from_hf_config(on).max_positions == 512
    mistral = LlamaDims.from_hf_config(MistralConfig(sliding_window=64, **sizes))
    assert mistral.layer_windows == (64, 64, 64) and mistral.max_positions == 512
    assert LlamaDims.from_hf_config(MistralConfig(sliding_window=None, **sizes)).layer_windows == (
        0,
        0,
        0,
    )
    odd = Qwen2Config(sliding_window=64, use_sliding_window=True, **sizes)
    odd.layer_types = ["full_attention", "chunked_attention", "full_attention"]
    with pytest.raises(ValueError, match="unsupported layer_types.*chunked_attention"):
        LlamaDims.from_hf_config(odd)


def test_distkv_refuses_a_windowed_model(tmp_path):
    """Remote micro-attention has no window: DistKV is refused up front, not served wrong."""
    llm = tiny_llm(make_tiny_family(tmp_path / "m", "mistral", sliding_window=6))
    with pytest.raises(ValueError, match="DistKV does not serve mistral"):
        llm.engine.distkv.enable("r0", None, None)


def test_an_adapter_made_for_another_family_is_refused_naming_the_mismatch(
    family_model, tiny_adapters
):
    """A Llama-layout adapter (q_proj, ...) on a Phi-3 base and a Phi-3 adapter (qkv_proj)
    on any other: AdapterError unknown_module, naming the base model's family and modules."""
    from punica_x.lora.adapter import AdapterError

    family, folder, adapters = family_model
    llm = tiny_llm(folder)
    foreign = tiny_adapters["r16"] if family == "phi3" else None
    if foreign is None:  # a Phi-3 adapter's module names on this family's base
        from helpers import rewrite_config

        foreign = rewrite_config(
            adapters["attn"], folder.parent / "foreign", target_modules=["qkv_proj"]
        )
        import safetensors.torch as st

        renamed = {
            k.replace("q_proj", "qkv_proj"): v
            for k, v in st.load_file(adapters["attn"] / "adapter_model.safetensors").items()
            if "q_proj" in k
        }
        st.save_file(renamed, str(foreign / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match=f"this {family} base model's modules are") as err:
        llm.load_adapter("foreign", str(foreign))
    assert err.value.code == "unknown_module"


def test_partial_rotary_is_refused():
    from transformers import Phi3Config

    config = Phi3Config(partial_rotary_factor=0.75)
    with pytest.raises(ValueError, match="partial_rotary_factor 0.75"):
        LlamaDims.from_hf_config(config)


@pytest.mark.parametrize(
    "field", ["attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"]
)
@pytest.mark.parametrize("bad", [-1.0, 0.0, float("nan"), float("inf"), True, "50"])
def test_bad_gemma_numbers_are_refused_by_name(field, bad):
    from transformers import Gemma2Config

    config = Gemma2Config(num_hidden_layers=2)
    config.__dict__[field] = bad  # past HF's own field validation, as a hand-edited config.json
    with pytest.raises(ValueError, match=field):
        LlamaDims.from_hf_config(config)


def test_gemma_dims_from_its_configs():
    from transformers import Gemma2Config, Gemma3TextConfig

    g2 = LlamaDims.from_hf_config(Gemma2Config(num_hidden_layers=4, hidden_size=2304))
    assert g2.family == "gemma2" and g2.activation == "gelu_pytorch_tanh"
    assert g2.layer_windows == (4096, 0, 4096, 0) and g2.layer_types == ()
    assert (g2.attn_softcap, g2.final_softcap) == (50.0, 30.0)
    assert g2.attn_scale == 256**-0.5 and g2.embed_scale == 2304**0.5
    g3 = LlamaDims.from_hf_config(Gemma3TextConfig(num_hidden_layers=6))
    assert g3.layer_windows == (4096,) * 5 + (0,)
    assert g3.layer_types[-1] == "full_attention" and g3.qk_norm
    assert (g3.attn_softcap, g3.final_softcap) == (0.0, 0.0)
    encoder = Gemma3TextConfig(num_hidden_layers=2, use_bidirectional_attention=True)
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        LlamaDims.from_hf_config(encoder)
