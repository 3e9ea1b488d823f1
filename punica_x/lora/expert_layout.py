"""An adapter's LoRA on a mixture of experts (lora/expert_keys.py) in the layout the MoE block
reads (models/moe.py), kept in LoraAdapter.groups beside the SGMV groups:

- "experts.gate_up_proj" / "experts.down_proj": (a [E, L, r, in], b [E, L, r * out]): a[e] and
  b[e] are expert e's SGMV weights of one slice (ops/sgmv.py's [L, r, in] and [L, r * out],
  contiguous), so one SGMV launch can give each (adapter, expert) segment its own;
- "gate" (the router): (a [L, r, hidden], b [L, r, E]).

Scaling is already folded into B (adapter._scaled); layers without the module stay zero."""

from __future__ import annotations

import torch

from punica_x.lora.expert_keys import EXPERT_STACKS, ROUTER, per_expert
from punica_x.lora.host_buffers import host_zeros


def to_expert_layout(tensors: dict, target, dtype: torch.dtype) -> tuple[dict, dict]:
    """(ranks, groups) of the expert modules among scaled float32 tensors
    {(layer, module, ab): t}; each module at its largest rank over the layers."""
    tensors = fold_per_expert(tensors, target)
    ranks, groups = {}, {}
    for module in (*EXPERT_STACKS, ROUTER):
        layers = {layer: t for (layer, m, ab), t in tensors.items() if m == module and ab == "A"}
        if not layers:
            continue
        e = target.num_experts if module in EXPERT_STACKS else 1
        rank = max(t.shape[0] for t in layers.values()) // e
        h_in, h_out = target.shape(module)
        a = host_zeros((e, target.num_layers, rank, h_in), dtype)
        b = host_zeros((e, target.num_layers, rank, h_out), dtype)
        for layer, ta in layers.items():
            r = ta.shape[0] // e
            a[:, layer, :r] = ta.view(e, r, h_in)
            # PEFT's B [out, r * E] is [out, r, E]: expert e's B^T is [r, out] of column e
            tb = tensors[(layer, module, "B")].view(h_out, r, e)
            b[:, layer, :r] = tb.permute(2, 1, 0)
        ranks[module] = (rank,)
        if module == ROUTER:
            groups[module] = (a[0].contiguous(), b[0].contiguous())
        else:
            groups[module] = (a, b.view(e, target.num_layers, rank * h_out))
    return ranks, groups


def fold_per_expert(tensors: dict, target) -> dict:
    """An older checkpoint's per-expert modules (lora/expert_keys.py) as the stacks' tensors
    in PEFT's layout, the same function: per layer, gate|up's A is each expert's gate A over
    its up A ([E * (r_g + r_u), hidden]) and its B maps the first r_g of them to the gate
    columns and the others to the up columns; down's as they are. Ranks padded with zeros to
    the layer's largest."""
    parts: dict = {}  # (layer, stack, projection) -> {expert: (A, B)}
    out = {}
    for (layer, module, ab), t in tensors.items():
        pe = per_expert(module)
        if pe is None:
            out[(layer, module, ab)] = t
            continue
        stack = "experts.down_proj" if pe[1] == "down_proj" else "experts.gate_up_proj"
        slot = parts.setdefault((layer, stack, pe[1]), {}).setdefault(pe[0], [None, None])
        slot[0 if ab == "A" else 1] = t
    for layer, stack in sorted({(k[0], k[1]) for k in parts}):
        order = ("down_proj",) if stack == "experts.down_proj" else ("gate_proj", "up_proj")
        out[(layer, stack, "A")], out[(layer, stack, "B")] = _stack(
            [parts.get((layer, stack, p), {}) for p in order], target, stack
        )
    return out


def _stack(projections: list[dict], target, stack: str):
    """(A [E * R, in], B [out, R * E] as PEFT's [out, R, E]) of one layer's per-expert LoRA
    of `projections` (each {expert: (A [r, in], B [h, r])}), the projections' outputs side
    by side and their ranks stacked (R: the sum of each projection's largest rank)."""
    e = target.num_experts
    h_in, h_out = target.shape(stack)
    ranks = [max((a.shape[0] for a, _ in p.values()), default=0) for p in projections]
    width = h_out // len(projections)  # each projection's outputs
    a = torch.zeros(e, sum(ranks), h_in)
    b = torch.zeros(h_out, sum(ranks), e)
    row = 0
    for j, (p, r) in enumerate(zip(projections, ranks)):
        for expert, (ta, tb) in p.items():
            a[expert, row : row + ta.shape[0]] = ta
            b[j * width : (j + 1) * width, row : row + ta.shape[0], expert] = tb
        row += r
    return a.reshape(e * sum(ranks), h_in), b.reshape(h_out, sum(ranks) * e)
