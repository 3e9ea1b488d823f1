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
and "gate" (the router).

Older checkpoints (PEFT on transformers 4, whose experts were Linear modules) name each
expert's projections: mlp.experts.{e}.gate_proj|up_proj|down_proj (Qwen-MoE, OLMoE) or
block_sparse_moe.experts.{e}.w1|w3|w2 (Mixtral), lora_A [r, in] and lora_B [out, r], declared
in target_modules. Their module here is "experts.{e}.<the name in the key>"; loading folds
them into the stacks' layout (lora/expert_layout.py)."""

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
# per-expert modules of older checkpoints: the name in the key -> the projection it is
PER_EXPERT = {
    "gate_proj": "gate_proj",
    "up_proj": "up_proj",
    "down_proj": "down_proj",
    "w1": "gate_proj",
    "w3": "up_proj",
    "w2": "down_proj",
}
PER_EXPERT_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
    r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.lora_(A|B)\.weight$"
)
_PER_EXPERT_MODULE = re.compile(r"^experts\.(\d+)\.(\w+)$")


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


def parse(key: str, parameters: tuple[str, ...], num_experts: int):
    """(layer, module, "A"|"B") of an expert LoRA tensor name in either format, None for any
    other name; AdapterError for an expert the base lacks or an unwrapped depth."""
    m = KEY.match(key)
    if m is not None:
        return parse_expert_key(m, parameters)
    m = PER_EXPERT_KEY.match(key)
    if m is None:
        return None
    if int(m.group(2)) >= num_experts:
        raise AdapterError(
            "shape_mismatch", f"{key}: expert {m.group(2)}, the base has {num_experts} experts"
        )
    return int(m.group(1)), f"experts.{int(m.group(2))}.{m.group(3)}", m.group(4)


def per_expert(module: str) -> tuple[int, str] | None:
    """(expert, projection) of an older checkpoint's per-expert module, else None."""
    m = _PER_EXPERT_MODULE.match(module)
    if m is None or m.group(2) not in PER_EXPERT:
        return None
    return int(m.group(1)), PER_EXPERT[m.group(2)]


def is_expert(module: str) -> bool:
    """An expert stack, the router or a per-expert module: lives on sparse layers only."""
    return module in EXPERT_MODULES or per_expert(module) is not None


def declared_name(module: str) -> str:
    """The name target_modules / target_parameters declares the module under."""
    return module.rsplit(".", 1)[1] if per_expert(module) is not None else module


def per_expert_shape(module: str, stacks: dict) -> tuple[int, int]:
    """(in, out) of a per-expert module, from the stacks' shapes (gate|up: (hidden, 2 I))."""
    hidden, double = stacks["experts.gate_up_proj"]
    down = per_expert(module)[1] == "down_proj"
    return (double // 2, hidden) if down else (hidden, double // 2)


def check_every_expert(modules: set, num_experts: int) -> None:
    """A per-expert projection targeted on one expert is on every expert, in one format."""
    names = {}
    for m in modules:
        pe = per_expert(m)
        if pe is not None:
            names.setdefault(declared_name(m), set()).add(pe[0])
    if names and any(m in EXPERT_STACKS for m in modules):
        raise AdapterError(
            "bad_weights", "expert LoRA in both formats (per-expert modules and target_parameters)"
        )
    for name, experts in sorted(names.items()):
        missing = sorted(set(range(num_experts)) - experts)
        if missing:
            raise AdapterError("bad_weights", f"{name} has no weights for experts {missing[:8]}")


def stack_of(module: str) -> str:
    """The expert stack a per-expert module folds into; any other module itself."""
    pe = per_expert(module)
    if pe is None:
        return module
    return "experts.down_proj" if pe[1] == "down_proj" else "experts.gate_up_proj"


def layers_of(wanted, module: str, sparse_layers) -> list:
    """The layers of `wanted` where `module` exists (an expert module: the sparse ones)."""
    if not is_expert(module):
        return list(wanted)
    return [layer for layer in wanted if sparse_layers[layer]]
