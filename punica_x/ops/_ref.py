"""Pure-PyTorch SGMV, one matmul per segment and slice: slow and obviously correct."""

from __future__ import annotations

import torch

from punica_x.ops.sgmv_weights import SgmvWeights


def shrink(v: torch.Tensor, x: torch.Tensor, w: SgmvWeights, layer: int) -> None:
    for s in range(w.num_segments):
        a = w.a[s]
        lo, hi = w.seg_host[s], w.seg_host[s + 1]
        if a is None or lo == hi:
            continue
        rank = a.shape[1]
        v[lo:hi, :rank] = (x[lo:hi].float() @ a[layer].float().t()).to(v.dtype)


def expand(y: torch.Tensor, v: torch.Tensor, w: SgmvWeights, layer: int) -> None:
    for s in range(w.num_segments):
        b = w.b[s]
        lo, hi = w.seg_host[s], w.seg_host[s + 1]
        if b is None or lo == hi:
            continue
        b_off = v_off = y_off = 0
        for r, h in zip(w.ranks_host[s], w.h_out):
            if r:
                bj = b[layer, b_off : b_off + r * h].view(r, h).float()
                delta = v[lo:hi, v_off : v_off + r].float() @ bj
                y[lo:hi, y_off : y_off + h] += delta.to(y.dtype)
            b_off, v_off, y_off = b_off + r * h, v_off + r, y_off + h
