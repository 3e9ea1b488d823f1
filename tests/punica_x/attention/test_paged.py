"""Paged attention (out + log-sum-exp) against dense attention, and the ScaleReduce merge."""

from __future__ import annotations

import os
import random

import pytest
import torch
from helpers import CPU_ISAS

from punica_x.attention import cpu as cpu_attention
from punica_x.attention import get_attention_backend
from punica_x.attention.cpu import LONG_PREFILL, CpuAttention
from punica_x.attention.merge import merge_attention, merge_many
from punica_x.attention.paged import SeqSpan


def dense_attention(q, k, v, first_pos, scale, window=0, softcap=0.0):
    """q: [n, Hq, D] at positions first_pos..; k, v: [S, Nkv, D] -> (out, lse). window: a
    row sees its last `window` keys (0: all); softcap: scores -> softcap * tanh(s / softcap)."""
    n, hq, _ = q.shape
    g = hq // k.shape[1]
    k = k.repeat_interleave(g, dim=1)
    v = v.repeat_interleave(g, dim=1)
    scores = torch.einsum("nhd,shd->hns", q, k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    pos = torch.arange(first_pos, first_pos + n)[:, None]
    keys = torch.arange(k.shape[0])[None, :]
    hidden = (keys > pos) | ((keys <= pos - window) if window else torch.zeros_like(keys > pos))
    scores = scores.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("hns,shd->nhd", torch.softmax(scores, dim=-1), v)
    return out, lse.t()


@pytest.fixture(params=["kernel", "flash"])
def long_prefill_path(request, monkeypatch):
    """Which CPU path takes the chunks of more than LONG_PREFILL rows (flash attention only
    runs large ones by default: FLASH_MIN_WORK 0 hands it every such chunk)."""
    monkeypatch.setattr(cpu_attention, "FLASH_MIN_WORK", 0 if request.param == "flash" else 1e18)
    return request.param


@pytest.mark.parametrize("backend", [*CPU_ISAS, "torch"])  # the compiled kernel per ISA, torch
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 1)])
@pytest.mark.parametrize("d", [32, 64, 40])
def test_paged_attention_matches_dense(backend, block_size, heads, d, long_prefill_path):
    check_against_dense(backend, block_size, heads, d)


@pytest.mark.parametrize("backend", [*CPU_ISAS, "torch"])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", [(7, 0.0), (0, 2.0), (24, 3.5), (1, 0.0)])
def test_sliding_window_and_softcap_match_dense(
    backend, block_size, dtype, window, softcap, long_prefill_path
):
    """Rows far past the window (the sequences are up to ~190 tokens) see only their last
    `window` keys, in decodes, chunks after a cached part and long chunks alike; capped
    scores (Gemma 2); bfloat16 caches within bf16's rounding."""
    check_against_dense(backend, block_size, (9, 3), 64, window, softcap, dtype)


def check_against_dense(backend, block_size, heads, d, window=0, softcap=0.0, dtype=torch.float32):
    seed = int.from_bytes(os.urandom(4), "little")
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    hq, nkv = heads
    layers, num_blocks = 2, 1000
    kv = torch.zeros(num_blocks, layers, 2, nkv, block_size, d, dtype=dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    # (new rows, context already cached): decodes, a fresh prefill, a chunk after a cached part,
    # and fresh and later chunks of more than LONG_PREFILL rows (the flash path's when
    # long_prefill_path says so)
    long = LONG_PREFILL + 1
    shapes = [(1, rng.randint(0, 40)) for _ in range(4)] + [
        (rng.randint(2, 30), 0),
        (rng.randint(2, 30), rng.randint(1, 50)),
        (rng.randint(long, long + 60), 0),
        (rng.randint(long, long + 40), rng.randint(1, 90)),
    ]
    rng.shuffle(shapes)
    spans, ks, vs, row = [], [], [], 0
    layer = 1
    for n, cached in shapes:
        total = n + cached
        blocks = [free.pop() for _ in range(-(-total // block_size))]
        k = torch.randn(total, nkv, d, generator=gen).to(dtype)
        v = torch.randn(total, nkv, d, generator=gen).to(dtype)
        for pos in range(cached):  # earlier steps' K/V already in the cache
            kv[blocks[pos // block_size], layer, 0, :, pos % block_size] = k[pos]
            kv[blocks[pos // block_size], layer, 1, :, pos % block_size] = v[pos]
        spans.append(SeqSpan(row, n, total, blocks))
        ks.append(k)
        vs.append(v)
        row += n
    impl = get_attention_backend("cpu", "torch") if backend == "torch" else CpuAttention(backend)
    plan = impl.plan(spans, block_size, torch.device("cpu"))
    q = torch.randn(row, hq, d, generator=gen).to(dtype)
    new_k = torch.cat([k[sp.kv_len - sp.num_rows :] for k, sp in zip(ks, spans)])
    new_v = torch.cat([v[sp.kv_len - sp.num_rows :] for v, sp in zip(vs, spans)])
    plan.write_kv(kv, layer, new_k, new_v)
    out, lse = plan.attend(q, kv, layer, d**-0.5, window, softcap)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for sp, k, v in zip(spans, ks, vs):
        rows = slice(sp.row_start, sp.row_start + sp.num_rows)
        first = sp.kv_len - sp.num_rows
        ref_out, ref_lse = dense_attention(
            q[rows].float(), k.float(), v.float(), first, d**-0.5, window, softcap
        )
        msg = f"seed={seed}"
        torch.testing.assert_close(out[rows].float(), ref_out, **tol, msg=msg)
        torch.testing.assert_close(lse[rows], ref_lse, **tol, msg=msg)
    assert torch.equal(kv[:, 0], torch.zeros_like(kv[:, 0])), "only the given layer is written"


def test_merge_of_partials_is_exact():
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    n, h, s, d = 5, 6, 70, 16
    q = torch.randn(n, h, d, generator=gen)
    k = torch.randn(s, h, d, generator=gen)
    v = torch.randn(s, h, d, generator=gen)
    full_out, full_lse = dense_attention(q, k, v, first_pos=s, scale=0.3)
    cuts = sorted(torch.randperm(s - 1, generator=gen)[:3].add(1).tolist())
    parts = []
    for lo, hi in zip([0, *cuts], [*cuts, s]):
        parts.append(dense_attention(q, k[lo:hi], v[lo:hi], first_pos=s, scale=0.3))
    out, lse = merge_many(parts)
    torch.testing.assert_close(out, full_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, full_lse, rtol=1e-5, atol=1e-6)


def test_merge_with_an_empty_part():
    out = torch.randn(3, 2, 4)
    lse = torch.randn(3, 2)
    empty_out, empty_lse = torch.zeros(3, 2, 4), torch.full((3, 2), float("-inf"))
    m_out, m_lse = merge_attention(out, lse, empty_out, empty_lse)
    torch.testing.assert_close(m_out, out)
    torch.testing.assert_close(m_lse, lse)
    both_out, both_lse = merge_attention(empty_out, empty_lse, empty_out, empty_lse)
    assert torch.equal(both_out, empty_out) and torch.isinf(both_lse).all()


def test_cpu_kernel_checks_inputs():
    ext = CpuAttention().ext
    kv = torch.zeros(4, 2, 2, 2, 4, 8)
    q = torch.zeros(3, 4, 8)
    out, lse = torch.empty_like(q), torch.empty(3, 4)
    seqs = torch.tensor([[0], [3], [3]], dtype=torch.int32)
    starts = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="block id 9 out of range"):
        ext.paged_attention(
            out, lse, q, kv, 0, seqs, starts, torch.tensor([9], dtype=torch.int32), 1.0, 0, 0.0
        )
    with pytest.raises(RuntimeError, match="layer 2 out of range"):
        ext.paged_attention(
            out, lse, q, kv, 2, seqs, starts, torch.tensor([0], dtype=torch.int32), 1.0, 0, 0.0
        )
    with pytest.raises(RuntimeError, match="too few blocks"):
        long = torch.tensor([[0], [3], [6]], dtype=torch.int32)
        ext.paged_attention(
            out, lse, q, kv, 0, long, starts, torch.tensor([0], dtype=torch.int32), 1.0, 0, 0.0
        )
    table = torch.tensor([0], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="q must be"):
        ext.paged_attention(out, lse, q[..., :4], kv, 0, seqs, starts, table, 1.0, 0, 0.0)
    for window, softcap, what in [
        (-1, 0.0, "window"),
        (2**31, 0.0, "window"),
        (0, -1.0, "softcap"),
        (0, float("nan"), "softcap"),
        (0, float("inf"), "softcap"),
    ]:
        with pytest.raises(RuntimeError, match=what):
            ext.paged_attention(out, lse, q, kv, 0, seqs, starts, table, 1.0, window, softcap)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flashinfer_matches_torch_backend(dtype):
    pytest.importorskip("flashinfer", reason="needs the [gpu] extra (flashinfer-python)")
    from punica_x.attention.flashinfer_backend import FlashInferAttention

    dev = torch.device("cuda")
    hq, nkv, d, p, layers = 8, 2, 64, 16, 2
    kv = torch.randn(64, layers, 2, nkv, p, d, device=dev, dtype=dtype)
    spans = [SeqSpan(0, 1, 40, [3, 9, 1]), SeqSpan(1, 20, 33, [4, 5, 6]), SeqSpan(21, 1, 7, [8])]
    q = torch.randn(22, hq, d, device=dev, dtype=dtype)
    fi = FlashInferAttention().configure(hq, nkv, d, dtype)
    out, lse = fi.plan(spans, p, dev).attend(q, kv, 1, d**-0.5)
    ref_out, ref_lse = (
        get_attention_backend(dev, "torch").plan(spans, p, dev).attend(q, kv, 1, d**-0.5)
    )
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse, ref_lse, rtol=2e-2, atol=2e-2)
    plan = fi.plan(spans, p, dev)  # per layer: a window, soft-capping, both, neither
    ref = get_attention_backend(dev, "torch").plan(spans, p, dev)
    for window, softcap in [(5, 0.0), (0, 2.0), (9, 3.0), (0, 0.0)]:
        out, lse = plan.attend(q, kv, 1, d**-0.5, window, softcap)
        ref_out, ref_lse = ref.attend(q, kv, 1, d**-0.5, window, softcap)
        torch.testing.assert_close(out.float(), ref_out.float(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(lse, ref_lse, rtol=2e-2, atol=2e-2)


def test_cuda_default_is_flashinfer_only_where_it_has_a_kernel(monkeypatch, caplog):
    import importlib.util

    from punica_x.attention import _default

    cuda = torch.device("cuda")
    real = importlib.util.find_spec
    # not installed (a lent GPU machine without the [gpu] extra): torch, with a warning
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "flashinfer" else real(n, *a)
    )
    assert _default(cuda, torch.bfloat16, 64) == "torch"
    assert "FlashInfer is not installed" in caplog.text
    # installed
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: object() if n == "flashinfer" else real(n, *a)
    )
    assert _default(cuda, torch.bfloat16, 64) == "flashinfer"
    assert _default(cuda, torch.float16, 128) == "flashinfer"
    assert _default(cuda, torch.bfloat16, 16) == "torch"  # no FlashInfer kernel for 16
    assert _default(cuda, torch.float32, 64) == "torch"
    assert _default(torch.device("cpu"), torch.float32, 64) == "cpu"


def test_flashinfer_refuses_what_it_cannot_run():
    from punica_x.attention.flashinfer_backend import FlashInferAttention

    fi = object.__new__(FlashInferAttention)  # no flashinfer import needed to check the refusal
    with pytest.raises(ValueError, match="head_dim 16"):
        fi.configure(4, 2, 16, torch.bfloat16)
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        fi.configure(4, 2, 64, torch.float32)
