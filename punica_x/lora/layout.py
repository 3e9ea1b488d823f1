"""A parsed adapter's tensors in the SGMV layout LoraAdapter.groups holds (see
punica_x/ops/sgmv.py): per projection group, every layer's A^T of the targeted slices stacked
and B flattened, each slice at its largest rank over the layers (zero-padded)."""

from __future__ import annotations

import torch

from punica_x.lora.host_buffers import host_zeros

# Projections that read one input and share one SGMV launch, in the base model's fused order.
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


def to_sgmv_layout(tensors, modules, target, dtype: torch.dtype):
    """Scaled float32 tensors (_scaled) in the SGMV layout of LoraAdapter.groups."""
    ranks: dict[str, tuple[int, ...]] = {}
    groups: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for group, slices in GROUPS.items():
        present = [m for m in slices if m in modules]
        if not present:
            continue
        top = {
            m: max(t.shape[0] for (_, mod, ab), t in tensors.items() if mod == m and ab == "A")
            for m in present
        }
        ranks[group] = tuple(top.get(m, 0) for m in slices)
        groups[group] = _group_buffers(tensors, present, top, target, dtype)
    return ranks, groups


def _group_buffers(tensors, present, top: dict, target, dtype: torch.dtype):
    """(A [L, R_g, h_in], B [L, sum_m r_m * h_out_m]) in `dtype`: per layer, the A^T of every
    targeted slice stacked and each slice's B as [r, h_out] (PEFT stores [h_out, r]),
    flattened; each slice at its largest rank `top` over the layers, zero-padded (zero rows of
    A and B add nothing; a layer without the module is all zeros). Each float32 tensor is
    copied into place once, rounded to `dtype` there (as a float32 stack then .to(dtype)).
    The buffers are the adapter's host copy: lora/host_buffers.py says where they live."""
    layers, h_in = target.num_layers, target.shapes[present[0]][0]
    a = host_zeros((layers, sum(top[m] for m in present), h_in), dtype)
    b = host_zeros((layers, sum(top[m] * target.shapes[m][1] for m in present)), dtype)
    for layer in range(layers):
        row = col = 0
        for m in present:
            rank, h_out = top[m], target.shapes[m][1]
            ta, tb = tensors.get((layer, m, "A")), tensors.get((layer, m, "B"))
            if ta is not None:
                a[layer, row : row + ta.shape[0]] = ta
            if tb is not None:
                b[layer, col : col + rank * h_out].view(rank, h_out)[: tb.shape[1]] = tb.t()
            row, col = row + rank, col + rank * h_out
    return a, b
