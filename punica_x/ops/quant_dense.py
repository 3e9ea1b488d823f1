"""Quantized dense projections: W kept in a GGUF file's own blocks (csrc/quant), y = x @ W^T.

A weight is QuantBlocks: [N, K / 32 * block_bytes] uint8, each row of W its K / 32 blocks as
the file stores them (ggml's layouts: Q4_0, Q4_1, Q8_0; fp16 scale, and min for Q4_1). Nothing
is expanded to a float copy at load. With x_bits 16 or 8 (ModelConfig.quant_activations
"int16", the default, or "int8") the CPU kernel rounds each block of 32 values of x to integers
with a scale each and multiplies in integer dot products (int8: llama.cpp's arithmetic) with
the blocks regrouped at load, 16 rows side by side (the same bytes; csrc/quant/quant.h); with
0 ("float") it unpacks blocks in registers (a few rows, decode) or into a per-thread panel
(more rows, prefill) and computes in float32 with x in the serving dtype (float32 or
bfloat16), the blocks' exact reference. `rows()` dequantizes rows of
W, which is how a tied LM head in Q8_0 also serves as the embedding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Formats served natively: name -> (ggml type id, bytes per block of 32 weights)
BLOCK = 32
FORMATS = {"Q4_0": (2, 18), "Q4_1": (3, 20), "Q8_0": (8, 34)}
FORMAT_BY_TYPE = {ggml: name for name, (ggml, _) in FORMATS.items()}
GROUP = 16  # rows of W side by side per block for the integer-activation kernel (quant.h)
# ModelConfig.quant_activations -> the kernels' x_bits
X_BITS = {"int16": 16, "int8": 8, "float": 0}


@dataclass
class QuantBlocks:
    """One tensor of W ([n, k] in HF's [out, in] layout) in blocks: data [n, row_bytes] uint8.
    `name` is the file's tensor name, used in every error."""

    name: str
    format: str
    data: torch.Tensor
    k: int
    # the file's tensors these rows came from, in order: (name, rows); () for `name` alone
    sources: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(
                f"{self.name}: block format {self.format!r} is not served natively "
                f"(served: {', '.join(FORMATS)})"
            )
        if self.k <= 0 or self.k % BLOCK:
            raise ValueError(f"{self.name}: {self.k} columns is not a multiple of {BLOCK}")
        d = self.data
        want = self.k // BLOCK * FORMATS[self.format][1]
        if d.dtype != torch.uint8 or d.dim() != 2 or d.shape[1] != want or d.shape[0] == 0:
            raise ValueError(
                f"{self.name}: {self.format} blocks of {self.k} columns are [rows, {want}] "
                f"uint8, got {list(d.shape)} {d.dtype}"
            )

    @property
    def n(self) -> int:
        return self.data.shape[0]

    @property
    def ggml_type(self) -> int:
        return FORMATS[self.format][0]

    def check_finite(self, ext) -> None:
        """ValueError naming the tensor and row if a block's scale or min is not finite."""
        row = ext.first_bad_row(self.data, self.ggml_type, self.k)
        if row < 0:
            return
        name = self.name
        for source, rows in self.sources:  # the source tensor that holds the row
            name = source
            if row < rows:
                break
            row -= rows
        raise ValueError(f"{name}: row {row} has a non-finite block scale or min")


def cat_blocks(parts: list[QuantBlocks], name: str) -> QuantBlocks:
    """Row slices of one fused weight (q|k|v, gate|up) as one QuantBlocks; ValueError if
    they differ in format or columns."""
    formats, ks = {p.format for p in parts}, {p.k for p in parts}
    if len(formats) != 1 or len(ks) != 1:
        raise ValueError(f"{name}: slices differ in format or columns ({formats}, {ks})")
    data = parts[0].data if len(parts) == 1 else torch.cat([p.data for p in parts])
    sources = tuple(s for p in parts for s in (p.sources or ((p.name, p.n),)))
    return QuantBlocks(name, parts[0].format, data, parts[0].k, sources)


def dequantize_blocks(blocks: QuantBlocks, dtype: torch.dtype) -> torch.Tensor:
    """The [n, k] weight `blocks` holds, in `dtype` (the exact values, float32 first)."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    kind = GGMLQuantizationType(blocks.ggml_type)
    values = quants.dequantize(blocks.data.numpy(), kind)
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(dtype)


class QuantCpuDense:
    """The dense backend for one format (csrc/quant): prepare() takes QuantBlocks. x_bits:
    8 or 16, x rounded to integers per block of 32 for the blocks' products, and W regrouped
    at prepare() (16 rows side by side per block, csrc/quant/quant.h: group_rows_cpu; the same
    bytes); 0, x as it is, W in the file's layout. From `dequant_from` rows on (None: never),
    forward() dequantizes W to the serving dtype for the call and multiplies with torch
    (oneDNN: AMX or AVX512-BF16 where the CPU has them), where first-load timing found that
    faster than the blocks (choose_quant)."""

    takes_prefetch = False

    def __init__(
        self,
        fmt: str,
        dtype: torch.dtype,
        isa: str | None = None,
        dequant_from: int | None = None,
        x_bits: int = 0,
        fixed_order: bool = False,
    ) -> None:
        """fixed_order: batch-invariant (ops.invariance): x as it is goes one row per tile
        (csrc/quant/quant.h; the integer-activation kernel is row-invariant as it is) and
        nothing is dequantized for a large call."""
        from punica_x.ops._build import load_extension

        if fmt not in FORMATS:
            raise ValueError(f"no CPU kernel for block format {fmt!r}")
        self.ext = load_extension("quant_cpu", isa)
        self.format, self.type, self.dtype = fmt, FORMATS[fmt][0], dtype
        if x_bits not in X_BITS.values():
            raise ValueError(f"x_bits must be one of {sorted(X_BITS.values())}, got {x_bits!r}")
        if fixed_order and dequant_from is not None:
            raise ValueError("fixed_order dequantizes nothing: dequant_from must be None")
        self.dequant_from, self.x_bits, self.fixed_order = dequant_from, x_bits, fixed_order
        self.name = f"quant_{fmt.lower()}" + (f"_x{x_bits}" if x_bits else "")
        self._all_rows: dict[int, torch.Tensor] = {}

    def prepare(self, blocks: QuantBlocks) -> torch.Tensor:
        if blocks.format != self.format:
            raise ValueError(f"{blocks.name}: {blocks.format} blocks given to {self.name}")
        blocks.check_finite(self.ext)
        if self.x_bits:
            return self.ext.group_rows(blocks.data.contiguous(), self.type, blocks.k)
        return blocks.data.contiguous()

    def forward(self, x, prepared, n, bias):
        """x: [M, K] float32 or bfloat16 -> [M, N] of x's dtype."""
        if self.dequant_from is not None and x.shape[0] >= self.dequant_from:
            ids = self._all_rows.get(n)
            if ids is None:
                ids = self._all_rows[n] = torch.arange(n)
            w = self._dequant(prepared, x.shape[1], n, ids, x.dtype)
            return torch.nn.functional.linear(x, w, bias)
        if self.x_bits:
            return self.ext.qgemm_grouped_new(
                x.contiguous(), prepared, self.type, bias, self.x_bits, n
            )
        return self.ext.qgemm_new(x.contiguous(), prepared, self.type, bias, self.fixed_order)

    def rows(self, prepared: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
        """W[ids] dequantized to the serving dtype: [T, K]."""
        # grouped: the rows of its groups, a last group's zero padding included (ids are token
        # ids, checked against the vocabulary before a step)
        n = prepared.shape[0] * GROUP if self.x_bits else prepared.shape[0]
        return self._dequant(prepared, k, n, ids.long(), self.dtype)

    def _dequant(self, prepared, k: int, n: int, ids: torch.Tensor, dtype) -> torch.Tensor:
        if self.x_bits:
            return self.ext.dequant_grouped_rows(prepared, self.type, k, n, ids, dtype)
        return self.ext.dequant_rows(prepared, self.type, k, ids, dtype)


_MADE: dict[tuple, QuantCpuDense] = {}


def quant_backend(
    fmt: str,
    device: torch.device,
    dtype: torch.dtype,
    dequant_from: int | None = None,
    x_bits: int = 0,
    fixed_order: bool = False,
) -> QuantCpuDense:
    """The backend serving `fmt` blocks (one per format, dtype, crossover, activation
    rounding and order); ValueError off the CPU."""
    if torch.device(device).type != "cpu":
        raise ValueError(
            f"quantized {fmt} weights run on the CPU only for now; serve this file with "
            "--quantization none on a GPU"
        )
    key = (fmt, dtype, dequant_from, x_bits, fixed_order)
    if key not in _MADE:
        _MADE[key] = QuantCpuDense(fmt, dtype, None, dequant_from, x_bits, fixed_order)
    return _MADE[key]


def choose_quant(
    fmt: str,
    device: torch.device,
    dtype: torch.dtype,
    n: int,
    k: int,
    rows: tuple[int, ...],
    x_bits: int = 0,
    fixed_order: bool = False,
) -> QuantCpuDense:
    """The backend for an [n, k] weight in `fmt` blocks that sees x of about `rows` rows
    (x_bits: the blocks multiply x rounded to integers of x_bits, 0 for x as it is):
    from the largest row count down, while dequantizing for the call and torch's matmul time
    faster than the blocks (punica_x.ops.autotune, cached per machine), it dequantizes from
    there on. Timing off ($PUNICA_X_AUTOTUNE=0) or fixed_order (the batch-invariant mode:
    ops.invariance; torch's matmul blocks by the row count): the blocks at every row count."""
    from punica_x.ops import autotune

    dequant_from = None
    if autotune.enabled() and not fixed_order:
        blocks = quant_backend(fmt, device, dtype, x_bits=x_bits)
        for m in sorted(rows, reverse=True):
            key = f"{fmt} {n}x{k} rows={m}" + autotune.dtype_suffix(dtype)
            key += f" x{x_bits}" if x_bits else ""
            candidates = {c: _timing(blocks, n, k, m, c == "dequant") for c in _CHOICES}
            if autotune.choose("quant", key, candidates).name != "dequant":
                break
            dequant_from = m
    return quant_backend(fmt, device, dtype, dequant_from, x_bits, fixed_order)


_CHOICES = ("blocks", "dequant")


def random_blocks(fmt: str, n: int, k: int) -> torch.Tensor:
    """[n, row_bytes] uint8 blocks of random quants with a scale (and min) of 1/64."""
    data = torch.randint(0, 256, (n, k // BLOCK, FORMATS[fmt][1]), dtype=torch.uint8)
    scale = torch.tensor([0x00, 0x24], dtype=torch.uint8)  # fp16 1/64, little-endian
    data[:, :, 0:2] = scale
    if fmt == "Q4_1":
        data[:, :, 2:4] = scale
    return data.reshape(n, -1).contiguous()


def _timing(backend: QuantCpuDense, n: int, k: int, m: int, dequant: bool):
    from punica_x.ops.dense import COLD_BYTES, MAX_COPIES  # cold weights, as a step sees them

    def setup():
        start, bits = (0 if dequant else None), backend.x_bits
        run = QuantCpuDense(backend.format, backend.dtype, dequant_from=start, x_bits=bits)
        size = n * k // BLOCK * FORMATS[backend.format][1]
        copies = max(1, min(MAX_COPIES, -(-COLD_BYTES // size)))
        fmt = backend.format
        weights = [
            run.prepare(QuantBlocks("random", fmt, random_blocks(fmt, n, k), k))
            for _ in range(copies)
        ]
        x = torch.randn(m, k).to(backend.dtype)
        return lambda: [run.forward(x, w, n, None) for w in weights]

    return setup
