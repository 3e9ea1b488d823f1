"""K-quant and 5-bit GGUF tensors repacked at load (models.kquants) against the gguf
package's own dequantization of the same bytes: Q5_0 -> Q8_0 exact, Q4_K -> Q4_1 within the
fp16 rounding of its scales and mins, Q5_K / Q6_K / Q5_1 -> Q8_0 within 0.57 of a Q8_0 step;
the reader hands them to the model as blocks; malformed ones are refused naming the tensor."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from gguf.constants import GGML_QUANT_SIZES
from helpers import write_gguf

from punica_x.models import gguf_native, kquants
from punica_x.ops.quant_dense import QuantBlocks, dequantize_blocks

N, K = 8, 512


def random_rows(kind: str, seed: int = 0, n: int = N, k: int = K) -> np.ndarray:
    """n rows of k weights of random `kind` blocks, their fp16 scales set to small values."""
    rng = np.random.default_rng(seed)
    per, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    raw = rng.integers(0, 256, (n, k // per, size), dtype=np.uint8)
    halves = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q5_0": (0,), "Q5_1": (0, 2)}
    for at in halves[kind]:
        scale = rng.uniform(0.001, 0.02, (n, k // per, 1)).astype(np.float16)
        raw[..., at : at + 2] = scale.view(np.uint8)
    return raw.reshape(n, -1)


def reference(kind: str, rows: np.ndarray) -> np.ndarray:
    return quants.dequantize(rows, GGMLQuantizationType[kind]).astype(np.float32)


def test_q5_0_becomes_q8_0_exactly():
    rows = random_rows("Q5_0")
    blocks = kquants.repack("w", "Q5_0", rows, K)
    assert blocks.format == "Q8_0" and (blocks.n, blocks.k) == (N, K)
    np.testing.assert_array_equal(
        dequantize_blocks(blocks, torch.float32).numpy(), reference("Q5_0", rows)
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_q4_k_becomes_q4_1_within_the_fp16_rounding_of_scale_and_min(seed):
    rows = random_rows("Q4_K", seed)
    blocks = kquants.repack("w", "Q4_K", rows, K)
    assert blocks.format == "Q4_1"
    got, want = dequantize_blocks(blocks, torch.float32).numpy(), reference("Q4_K", rows)
    blk = rows.reshape(N, -1, 144)
    d = blk[..., 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blk[..., 2:4].copy().view(np.float16).astype(np.float32)
    sc, mn = kquants.q4_k_scales(blk[..., 4:16])
    # per sub-block of 32: |d sc| * 15 + |dmin m| (the largest |q scale| plus |min|) x 2^-11
    bound = (np.repeat(d * sc * 15 + dmin * mn, 32, axis=-1).reshape(N, K)) * 2.0**-11
    assert (np.abs(got - want) <= bound + 1e-7).all()
    assert np.abs(got - want).max() > 0  # rounded, not copied


@pytest.mark.parametrize("kind", ["Q5_K", "Q6_K", "Q5_1"])
def test_other_5_and_6_bit_formats_are_requantized_to_q8_0(kind):
    rows = random_rows(kind)
    blocks = kquants.repack("w", kind, rows, K)
    assert blocks.format == "Q8_0"
    got, want = dequantize_blocks(blocks, torch.float32).numpy(), reference(kind, rows)
    step = np.abs(want.reshape(N, -1, 32)).max(-1, keepdims=True) / 127
    assert (np.abs(got - want).reshape(N, -1, 32) <= 0.57 * step + 1e-9).all()


def test_malformed_k_quant_tensors_are_refused_naming_them():
    rows = random_rows("Q4_K")
    with pytest.raises(ValueError, match="blk.0.ffn_down.weight: 200 bytes a row are not Q4_K"):
        kquants.repack("blk.0.ffn_down.weight", "Q4_K", rows[:, :200], K)
    bad = rows.copy()
    bad[3, 0:2] = np.array([np.nan], np.float16).view(np.uint8)
    with pytest.raises(ValueError, match="blk.1.ffn_up.weight: a Q4_K super-block has a non"):
        kquants.repack("blk.1.ffn_up.weight", "Q4_K", bad, K)
    q5 = random_rows("Q5_0")
    q5[0, 0:2] = np.array([np.inf], np.float16).view(np.uint8)
    with pytest.raises(ValueError, match="blk.2.attn_q.weight: a Q5_0 block has a non-finite"):
        kquants.repack("blk.2.attn_q.weight", "Q5_0", q5, K)
    with pytest.raises(ValueError, match="blk.2.attn_k.weight: 20 bytes a row are not Q5_0"):
        kquants.repack("blk.2.attn_k.weight", "Q5_0", q5[:, :20], K)
    q6 = random_rows("Q6_K")
    q6[1, 208:210] = np.array([np.nan], np.float16).view(np.uint8)
    with pytest.raises(ValueError, match="blk.3.ffn_down.weight: non-finite values in its Q6_K"):
        kquants.repack("blk.3.ffn_down.weight", "Q6_K", q6, K)


@pytest.mark.parametrize(("kind", "fmt"), [("Q4_K", "Q4_1"), ("Q6_K", "Q8_0"), ("Q5_0", "Q8_0")])
def test_the_reader_hands_repacked_tensors_over_as_blocks(kind, fmt, tmp_path):
    rows = random_rows(kind)
    tensors = {"blk.0.ffn_down.weight": (rows, GGMLQuantizationType[kind])}
    ((name, value),) = gguf_native.read_tensors(write_gguf(tmp_path / "x.gguf", tensors), 1, 1)
    assert name == "model.layers.0.mlp.down_proj.weight"
    assert isinstance(value, QuantBlocks) and value.format == fmt and (value.n, value.k) == (N, K)
