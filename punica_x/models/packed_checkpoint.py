"""HF checkpoints whose projections are packed 4-bit integers (a `quantization_config` of
quant_method "gptq" or "awq"), read into ggml blocks (ops.quant_dense) without a float copy.

Both formats store, per projection `P` of W [N out, K in], 4-bit codes q, per group of
`group_size` input columns a zero point z and an fp16 scale s, and compute
W[n, k] = s[g, n] * (q[k, n] - z[g, n]) with g = k // group_size:
- GPTQ: P.qweight int32 [K / 8, N] (8 codes of consecutive k per word, lowest nibble first),
  P.qzeros int32 [G, N / 8] (consecutive n), P.scales fp16 [G, N], P.g_idx int32 [K]
  (optional). The original ("gptq", v1) checkpoint format stores z - 1, "gptq_v2" z itself.
- AWQ (version "gemm"): P.qweight int32 [K, N / 8] and P.qzeros int32 [G, N / 8], 8 codes of
  consecutive n per word in the order (0, 2, 4, 6, 1, 3, 5, 7), P.scales fp16 [G, N].

A group of 32 or more columns holds whole ggml blocks of 32, so a projection becomes
- Q4_0 (d = s, value d * (q - 8)) where every zero point is 8 (symmetric quantization,
  GPTQ's default): exact;
- Q4_1 (d = s, m = -z * s, value d * q + m) otherwise: m rounded to fp16, at most 2^-11 of
  |z * s| (<= 0.8% of a quantization step s) away from the checkpoint's value.
With --quantization none the projections are dequantized with the formula above in float32
instead: the exact reference. Refused at load, naming the tensor or field: bits other than 4,
act-order (desc_act, a g_idx that is not k // group_size), a group size that is not a
multiple of 32, AWQ versions other than gemm, wrong shapes or dtypes, missing parts,
non-finite scales.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from punica_x.ops.quant_dense import BLOCK, QuantBlocks

METHODS = ("gptq", "awq")
PARTS = {"gptq": ("qweight", "qzeros", "scales", "g_idx"), "awq": ("qweight", "qzeros", "scales")}
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_ORDER[i]
PACK = 8  # 4-bit codes per int32


@dataclass(frozen=True)
class PackedFormat:
    """A checkpoint's quantization_config, checked: method gptq / awq, group_size (-1: one
    group over all K), zero_offset (1 for GPTQ v1 checkpoints, which store z - 1)."""

    method: str
    group_size: int
    zero_offset: int


def packed_format(hf_config) -> PackedFormat | None:
    """The packed format hf_config's quantization_config names (None: no such config);
    ValueError naming the field for one that is not served."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    qc = qc if isinstance(qc, dict) else qc.to_dict()
    method = str(qc.get("quant_method", "")).lower()
    if method not in METHODS:
        raise ValueError(
            f"quantization_config.quant_method {method!r} is not served "
            f"(served: {', '.join(METHODS)}; or a GGUF file)"
        )
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ValueError(f"quantization_config.bits {bits!r}: only 4-bit {method} is served")
    group = qc.get("group_size", qc.get("q_group_size", 128))
    if not isinstance(group, int) or isinstance(group, bool) or (group != -1 and group <= 0):
        raise ValueError(f"quantization_config.group_size {group!r} is not a group size")
    if group != -1 and group % BLOCK:
        raise ValueError(
            f"quantization_config.group_size {group}: groups must be a multiple of {BLOCK}"
        )
    offset = 0
    if method == "gptq":
        if qc.get("desc_act"):
            raise ValueError(
                "quantization_config.desc_act: act-order GPTQ checkpoints are not served "
                "(their groups are not runs of consecutive columns)"
            )
        fmt = qc.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"quantization_config.checkpoint_format {fmt!r} is not served")
        offset = 1 if fmt == "gptq" else 0
    else:
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"quantization_config.version {version!r}: AWQ gemm only")
        if qc.get("zero_point") is False:
            raise ValueError("quantization_config.zero_point false: AWQ without zeros")
    return PackedFormat(method, group, offset)


def read_packed(
    files: list[Path], fmt: PackedFormat, as_blocks: bool
) -> Iterator[tuple[str, torch.Tensor | QuantBlocks]]:
    """(name, tensor) for every tensor of the checkpoint, a packed projection P as
    (P.weight, QuantBlocks) or, as_blocks False, (P.weight, its float32 values [N, K])."""
    parts = PARTS[fmt.method]
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(p), "pt", device="cpu")) for p in files]
        where = {name: h for h in handles for name in h.keys()}  # noqa: SIM118
        packed = {n.rpartition(".")[0] for n in where if n.endswith(".qweight")}
        for name, handle in where.items():
            prefix, _, part = name.rpartition(".")
            if part not in parts:
                yield name, handle.get_tensor(name)
            elif prefix not in packed:
                raise ValueError(f"{name}: no {prefix}.qweight beside it")
            elif part == "qweight":
                get = {
                    p: where[f"{prefix}.{p}"].get_tensor for p in parts if f"{prefix}.{p}" in where
                }
                tensors = {p: f(f"{prefix}.{p}") for p, f in get.items()}
                yield f"{prefix}.weight", unpack(prefix, tensors, fmt, as_blocks)


def unpack(
    prefix: str, parts: dict[str, torch.Tensor], fmt: PackedFormat, as_blocks: bool
) -> torch.Tensor | QuantBlocks:
    """One packed projection as blocks or as float32 [N, K]; ValueError naming the part."""
    for need in ("qweight", "qzeros", "scales"):
        if need not in parts:
            raise ValueError(f"{prefix}.{need}: missing (the projection has a qweight)")
    q, z, s = _codes(prefix, parts, fmt)
    n, k = q.shape
    group = k if fmt.group_size == -1 else fmt.group_size
    if k % group:
        raise ValueError(f"{prefix}.qweight: {k} input columns are not whole groups of {group}")
    if s.shape != (k // group, n) or z.shape != s.shape:
        raise ValueError(
            f"{prefix}.scales / qzeros: expected [{k // group}, {n}] groups x columns, got "
            f"{list(s.shape)} and {list(z.shape)}"
        )
    _check_g_idx(prefix, parts.get("g_idx"), k, group)
    if not as_blocks:
        zk = z.t().repeat_interleave(group, dim=1).float()
        return (q.float() - zk) * s.t().float().repeat_interleave(group, dim=1)
    return _blocks(prefix, q, z, s, group)


def _codes(prefix: str, parts, fmt: PackedFormat):
    """(q [N, K] uint8 codes, z [G, N] int16 zero points, s [G, N] fp16 scales)."""
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    for part, t in (("qweight", qweight), ("qzeros", qzeros)):
        if t.dtype != torch.int32 or t.dim() != 2:
            raise ValueError(f"{prefix}.{part}: expected a 2-d int32 tensor, got {t.dtype}")
    if scales.dtype not in (torch.float16, torch.bfloat16, torch.float32) or scales.dim() != 2:
        raise ValueError(f"{prefix}.scales: expected a 2-d float tensor, got {scales.dtype}")
    if not torch.isfinite(scales).all():
        raise ValueError(f"{prefix}.scales: non-finite scales")
    if fmt.method == "gptq":
        q = _nibbles(qweight, dim=0).t()  # [K/8, N] -> [K, N] -> [N, K]
        z = _nibbles(qzeros, dim=1)
    else:
        q = _nibbles(qweight, dim=1, order=AWQ_ORDER).t()  # [K, N/8] -> [K, N] -> [N, K]
        z = _nibbles(qzeros, dim=1, order=AWQ_ORDER)
    if scales.shape[1] != q.shape[0]:
        raise ValueError(
            f"{prefix}.scales: {scales.shape[1]} output columns, the qweight holds {q.shape[0]}"
        )
    return q.contiguous(), z.to(torch.int16) + fmt.zero_offset, scales.to(torch.float16)


def _nibbles(words: torch.Tensor, dim: int, order=None) -> torch.Tensor:
    """The 8 4-bit codes of each int32 along `dim`, expanded in place ([.., W, ..] ->
    [.., 8W, ..]) as uint8; order: nibble i holds position order[i] of its 8."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    codes = ((words.unsqueeze(-1) >> shifts) & 15).to(torch.uint8)  # [.., 8]
    if order is not None:
        codes = codes[..., [order.index(j) for j in range(PACK)]]
    if dim == 0:  # [W, N, 8] -> [W, 8, N] -> [8W, N]
        return codes.permute(0, 2, 1).reshape(-1, words.shape[1])
    return codes.reshape(words.shape[0], -1)


def _check_g_idx(prefix: str, g_idx: torch.Tensor | None, k: int, group: int) -> None:
    if g_idx is None:
        return
    if g_idx.shape != (k,) or not torch.equal(g_idx.long(), torch.arange(k) // group):
        raise ValueError(
            f"{prefix}.g_idx: act-order groups (a g_idx other than k // {group}) are not served"
        )


def _blocks(prefix: str, q, z, s, group: int) -> QuantBlocks:
    """Codes [N, K], zeros and scales [G, N] as Q4_0 (all zeros 8) or Q4_1 blocks."""
    n, k = q.shape
    per = group // BLOCK  # blocks per group
    d = s.t().repeat_interleave(per, dim=1)  # [N, K/32] fp16
    q = q.view(n, k // BLOCK, BLOCK)
    qs = q[..., : BLOCK // 2] | (q[..., BLOCK // 2 :] << 4)  # ggml: byte j = q[j] | q[j+16] << 4
    if bool((z == 8).all()):
        head = [d]
        fmt = "Q4_0"
    else:
        m = (-z.float() * s.float()).to(torch.float16).t().repeat_interleave(per, dim=1)
        if not torch.isfinite(m).all():
            raise ValueError(f"{prefix}.scales: zero point x scale overflows fp16")
        head = [d, m]
        fmt = "Q4_1"
    halves = [h.contiguous().view(torch.uint8).view(n, k // BLOCK, 2) for h in head]
    data = torch.cat([*halves, qs], dim=2).reshape(n, -1)
    return QuantBlocks(f"{prefix}.qweight", fmt, data.contiguous(), k)
