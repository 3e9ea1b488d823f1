"""Phi-3 / Phi-3.5 / Phi-4 (dense): the Llama decoder whose checkpoint fuses q|k|v into
`qkv_proj` and gate|up into `gate_up_proj` (the layout our dense layers already use), so its
LoRA adapters target the fused modules too (punica_x/lora/adapter.py splits them into one
SGMV slice per fused output). A set `sliding_window` is in use (capped as Mistral's)."""

from punica_x.models.family import Family

PHI3 = Family("phi3", ("Phi3ForCausalLM",), ("phi3",), fused_projections=True)
