"""PEFT's LoRA on a mixture of experts' parameters (LoraConfig.target_parameters): what an
adapter's config and tensor names say, checked without torch.

PEFT wraps the 3-D expert stacks of transformers 5 (mlp.experts.gate_up_proj [E, 2 I,
hidden], mlp.experts.down_proj [E, hidden, I]) and the router's weight (mlp.gate.weight
[E, hidden]) in ParamWrappers. An expert stack's lora_A is [r * E, in] (expert e's A: rows
e * r .. e * r + r) and its lora_B [out, r * E] (expert e's B: columns e, E + e, ...: PEFT
reshapes it [out, r, E]); the router's are a plain [r, hidden] and [E, r]. Two wrapped
parameters of one module nest, the first the module declares innermost, so their tensors are
named mlp.experts.base_layer.lora_A.weight (gate_up_proj) and mlp.experts.lora_A.weight
(down_proj); which is which is read from that nesting and then held to its shapes.

Our names for them (LoraTarget.expert_shapes): "experts.gate_up_proj", "experts.down_proj"
and "gate" (the router)."""

from __future__ import annotations

import re

from punica_x.lora.peft_errors import AdapterError

EXPERT_STACKS = ("experts.gate_up_proj", "experts.down_proj")  # as HF's experts declare them
ROUTER = "gate"
EXPERT_MODULES = (*EXPERT_STACKS, ROUTER)
_PARAMETERS = {
    "mlp.experts.gate_up_proj": "experts.gate_up_proj",
    "mlp.experts.down_proj": "experts.down_proj",
    "mlp.gate.weight": ROUTER,
}
KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.mlp\."
    r"(experts((?:\.base_layer)*)|gate)\.lora_(A|B)\.weight$"
)


def offered(num_experts: int) -> str:
    """What a base with `num_experts` experts offers target_parameters, for refusals."""
    if not num_experts:
        return "this base model has no experts (target_parameters needs a mixture of experts)"
    return f"its experts offer target_parameters {', '.join(_PARAMETERS)}"


def targeted_parameters(value, num_experts: int) -> tuple[str, ...]:
    """Our names of the parameters a config's target_parameters names (PEFT matches an entry
    against the end of "<module>.<parameter>"), in EXPERT_MODULES order; AdapterError for
    anything else."""
    if value is None or value == []:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise AdapterError(
            "bad_config", f"target_parameters must be a list of names, got {value!r}"
        )
    if not num_experts:
        raise AdapterError("unsupported_option", f"target_parameters {value}: {offered(0)}")
    names = set()
    for entry in value:
        hits = [ours for full, ours in _PARAMETERS.items() if _matches(full, entry)]
        if not hits:
            raise AdapterError(
                "unknown_module",
                f"target_parameters entry {entry!r} names no expert parameter; "
                f"{offered(num_experts)}",
            )
        names.update(hits)
    return tuple(m for m in EXPERT_MODULES if m in names)


def _matches(full: str, entry: str) -> bool:
    """PEFT's rule within a layer: the entry is the name, or its end after a dot (an entry
    naming one layer, "model.layers.3.mlp...", is refused: layers_to_transform says that)."""
    return full == entry or full.endswith("." + entry)


def parse_expert_key(match: re.Match, parameters: tuple[str, ...]) -> tuple[int, str, str]:
    """(layer, our module name, "A"|"B") of a KEY match, given targeted_parameters(...)."""
    layer, ab = int(match.group(1)), match.group(4)
    if match.group(2) == ROUTER:
        if ROUTER not in parameters:
            raise AdapterError(
                "bad_weights", f"{match.string}: the router's LoRA, not in target_parameters"
            )
        return layer, ROUTER, ab
    stacks = [m for m in EXPERT_STACKS if m in parameters]
    depth = match.group(3).count(".base_layer")
    if depth >= len(stacks):
        raise AdapterError(
            "bad_weights",
            f"{match.string}: no expert parameter of target_parameters is wrapped {depth} deep",
        )
    return layer, stacks[len(stacks) - 1 - depth], ab
