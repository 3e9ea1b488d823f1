"""SGMV: segmented gather matrix-vector multiplication (Punica sec. 4).

Rows of a batch are grouped into contiguous segments; segment ``s`` (rows ``seg[s]:seg[s+1]``)
uses its own LoRA weights, or none. The LoRA add-on ``y += x @ A_s @ B_s`` is two launches:

* shrink: ``v[rows, :R_s] = x[rows] @ A_s``     (h_in -> r, float32 workspace ``v``)
* expand: ``y[rows] += v[rows, :R_s] @ B_s``     (r -> h_out)

One launch may cover several *slices*: projections that read the same input and write
side-by-side columns of one output (q|k|v, gate|up). Slice ``j`` of segment ``s`` has rank
``ranks[s, j]`` (0 when the adapter does not target it); its rows of ``A^T`` are stacked so
that a single shrink serves all slices, and its ``B`` writes columns
``sum(h_out[:j]) : sum(h_out[:j+1])`` of ``y``. With one slice this is exactly Punica's SGMV.

Weight layouts (per adapter, all layers in one tensor so the kernel offsets by ``layer``):

* ``a``: ``[L, R, h_in]`` with ``R = sum_j r_j``; ``a[l, voff_j:voff_j + r_j] = A_j[l]^T``
* ``b``: ``[L, sum_j r_j * h_out_j]``; slice ``j`` is ``B_j[l]`` (``[r_j, h_out_j]``), row-major,
  scaling (lora_alpha / r) already folded in.

Backends: ``cpu`` (compiled C++, float32 or bfloat16), ``cuda`` (compiled CUDA, float32,
float16 or bfloat16), ``torch_ref`` (pure PyTorch, any dtype). x and y share one dtype and the
adapters' weights have it too, except that the ``cpu`` kernels (and ``torch_ref``) also take
bfloat16 weights with float32 x (``SgmvWeights.weight_dtype``; ``LoraConfig.lora_dtype``: half the
bytes a memory-bound launch reads, each weight widened exactly as loaded); ``v`` is float32
and every sum is accumulated in float32 (the bf16 expand of the ``avx512_bf16`` CPU build
reads ``v`` as two bf16 parts, within 2^-17 of it).
The default is chosen by device and never silently replaced: a failed build raises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from punica_x.env import SGMV_BACKEND
from punica_x.ops import _ref, amx_tiles, autotune
from punica_x.ops import isa as isa_mod
from punica_x.ops.registry import CPU_KERNEL_DTYPES, Registry
from punica_x.ops.sgmv_weights import SgmvWeights


class SgmvBackend(Protocol):
    name: str
    # whether a launch reads the adapters only through the weights' tensors (a_ptr, b_ptr,
    # ranks, seg), never the host lists w.a / w.b: a captured CUDA graph, whose fixed
    # weights' lists hold no adapter, replays it right (engine/cuda_graphs.py)
    graph_safe: bool

    def shrink(self, v: torch.Tensor, x: torch.Tensor, w: SgmvWeights, layer: int) -> None: ...

    def expand(self, y: torch.Tensor, v: torch.Tensor, w: SgmvWeights, layer: int) -> None: ...

    def add_lora(
        self, y: torch.Tensor, x: torch.Tensor, v: torch.Tensor, w: SgmvWeights, layer: int
    ) -> None: ...

    def bind(self, w: SgmvWeights) -> Launch:
        """add_lora with ``w`` fixed: launch(y, x, v, layer). Use SgmvWeights.launch, which
        keeps one per weights."""
        ...


Launch = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], None]
_NO_LAYERS = 2**31 - 1  # a launch without adapters reads no weights at any layer


def _bound(backend: SgmvBackend, w: SgmvWeights) -> Launch:
    def launch(y, x, v, layer) -> None:
        backend.add_lora(y, x, v, w, layer)

    return launch


class CompiledBackend:
    """The csrc/sgmv extension (C++ on CPU; CUDA kernels when built with CUDA)."""

    graph_safe = True  # the kernels follow a_ptr / b_ptr

    def __init__(self, name: str, module, fixed_order: bool = False) -> None:
        """fixed_order: batch-invariant order (csrc/sgmv/sgmv.h, ops.invariance)."""
        self.name = name
        self.module = module
        self.fixed_order = fixed_order

    def shrink(self, v, x, w, layer) -> None:
        self.module.sgmv_shrink(
            v, x, w.a_ptr, w.ranks, w.seg, layer, w.max_rows, w.max_rank, w.weight_dtype,
            self.fixed_order,
        )  # fmt: skip

    def expand(self, y, v, w, layer) -> None:
        self.module.sgmv_expand(
            y, v, w.b_ptr, w.ranks, w.seg, w.h_out, layer, w.max_rows, w.max_rank, w.weight_dtype,
            self.fixed_order,
        )  # fmt: skip

    def add_lora(self, y, x, v, w, layer) -> None:
        self.module.sgmv_add_lora(
            y,
            x,
            v,
            w.a_ptr,
            w.b_ptr,
            w.ranks,
            w.seg,
            w.h_out,
            layer,
            w.max_rows,
            w.max_rank,
            w.weight_dtype,
            self.fixed_order,
        )

    def bind(self, w) -> Launch:
        """On the CPU a C++ launch object that checked the metadata once (a call then checks
        only y, x, v and the layer against the adapters' layer count and width, and skips ~10
        Python attribute reads and pybind conversions)."""
        if w.seg.device.type != "cpu":
            return _bound(self, w)
        # SgmvWeights.build made every adapter's (layers, h_in) the same
        first = next((a for a in w.a if a is not None), None)
        layers, h_in = (_NO_LAYERS, 0) if first is None else (first.shape[0], first.shape[2])
        launch = self.module.CpuLaunch(
            w.a_ptr,
            w.b_ptr,
            w.ranks,
            w.seg,
            list(w.h_out),
            w.max_rows,
            w.max_rank,
            layers,
            h_in,
            (w.a, w.b),
            w.weight_dtype,
            self.fixed_order,
        )
        return launch.add_lora


class TorchRefBackend:
    """Pure PyTorch, one matmul per segment: the reference every kernel is tested against."""

    name = "torch_ref"
    graph_safe = False  # one matmul per segment of w.a / w.b, chosen on the host

    def shrink(self, v, x, w, layer) -> None:
        _ref.shrink(v, x, w, layer)

    def expand(self, y, v, w, layer) -> None:
        _ref.expand(y, v, w, layer)

    def add_lora(self, y, x, v, w, layer) -> None:
        _ref.shrink(v, x, w, layer)
        _ref.expand(y, v, w, layer)

    def bind(self, w) -> Launch:
        return _bound(self, w)


_AMX_SET: set[str] = set()  # kernel modules whose AMX mode $PUNICA_X_SGMV_AMX has set


def _compiled(name: str, with_cuda: bool, isa: str | None = None) -> SgmvBackend:
    from punica_x.ops._build import load_extension

    module = load_extension("sgmv_cuda" if with_cuda else "sgmv_cpu", isa)
    if module.__name__ not in _AMX_SET:  # once per module: later calls keep what was set since
        amx_tiles.apply_setting(module)
        _AMX_SET.add(module.__name__)
    return CompiledBackend(name, module)


def cpu_backend(isa: str | None = None) -> SgmvBackend:
    """The compiled CPU kernels built for `isa` (None: $PUNICA_X_CPU_ISA / native)."""
    return _compiled("cpu", with_cuda=False, isa=isa)


def cpu_sgmv_fixed_order(isa: str | None = None) -> CompiledBackend:
    """The compiled CPU kernels in batch-invariant order (ops.invariance): a row's result is
    the same bits whatever the size of its segment."""
    return CompiledBackend("cpu", cpu_backend(isa).module, fixed_order=True)


def sgmv_fixed_order(device: torch.device) -> CompiledBackend:
    """The compiled kernels of `device` (CPU or CUDA) in batch-invariant order: a row's result
    is the same bits whatever its segment's size and the batch's."""
    if device.type == "cuda":
        return CompiledBackend("cuda", BACKENDS.get(device, None, "cuda").module, fixed_order=True)
    return cpu_sgmv_fixed_order()


BACKENDS: Registry[SgmvBackend] = Registry(
    "SGMV",
    SGMV_BACKEND,
    {
        "cpu": lambda: _compiled("cpu", with_cuda=False),
        "cuda": lambda: _compiled("cuda", with_cuda=True),
        "torch_ref": TorchRefBackend,
    },
    default=lambda device, dtype: (
        "cuda"
        if device.type == "cuda"
        else "cpu"
        if isa_mod.tuned() and dtype in (None, *CPU_KERNEL_DTYPES)
        else "torch_ref"
    ),
    needs={
        "cpu": ("cpu", CPU_KERNEL_DTYPES),
        "cuda": ("cuda", (torch.float32, torch.float16, torch.bfloat16)),
    },
)


def available_backends() -> tuple[str, ...]:
    return BACKENDS.names


def get_backend(
    device: torch.device | str, name: str | None = None, dtype: torch.dtype | None = None
) -> SgmvBackend:
    """The SGMV backend for ``device``: ``name``, else $PUNICA_X_SGMV_BACKEND, else by device
    (and ``dtype``: torch_ref where no compiled kernel takes it).

    Raises ValueError when the named backend cannot run ``dtype`` and KernelBuildError when
    the compiled kernels cannot be built (no silent fallback)."""
    return BACKENDS.get(device, dtype, name)


def sgmv_shrink(
    x: torch.Tensor,
    w: SgmvWeights,
    layer: int = 0,
    out: torch.Tensor | None = None,
    backend: SgmvBackend | None = None,
) -> torch.Tensor:
    """v[rows_s, :R_s] = x[rows_s] @ A_s[layer] for every segment s with an adapter.

    x: [T, h_in] (rows contiguous), returns v: [T, >= max_rank] float32. Columns past a
    segment's rank and rows without an adapter are left as they were in ``out`` (zeros if new).
    """
    if out is None:
        out = torch.zeros(x.shape[0], max(w.max_rank, 1), dtype=torch.float32, device=x.device)
    (backend or get_backend(x.device, dtype=x.dtype)).shrink(out, x, w, layer)
    return out


def sgmv_expand(
    y: torch.Tensor,
    v: torch.Tensor,
    w: SgmvWeights,
    layer: int = 0,
    backend: SgmvBackend | None = None,
) -> torch.Tensor:
    """y[rows_s, cols_j] += v[rows_s, voff_j:voff_j + r_j] @ B_s,j[layer], in place; returns y.

    y: [T, >= sum(h_out)] (rows contiguous, may be a view), v: [T, >= max_rank] float32."""
    (backend or get_backend(y.device, dtype=y.dtype)).expand(y, v, w, layer)
    return y


def add_lora_sgmv(
    y: torch.Tensor,
    x: torch.Tensor,
    w: SgmvWeights,
    layer: int = 0,
    workspace: torch.Tensor | None = None,
    backend: SgmvBackend | None = None,
) -> torch.Tensor:
    """y += x @ A_s @ B_s per segment (shrink then expand), in place; returns y.

    ``workspace``: optional float32 [T, >= max_rank] buffer reused across calls."""
    if w.max_rank == 0:
        return y
    if workspace is None:
        workspace = torch.zeros(x.shape[0], w.max_rank, dtype=torch.float32, device=x.device)
    (backend or get_backend(x.device, dtype=x.dtype)).add_lora(y, x, workspace, w, layer)
    return y


TIMING_ROWS, TIMING_RANK = 32, 16


def choose_sgmv(
    device: torch.device | str,
    dtype: torch.dtype,
    lora_shapes: dict[str, tuple[int, int]],
    name: str | None = None,
    weight_dtype: torch.dtype | None = None,
) -> SgmvBackend:
    """`name`, else $PUNICA_X_SGMV_BACKEND, else: cuda on CUDA; on CPU (float32 or bfloat16,
    timing enabled) the faster of cpu/torch_ref on the model's widest projection at rank 16,
    with 32 rows of 32 adapters and 32 rows of one adapter, timed at first load and cached.
    weight_dtype: the adapters' dtype where it is not `dtype` (LoraConfig.lora_dtype)."""
    device = torch.device(device)
    name = name or SGMV_BACKEND.get() or None
    if name or device.type != "cpu" or dtype not in CPU_KERNEL_DTYPES or not autotune.enabled():
        return get_backend(device, name, dtype)
    h_in, h_out = max(lora_shapes.values(), key=lambda s: s[0] * s[1])
    names = ("cpu", "torch_ref") if isa_mod.tuned() else ("torch_ref",)
    weight_dtype = weight_dtype or dtype
    key = f"{h_in}x{h_out} rank={TIMING_RANK} rows={TIMING_ROWS}" + autotune.dtype_suffix(dtype)
    key += "" if weight_dtype == dtype else " weights" + autotune.dtype_suffix(weight_dtype)
    candidates = {n: _timing(n, h_in, h_out, dtype, weight_dtype) for n in names}
    tuned = autotune.choose("sgmv", key, candidates)
    return BACKENDS.get(device, dtype, tuned.name)


# the builds whose cpu kernels run other instructions in fixed order (csrc/sgmv/sgmv.h: the
# widening tiles for bf16 segments of several rows too, never the dot or AMX tiles);
# elsewhere the orders are one
ORDER_DIFFERS = ("avx512_bf16",)


def order_timings(
    lora_shapes: dict[str, tuple[int, int]],
    dtype: torch.dtype,
    force: bool = False,
    fresh: bool = False,
) -> list[tuple[int, dict[str, float]]]:
    """What the batch-invariant order costs the cpu kernels (ops.invariance's auto): per
    distinct (h_in, h_out) a LoRA may target, (how many projections have it, {"cpu": ms in
    fixed order, "cpu_any_order": ms in the kernels' own}) of TIMING_ROWS rows of as many
    adapters and of one adapter at rank TIMING_RANK (_timing's launches), timed at first
    load and cached (timed again when `fresh`). Empty where both orders run the same
    instructions (a build not in ORDER_DIFFERS, timing off), unless `force` (tests time them
    anyway)."""
    if not isa_mod.tuned() or dtype not in CPU_KERNEL_DTYPES or not autotune.enabled():
        return []
    if not force and isa_mod.resolve() not in ORDER_DIFFERS:
        return []
    fixed, own = cpu_sgmv_fixed_order(), cpu_backend()
    counts: dict[tuple[int, int], int] = {}
    for shape in lora_shapes.values():
        counts[shape] = counts.get(shape, 0) + 1
    timings = []
    for (h_in, h_out), count in counts.items():
        key = f"{h_in}x{h_out} rank={TIMING_RANK} rows={TIMING_ROWS}" + autotune.dtype_suffix(dtype)
        candidates = {
            "cpu": _timing(fixed, h_in, h_out, dtype),
            "cpu_any_order": _timing(own, h_in, h_out, dtype),
        }
        tuned = autotune.choose("sgmv_order", key, candidates, fresh=fresh)
        timings.append((count, tuned.timings_ms))
    return timings


def _timing(
    name: str | SgmvBackend,
    h_in: int,
    h_out: int,
    dtype: torch.dtype = torch.float32,
    weight_dtype: torch.dtype | None = None,
) -> autotune.Candidate:
    """The timed launches of backend `name` (or that backend): TIMING_ROWS rows of as many
    adapters, then of one adapter, each shrink and expand at rank TIMING_RANK."""
    w_dtype = weight_dtype or dtype

    def setup():
        backend = BACKENDS.get("cpu", dtype, name) if isinstance(name, str) else name
        r, t = TIMING_RANK, TIMING_ROWS
        a = [(torch.randn(1, r, h_in) * 0.01).to(w_dtype) for _ in range(t)]
        b = [(torch.randn(1, r * h_out) * 0.01).to(w_dtype) for _ in range(t)]
        distinct = SgmvWeights.build(list(range(t + 1)), a, b, [[r]] * t, [h_out], "cpu")
        one = SgmvWeights.build([0, t], a[:1], b[:1], [[r]], [h_out], "cpu")
        x, y = torch.randn(t, h_in).to(dtype), torch.zeros(t, h_out, dtype=dtype)
        v = torch.zeros(t, r)

        def run():
            backend.add_lora(y, x, v, distinct, 0)
            backend.add_lora(y, x, v, one, 0)

        return run

    return setup
