"""A mixture-of-experts checkpoint's expert tensors into MoeBlock (models/moe.py), whatever
layout the checkpoint stores them in:

- per expert (HF's safetensors, transformers 4 and 5): mlp.experts.{e}.gate_proj|up_proj|
  down_proj.weight, and Mixtral's block_sparse_moe.experts.{e}.w1|w3|w2.weight;
- fused (transformers 5's in-memory layout): mlp.experts.gate_up_proj [E, 2 I, hidden] (gate
  rows first) and mlp.experts.down_proj [E, hidden, I];
- the router mlp.gate.weight (block_sparse_moe.gate.weight), and Qwen2-MoE's shared expert
  mlp.shared_expert.gate_proj|up_proj|down_proj.weight and mlp.shared_expert_gate.weight.

canonical() turns each into the per-expert names, which load() and expected() speak."""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from punica_x.models.moe import MoeBlock
from punica_x.models.moe_spec import MoeSpec

_MIXTRAL = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_LAYER = re.compile(r"^(model\.layers\.\d+\.)(?:mlp|block_sparse_moe)\.(.+)$")
_EXPERT = re.compile(r"^experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_SHARED = re.compile(r"^shared_expert\.(gate_proj|up_proj|down_proj)\.weight$")


def canonical(name: str, tensor) -> Iterator[tuple[str, object]]:
    """(name, tensor) pairs in the per-expert layout for one checkpoint tensor (fused expert
    stacks split per expert; Mixtral's names renamed); any other tensor as it is."""
    m = _LAYER.match(name)
    if m is None:
        yield name, tensor
        return
    prefix, rest = m.group(1) + "mlp.", m.group(2)
    if rest in ("experts.gate_up_proj", "experts.down_proj") and isinstance(tensor, torch.Tensor):
        if tensor.dim() != 3:
            raise ValueError(f"{name}: expected [experts, out, in], got {tuple(tensor.shape)}")
        half = tensor.shape[1] // 2
        for e in range(tensor.shape[0]):
            if rest == "experts.down_proj":
                yield f"{prefix}experts.{e}.down_proj.weight", tensor[e]
            else:
                yield f"{prefix}experts.{e}.gate_proj.weight", tensor[e, :half]
                yield f"{prefix}experts.{e}.up_proj.weight", tensor[e, half:]
        return
    expert = _EXPERT.match(rest)
    if expert is not None:
        proj = _MIXTRAL.get(expert.group(2), expert.group(2))
        yield f"{prefix}experts.{expert.group(1)}.{proj}.weight", tensor
        return
    yield prefix + rest, tensor


def load(block: MoeBlock, rest: str, tensor) -> bool:
    """Copy one canonical tensor of a sparse layer (`rest`: its name after the layer's
    prefix, e.g. "mlp.experts.3.up_proj.weight") into `block`; False for unknown names."""
    if rest == "mlp.gate.weight":
        return block.gate.load_slice(None, "weight", tensor)
    if rest == "mlp.shared_expert_gate.weight" and block.shared_expert_gate is not None:
        return block.shared_expert_gate.load_slice(None, "weight", tensor)
    m = _EXPERT.match(rest.removeprefix("mlp."))
    if m is not None and int(m.group(1)) < block.num_experts:
        e, proj = int(m.group(1)), m.group(2)
        if proj == "down_proj":
            return block.experts_down[e].load_slice(None, "weight", tensor)
        index = 0 if proj == "gate_proj" else 1
        return block.experts_gate_up[e].load_slice(index, "weight", tensor)
    m = _SHARED.match(rest.removeprefix("mlp."))
    if m is not None and block.shared_gate_up is not None:
        if m.group(1) == "down_proj":
            return block.shared_down.load_slice(None, "weight", tensor)
        index = 0 if m.group(1) == "gate_proj" else 1
        return block.shared_gate_up.load_slice(index, "weight", tensor)
    return False


def expected(spec: MoeSpec) -> list[str]:
    """The canonical names of one sparse layer's MLP (after the layer's prefix)."""
    names = ["mlp.gate.weight"]
    for e in range(spec.num_experts):
        names += [f"mlp.experts.{e}.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
    if spec.shared_size:
        names += [f"mlp.shared_expert.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]
        names.append("mlp.shared_expert_gate.weight")
    return names
