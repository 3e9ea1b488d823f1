"""Qwen2 / Qwen2.5: the Llama decoder with biases on q, k and v (not on o), and a sliding
window only when the config's use_sliding_window says so."""

from punica_x.models.family import Family

QWEN2 = Family(
    "qwen2",
    ("Qwen2ForCausalLM",),
    ("qwen2",),
    qkv_bias=True,
    o_bias=False,
    window_flag="use_sliding_window",
)
