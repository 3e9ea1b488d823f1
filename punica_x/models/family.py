"""What one model family changes in the shared Llama decoder (punica_x/models/llama.py): a
family states only how it differs; the registry (registry.py) finds it from a HF config.
Adding a family is one small module declaring its Family, plus its test against HF."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """name: what /v1/models and the admin status call it. architectures / model_types: the
    HF config values that select it. qkv_bias / o_bias: biases on the q/k/v and o
    projections (None: the config's attention_bias, as Llama reads it). qk_norm: an RMSNorm
    over each head of q and k before RoPE (Qwen3). window_flag: the config field that turns
    `sliding_window` on (None: a set window is in use, as Mistral's). fused_projections: the
    checkpoint and its adapters name q|k|v `qkv_proj` and gate|up `gate_up_proj` (Phi-3).
    norm_offset: every RMSNorm scales by (1 + weight) (Gemma's checkpoints store the offset
    from 1). sandwich_norms: RMSNorms after attention and around the MLP too (Gemma 2/3:
    pre_feedforward_layernorm, post_feedforward_layernorm). embed_scale: embeddings are
    multiplied by sqrt(hidden_size) (Gemma). qk_norm_full: the q and k norms span the whole
    projection, not each head (OLMoE). qkv_bias_field: the config field that turns the q/k/v
    biases on when qkv_bias is None (Qwen2-MoE: `qkv_bias`). moe: a mixture of experts
    (models/moe_spec.py reads its config); norm_topk: whether the top-k routing weights are
    divided by their sum (None: the config's norm_topk_prob; Mixtral always); float_routing:
    the routing weights stay float32 (Mixtral). Read from the config whatever the family: the
    activation (`hidden_act` / `hidden_activation`), `query_pre_attn_scalar`,
    `attn_logit_softcapping`, `final_logit_softcapping`, `layer_types` and per-layer-type
    RoPE."""

    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    qkv_bias: bool | None = None
    o_bias: bool | None = None
    qk_norm: bool = False
    window_flag: str | None = None
    fused_projections: bool = False
    norm_offset: bool = False
    sandwich_norms: bool = False
    embed_scale: bool = False
    qk_norm_full: bool = False
    qkv_bias_field: str = "attention_bias"
    moe: bool = False
    norm_topk: bool | None = None
    float_routing: bool = False

    def biases(self, config) -> tuple[bool, bool]:
        """(q/k/v bias, o bias) of this family's attention for `config`."""
        default = bool(getattr(config, "attention_bias", False))
        field = bool(getattr(config, self.qkv_bias_field, False))
        qkv = field if self.qkv_bias is None else self.qkv_bias
        return qkv, default if self.o_bias is None else self.o_bias

    def sliding_window(self, config) -> int | None:
        """The attention window in tokens, None when every layer attends to all tokens."""
        if self.window_flag is not None and not getattr(config, self.window_flag, False):
            return None
        return getattr(config, "sliding_window", None) or None

    def layer_windows(self, config, num_layers: int) -> tuple[int, ...]:
        """Each layer's window (0: full attention). The config's `layer_types` says which
        layers slide where it has them (Qwen2's max_window_layers, Gemma's local/global
        pattern); without them a set window is every layer's (Mistral, Phi-3)."""
        window = self.sliding_window(config) or 0
        types = getattr(config, "layer_types", None)
        if not types:
            return (window,) * num_layers
        if len(types) != num_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
        windows = {"full_attention": 0, "sliding_attention": window}
        unknown = sorted(set(types) - set(windows))
        if unknown:
            raise ValueError(f"unsupported layer_types {unknown} (supported: {sorted(windows)})")
        return tuple(windows[t] for t in types)
