"""Every compiled CPU kernel in bfloat16 against its float32 PyTorch reference, on fresh
random inputs, for each instruction set this CPU runs (AVX2, AVX-512 and AVX512-BF16 builds; the
last multiplies bf16 pairs with vdpbf16ps in the dense GEMM and the SGMV shrink).

The kernels read bf16, compute in float32 and round each output once. The reference runs in
float32 on the same bf16-rounded inputs, so the only difference left is that one rounding
(at most 2^-9 of the value, ~0.2%) plus float32 summation order (the SGMV expand of the
avx512_bf16 build reads its float32 input v as two bf16 parts, within 2^-17 of v). Stated
tolerance: rtol 8e-3 (2x a bf16 ulp) with an atol of 1e-3 x the output's scale for values
near zero. The fused layers round intermediate results where the reference (the model in
bf16, as HF runs it) rounds them, and are compared with that bf16 reference at one bf16 ulp.
"""

from __future__ import annotations

import os

import pytest
import torch

from punica_x.attention import cpu as cpu_attention
from punica_x.attention.cpu import CpuAttention
from punica_x.attention.paged import SeqSpan
from punica_x.ops.dense import PackedCpuDense
from punica_x.ops.fused import CpuFused, TorchFused
from punica_x.ops.sgmv import SgmvWeights, add_lora_sgmv, cpu_backend, get_backend

BF16 = torch.bfloat16
RTOL = 8e-3


def gen() -> torch.Generator:
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))


def bf16_randn(g: torch.Generator, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(BF16)


def assert_bf16_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == BF16
    atol = 1e-3 * max(ref.abs().max().item(), 1e-6)
    torch.testing.assert_close(ours.float(), ref.float(), rtol=RTOL, atol=atol)


@pytest.mark.parametrize("m", [1, 5, 32, 130])
@pytest.mark.parametrize(("k", "n"), [(576, 960), (100, 50), (101, 50), (1536, 576)])
@pytest.mark.parametrize("bias", [False, True])
def test_dense_bf16(m, k, n, bias, cpu_isa):
    g = gen()
    w, x = bf16_randn(g, n, k, scale=k**-0.5), bf16_randn(g, m, k)
    b = bf16_randn(g, n) if bias else None
    cpu = PackedCpuDense(cpu_isa)
    packed = cpu.prepare(w)
    assert packed.dtype == BF16  # the panels stay 2 bytes a weight
    ref = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    assert_bf16_close(cpu.forward(x, packed, n, b), ref)


@pytest.mark.parametrize("rows", [1, 2, 5])  # 2, 5: the multi-row tiles (and a 1-row block)
def test_sgmv_bf16_expand_keeps_v_float32_precise(rows, cpu_isa):
    """v = 1 + 2^-8 + 2^-10 and v' = 1 against B rows 256 and -256: the output is
    256 * (v - v') = 1.25 from v as computed (float32, or the avx512_bf16 build's hi + lo bf16
    split, exact here) and 2.0 from v rounded to bf16 (1 + 2^-7), both exact in bf16."""
    h_in, h_out = 32, 40  # 40: a masked tail of 8 columns after a full 32
    x = torch.zeros(rows, h_in, dtype=BF16)
    x[:, :3] = 1
    a = torch.zeros(1, 2, h_in, dtype=BF16)
    a[0, 0, :3] = torch.tensor([1, 2**-8, 2**-10])
    a[0, 1, 0] = 1
    b = torch.cat([torch.full((h_out,), 256.0), torch.full((h_out,), -256.0)]).to(BF16)[None]
    w = SgmvWeights.build([0, rows], [a], [b], [[2]], [h_out], "cpu")
    y = add_lora_sgmv(torch.zeros(rows, h_out, dtype=BF16), x, w, 0, backend=cpu_backend(cpu_isa))
    assert torch.equal(y, torch.full((rows, h_out), 1.25, dtype=BF16))


@pytest.mark.parametrize("slices", [[576], [576, 192, 192]])
@pytest.mark.parametrize("lens", [[1, 1, 1, 1], [3, 7, 1, 12], [32]])
@pytest.mark.parametrize("h_in", [576, 100])  # 100: a partial last block of 32 (masked loads)
def test_sgmv_bf16(slices, lens, h_in, cpu_isa):
    g = gen()
    rank, layers = 16, 2
    seg, a, b, ranks = [0], [], [], []
    for i, n in enumerate(lens):
        seg.append(seg[-1] + n)
        lora = i != 1  # the second segment runs the base model only
        a.append(bf16_randn(g, layers, rank * len(slices), h_in, scale=0.1) if lora else None)
        b.append(bf16_randn(g, layers, rank * sum(slices), scale=0.1) if lora else None)
        ranks.append([rank if lora else 0] * len(slices))
    w = SgmvWeights.build(seg, a, b, ranks, slices, "cpu")
    w32 = SgmvWeights.build(
        seg,
        [None if t is None else t.float() for t in a],
        [None if t is None else t.float() for t in b],
        ranks,
        slices,
        "cpu",
    )
    x, y0 = bf16_randn(g, seg[-1], h_in), bf16_randn(g, seg[-1], sum(slices))
    ours = add_lora_sgmv(y0.clone(), x, w, 1, backend=cpu_backend(cpu_isa))
    ref = add_lora_sgmv(y0.float(), x.float(), w32, 1, backend=get_backend("cpu", "torch_ref"))
    assert_bf16_close(ours, ref)
    if len(lens) > 1:  # rows without an adapter are left exactly as they were
        assert torch.equal(ours[seg[1] : seg[2]], y0[seg[1] : seg[2]])


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize(("hq", "nkv", "d"), [(9, 3, 64), (4, 4, 40)])
@pytest.mark.parametrize("flash", [False, True])
def test_paged_attention_bf16(block_size, hq, nkv, d, cpu_isa, flash, monkeypatch):
    """Decodes and prefill chunks over bf16 blocks, fresh and after a cached part; the chunks
    of more than LONG_PREFILL rows by the kernel, or by flash attention (what runs large ones
    by default)."""
    monkeypatch.setattr(cpu_attention, "FLASH_MIN_WORK", 0 if flash else 1e18)
    g = gen()
    # (new rows, tokens already cached)
    shapes = [(1, 37), (1, 5), (12, 0), (9, 20), (100, 0), (80, 33)]
    kv = torch.zeros(160, 2, 2, nkv, block_size, d, dtype=BF16)
    spans, ks, vs, row, next_block = [], [], [], 0, 0
    for n, cached in shapes:
        total = n + cached
        blocks = list(range(next_block, next_block + -(-total // block_size)))[::-1]
        next_block += len(blocks)
        k, v = bf16_randn(g, total, nkv, d), bf16_randn(g, total, nkv, d)
        for pos in range(cached):
            kv[blocks[pos // block_size], 1, 0, :, pos % block_size] = k[pos]
            kv[blocks[pos // block_size], 1, 1, :, pos % block_size] = v[pos]
        spans.append(SeqSpan(row, n, total, blocks))
        ks.append(k)
        vs.append(v)
        row += n
    plan = CpuAttention(cpu_isa).plan(spans, block_size, torch.device("cpu"))
    q = bf16_randn(g, row, hq, d)
    new_k = torch.cat([k[sp.kv_len - sp.num_rows :] for k, sp in zip(ks, spans)])
    new_v = torch.cat([v[sp.kv_len - sp.num_rows :] for v, sp in zip(vs, spans)])
    plan.write_kv(kv, 1, new_k, new_v)
    out, lse = plan.attend(q, kv, 1, d**-0.5)
    assert out.dtype == BF16 and lse.dtype == torch.float32
    for sp, k, v in zip(spans, ks, vs):
        rows = slice(sp.row_start, sp.row_start + sp.num_rows)
        first = sp.kv_len - sp.num_rows
        qf = q[rows].float()
        kf = k.float().repeat_interleave(hq // nkv, dim=1)
        vf = v.float().repeat_interleave(hq // nkv, dim=1)
        scores = torch.einsum("nhd,shd->hns", qf, kf) * d**-0.5
        pos = torch.arange(first, first + sp.num_rows)[:, None]
        scores = scores.masked_fill(torch.arange(sp.kv_len)[None, :] > pos, float("-inf"))
        ref = torch.einsum("hns,shd->nhd", torch.softmax(scores, -1), vf)
        assert_bf16_close(out[rows], ref)
        torch.testing.assert_close(lse[rows], torch.logsumexp(scores, -1).t(), rtol=1e-4, atol=1e-4)
    # the cache holds exactly the bf16 K/V written (no rounding on the way in)
    sp = spans[2]
    for pos in range(sp.kv_len):
        assert torch.equal(
            kv[sp.block_ids[pos // block_size], 1, 0, :, pos % block_size], ks[2][pos]
        )


def assert_within_one_ulp(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == ref.dtype == BF16
    torch.testing.assert_close(ours.float(), ref.float(), rtol=RTOL, atol=1e-2)


@pytest.mark.parametrize("rows", [1, 33])
@pytest.mark.parametrize("hidden", [576, 1000])
@pytest.mark.parametrize("head_dim", [64, 40])  # 40: RoPE's half head is not a whole vector
def test_fused_layers_bf16(rows, hidden, head_dim, cpu_isa):
    g = gen()
    cpu, ref = CpuFused(cpu_isa), TorchFused()
    x, w = bf16_randn(g, rows, hidden, scale=3), bf16_randn(g, hidden)
    assert_within_one_ulp(cpu.rms_norm(x, w, 1e-5), ref.rms_norm(x, w, 1e-5))
    r1 = bf16_randn(g, rows, hidden)
    r2 = r1.clone()
    out = cpu.add_rms_norm(x, r1, w, 1e-5)
    assert_within_one_ulp(out, ref.add_rms_norm(x, r2, w, 1e-5))
    assert torch.equal(r1, r2)  # the bf16 residual stream: one rounding of r + x, as torch does
    gate_up = bf16_randn(g, rows, 2 * hidden, scale=4)
    assert_within_one_ulp(cpu.silu_and_mul(gate_up), ref.silu_and_mul(gate_up))
    assert_within_one_ulp(cpu.gelu_tanh_and_mul(gate_up), ref.gelu_tanh_and_mul(gate_up))
    heads = hidden // head_dim
    ang = torch.rand(50, head_dim // 2, generator=g) * 6
    emb = torch.cat((ang, ang), dim=-1)
    cos, sin = emb.cos().to(BF16), emb.sin().to(BF16)
    positions = torch.randint(0, 50, (rows,), generator=g)
    q = bf16_randn(g, rows, heads * head_dim)
    # reference: the exact rotation of the same bf16 inputs, rounded once (the kernel computes
    # in float32; torch's bf16 ops round q*cos and rot*sin first, and where they cancel that
    # can be off by more than one bf16 step of the result)
    q_ref = q.float()
    cpu.rope_(q, heads, head_dim, positions, cos, sin)
    ref.rope_(q_ref, heads, head_dim, positions, cos.float(), sin.float())
    assert_within_one_ulp(q, q_ref.to(BF16))


def test_kernels_refuse_mixed_and_other_dtypes(cpu_isa):
    """A dtype the kernels do not take is refused by the binding, naming the tensor."""
    dense = PackedCpuDense(cpu_isa)
    packed = dense.prepare(torch.randn(48, 32, dtype=BF16))
    with pytest.raises(RuntimeError, match="packed must be Float like the other operands"):
        dense.ext.gemm(torch.empty(2, 48), torch.randn(2, 32), packed, 48, None)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        dense.prepare(torch.randn(48, 32, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="x must be float32 or bfloat16 on CPU, got Half"):
        w = SgmvWeights.build([0, 1], [None], [None], [[0]], [8], "cpu")
        cpu_backend(cpu_isa).shrink(torch.zeros(1, 1), torch.zeros(1, 8, dtype=torch.half), w, 0)
    fused = CpuFused(cpu_isa)
    with pytest.raises(RuntimeError, match="w must be BFloat16 like the other inputs"):
        fused.rms_norm(torch.zeros(2, 8, dtype=BF16), torch.ones(8), 1e-5)
