"""ScaleReduce (DistAttention): merge partial attention results computed on disjoint key sets.

Each partial result is (out, lse): the softmax-weighted sum of its values and the
log-sum-exp (natural log) of its scores, per query row and head. Merging is exact:
lse = log(exp(lse_a) + exp(lse_b)); out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse).
An empty partial has lse = -inf and contributes nothing.
"""

from __future__ import annotations

import torch


def merge_attention(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """out_*: [T, H, D], lse_*: [T, H] float32. Returns (out [T, H, D], lse [T, H])."""
    lse_a, lse_b = lse_a.float(), lse_b.float()
    lse = torch.logaddexp(lse_a, lse_b)
    # Rows where both parts are empty keep lse = -inf and out = 0 (no NaN from inf - inf).
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    wa = torch.exp(lse_a - safe).unsqueeze(-1)
    wb = torch.exp(lse_b - safe).unsqueeze(-1)
    out = out_a.float() * wa + out_b.float() * wb
    return out.to(out_a.dtype), lse


def merge_many(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold merge_attention over any number of (out, lse) parts (at least one)."""
    out, lse = parts[0]
    for o, s in parts[1:]:
        out, lse = merge_attention(out, lse, o, s)
    return out, lse
