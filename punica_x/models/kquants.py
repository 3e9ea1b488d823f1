"""GGUF tensors in formats without a kernel of their own, repacked at load into the block
formats csrc/quant serves (ops.quant_dense), one tensor at a time, no float copy kept:

- Q4_K (super-blocks of 256: fp16 d and dmin, 6-bit scale and min per 32 weights, 4-bit
  codes) -> Q4_1: each 32-weight sub-block already is a Q4_1 block, w = (d sc) q - (dmin m),
  with its scale d*sc and min -dmin*m rounded to fp16 (at most 2^-11 of each, under 1% of a
  quantization step; the codes are kept). 5.0 bits a weight instead of 4.5.
- Q5_0 -> Q8_0: w = d (q - 16) with 5-bit q is a Q8_0 block with the same d and the codes
  q - 16: exact. 8.5 bits a weight instead of 5.5.
- Q5_K, Q6_K, Q5_1 -> Q8_0: dequantized one tensor at a time and requantized to 8
  bits per weight (gguf's reference quantizer: at most 0.57 of a Q8_0 step, max|w| / 127
  per block of 32, half a step of rounding plus the fp16 scale's; about 1/8 of a 5- or 6-bit
  step). 8.5 bits a weight.

Files of common mixes (Q4_K_M: Q4_K projections, Q6_K for some and for the head) are then
served in blocks at 5-8.5 bits a weight instead of 16. Other types (Q2_K, Q3_K, IQ*) are still
dequantized by the reader.
"""

from __future__ import annotations

import numpy as np
import torch

from punica_x.models.quantize import quantize_blocks
from punica_x.ops.quant_dense import BLOCK, QuantBlocks

TO_Q8_0 = ("Q5_K", "Q6_K", "Q5_1")
REPACKED = ("Q4_K", "Q5_0", *TO_Q8_0)
QK_K = 256
Q4_K_BYTES = 144


def repack(name: str, kind: str, rows: np.ndarray, cols: int) -> QuantBlocks:
    """rows: [n, row_bytes] uint8 of a `kind` tensor with `cols` weights a row -> blocks."""
    if kind == "Q4_K":
        return q4_k_to_q4_1(name, rows, cols)
    if kind == "Q5_0":
        return q5_0_to_q8_0(name, rows, cols)
    from gguf import GGMLQuantizationType, quants

    values = quants.dequantize(rows, GGMLQuantizationType[kind]).astype(np.float32)
    if not np.isfinite(values).all():
        raise ValueError(f"{name}: non-finite values in its {kind} blocks")
    return quantize_blocks(name, torch.from_numpy(values), "Q8_0")


def q4_k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's get_scale_min_k4 for all 8 sub-blocks: packed [..., 12] uint8 -> (scales,
    mins) [..., 8] as uint8 in 0..63."""
    q = packed.astype(np.uint8)
    sc = np.empty(q.shape[:-1] + (8,), np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4] = q[..., 0:4] & 63
    mn[..., :4] = q[..., 4:8] & 63
    sc[..., 4:] = (q[..., 8:12] & 0xF) | ((q[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)
    return sc, mn


def q4_k_to_q4_1(name: str, rows: np.ndarray, cols: int) -> QuantBlocks:
    """Q4_K rows as Q4_1 blocks (see the module docstring); ValueError naming the tensor for
    a row whose bytes are not whole super-blocks or a non-finite d / dmin."""
    n = rows.shape[0]
    if cols % QK_K or rows.shape[1] != cols // QK_K * Q4_K_BYTES:
        raise ValueError(f"{name}: {rows.shape[1]} bytes a row are not Q4_K of {cols} weights")
    blk = rows.reshape(n, cols // QK_K, Q4_K_BYTES)
    d = blk[..., 0:2].copy().view(np.float16).astype(np.float32)  # [n, S, 1]
    dmin = blk[..., 2:4].copy().view(np.float16).astype(np.float32)
    if not (np.isfinite(d).all() and np.isfinite(dmin).all()):
        raise ValueError(f"{name}: a Q4_K super-block has a non-finite d or dmin")
    sc, mn = q4_k_scales(blk[..., 4:16])
    scale = (d * sc).astype(np.float16)  # [n, S, 8]
    low = (-(dmin * mn)).astype(np.float16)
    if not (np.isfinite(scale).all() and np.isfinite(low).all()):
        raise ValueError(f"{name}: a Q4_K sub-block scale or min overflows fp16")
    qs = blk[..., 16:].reshape(n, -1, 4, 32)  # 4 pairs of sub-blocks: low / high nibbles
    codes = np.stack([qs & 0xF, qs >> 4], axis=3).reshape(n, -1, 8, BLOCK)
    packed = codes[..., :16] | (codes[..., 16:] << 4)  # ggml Q4_1: byte j = q[j] | q[j+16] << 4
    out = np.concatenate(
        [scale[..., None].view(np.uint8), low[..., None].view(np.uint8), packed], axis=-1
    )
    return QuantBlocks(name, "Q4_1", torch.from_numpy(out.reshape(n, -1).copy()), cols)


def q5_0_to_q8_0(name: str, rows: np.ndarray, cols: int) -> QuantBlocks:
    """Q5_0 rows (per 32 weights: fp16 d, 32 high bits, 16 bytes of low nibbles) as the
    Q8_0 blocks of the same values: d and the signed codes q - 16."""
    n = rows.shape[0]
    if cols % BLOCK or rows.shape[1] != cols // BLOCK * 22:
        raise ValueError(f"{name}: {rows.shape[1]} bytes a row are not Q5_0 of {cols} weights")
    blk = rows.reshape(n, cols // BLOCK, 22)
    if not np.isfinite(blk[..., 0:2].copy().view(np.float16)).all():
        raise ValueError(f"{name}: a Q5_0 block has a non-finite scale")
    high = blk[..., 2:6].copy().view("<u4")  # [n, B, 1]: bit j is weight j's fifth bit
    bits = ((high >> np.arange(BLOCK, dtype=np.uint32)) & 1).astype(np.uint8)
    qs = blk[..., 6:22]
    codes = np.concatenate([qs & 0xF, qs >> 4], axis=-1) | (bits << 4)
    signed = (codes.astype(np.int16) - 16).astype(np.int8).view(np.uint8)
    out = np.concatenate([blk[..., 0:2], signed], axis=-1)
    return QuantBlocks(name, "Q8_0", torch.from_numpy(out.reshape(n, -1).copy()), cols)
