"""The dimensions and numerics of a model of the Llama-family decoder, read once from its HF
config (what punica_x/models/llama.py builds, the LoRA planner offers and the memory plan
sizes): the family's declarations (registry.py) and the config's own fields; a mixture of
experts adds its MoeSpec (moe_spec.py)."""

from __future__ import annotations

from dataclasses import dataclass

from punica_x.layers.rope import per_layer_type
from punica_x.models.moe_spec import MoeSpec
from punica_x.models.registry import family_of

# HF activation names -> the fused layers' act-and-mul
ACTIVATIONS = {"silu": "silu_and_mul", "gelu_pytorch_tanh": "gelu_tanh_and_mul"}


@dataclass(frozen=True)
class LlamaDims:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    vocab_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool  # on q, k and v
    mlp_bias: bool
    max_positions: int
    o_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    qk_norm_full: bool = False  # the q / k norms span the whole projection (OLMoE)
    family: str = "llama"
    fused_projections: bool = False  # checkpoint and adapters name qkv_proj, gate_up_proj
    layer_windows: tuple[int, ...] = ()  # each layer's sliding window, 0: full attention
    attn_softcap: float = 0.0  # attention logit soft-capping (0: none)
    final_softcap: float = 0.0  # final logit soft-capping (0: none)
    attn_scale: float = 0.0  # multiplies q.k (0: head_dim ** -0.5)
    activation: str = "silu"  # a key of ACTIVATIONS
    norm_offset: bool = False  # RMSNorms scale by (1 + weight)
    sandwich_norms: bool = False  # post-attention, pre- and post-MLP norms (Gemma)
    embed_scale: float = 1.0  # embeddings times this (Gemma: sqrt(hidden_size))
    layer_types: tuple[str, ...] = ()  # each layer's RoPE, where the config has one per type
    moe: MoeSpec | None = None  # the experts of a mixture-of-experts family

    @classmethod
    def from_hf_config(cls, config) -> LlamaDims:
        family = family_of(config)
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {act!r} (supported: {sorted(ACTIVATIONS)})")
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention (an encoder) is not a causal LM")
        if getattr(config, "clip_qkv", None) is not None:
            raise ValueError(f"clip_qkv {config.clip_qkv} (clamped q/k/v) is not supported")
        partial = _partial_rotary(config)
        if partial != 1.0:
            raise ValueError(
                f"partial_rotary_factor {partial} (RoPE on part of each head) is not supported"
            )
        heads = config.num_attention_heads
        qkv_bias, o_bias = family.biases(config)
        return cls(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            num_layers=config.num_hidden_layers,
            vocab_size=config.vocab_size,
            rms_norm_eps=config.rms_norm_eps,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            max_positions=config.max_position_embeddings,
            o_bias=o_bias,
            qk_norm=family.qk_norm,
            qk_norm_full=family.qk_norm_full,
            family=family.name,
            fused_projections=family.fused_projections,
            layer_windows=family.layer_windows(config, config.num_hidden_layers),
            attn_softcap=_positive(config, "attn_logit_softcapping"),
            final_softcap=_positive(config, "final_logit_softcapping"),
            attn_scale=_positive(config, "query_pre_attn_scalar") ** -0.5
            if _positive(config, "query_pre_attn_scalar")
            else 0.0,
            activation=act,
            norm_offset=family.norm_offset,
            sandwich_norms=family.sandwich_norms,
            embed_scale=config.hidden_size**0.5 if family.embed_scale else 1.0,
            layer_types=tuple(config.layer_types) if per_layer_type(config) else (),
            moe=MoeSpec.from_config(config, family.norm_topk, family.float_routing)
            if family.moe
            else None,
        )

    def lora_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of every projection a LoRA adapter may target: a
        mixture of experts offers its attention's (LoRA on the experts: moe.py)."""
        q, kv, h, i = (
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
            self.hidden_size,
            self.intermediate_size,
        )
        attention = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
        if self.moe is not None:
            return attention
        return {
            **attention,
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def expert_lora_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of the expert parameters an adapter may target (target_parameters:
        lora/expert_keys.py): each expert's gate|up and down, and the router; {} unless a
        mixture of experts."""
        if self.moe is None:
            return {}
        h, i = self.hidden_size, self.moe.expert_size
        return {
            "experts.gate_up_proj": (h, 2 * i),
            "experts.down_proj": (i, h),
            "gate": (h, self.moe.num_experts),
        }

    def fused_modules(self) -> dict[str, tuple[str, ...]]:
        """The modules a checkpoint (and its adapters) of this family fuses, as the
        projections of lora_shapes() they hold in order: {} unless fused_projections."""
        if not self.fused_projections:
            return {}
        return {
            "qkv_proj": ("q_proj", "k_proj", "v_proj"),
            "gate_up_proj": ("gate_proj", "up_proj"),
        }


def _positive(config, field: str) -> float:
    """A config's optional positive number (None or absent: 0); ValueError otherwise."""
    value = getattr(config, field, None)
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{field} must be a positive number, got {value!r}")
    if value == float("inf"):
        raise ValueError(f"{field} must be finite, got {value!r}")
    return float(value)


def _partial_rotary(config) -> float:
    """The share of each head RoPE rotates (Phi-4-mini: 0.75), from the config or its
    rope_parameters; 1 when neither says."""
    params = getattr(config, "rope_parameters", None)
    value = getattr(config, "partial_rotary_factor", None)
    if value is None and isinstance(params, dict):
        value = params.get("partial_rotary_factor")
    return 1.0 if value is None else float(value)
