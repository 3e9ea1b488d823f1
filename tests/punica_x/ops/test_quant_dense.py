"""The quantized CPU GEMM (csrc/quant) against the same blocks dequantized by the gguf
package, in every ISA build this CPU runs; its checks; QuantBlocks' validation."""

import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from punica_x.ops.quant_dense import FORMATS, QuantBlocks, QuantCpuDense, cat_blocks

NAMES = list(FORMATS)


def _blocks(fmt: str, n: int, k: int, seed: int) -> tuple[QuantBlocks, torch.Tensor]:
    """(blocks of a random [n, k] weight, the float32 weight they hold)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, k)) * k**-0.5).astype(np.float32)
    kind = GGMLQuantizationType[fmt]
    q = quants.quantize(w, kind)
    ref = torch.from_numpy(np.array(quants.dequantize(q, kind), dtype=np.float32))
    return QuantBlocks(f"w.{fmt}", fmt, torch.from_numpy(q.copy()), k), ref


@pytest.mark.parametrize("fmt", NAMES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 33])
@pytest.mark.parametrize(("n", "k"), [(37, 64), (192, 576), (576, 1536)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qgemm_matches_dequantized(fmt, m, n, k, dtype, cpu_isa):
    seed = int.from_bytes(os.urandom(4), "little")
    blocks, ref = _blocks(fmt, n, k, seed)
    backend = QuantCpuDense(fmt, dtype, cpu_isa)
    x = torch.randn(m, k).to(dtype)
    bias = torch.randn(n).to(dtype) if m % 2 else None
    y = backend.forward(x, backend.prepare(blocks), n, bias)
    want = x.float() @ ref.t() + (bias.float() if bias is not None else 0)
    assert y.dtype == dtype and y.shape == (m, n)
    tol = 2e-5 if dtype == torch.float32 else 1e-2  # bf16: y is rounded once
    err = (y.float() - want).abs().max() / want.abs().max()
    assert err < tol, f"seed {seed}: relative error {err}"


@pytest.mark.parametrize("fmt", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [0, 8, 16])
def test_rows_are_the_dequantized_rows(fmt, dtype, bits, cpu_isa):
    """From the file's layout (bits 0) and from rows grouped by 4 (the integer kernels')."""
    blocks, ref = _blocks(fmt, 50, 96, 1)
    backend = QuantCpuDense(fmt, dtype, cpu_isa, x_bits=bits)
    ids = torch.tensor([0, 49, 7, 7])
    got = backend.rows(backend.prepare(blocks), ids, 96)
    assert got.dtype == dtype
    torch.testing.assert_close(got, ref[ids].to(dtype), rtol=0, atol=0)


def test_nan_scale_is_refused_naming_the_tensor(cpu_isa):
    for fmt in NAMES:
        blocks, _ = _blocks(fmt, 8, 64, 2)
        bad = blocks.data.clone()
        bad[5, FORMATS[fmt][1]] = 0x00  # second block of row 5: its fp16 scale is NaN
        bad[5, FORMATS[fmt][1] + 1] = 0x7E
        backend = QuantCpuDense(fmt, torch.float32, cpu_isa)
        with pytest.raises(ValueError, match=r"blk\.3\.attn_q\.weight: row 5 has a non-finite"):
            backend.prepare(QuantBlocks("blk.3.attn_q.weight", fmt, bad, 64))
    if "Q4_1" in NAMES:  # the min too
        blocks, _ = _blocks("Q4_1", 4, 32, 3)
        bad = blocks.data.clone()
        bad[2, 2:4] = torch.tensor([0x00, 0x7C], dtype=torch.uint8)  # +inf min
        with pytest.raises(ValueError, match="row 2"):
            QuantCpuDense("Q4_1", torch.float32, cpu_isa).prepare(QuantBlocks("t", "Q4_1", bad, 32))


def test_kernel_checks_its_inputs(cpu_isa):
    ext = QuantCpuDense("Q8_0", torch.float32, cpu_isa).ext
    assert ext.isa() == cpu_isa
    blocks, _ = _blocks("Q8_0", 16, 64, 4)
    w, x, y = blocks.data, torch.randn(2, 64), torch.empty(2, 16)
    g, f32 = ext.group_rows(w, 8, 64), torch.float32
    bad = [
        (lambda: ext.qgemm(y, x, w, 5, None), "unknown block format 5"),
        (lambda: ext.qgemm(y, x, w, 2, None), "w rows must hold 36 bytes"),
        (lambda: ext.qgemm(y, torch.randn(2, 48), w, 8, None), "multiple of 32"),
        (lambda: ext.qgemm(y, x.bfloat16(), w, 8, None), "y must be"),
        (lambda: ext.qgemm(torch.empty(3, 16), x, w, 8, None), r"y must be \[2, 16\]"),
        (lambda: ext.qgemm(y, x, w.float(), 8, None), "uint8"),
        (lambda: ext.qgemm(y, x, w, 8, torch.zeros(15)), r"bias must be \[16\]"),
        (lambda: ext.qgemm(y, x.int(), w, 8, None), "float32 or bfloat16"),
        (lambda: ext.qgemm_grouped(y, x, g, 8, None, 4), "x_bits must be 8 or 16, got 4"),
        (lambda: ext.qgemm_grouped(y, x, g, 8, None, 0), "x_bits must be 8 or 16"),
        (lambda: ext.qgemm_grouped(y, x, w, 8, None, 16), r"must be \[1, 1088\], got \[16, 68\]"),
        (lambda: ext.qgemm_grouped(torch.empty(2, 17), x, g, 8, None, 8), r"\[2, 1088\]"),
        (lambda: ext.qgemm_grouped(y, x, g, 3, None, 8), r"must be \[1, 640\]"),
        (lambda: ext.qgemm_grouped(y, x, g, 7, None, 8), "unknown block format 7"),
        (lambda: ext.qgemm_grouped(y, x, g.float(), 8, None, 8), "uint8"),
        (lambda: ext.qgemm_grouped(y, x, g, 8, torch.zeros(15), 8), r"bias must be \[16\]"),
        (lambda: ext.qgemm_grouped(y, x.bfloat16(), g, 8, None, 8), "y must be"),
        (lambda: ext.qgemm_grouped(y[:, :0], x, g, 8, None, 8), "N must be"),
        (lambda: ext.qgemm_new(x, w, 5, None), "unknown block format 5"),
        (lambda: ext.qgemm_new(x[0], w, 8, None), "x and w must be 2-D"),
        (lambda: ext.qgemm_new(x.int(), w, 8, None), "float32 or bfloat16"),
        (lambda: ext.qgemm_grouped_new(x, g, 8, None, 8, 0), "N must be 1"),
        (lambda: ext.qgemm_grouped_new(x, g, 8, None, 8, -3), "N must be 1"),
        (lambda: ext.qgemm_grouped_new(x, g, 8, None, 8, 2**40), "N must be 1"),
        (lambda: ext.qgemm_grouped_new(x, g, 8, None, 8, 17), r"\[2, 1088\]"),
        (lambda: ext.qgemm_grouped_new(x[0], g, 8, None, 8, 16), "x must be 2-D"),
        (lambda: ext.qgemm_grouped_new(x, g, 8, None, 4, 16), "x_bits must be 8 or 16"),
        (lambda: ext.group_rows(w, 2, 64), "w rows must hold 36 bytes"),
        (lambda: ext.dequant_grouped_rows(g, 8, 64, 16, torch.tensor([16]), f32), "out of"),
        (lambda: ext.dequant_grouped_rows(g, 8, 64, 17, torch.tensor([0]), f32), "17 rows"),
        (lambda: ext.dequant_rows(w, 8, 64, torch.tensor([16]), torch.float32), "out of range"),
        (lambda: ext.dequant_rows(w, 8, 64, torch.tensor([-1]), torch.float32), "out of range"),
        (lambda: ext.dequant_rows(w, 8, 64, torch.tensor([0.0]), torch.float32), "int64"),
        (lambda: ext.dequant_rows(w, 8, 64, torch.tensor([0]), torch.int32), "dtype must be"),
        (lambda: ext.first_bad_row(w[:, :10].contiguous(), 8, 64), "w rows must hold"),
    ]
    for call, message in bad:
        with pytest.raises(RuntimeError, match=message):
            call()
    # the allocating forms compute what the y forms do
    ext.qgemm(y, x, w, 8, None)
    assert torch.equal(ext.qgemm_new(x, w, 8, None), y)
    ext.qgemm_grouped(y, x, g, 8, None, 16)
    assert torch.equal(ext.qgemm_grouped_new(x, g, 8, None, 16, 16), y)
    assert ext.qgemm_grouped_new(x.bfloat16(), g, 8, None, 8, 16).dtype == torch.bfloat16
    ext.qgemm(torch.empty(0, 16), torch.empty(0, 64), w, 8, None)  # no rows: nothing to do
    ext.qgemm_grouped(torch.empty(0, 16), torch.empty(0, 64), g, 8, None, 8)


def test_quant_blocks_validate_shape_and_format():
    data = torch.zeros(4, 20, dtype=torch.uint8)
    QuantBlocks("ok", "Q4_1", data, 32)
    for fmt, d, k, message in [
        ("Q4_K", data, 32, "Q4_K.* not served natively"),
        ("Q4_1", data, 48, "not a multiple of 32"),
        ("Q4_1", data, 64, r"\[rows, 40\] uint8"),
        ("Q4_1", data.float(), 32, "uint8"),
        ("Q4_1", data[:0], 32, r"\[rows, 20\]"),
        ("Q4_1", data[0], 32, r"\[rows, 20\]"),
    ]:
        with pytest.raises(ValueError, match=message):
            QuantBlocks("t", fmt, d, k)
    a = QuantBlocks("a", "Q4_1", data, 32)
    assert cat_blocks([a, a], "qkv").n == 8
    with pytest.raises(ValueError, match="differ"):
        cat_blocks([a, QuantBlocks("b", "Q4_0", torch.zeros(4, 18, dtype=torch.uint8), 32)], "x")


def test_quant_backend_refuses_gpus():
    from punica_x.ops.quant_dense import quant_backend

    with pytest.raises(ValueError, match="CPU only"):
        quant_backend("Q4_1", torch.device("cuda"), torch.bfloat16)


def test_a_bad_row_of_fused_slices_names_its_own_tensor(cpu_isa):
    q, _ = _blocks("Q8_0", 6, 32, 5)
    v, _ = _blocks("Q8_0", 4, 32, 6)
    bad = v.data.clone()
    bad[3, 0:2] = torch.tensor([0x00, 0x7C], dtype=torch.uint8)  # +inf scale
    fused = cat_blocks(
        [QuantBlocks("q", "Q8_0", q.data, 32), QuantBlocks("v", "Q8_0", bad, 32)], "q"
    )
    with pytest.raises(ValueError, match="^v: row 3 has"):
        QuantCpuDense("Q8_0", torch.float32, cpu_isa).prepare(fused)


@pytest.mark.parametrize("fmt", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [0, 16])
def test_dequantizing_rows_compute_what_the_blocks_do(fmt, dtype, bits, cpu_isa):
    """From dequant_from rows on, W is dequantized for the call and torch multiplies (from
    the file's layout, and from rows grouped for the integer kernels: x exact there)."""
    blocks, ref = _blocks(fmt, 40, 64, 7)
    blockwise = QuantCpuDense(fmt, dtype, cpu_isa, x_bits=bits)
    dequant = QuantCpuDense(fmt, dtype, cpu_isa, dequant_from=3, x_bits=bits)
    w = blockwise.prepare(blocks)
    bias = torch.randn(40).to(dtype)
    for m in (1, 2, 3, 9):
        x = torch.randn(m, 64).to(dtype)
        want = blockwise.forward(x, w, 40, bias)
        got = dequant.forward(x, w, 40, bias)
        tol = (5e-4 if bits else 1e-5) if dtype == torch.float32 else 2e-2  # bits: x rounded
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_choose_quant_times_each_row_count(monkeypatch, tmp_path):
    from punica_x.ops import autotune
    from punica_x.ops.quant_dense import choose_quant, random_blocks

    monkeypatch.setenv("PUNICA_X_CACHE", str(tmp_path))
    monkeypatch.setattr("punica_x.ops.dense.COLD_BYTES", 1 << 16)
    b = random_blocks("Q4_1", 8, 64)
    assert b.shape == (8, 40) and b.dtype == torch.uint8
    backend = choose_quant("Q4_1", torch.device("cpu"), torch.float32, 96, 64, (1, 64))
    made = autotune._lookup("quant:Q4_1 96x64 rows=64")
    assert made is not None and set(made["timings_ms"]) == {"blocks", "dequant"}
    assert made["name"] == min(made["timings_ms"], key=made["timings_ms"].get)
    one = autotune._lookup("quant:Q4_1 96x64 rows=1")  # timed only where 64 rows dequantize
    want = None if made["name"] == "blocks" else 1 if one["name"] == "dequant" else 64
    assert backend.dequant_from == want
    monkeypatch.setenv("PUNICA_X_AUTOTUNE", "0")
    assert (
        choose_quant("Q4_1", torch.device("cpu"), torch.float32, 96, 64, (64,)).dequant_from is None
    )


@pytest.mark.parametrize(
    ("at64", "at1", "want"),
    [("blocks", "dequant", None), ("dequant", "blocks", 64), ("dequant", "dequant", 1)],
)
def test_choose_quant_dequantizes_from_where_it_wins_down(monkeypatch, tmp_path, at64, at1, want):
    """From the largest row count down while dequantizing wins (the choices kept as if
    timed): a win at 1 row below a loss at 64 does not count."""
    from punica_x.ops import autotune
    from punica_x.ops.quant_dense import choose_quant

    monkeypatch.setenv("PUNICA_X_CACHE", str(tmp_path))
    for rows, name in ((64, at64), (1, at1)):
        timings = (
            {"blocks": 1.0, "dequant": 2.0} if name == "blocks" else {"blocks": 2.0, "dequant": 1.0}
        )
        autotune.remember(f"quant:Q4_1 96x64 rows={rows}", {"name": name, "timings_ms": timings})
    backend = choose_quant("Q4_1", torch.device("cpu"), torch.float32, 96, 64, (1, 64))
    assert backend.dequant_from == want


# the integer-activation kernel's largest |xq| per x_bits (int16: two int8 parts, 128 xh + xl)
QMAX = {8: 127, 16: 127 * 128}


def _xq_reference(ref: torch.Tensor, x: torch.Tensor, bits: int) -> torch.Tensor:
    """What the integer-activation kernel computes, in float64: each block of 32 values of x
    rounded to integers with scale max|x| / QMAX[bits] (half to even), times W's blocks."""
    xf = x.float().reshape(x.shape[0], -1, 32)
    d = xf.abs().amax(-1, keepdim=True) / QMAX[bits]
    q = torch.round(xf * torch.where(d > 0, 1 / d, torch.zeros_like(d)))
    return (q * d).reshape(x.shape).double() @ ref.double().t()


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("fmt", NAMES)
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9])
# 45 rows: a last group whose second half (rows 8-15, AVX2 takes one half at a time) is partial
@pytest.mark.parametrize(("n", "k"), [(37, 64), (45, 96), (2, 32), (576, 1536)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_integer_x_is_rounded_x_times_the_blocks(bits, fmt, m, n, k, dtype, cpu_isa):
    """x_bits 8 / 16: the blocks times x rounded to integers per block, exactly that
    arithmetic (integer dot products; float32 only in the per-block scaling and the sums
    over blocks); its distance from the float product is what rounding x costs (<= half a
    step a value)."""
    seed = int.from_bytes(os.urandom(4), "little")
    blocks, ref = _blocks(fmt, n, k, seed)
    backend = QuantCpuDense(fmt, dtype, cpu_isa, x_bits=bits)
    assert backend.name == f"quant_{fmt.lower()}_x{bits}"
    x = torch.randn(m, k).to(dtype)
    x[0, :32] = 0  # a block of zeros: scale 0
    bias = torch.randn(n).to(dtype) if m % 2 else None
    y = backend.forward(x, backend.prepare(blocks), n, bias)
    want = _xq_reference(ref, x, bits) + (bias.double() if bias is not None else 0)
    assert y.dtype == dtype and y.shape == (m, n)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    err = (y.double() - want).abs().max() / want.abs().max()
    assert err < tol, f"seed {seed}: relative error {err}"
    exact = x.double() @ ref.double().t() + (bias.double() if bias is not None else 0)
    step = x.float().reshape(m, -1, 32).abs().amax(-1) / QMAX[bits]  # [m, k / 32]
    bound = (step.double() / 2) @ ref.abs().reshape(n, -1, 32).sum(-1).double().t()
    assert ((y.double() - exact).abs() <= bound + tol * exact.abs().max()).all(), seed


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("fmt", NAMES)
def test_integer_x_non_finite_gives_nan_rows_and_spares_the_others(bits, fmt, cpu_isa):
    blocks, ref = _blocks(fmt, 24, 64, 8)
    backend = QuantCpuDense(fmt, torch.float32, cpu_isa, x_bits=bits)
    x = torch.randn(3, 64)
    x[0, 5], x[2, 40] = float("nan"), float("inf")
    y = backend.forward(x, backend.prepare(blocks), 24, None)
    assert y[0].isnan().all() and y[2].isnan().all()
    want = _xq_reference(ref, x[1:2], bits)
    torch.testing.assert_close(y[1:2].double(), want, rtol=1e-5, atol=1e-5)


def test_x_bits_are_checked():
    for bad in (4, 32, -8, None, "8"):
        with pytest.raises(ValueError, match="x_bits must be one of"):
            QuantCpuDense("Q4_0", torch.float32, x_bits=bad)


def test_quant_activations_setting_is_checked():
    from punica_x.config import ModelConfig

    assert ModelConfig().quant_activations == "int16"
    assert ModelConfig(quant_activations="float").quant_activations == "float"
    for bad in ("INT8", "int4", "int32", "", None, 8, 16, True, ["int8"]):
        with pytest.raises(ValueError, match="quant_activations must be one of"):
            ModelConfig(quant_activations=bad)
