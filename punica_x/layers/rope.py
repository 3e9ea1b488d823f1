"""Rotary position embedding (rotate-half convention) with the scaling the config asks for.

Frequencies come from transformers' rope initialisers, so "linear", "llama3" and "yarn"
scaling match the reference models; position-dependent schemes ("dynamic", "longrope")
would need per-step frequencies and are refused."""

from __future__ import annotations

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _rope_parameters(config, layer_type: str | None = None) -> dict:
    params = getattr(config, "rope_parameters", None) or {}
    if isinstance(params, dict) and "rope_type" not in params and params:
        # per-layer-type dicts ({"full_attention": {...}, "sliding_attention": {...}}: Gemma 3)
        params = params[layer_type] if layer_type in params else next(iter(params.values()))
    return dict(params) or {
        "rope_type": "default",
        "rope_theta": getattr(config, "rope_theta", 10000.0),
    }


def per_layer_type(config) -> bool:
    """Whether the config gives each layer type its own RoPE (Gemma 3's local and global)."""
    params = getattr(config, "rope_parameters", None)
    return isinstance(params, dict) and bool(params) and "rope_type" not in params


def inverse_frequencies(
    config, head_dim: int, layer_type: str | None = None
) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2] float32, attention_scaling) for the model config (for one
    layer type's RoPE where the config has one per type)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = _rope_parameters(config, layer_type)
    rope_type = params.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        supported = ", ".join(SUPPORTED_ROPE_TYPES)
        raise ValueError(f"rope_type {rope_type!r} is not supported (supported: {supported})")
    if rope_type == "default":
        base = params["rope_theta"]
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv, 1.0
    if layer_type is not None and per_layer_type(config):
        return ROPE_INIT_FUNCTIONS[rope_type](config, layer_type=layer_type)
    return ROPE_INIT_FUNCTIONS[rope_type](config)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables for positions [0, max_positions)."""

    def __init__(
        self,
        config,
        head_dim: int,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device,
        layer_type: str | None = None,
    ) -> None:
        super().__init__()
        inv_freq, scaling = inverse_frequencies(config, head_dim, layer_type)
        pos = torch.arange(max_positions, dtype=torch.float)
        freqs = pos[:, None] * inv_freq[None, :]  # [max_positions, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, D]
        self.register_buffer(
            "cos", (emb.cos() * scaling).to(dtype=dtype, device=device), persistent=False
        )
        self.register_buffer(
            "sin", (emb.sin() * scaling).to(dtype=dtype, device=device), persistent=False
        )

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [max_positions, head_dim], read from _buffers: Module.__getattr__ costs
        ~0.5 us a lookup, twice per layer of every step."""
        buffers = self._buffers
        return buffers["cos"], buffers["sin"]

    def rotate_(self, x: torch.Tensor, heads: int, positions: torch.Tensor, fused) -> None:
        """In place on x: [T, heads * head_dim] (a column slice of the fused qkv output)."""
        fused.rope_(x, heads, self.cos.shape[1], positions, self.cos, self.sin)
