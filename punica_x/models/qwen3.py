"""Qwen3 (dense): the Llama decoder with an RMSNorm over each head of q and k before RoPE
(q_norm, k_norm), an explicit head_dim, no biases by default, and a sliding window only when
the config's use_sliding_window says so."""

from punica_x.models.family import Family

QWEN3 = Family(
    "qwen3",
    ("Qwen3ForCausalLM",),
    ("qwen3",),
    qk_norm=True,
    window_flag="use_sliding_window",
)
