"""CpuAttentionPlan.rope_write_attend (one native call per layer: RoPE on q and k, the K/V
write, paged attention) against the calls it replaces: the fused layers' rope_, write_kv
and attend, bit for bit."""

from __future__ import annotations

import os
import random

import pytest
import torch
from helpers import CPU_ISAS

from punica_x.attention.cpu import CpuAttention
from punica_x.attention.paged import SeqSpan
from punica_x.ops.fused import CpuFused


def _step(heads, nkv, d, block_size, dtype, seed):
    """A step of decodes and short chunks after cached parts: (spans, positions, qkv, kv)."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    kv = torch.randn(64, 2, 2, nkv, block_size, d, generator=gen).to(dtype)
    free = list(range(64))
    rng.shuffle(free)
    spans, positions, row = [], [], 0
    for n, cached in [(1, rng.randint(0, 30)), (rng.randint(2, 9), rng.randint(0, 20)), (1, 0)]:
        total = n + cached
        blocks = [free.pop() for _ in range(-(-total // block_size))]
        spans.append(SeqSpan(row, n, total, blocks))
        positions += range(cached, total)
        row += n
    qkv = torch.randn(row, (heads + 2 * nkv) * d, generator=gen).to(dtype)
    return spans, torch.tensor(positions), qkv, kv


@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,nkv,d", [(9, 3, 64), (4, 4, 32), (8, 1, 40)])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (5, 0.0), (0, 3.5)])
def test_equals_rope_write_attend_as_separate_calls(isa, dtype, heads, nkv, d, window, softcap):
    seed = int.from_bytes(os.urandom(4), "little")
    spans, positions, qkv, kv = _step(heads, nkv, d, 4, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    cos, sin = (torch.randn(64, d, generator=gen).to(dtype) for _ in range(2))
    plan = CpuAttention(isa).plan(spans, 4, torch.device("cpu"))
    assert plan.fuses_rope
    fused_qkv, fused_kv = qkv.clone(), kv.clone()
    out = plan.rope_write_attend(
        fused_qkv, fused_kv, 1, heads, positions, cos, sin, 0.3, window, softcap
    )

    layers = CpuFused(isa)
    t, q_cols = qkv.shape[0], heads * d
    q, k, v = qkv.split([q_cols, nkv * d, nkv * d], dim=-1)
    layers.rope_(q, heads, d, positions, cos, sin)
    layers.rope_(k, nkv, d, positions, cos, sin)
    plan.write_kv(kv, 1, k.reshape(t, nkv, d), v.reshape(t, nkv, d))
    ref, _ = plan.attend(q.reshape(t, heads, d), kv, 1, 0.3, window, softcap)

    msg = f"seed={seed}"
    assert out.shape == (t, heads * d), msg
    assert torch.equal(out, ref.reshape(t, -1)), msg
    assert torch.equal(fused_kv, kv), msg  # the same slots written, nothing else
    assert torch.equal(fused_qkv, qkv), msg  # q and k rotated in place, v as it was


def test_long_prefills_take_the_separate_calls():
    spans = [SeqSpan(0, 1000, 1000, list(range(250)))]  # rows x keys past FLASH_MIN_WORK
    plan = CpuAttention().plan(spans, 4, torch.device("cpu"))
    assert plan.long_prefills and not plan.fuses_rope


def test_checks_inputs():
    ext = CpuAttention().ext
    heads, nkv, d = 4, 2, 8
    kv = torch.zeros(4, 2, 2, nkv, 4, d)
    qkv = torch.zeros(2, (heads + 2 * nkv) * d)
    pos = torch.tensor([0, 1])
    cos = sin = torch.zeros(16, d)
    blocks, offsets = torch.tensor([0, 0]), torch.tensor([0, 1])
    seqs = torch.tensor([[0], [2], [2]], dtype=torch.int32)
    starts, table = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32)
    good = dict(
        qkv=qkv,
        heads=heads,
        positions=pos,
        cos=cos,
        sin=sin,
        kv=kv,
        layer=0,
        blocks=blocks,
        offsets=offsets,
        seqs=seqs,
        starts=starts,
        table=table,
        scale=1.0,
        window=0,
        softcap=0.0,
    )
    ext.rope_write_attend(*good.values())  # the good call runs
    bad = [
        (dict(qkv=torch.zeros(2, 40)), r"qkv must be \[T, 64\]"),
        (dict(qkv=qkv[:, :-1]), "qkv must be"),
        (dict(qkv=qkv.t().contiguous().t()), "contiguous"),
        (dict(qkv=qkv.bfloat16()), "qkv must be Float"),
        (dict(heads=3, qkv=torch.zeros(2, 56)), "multiple of N_kv"),
        (dict(heads=0), "heads must be in"),
        (dict(heads=-5), "heads must be in"),
        (dict(positions=torch.tensor([0, 16])), "position 16 outside the table"),
        (dict(positions=torch.tensor([-1, 0])), "position -1 outside the table"),
        (dict(positions=torch.tensor([0])), "positions must be int64"),
        (dict(positions=torch.tensor([0.0, 1.0])), "positions must be Long"),
        (dict(cos=torch.zeros(16, 4)), "cos/sin must be"),
        (dict(sin=torch.zeros(8, d)), "cos/sin must be"),
        (dict(blocks=torch.tensor([0, 9])), r"row 1: slot \(9, 1\) out of range"),
        (dict(offsets=torch.tensor([0, 4])), r"row 1: slot \(0, 4\) out of range"),
        (dict(blocks=torch.tensor([0])), "one block/offset per row"),
        (dict(layer=2), "layer 2 out of range"),
        (dict(table=torch.tensor([7], dtype=torch.int32)), "block id 7 out of range"),
        (dict(seqs=torch.tensor([[0], [3], [3]], dtype=torch.int32)), "rows out of range"),
        (dict(window=-1), "window"),
        (dict(softcap=float("nan")), "softcap"),
        (dict(softcap=float("inf")), "softcap"),
    ]
    for change, message in bad:
        args = {**good, **change}
        with pytest.raises(RuntimeError, match=message):
            ext.rope_write_attend(*args.values())
