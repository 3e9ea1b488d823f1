"""What a mixture-of-experts model's config says about its experts (Qwen2-MoE, Qwen3-MoE,
Mixtral, OLMoE): how many, how many each token runs, their size, how the router's top-k
weights are normalized, the shared expert, and which layers are sparse. Pure config reading:
the block that computes it is moe.py."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MoeSpec:
    """num_experts (E) and top_k (k): each token runs k of the E experts of a sparse layer, each
    an MLP of expert_size. The router's logits ([T, E], x @ gate^T) go through a float32
    softmax; the k largest probabilities are the weights, divided by their sum when
    norm_topk, then cast to the serving dtype unless float_weights (Mixtral keeps them
    float32, so an expert's output is weighted in float32 and rounded once). shared_size > 0:
    a shared expert of that size runs for every token, weighted by sigmoid(x @ shared_gate^T)
    (Qwen2-MoE). sparse_layers[l]: layer l has experts (else a dense MLP of the config's
    intermediate_size: Qwen's mlp_only_layers and decoder_sparse_step)."""

    num_experts: int
    top_k: int
    expert_size: int
    norm_topk: bool
    float_weights: bool
    shared_size: int
    sparse_layers: tuple[bool, ...]

    @classmethod
    def from_config(cls, config, norm_topk: bool | None, float_weights: bool) -> MoeSpec:
        """The spec of a HF MoE config; norm_topk None: the config's norm_topk_prob.
        ValueError naming the field when a number is absurd."""
        experts = _count(config, "num_experts", "num_local_experts")
        top_k = _count(config, "num_experts_per_tok")
        if top_k > experts:
            raise ValueError(f"num_experts_per_tok {top_k} exceeds the {experts} experts")
        size = _count(config, "moe_intermediate_size", "intermediate_size")
        step = _optional(config, "decoder_sparse_step", 1)
        only = getattr(config, "mlp_only_layers", None) or []
        if not isinstance(only, list) or not all(_is_int(i) for i in only):
            raise ValueError(f"mlp_only_layers must be a list of layer indices, got {only!r}")
        layers = range(config.num_hidden_layers)
        sparse = tuple(i not in set(only) and (i + 1) % step == 0 for i in layers)
        if norm_topk is None:
            norm_topk = bool(getattr(config, "norm_topk_prob", False))
        shared = _optional(config, "shared_expert_intermediate_size", 0)
        return cls(experts, top_k, size, norm_topk, float_weights, shared, sparse)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional(config, field: str, default: int) -> int:
    """An optional positive integer: `default` when absent or None (or 0 where the default is
    0: no shared expert)."""
    value = getattr(config, field, None)
    if value is None or (default == 0 and _is_int(value) and value == 0):
        return default
    return _count(config, field)


def _count(config, *fields: str) -> int:
    """The first of `fields` the config sets, a positive integer."""
    for field in fields:
        value = getattr(config, field, None)
        if value is None:
            continue
        if not _is_int(value) or value < 1:
            raise ValueError(f"{field} must be a positive integer, got {value!r}")
        return value
    raise ValueError(f"a mixture-of-experts config needs {' or '.join(fields)}")
