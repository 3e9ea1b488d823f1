"""Fused element-wise layers: RMSNorm (+ residual add), in-place RoPE, SiLU-and-mul and
GeLU(tanh)-and-mul (Gemma).

Two implementations with one interface: ``cpu`` (csrc/layers, float32 or bfloat16 on CPU,
float32 arithmetic: one pass and
one call per layer instead of 5-16 PyTorch ops, which also keeps the engine thread off the
GIL), ``torch`` (the reference, any device and dtype) and ``triton`` (the batch-invariant
norms on CUDA: ops.triton_norm). Shapes: rows are tokens [T, ...].
choose_fused: a named backend, else $PUNICA_X_FUSED_BACKEND, else on CPU (float32 or
bfloat16) the faster
on the model's shapes by a timing at first load (punica_x.ops.autotune), else torch.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from punica_x.env import FUSED_BACKEND
from punica_x.ops import autotune
from punica_x.ops import isa as isa_mod
from punica_x.ops.registry import (
    CPU_KERNEL_DTYPES,
    TRITON_DTYPES,
    Registry,
    cpu_kernels_else_torch,
)

TIMING_ROWS = 32  # a decode step of 32 requests


class TorchFused:
    """The reference, written as the Llama reference model computes it."""

    name = "torch"

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        """x: [T, H] -> w * x / rms(x), statistics in float32."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return w * h.to(x.dtype)

    def add_rms_norm(self, x, residual, w, eps) -> torch.Tensor:
        """residual += x (in place); returns rms_norm(residual)."""
        residual.add_(x)
        return self.rms_norm(residual, w, eps)

    def rope_(self, x: torch.Tensor, heads: int, head_dim: int, positions, cos, sin) -> None:
        """Rotate-half RoPE in place; x: [T, heads * head_dim] (rows may be strided)."""
        v = x.view(x.shape[0], heads, head_dim)
        c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
        half = head_dim // 2
        rotated = torch.cat((-v[..., half:], v[..., :half]), dim=-1)
        v.copy_(v * c + rotated * s)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2 * I] -> silu(gate) * up, [T, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2 * I] -> gelu(gate, approximate="tanh") * up, [T, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class CpuFused:
    name = "cpu"

    def __init__(self, isa: str | None = None) -> None:
        from punica_x.ops._build import load_extension

        self.ext = load_extension("layers_cpu", isa)

    def rms_norm(self, x, w, eps):
        return self.ext.rms_norm(x, w, eps)

    def add_rms_norm(self, x, residual, w, eps):
        return self.ext.add_rms_norm(x.contiguous(), residual, w, eps)

    def rope_(self, x, heads, head_dim, positions, cos, sin) -> None:
        self.ext.rope_(x, heads, head_dim, positions, cos, sin)

    def silu_and_mul(self, gate_up):
        return self.ext.silu_and_mul(gate_up.contiguous())

    def gelu_tanh_and_mul(self, gate_up):
        return self.ext.gelu_tanh_and_mul(gate_up.contiguous())


def _triton():
    from punica_x.ops.triton_norm import TritonFused

    return TritonFused(TorchFused())


BACKENDS: Registry = Registry(
    "fused",
    FUSED_BACKEND,
    {"cpu": CpuFused, "torch": TorchFused, "triton": _triton},
    default=cpu_kernels_else_torch,
    needs={
        "cpu": ("cpu", CPU_KERNEL_DTYPES),
        "triton": ("cuda", TRITON_DTYPES),
    },
)


def get_fused_backend(device: torch.device | str, dtype: torch.dtype, name: str | None = None):
    """`name`, else $PUNICA_X_FUSED_BACKEND, else cpu for float32 / bfloat16 on CPU and torch
    otherwise."""
    return BACKENDS.get(device, dtype, name)


def choose_fused(device: torch.device | str, dtype: torch.dtype, dims, name: str | None = None):
    """`name`, else $PUNICA_X_FUSED_BACKEND, else the faster of cpu/torch on one decoder
    layer's element-wise work for `dims` (a LlamaDims), timed at first load and cached."""
    device = torch.device(device)
    name = name or FUSED_BACKEND.get() or None
    if name or device.type != "cpu" or dtype not in CPU_KERNEL_DTYPES or not autotune.enabled():
        return BACKENDS.get(device, dtype, name)
    names = ("cpu", "torch") if isa_mod.tuned() else ("torch",)
    h, i = dims.hidden_size, dims.intermediate_size
    key = f"hidden={h} inter={i} heads={dims.num_heads}x{dims.head_dim} rows={TIMING_ROWS}"
    key += autotune.dtype_suffix(dtype)
    tuned = autotune.choose("fused", key, {n: _timing(n, dims, dtype) for n in names})
    return BACKENDS.get(device, dtype, tuned.name)


def _timing(name: str, dims, dtype: torch.dtype = torch.float32) -> autotune.Candidate:
    def setup():
        f = BACKENDS.get("cpu", dtype, name)
        t, h, hd = TIMING_ROWS, dims.hidden_size, dims.head_dim

        def randn(*shape):
            return torch.randn(*shape).to(dtype)

        x, res, w = randn(t, h), randn(t, h), torch.ones(h, dtype=dtype)
        gate_up = randn(t, 2 * dims.intermediate_size)
        q = randn(t, dims.num_heads * hd)
        positions = torch.arange(t)
        cos, sin = randn(t, hd), randn(t, hd)

        def run():
            f.rms_norm(x, w, 1e-5)
            f.add_rms_norm(x, res, w, 1e-5)
            f.silu_and_mul(gate_up)
            f.rope_(q, dims.num_heads, hd, positions, cos, sin)

        return run

    return setup
