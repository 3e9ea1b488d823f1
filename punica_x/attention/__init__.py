"""Attention backends over the paged KV cache, chosen per device through a small registry.

A backend's plan(spans, block_size, device) is made once per step; the plan's
write_kv(kv, layer, k, v) and attend(q, kv, layer, scale) -> (out, lse) run per layer.
Backends: "cpu" (compiled kernel, float32 or bfloat16, default on CPU), "torch" (pure PyTorch
reference, any device and dtype), "flashinfer" (CUDA float16 / bfloat16, the [gpu] extra),
"triton" (CUDA, the batch-invariant mode's: attention.triton_paged)."""

from __future__ import annotations

import importlib.util
import logging

import torch

from punica_x.env import ATTENTION_BACKEND
from punica_x.ops import autotune
from punica_x.ops import isa as isa_mod
from punica_x.ops.registry import CPU_KERNEL_DTYPES, TRITON_DTYPES, Registry

log = logging.getLogger("punica_x.attention")


def _torch():
    from punica_x.attention.paged import TorchAttention

    return TorchAttention()


def _cpu():
    from punica_x.attention.cpu import CpuAttention

    return CpuAttention()


def _flashinfer():
    from punica_x.attention.flashinfer_backend import FlashInferAttention

    return FlashInferAttention()


def _triton():
    from punica_x.attention.triton_plan import TritonAttention

    return TritonAttention()


BACKENDS = Registry(
    "attention",
    ATTENTION_BACKEND,
    {"cpu": _cpu, "torch": _torch, "flashinfer": _flashinfer, "triton": _triton},
    default=lambda device, dtype: _default(device, dtype, None),
    needs={
        "cpu": ("cpu", CPU_KERNEL_DTYPES),
        "flashinfer": ("cuda", (torch.float16, torch.bfloat16)),
        "triton": ("cuda", TRITON_DTYPES),
    },
)


def _default(device: torch.device, dtype: torch.dtype | None, head_dim: int | None) -> str:
    if device.type != "cuda":
        ours = dtype in (None, *CPU_KERNEL_DTYPES)
        return "cpu" if ours and isa_mod.tuned() else "torch"
    from punica_x.attention.flashinfer_backend import HEAD_DIMS

    fits = dtype in (None, torch.float16, torch.bfloat16) and head_dim in (None, *HEAD_DIMS)
    if not fits:
        log.info(
            "attention: FlashInfer has no kernel for head_dim=%s %s; using the torch backend",
            head_dim,
            dtype,
        )
    elif importlib.util.find_spec("flashinfer") is None:
        log.warning(
            "attention: FlashInfer is not installed (pip install 'punica-x[gpu]'); using the "
            "torch backend (decode steps from CUDA graphs; prefill slower)"
        )
        return "torch"
    return "flashinfer" if fits else "torch"


def get_attention_backend(
    device: torch.device | str,
    name: str | None = None,
    dtype: torch.dtype | None = None,
    head_dim: int | None = None,
):
    """`name`, else $PUNICA_X_ATTENTION_BACKEND, else by device: cpu on CPU (float32 or
    bfloat16, else torch); on CUDA flashinfer where it is installed and has a kernel for
    (dtype, head_dim), torch otherwise (logged). A named backend that cannot run `dtype` raises."""
    device = torch.device(device)
    name = name or ATTENTION_BACKEND.get() or _default(device, dtype, head_dim)
    return BACKENDS.get(device, dtype, name)


# Timing workload: a decode step of 32 sequences with 128 tokens of context each.
TIMING_SEQS, TIMING_CONTEXT = 32, 128


def choose_attention(
    device: torch.device | str,
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    name: str | None = None,
):
    """`name`, else $PUNICA_X_ATTENTION_BACKEND, else: on CUDA by get_attention_backend's
    rule; on CPU (float32 or bfloat16, timing enabled) the faster of cpu/torch on a decode
    step of the model's heads, timed at first load and cached."""
    device = torch.device(device)
    name = name or ATTENTION_BACKEND.get() or None
    if name or device.type != "cpu" or dtype not in CPU_KERNEL_DTYPES or not autotune.enabled():
        return get_attention_backend(device, name, dtype, head_dim)
    names = ("cpu", "torch") if isa_mod.tuned() else ("torch",)
    key = (
        f"heads={num_heads}/{num_kv_heads}x{head_dim} block={block_size} "
        f"decode={TIMING_SEQS}x{TIMING_CONTEXT}"
    ) + autotune.dtype_suffix(dtype)
    shape = (num_heads, num_kv_heads, head_dim, block_size)
    tuned = autotune.choose("attention", key, {n: _timing(n, *shape, dtype) for n in names})
    return BACKENDS.get(device, dtype, tuned.name)


def _timing(
    name: str, hq: int, nkv: int, d: int, p: int, dtype: torch.dtype = torch.float32
) -> autotune.Candidate:
    from punica_x.attention.paged import SeqSpan

    def setup():
        backend = BACKENDS.get("cpu", dtype, name)
        per_seq = -(-TIMING_CONTEXT // p)
        kv = torch.randn(TIMING_SEQS * per_seq, 1, 2, nkv, p, d).to(dtype)
        spans = [
            SeqSpan(s, 1, TIMING_CONTEXT, list(range(s * per_seq, (s + 1) * per_seq)))
            for s in range(TIMING_SEQS)
        ]
        q = torch.randn(TIMING_SEQS, hq, d).to(dtype)

        def run():
            backend.plan(spans, p, torch.device("cpu")).attend(q, kv, 0, d**-0.5)

        return run

    return setup
