"""An adapter's LoRA on a mixture of experts (lora/expert_keys.py) in the layout the MoE block
reads (models/moe.py), kept in LoraAdapter.groups beside the SGMV groups:

- "experts.gate_up_proj" / "experts.down_proj": (a [E, L, r, in], b [E, L, r * out]): a[e] and
  b[e] are expert e's SGMV weights of one slice (ops/sgmv.py's [L, r, in] and [L, r * out],
  contiguous), so one SGMV launch can give each (adapter, expert) segment its own;
- "gate" (the router): (a [L, r, hidden], b [L, r, E]).

Scaling is already folded into B (adapter._scaled); layers without the module stay zero."""

from __future__ import annotations

import torch

from punica_x.lora.expert_keys import EXPERT_STACKS, ROUTER


def to_expert_layout(tensors: dict, target, dtype: torch.dtype) -> tuple[dict, dict]:
    """(ranks, groups) of the expert modules among scaled float32 tensors
    {(layer, module, ab): t}; each module at its largest rank over the layers."""
    ranks, groups = {}, {}
    for module in (*EXPERT_STACKS, ROUTER):
        layers = {layer: t for (layer, m, ab), t in tensors.items() if m == module and ab == "A"}
        if not layers:
            continue
        e = target.num_experts if module in EXPERT_STACKS else 1
        rank = max(t.shape[0] for t in layers.values()) // e
        h_in, h_out = target.shape(module)
        a = torch.zeros(e, target.num_layers, rank, h_in, dtype=dtype)
        b = torch.zeros(e, target.num_layers, rank, h_out, dtype=dtype)
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
