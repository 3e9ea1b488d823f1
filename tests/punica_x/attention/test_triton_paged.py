"""The batch-invariant Triton paged attention (attention.triton_paged): the torch
reference's values (GQA, sliding window, soft-capping, log-sum-exp), and a position's bits
the same as a decode row, in a chunk or in a whole prompt, alone or beside other sequences.
Through Triton's interpreter on a CPU."""

import pytest
import torch
from triton_interpreter import device, mended, skip_without_triton

pytestmark = pytest.mark.triton
skip_without_triton()
from punica_x.attention.paged import SeqSpan, TorchAttention  # noqa: E402
from punica_x.attention.triton_plan import TritonAttention  # noqa: E402

P, NKV, HQ, D, BLOCKS = 4, 2, 6, 16, 24


def _cache(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(BLOCKS, 1, 2, NKV, P, D, generator=g).to(dtype).to(device())
    return kv, g


def _q(rows, dtype, g):
    return torch.randn(rows, HQ, D, generator=g).to(dtype).to(device())


def _run(backend, spans, q, kv, **kw):
    plan = backend.plan(spans, P, kv.device)
    with mended():
        return plan.attend(q, kv, 0, 0.3, **kw)


SEQ_A = list(range(0, 6))  # 6 blocks: up to 24 keys
SEQ_B = [10, 7, 12, 20, 21]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kw", [{}, {"window": 5}, {"softcap": 2.0}])
def test_matches_the_torch_reference(dtype, kw):
    kv, g = _cache(dtype)
    spans = [SeqSpan(0, 9, 14, SEQ_A), SeqSpan(9, 1, 17, SEQ_B), SeqSpan(10, 1, 3, [23])]
    q = _q(11, dtype, g)
    out, lse = _run(TritonAttention(), spans, q, kv, **kw)
    ref, ref_lse = TorchAttention().plan(spans, P, kv.device).attend(q, kv, 0, 0.3, **kw)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kw", [{}, {"window": 5}])
def test_a_position_has_the_same_bits_however_it_is_batched(kw):
    kv, g = _cache(torch.bfloat16, seed=1)
    q = _q(20, torch.bfloat16, g)  # the 20 positions of sequence A
    attn = TritonAttention()
    whole, whole_lse = _run(attn, [SeqSpan(0, 20, 20, SEQ_A)], q, kv, **kw)
    for lo, hi in ((0, 7), (7, 15), (15, 20)):  # chunked prefill
        part, part_lse = _run(attn, [SeqSpan(0, hi - lo, hi, SEQ_A)], q[lo:hi], kv, **kw)
        assert torch.equal(part, whole[lo:hi]) and torch.equal(part_lse, whole_lse[lo:hi])
    other = _q(3, torch.bfloat16, g)
    for pos in (0, 3, 4, 19):  # a decode row, alone and after another sequence's rows
        alone, _ = _run(attn, [SeqSpan(0, 1, pos + 1, SEQ_A)], q[pos : pos + 1], kv, **kw)
        assert torch.equal(alone[0], whole[pos])
        spans = [SeqSpan(0, 3, 17, SEQ_B), SeqSpan(3, 1, pos + 1, SEQ_A)]
        mixed, _ = _run(attn, spans, torch.cat([other, q[pos : pos + 1]]), kv, **kw)
        assert torch.equal(mixed[3], whole[pos])


def test_the_plan_writes_each_row_where_the_torch_plan_does():
    kv, g = _cache(torch.float32)
    spans = [SeqSpan(0, 3, 9, SEQ_A), SeqSpan(3, 1, 5, SEQ_B)]
    k, v = (torch.randn(4, NKV, D, generator=g).to(kv.device) for _ in range(2))
    ours, ref = kv.clone(), kv.clone()
    TritonAttention().plan(spans, P, kv.device).write_kv(ours, 0, k, v)
    TorchAttention().plan(spans, P, kv.device).write_kv(ref, 0, k, v)
    assert torch.equal(ours, ref) and not torch.equal(ours, kv)
    empty = TritonAttention().plan([], P, kv.device)
    out, lse = empty.attend(q := torch.empty(0, HQ, D, device=kv.device), kv, 0, 0.3)
    assert out.shape == q.shape and lse.shape == (0, HQ)


@pytest.mark.parametrize("kw", [{}, {"window": 20}])
def test_blocks_larger_than_a_key_tile_walk_in_tiles_of_16(kw):
    """A cache block of 32 or 64 keys is walked 16 keys at a time (the tile a program holds):
    the reference's values, and a position's bits the same alone or in a whole prompt."""
    for p in (32, 64):
        g = torch.Generator().manual_seed(p)
        kv = torch.randn(6, 1, 2, NKV, p, D, generator=g).to(device())
        q = _q(40, torch.float32, g)
        seq = [4, 1]
        spans = [SeqSpan(0, 40, 40, seq)]
        plan = TritonAttention().plan(spans, p, kv.device)
        with mended():
            out, lse = plan.attend(q, kv, 0, 0.3, **kw)
            alone, _ = (
                TritonAttention()
                .plan([SeqSpan(0, 1, 38, seq)], p, kv.device)
                .attend(q[37:38], kv, 0, 0.3, **kw)
            )
        ref, ref_lse = TorchAttention().plan(spans, p, kv.device).attend(q, kv, 0, 0.3, **kw)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
        assert torch.equal(alone[0], out[37])


def test_a_decode_plan_from_padded_tables_is_the_spans_plan():
    """decode_plan (the persistent batch's: batching/persistent.py) from block tables padded
    wider than the sequences need: the same slots, positions and attention bits as plan()."""
    kv, g = _cache(torch.float32, seed=3)
    lens = [14, 17, 3, 1]
    blocks = [SEQ_A[:4], SEQ_B, [23], [9]]
    spans = [SeqSpan(i, 1, n, b) for i, (n, b) in enumerate(zip(lens, blocks))]
    width = 7  # wider than any sequence's blocks, padded with block 0
    tables = torch.tensor([b + [0] * (width - len(b)) for b in blocks], dtype=torch.int32)
    attn = TritonAttention()
    fast = attn.decode_plan(tables, torch.tensor(lens), P, kv.device)
    slow = attn.plan(spans, P, kv.device)
    for name in ("slot_blocks", "slot_offsets", "row_pos", "row_seq"):
        assert torch.equal(getattr(fast, name), getattr(slow, name)), name
    assert fast.decode_only and slow.decode_only
    q = _q(len(lens), torch.float32, g)
    with mended():
        a, a_lse = fast.attend(q, kv, 0, 0.3)
        b, b_lse = slow.attend(q, kv, 0, 0.3)
    assert torch.equal(a, b) and torch.equal(a_lse, b_lse)
