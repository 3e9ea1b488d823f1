"""The mixture-of-experts families: the Llama decoder whose MLP is a block of routed experts
(models/moe.py; what each config says of them: moe_spec.py).

- Qwen3-MoE: Qwen3's attention (per-head q/k norms), experts of moe_intermediate_size, the
  top-k weights normalized where norm_topk_prob says, dense MLPs on mlp_only_layers;
- Qwen2-MoE (Qwen1.5-MoE): Qwen2's attention with the config's qkv_bias, and a shared expert
  beside the routed ones, gated by a sigmoid;
- Mixtral: Mistral's attention, 8 experts of intermediate_size in checkpoints named
  block_sparse_moe.experts.{e}.w1|w3|w2, top-2 weights always normalized and kept float32;
- OLMoE: q and k RMSNorms over the whole projection (not per head), 64 experts, top-8 weights
  not normalized (norm_topk_prob false)."""

from punica_x.models.family import Family

QWEN3_MOE = Family(
    "qwen3_moe",
    ("Qwen3MoeForCausalLM",),
    ("qwen3_moe",),
    qk_norm=True,
    window_flag="use_sliding_window",
    moe=True,
)
QWEN2_MOE = Family(
    "qwen2_moe",
    ("Qwen2MoeForCausalLM",),
    ("qwen2_moe",),
    o_bias=False,
    qkv_bias_field="qkv_bias",
    window_flag="use_sliding_window",
    moe=True,
)
MIXTRAL = Family(
    "mixtral",
    ("MixtralForCausalLM",),
    ("mixtral",),
    moe=True,
    norm_topk=True,
    float_routing=True,
)
OLMOE = Family("olmoe", ("OlmoeForCausalLM",), ("olmoe",), qk_norm_full=True, moe=True)
MOE_FAMILIES = (QWEN3_MOE, QWEN2_MOE, MIXTRAL, OLMOE)
