"""The batch-invariant fused layers on CUDA: RMSNorm (+ residual add) in Triton, one program
per row (ops.invariance).

torch's row mean on CUDA splits a row's sum over threads and blocks by the number of rows
(its reduction config), so a row's statistics round differently alone than in a batch. Here
each row is one program with the whole row in one block of next_pow2(hidden) lanes and a
fixed warp count: the same tree of additions for every row, whatever the row count.
Arithmetic as the reference (TorchFused): float32 statistics, the normed row rounded to the
input dtype, then times the weight in that dtype; add_rms_norm rounds residual + x to the
residual's dtype first, as residual.add_(x) does. RoPE and the activations are element-wise
(each element's arithmetic is its own whatever the batch) and stay torch's.
"""

from __future__ import annotations

import torch

from punica_x.ops.triton_env import tl, triton

NUM_WARPS = 8


@triton.jit
def _rms_norm_kernel(x, residual, w, out, hidden, eps, ADD: tl.constexpr, BLOCK: tl.constexpr):
    """out[row] = w * (s / rms(s)) with s = x[row] (ADD: s = residual[row] + x[row], also
    written back into residual); rows of `hidden` contiguous values."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    keep = cols < hidden
    s = tl.load(x + row * hidden + cols, keep, 0.0)
    if ADD:
        r = tl.load(residual + row * hidden + cols, keep, 0.0)
        s = (r.to(tl.float32) + s.to(tl.float32)).to(r.dtype)
        tl.store(residual + row * hidden + cols, s, keep)
    h = s.to(tl.float32)
    mean = tl.sum(h * h, axis=0) / hidden
    normed = (h * tl.rsqrt(mean + eps)).to(s.dtype).to(tl.float32)
    wv = tl.load(w + cols, keep, 0.0).to(tl.float32)
    tl.store(out + row * hidden + cols, (wv * normed).to(out.dtype.element_ty), keep)


def rms_norm(
    x: torch.Tensor, w: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """x: [T, H] -> [T, H], batch-invariant; residual [T, H] (contiguous, x's dtype): += x
    in place first and normed instead of x."""
    t, h = x.shape
    x = x.contiguous()
    if residual is not None and (not residual.is_contiguous() or residual.shape != x.shape):
        raise ValueError(f"the residual must be a contiguous {list(x.shape)}")
    out = torch.empty_like(x)
    if t:
        block = triton.next_power_of_2(h)
        _rms_norm_kernel[(t,)](
            x,
            residual if residual is not None else x,
            w,
            out,
            h,
            eps,
            ADD=residual is not None,
            BLOCK=block,
            num_warps=NUM_WARPS,
        )
    return out


class TritonFused:
    """The fused backend of the batch-invariant mode on CUDA (ops.fused's interface): the
    norms in Triton, RoPE and the activations those of `elementwise` (the torch reference,
    ops.fused.TorchFused, handed in: this module does not import ops.fused, which makes it)."""

    name = "triton"

    def __init__(self, elementwise) -> None:
        self.rope_ = elementwise.rope_
        self.silu_and_mul = elementwise.silu_and_mul
        self.gelu_tanh_and_mul = elementwise.gelu_tanh_and_mul

    def rms_norm(self, x, w, eps):
        return rms_norm(x, w, eps)

    def add_rms_norm(self, x, residual, w, eps):
        return rms_norm(x, w, eps, residual)
