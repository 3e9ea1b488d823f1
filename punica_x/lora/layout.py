"""A parsed adapter's tensors in the SGMV layout LoraAdapter.groups holds (see
punica_x/ops/sgmv.py): per projection group, every layer's A^T of the targeted slices stacked
and B flattened, each slice at its largest rank over the layers (zero-padded)."""

from __future__ import annotations

import torch

# Projections that read one input and share one SGMV launch, in the base model's fused order.
GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


def _padded(t: torch.Tensor | None, rows: int, cols: int) -> torch.Tensor:
    """t [r, cols] zero-padded to [rows, cols] (a layer without this module: all zeros):
    zero rows of A and B add nothing, so a slice's rank is its largest over the layers."""
    out = torch.zeros(rows, cols)
    if t is not None:
        out[: t.shape[0]] = t
    return out


def to_sgmv_layout(tensors, modules, target, dtype: torch.dtype):
    """Scaled float32 tensors (_scaled) in the SGMV layout of LoraAdapter.groups."""
    ranks: dict[str, tuple[int, ...]] = {}
    groups: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    layers = range(target.num_layers)
    for group, slices in GROUPS.items():
        present = [m for m in slices if m in modules]
        if not present:
            continue
        top = {
            m: max(t.shape[0] for (_, mod, ab), t in tensors.items() if mod == m and ab == "A")
            for m in present
        }
        ranks[group] = tuple(top.get(m, 0) for m in slices)
        a_layers, b_layers = [], []
        for layer in layers:
            # A^T of every targeted slice stacked: [R_g, h_in]
            a_layers.append(
                torch.cat(
                    [
                        _padded(tensors.get((layer, m, "A")), top[m], target.shapes[m][0])
                        for m in present
                    ]
                )
            )
            # each slice's B as [r, h_out] (PEFT stores [h_out, r]), flattened
            b_layers.append(
                torch.cat(
                    [
                        _padded(
                            _t(tensors.get((layer, m, "B"))), top[m], target.shapes[m][1]
                        ).reshape(-1)
                        for m in present
                    ]
                )
            )
        groups[group] = (
            torch.stack(a_layers).to(dtype).contiguous(),
            torch.stack(b_layers).to(dtype).contiguous(),
        )
    return ranks, groups


def _t(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.t()
