"""Batch invariance of every kernel a token passes through (punica_x/ops/invariance.py), in
each ISA build this CPU runs, float32 and bfloat16: a row's result is the same bits alone,
inside a batch of any size at any position, in a segment of any size, as a whole prompt, a
chunk or a decode row."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import CPU_ISAS

from punica_x.attention.cpu import CpuAttention
from punica_x.attention.paged import SeqSpan
from punica_x.ops.dense import PackedCpuDense
from punica_x.ops.fused import CpuFused
from punica_x.ops.quant_dense import FORMATS, QuantBlocks, QuantCpuDense
from punica_x.ops.sgmv import SgmvWeights, cpu_sgmv_fixed_order

DTYPES = [torch.float32, torch.bfloat16]
# (offset, rows) of sub-batches cut out of a batch of 40 rows: alone, small, odd, whole
CUTS = [(0, 1), (17, 1), (39, 1), (3, 2), (5, 3), (9, 4), (1, 5), (11, 7), (4, 8), (20, 9)]
CUTS += [(2, 17), (0, 40)]


def generator() -> torch.Generator:
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))


def assert_rows_invariant(f, x: torch.Tensor) -> None:
    """f(x[o : o + m]) equals f(x)[o : o + m] bit for bit for every cut."""
    full = f(x)
    for o, m in CUTS:
        part = f(x[o : o + m].clone())
        assert torch.equal(part, full[o : o + m]), (o, m, (part - full[o : o + m]).abs().max())


@pytest.mark.parametrize("cpu_isa", CPU_ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), [(100, 67), (576, 1536), (49, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_dense_gemm_rows_do_not_depend_on_the_batch(cpu_isa, dtype, n, k, bias):
    gen = generator()
    backend = PackedCpuDense(cpu_isa)
    w = backend.prepare((torch.randn(n, k, generator=gen) * k**-0.5).to(dtype))
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    x = torch.randn(40, k, generator=gen).to(dtype)
    assert_rows_invariant(lambda t: backend.forward(t, w, n, b), x)


def _blocks(fmt: str, n: int, k: int) -> QuantBlocks:
    from gguf import GGMLQuantizationType, quants

    w = torch.randn(n, k, generator=generator()).mul(k**-0.5).numpy()
    q = quants.quantize(w, GGMLQuantizationType[fmt])
    return QuantBlocks(f"w.{fmt}", fmt, torch.from_numpy(q.copy()), k)


@pytest.mark.parametrize("cpu_isa", CPU_ISAS)
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("x_bits", [0, 8, 16])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), [(53, 320), (300, 576)])
def test_quantized_gemm_rows_do_not_depend_on_the_batch(cpu_isa, fmt, x_bits, dtype, n, k):
    """The blocks' kernels in fixed order (what choose_quant keeps at every row count then);
    the second shape has more output columns than a tile's panel."""
    backend = QuantCpuDense(fmt, dtype, cpu_isa, x_bits=x_bits, fixed_order=True)
    w = backend.prepare(_blocks(fmt, n, k))
    x = torch.randn(40, k, generator=generator()).to(dtype)
    assert_rows_invariant(lambda t: backend.forward(t, w, n, None), x)


@pytest.mark.parametrize("cpu_isa", CPU_ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_layers_rows_do_not_depend_on_the_batch(cpu_isa, dtype):
    gen = generator()
    fused = CpuFused(cpu_isa)
    h, heads, d = 96, 3, 32
    w = (1 + 0.1 * torch.randn(h, generator=gen)).to(dtype)
    x = torch.randn(40, h, generator=gen).to(dtype)
    res = torch.randn(40, h, generator=gen).to(dtype)
    assert_rows_invariant(lambda t: fused.rms_norm(t, w, 1e-5), x)
    assert_rows_invariant(lambda t: fused.silu_and_mul(t), torch.cat([x, res], 1))
    assert_rows_invariant(lambda t: fused.gelu_tanh_and_mul(t), torch.cat([x, res], 1))

    def add_norm(t):  # t: [m, 2h] = (x | residual); returns (normed | residual after)
        r = t[:, h:].clone()
        return torch.cat([fused.add_rms_norm(t[:, :h], r, w, 1e-5), r], 1)

    assert_rows_invariant(add_norm, torch.cat([x, res], 1))
    pos = torch.randint(0, 500, (40,), generator=gen)
    angles = torch.outer(torch.arange(512.0), 1e-2 * torch.arange(d // 2).float())
    cos = torch.cat([angles.cos()] * 2, 1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, 1).to(dtype)

    def rope(t):  # t: [m, heads * d + 1] = (x | position)
        y = t[:, :-1].contiguous()
        fused.rope_(y, heads, d, t[:, -1].long(), cos, sin)
        return y

    assert_rows_invariant(rope, torch.cat([x, pos[:, None].to(dtype)], 1))


@pytest.mark.parametrize("cpu_isa", CPU_ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rank", [8, 13])
def test_sgmv_fixed_order_rows_do_not_depend_on_their_segment(cpu_isa, dtype, rank):
    """A row of an adapter's segment of 1, 2, 5, 9 or 16 rows (and rows of the base) gives
    the bits it gives alone in a one-row segment; three slices of odd widths, one wider than
    a one-row expand tile (256 columns on AVX-512, 96 on AVX2), whose last item then has as
    few columns as a multi-row segment's (there AVX2's one-row tile had kept a multiply and
    an add unfused, float32)."""
    gen = generator()
    h_in, h_out, layers = 200, [72, 40, 300], 2
    lens = [9, 1, 2, 5, 16]  # rows per segment; the second is the base model's
    ranks = [[rank] * 3 for _ in lens]
    ranks[1] = [0, 0, 0]
    a = [(0.1 * torch.randn(layers, 3 * rank, h_in, generator=gen)).to(dtype) for _ in lens]
    b = [(0.1 * torch.randn(layers, rank * sum(h_out), generator=gen)).to(dtype) for _ in lens]
    a[1] = b[1] = None
    seg = [0]
    for n in lens:
        seg.append(seg[-1] + n)
    rows = seg[-1]
    x = torch.randn(rows, h_in, generator=gen).to(dtype)
    y0 = torch.randn(rows, sum(h_out), generator=gen).to(dtype)
    backend = cpu_sgmv_fixed_order(cpu_isa)

    def run(seg_, a_, b_, ranks_, rows_x, rows_y):
        w = SgmvWeights.build(seg_, a_, b_, ranks_, h_out, "cpu")
        y, v = rows_y.clone(), torch.zeros(rows_x.shape[0], 3 * rank)
        backend.bind(w)(y, rows_x, v, 1)
        return y

    batch = run(seg, a, b, ranks, x, y0)
    for s, n in enumerate(lens):
        for t in range(seg[s], seg[s] + n):
            alone = run([0, 1], [a[s]], [b[s]], [ranks[s]], x[t : t + 1], y0[t : t + 1])
            assert torch.equal(alone[0], batch[t]), (s, n, t)


def _fill(kv, layer, blocks, k, v, p):
    for pos in range(k.shape[0]):
        kv[blocks[pos // p], layer, 0, :, pos % p] = k[pos]
        kv[blocks[pos // p], layer, 1, :, pos % p] = v[pos]


@pytest.mark.parametrize("cpu_isa", CPU_ISAS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_rows_are_the_same_as_prompt_chunks_or_decodes(cpu_isa, dtype):
    """A 900-token sequence (past flash attention's threshold when whole) attended as one
    prompt, in chunks after a cached part, beside other sequences, and row by row as decodes:
    every row's output and log-sum-exp the same bits, with flash attention off."""
    gen = generator()
    hq, nkv, d, p, length = 4, 2, 32, 16, 900
    attention = CpuAttention(cpu_isa).fixed_order()
    nb = -(-length // p)
    kv = torch.zeros(2 * nb + 8, 1, 2, nkv, p, d, dtype=dtype)
    blocks = list(range(nb))
    k = torch.randn(length, nkv, d, generator=gen).to(dtype)
    v = torch.randn(length, nkv, d, generator=gen).to(dtype)
    _fill(kv, 0, blocks, k, v, p)
    q = torch.randn(length, hq, d, generator=gen).to(dtype)
    other = list(range(nb, nb + 8))  # a short neighbour of 100 tokens
    _fill(kv, 0, other, k[:100].flip(0), v[:100], p)

    def attend(spans, rows_q):
        plan = attention.plan(spans, p, torch.device("cpu"))
        assert not plan.long_prefills
        return plan.attend(rows_q, kv, 0, d**-0.5)

    whole, whole_lse = attend([SeqSpan(0, length, length, blocks)], q)
    for start, end in [(0, 300), (300, 301), (301, 700), (700, 900)]:  # chunks
        n = end - start
        out, lse = attend([SeqSpan(0, n, end, blocks)], q[start:end])
        assert torch.equal(out, whole[start:end]) and torch.equal(lse, whole_lse[start:end])
    for pos in range(0, length, 37):  # a decode row beside the neighbour's chunk
        rows = torch.cat([q[100:130], q[pos : pos + 1]])
        spans = [SeqSpan(0, 30, 100, other), SeqSpan(30, 1, pos + 1, blocks)]
        out, lse = attend(spans, rows)
        assert torch.equal(out[30], whole[pos]) and torch.equal(lse[30], whole_lse[pos]), pos
