"""Dense projections of the shared backbone: y = x @ W^T (+ bias), W given as [N, K].

Backends (each converts W once, at load, into the layout its forward() reads):
* ``cpu``: W packed into panels [ceil(N/P), K, P] for the compiled GEMM in csrc/dense
  (float32 or bfloat16 on CPU, float32 accumulation; P = 48 columns on AVX-512, 24 on AVX2,
  register tiles sized per ISA).
* ``onednn``: oneDNN's linear with W reordered once into its blocked layout (the prepack of
  torch's CPU freezing path); float32 on CPU where torch has oneDNN.
* ``torch``: W stored transposed, [K, N] contiguous, and ``x @ W_t`` (any device/dtype; on
  CPU this layout is itself ~2.5x faster than F.linear's x @ W^T for small M).
* ``triton``: the batch-invariant GEMM on CUDA (ops.triton_gemm; ops.invariance).
MKL's packed sgemm (``torch.ops.mkl._mkl_linear``) is measured in benchmarks/bench_dense.py
but not offered: it uses its pack only at the one batch size it was packed for.

Choice (choose_dense): an explicit name, else $PUNICA_X_DENSE_BACKEND, else on CPU (float32
or bfloat16) the fastest for each weight shape by a timing at first load
(punica_x.ops.autotune), else ``torch``. A named backend that cannot run raises.
bfloat16 candidates: ``cpu`` always; ``onednn`` and ``torch`` only on CPUs with AVX512-BF16 or
AMX-BF16, where oneDNN has bf16 kernels (elsewhere torch's bf16 matmul falls back to a
reference loop ~25x slower than float32 at 256 rows, AMD EPYC AVX2, and timing it alone would
take minutes).
"""

from __future__ import annotations

from typing import Protocol

import torch

from punica_x.env import DENSE_BACKEND
from punica_x.ops import autotune
from punica_x.ops import isa as isa_mod
from punica_x.ops.registry import (
    CPU_KERNEL_DTYPES,
    TRITON_DTYPES,
    Registry,
    cpu_kernels_else_torch,
)

# Rows a projection sees: decode steps (8, 32 requests) and a prefill chunk (256 tokens).
PROJECTION_ROWS = (8, 32, 256)
# A model's weights stream from memory every step (they do not fit a CPU's caches), so the
# timing cycles through copies of the weight adding up to more than a last-level cache:
# timed on one hot weight, a backend that computes fast but streams slowly wins wrongly.
COLD_BYTES = 96 << 20
MAX_COPIES = 16
# The LM head only sees the rows that are sampled: at most one per running request.
HEAD_ROWS = (8, 32)


class DenseBackend(Protocol):
    name: str

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        """[N, K] weight -> the layout forward() reads."""

    def forward(
        self, x: torch.Tensor, prepared: torch.Tensor, n: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x: [M, K] -> [M, N]."""


def prefetches(backend: DenseBackend) -> bool:
    """Whether the backend's forward takes ``prefetch``: an [R, 2] int64 CPU tensor of
    (address, bytes) regions that the caller's next kernel reads, pulled into the caches while
    the GEMM computes (cpu; a hint that changes no result: csrc/common/prefetch.h)."""
    return bool(getattr(backend, "takes_prefetch", False))


def has_rows(backend: DenseBackend) -> bool:
    """Whether the backend reads rows of W back from its layout (rows(prepared, ids, k) ->
    W[ids], [T, K]): what lets a tied LM head serve as the embedding (cpu, torch; oneDNN's
    blocked layout is opaque)."""
    return callable(getattr(backend, "rows", None))


class TorchDense:
    name = "torch"

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.t().contiguous()

    def forward(self, x, prepared, n, bias):
        return x @ prepared if bias is None else torch.addmm(bias, x, prepared)

    def rows(self, prepared: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
        """W[ids] from W^T [K, N]: [T, K]."""
        return prepared[:, ids].t().contiguous()


class PackedCpuDense:
    name = "cpu"
    takes_prefetch = True

    def __init__(self, isa: str | None = None) -> None:
        from punica_x.ops._build import load_extension

        self.ext = load_extension("dense_cpu", isa)

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        return self.ext.pack(weight.contiguous())

    def forward(self, x, prepared, n, bias, prefetch=None):
        y = torch.empty(x.shape[0], n, dtype=prepared.dtype)
        self.ext.gemm(y, x.contiguous(), prepared, n, bias, prefetch)
        return y

    def rows(self, prepared: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
        """W[ids] from the panels [ceil(N / P), ceil(K / KP), P * KP] (csrc/dense/dense.h:
        row n is column n % P of panel n // P, its K values in KP-wide pairs): [T, K]."""
        p = self.ext.panel()
        panels, rows, cols = prepared.shape
        view = prepared.view(panels, rows, p, cols // p)
        picked = view[ids // p, :, ids % p, :]  # [T, rows, KP]
        return picked.reshape(ids.shape[0], -1)[:, :k].contiguous()


class OneDnnDense:
    name = "onednn"

    def __init__(self) -> None:
        if not torch.backends.mkldnn.is_available():
            raise RuntimeError("this torch build has no oneDNN (torch.backends.mkldnn)")
        self._reorder = torch.ops.mkldnn._reorder_linear_weight
        self._linear = torch.ops.mkldnn._linear_pointwise

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        return self._reorder(weight.contiguous())

    def forward(self, x, prepared, n, bias):
        return self._linear(x.contiguous(), prepared, bias, "none", [], "")


def _triton() -> DenseBackend:
    from punica_x.ops.triton_gemm import TritonDense

    return TritonDense()


BACKENDS: Registry[DenseBackend] = Registry(
    "dense",
    DENSE_BACKEND,
    {"cpu": PackedCpuDense, "onednn": OneDnnDense, "torch": TorchDense, "triton": _triton},
    default=cpu_kernels_else_torch,
    needs={
        "cpu": ("cpu", CPU_KERNEL_DTYPES),
        "onednn": ("cpu", CPU_KERNEL_DTYPES),
        "triton": ("cuda", TRITON_DTYPES),
    },
)


def get_dense_backend(
    device: torch.device | str, dtype: torch.dtype, name: str | None = None
) -> DenseBackend:
    """`name`, else $PUNICA_X_DENSE_BACKEND, else the static default (no timing)."""
    return BACKENDS.get(device, dtype, name)


def choose_dense(
    device: torch.device | str,
    dtype: torch.dtype,
    n: int,
    k: int,
    rows: tuple[int, ...] = PROJECTION_ROWS,
    name: str | None = None,
) -> DenseBackend:
    """The backend for an [n, k] weight: `name`, else $PUNICA_X_DENSE_BACKEND, else (float32
    or bfloat16 on CPU, timing enabled) the fastest over x of `rows` rows, else the static
    default."""
    device = torch.device(device)
    name = name or DENSE_BACKEND.get() or None
    tuned = None if name else tune_dense(device, dtype, n, k, rows)
    return BACKENDS.get(device, dtype, name or (tuned.name if tuned else None))


def tune_dense(
    device: torch.device,
    dtype: torch.dtype,
    n: int,
    k: int,
    rows: tuple[int, ...],
    fresh: bool = False,
) -> autotune.Tuned | None:
    """The timing of every CPU candidate for an [n, k] weight over x of `rows` rows
    (autotune: cached per machine, timed again when `fresh`; a lone candidate untimed); None
    off the CPU, for a dtype no compiled kernel takes, or with timing disabled."""
    if device.type != "cpu" or dtype not in CPU_KERNEL_DTYPES or not autotune.enabled():
        return None
    candidates = {c: _timing(c, n, k, rows, dtype) for c in _cpu_candidates(dtype)}
    key = f"{n}x{k} rows={','.join(map(str, rows))}" + autotune.dtype_suffix(dtype)
    return autotune.choose("dense", key, candidates, fresh=fresh)


def _cpu_candidates(dtype: torch.dtype = torch.float32) -> tuple[str, ...]:
    if dtype == torch.bfloat16 and not isa_mod.native_bf16():
        return ("cpu",) if isa_mod.tuned() else ("torch",)
    names = ("cpu", "onednn", "torch") if isa_mod.tuned() else ("onednn", "torch")
    return tuple(c for c in names if c != "onednn" or torch.backends.mkldnn.is_available())


def _timing(
    name: str, n: int, k: int, rows: tuple[int, ...], dtype: torch.dtype = torch.float32
) -> autotune.Candidate:
    def setup():
        backend = BACKENDS.get("cpu", dtype, name)
        size = torch.empty((), dtype=dtype).element_size()
        copies = max(1, min(MAX_COPIES, -(-COLD_BYTES // (size * n * k))))
        weights = [backend.prepare((torch.randn(n, k) * k**-0.5).to(dtype)) for _ in range(copies)]
        xs = [torch.randn(m, k).to(dtype) for m in rows]
        return lambda: [backend.forward(x, w, n, None) for w in weights for x in xs]

    return setup
