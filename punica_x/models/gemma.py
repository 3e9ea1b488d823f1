"""Gemma 2 and Gemma 3 (text): the Llama decoder with Gemma's numerics.

- RMSNorms scale by (1 + weight) (the checkpoint stores the offset; the loader adds 1 once),
  and four of them a layer: after attention, and before and after the MLP (sandwich);
- embeddings multiplied by sqrt(hidden_size); a GeLU (tanh) MLP;
- the attention scale from query_pre_attn_scalar; local (sliding-window) and global layers
  as `layer_types` alternates them;
- Gemma 2: attention logits and final logits soft-capped (cap * tanh(x / cap));
- Gemma 3: per-head q/k RMSNorms, and its own RoPE base (and scaling) per layer type."""

from punica_x.models.family import Family

_GEMMA = dict(norm_offset=True, sandwich_norms=True, embed_scale=True)

GEMMA2 = Family("gemma2", ("Gemma2ForCausalLM",), ("gemma2",), **_GEMMA)
GEMMA3 = Family("gemma3", ("Gemma3ForCausalLM",), ("gemma3_text",), qk_norm=True, **_GEMMA)
