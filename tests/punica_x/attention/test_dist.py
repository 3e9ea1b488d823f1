"""DistAttention: a batch whose requests' keys are split across a local cache and any number
of peer caches (any split, any layout, decodes and prefill chunks, rows that straddle
segments) equals dense attention over all keys; the new K/V lands where its block lives."""

from __future__ import annotations

import os
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import CPU_ISAS
from test_paged import dense_attention

from punica_x.attention import get_attention_backend
from punica_x.attention.cpu import CpuAttention
from punica_x.attention.dist import DistContext, DistSeq, merge_into, plan_dist, segment_work
from punica_x.attention.paged import SeqSpan
from punica_x.core import RemoteExtent
from punica_x.kv.blocks import KVCache, KVCacheSpec
from punica_x.kv.rmanager import LendCaps, PeerLost, RManager


class Peers:
    """A KVBorrower over in-process rManagers (no ledger: the test lends directly)."""

    def __init__(self, managers: dict[str, RManager]) -> None:
        self.managers = managers

    def peer(self, owner: str) -> RManager:
        rm = self.managers[owner]
        if not rm.alive:
            raise PeerLost(owner)
        return rm


def _backend(name: str):
    return get_attention_backend("cpu", "torch") if name == "torch" else CpuAttention(name)


def _put(kv, layer, blocks, t0, p, k, v, block_size):
    """Store position p's K/V (segment starting at t0 with `blocks`) into kv."""
    b, off = blocks[(p - t0) // block_size], (p - t0) % block_size
    kv[b, layer, 0, :, off] = k[p]
    kv[b, layer, 1, :, off] = v[p]


def _requests(rng, gen, spec, local, owners, managers, layer, one=None):
    """Random requests of one step over `local` and peers: decodes, prefill chunks after a
    cached part, a plain one; each one's KV split into a local prefix and 1-3 extents lent by
    random peers (sizes >= 0, spare blocks at the end too), its earlier K/V in place wherever
    its block lives (and in `one`, a runner holding all of it, where given). Returns (plain
    spans, DistSeqs, refs (row, n, total, k, v), new k, new v, rows, spans over `one`)."""
    block_size, d, nkv = spec.block_size, spec.head_dim, spec.num_kv_heads
    shapes = [(1, rng.randint(1, 60), rng.randint(1, 3)) for _ in range(3)]
    shapes += [(rng.randint(2, 40), rng.randint(0, 50), rng.randint(1, 3)) for _ in range(2)]
    shapes += [(rng.randint(1, 20), rng.randint(0, 30), 0)]
    rng.shuffle(shapes)
    seqs, plain, refs, new_k, new_v, one_spans, row = [], [], [], [], [], [], 0
    for i, (n, cached, parts) in enumerate(shapes):
        total = n + cached
        k = torch.randn(total, nkv, d, generator=gen).to(spec.dtype)
        v = torch.randn(total, nkv, d, generator=gen).to(spec.dtype)
        nb = -(-total // block_size) + rng.randint(0, 2)
        cuts = sorted(rng.randint(0, nb) for _ in range(parts))
        sizes = [b - a for a, b in zip([0, *cuts], [*cuts, nb])]
        local_ids = local.allocator.allocate(sizes[0])
        extents = []
        for size in sizes[1:]:
            if size == 0:
                continue
            owner = rng.choice(list(managers))
            extents.append(RemoteExtent(owner, managers[owner].lend("me", f"r{i}", size)))
        for p in range(cached):
            t0 = 0
            for owner, ids in [(None, local_ids)] + [(e.owner, e.block_ids) for e in extents]:
                if p < t0 + len(ids) * block_size:
                    cache = local if owner is None else owners[owner]
                    _put(cache.kv, layer, list(ids), t0, p, k, v, block_size)
                    break
                t0 += len(ids) * block_size
        if one is not None:
            ids = one.allocator.allocate(max(nb, 1))
            for p in range(cached):
                _put(one.kv, layer, ids, 0, p, k, v, block_size)
            one_spans.append(SeqSpan(row, n, total, ids))
        if parts == 0 or not extents:
            local_ids += local.allocator.allocate(max(0, -(-total // block_size) - len(local_ids)))
            plain.append(SeqSpan(row, n, total, local_ids))
        else:
            seqs.append(DistSeq(row, n, total, local_ids, tuple(extents), f"r{i}"))
        refs.append((row, n, total, k, v))
        new_k.append(k[cached:])
        new_v.append(v[cached:])
        row += n
    return plain, seqs, refs, torch.cat(new_k), torch.cat(new_v), row, one_spans


def _cluster(spec, impl, peers: int = 3):
    local = KVCache(spec, 600, torch.device("cpu"))
    owners = {f"peer-{i}": KVCache(spec, 600, torch.device("cpu")) for i in range(peers)}
    managers = {o: RManager(o, c, impl, LendCaps(600, 64)) for o, c in owners.items()}
    return local, owners, managers


@pytest.mark.parametrize("backend", [*CPU_ISAS, "torch"])
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("trial", range(3))
def test_dist_attention_equals_dense_attention(backend, overlap, trial):
    seed = int.from_bytes(os.urandom(4), "little")
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    block_size = rng.choice([1, 4, 16])
    hq, nkv = rng.choice([(4, 4), (9, 3), (8, 1)])
    d, layers, layer = rng.choice([32, 40, 64]), 2, 1
    spec = KVCacheSpec(layers, nkv, d, block_size, torch.float32)
    impl = _backend(backend)
    local, owners, managers = _cluster(spec, impl)
    plain, seqs, refs, new_k, new_v, row, _ = _requests(
        rng, gen, spec, local, owners, managers, layer
    )
    pool = ThreadPoolExecutor(2) if overlap else None
    ctx = DistContext("me", Peers(managers), pool, overlap)
    plan = plan_dist(impl, plain, seqs, row, block_size, torch.device("cpu"), ctx)
    q = torch.randn(row, hq, d, generator=gen)
    plan.write_kv(local.kv, layer, new_k, new_v)
    out, lse = plan.attend(q, local.kv, layer, d**-0.5)
    for r0, n, total, k, v in refs:
        rows = slice(r0, r0 + n)
        ref_out, ref_lse = dense_attention(q[rows], k, v, total - n, d**-0.5)
        msg = f"seed={seed}"
        torch.testing.assert_close(out[rows], ref_out, rtol=1e-4, atol=1e-5, msg=msg)
        torch.testing.assert_close(lse[rows], ref_lse, rtol=1e-4, atol=1e-5, msg=msg)
    for cache in (local, *owners.values()):
        assert torch.equal(cache.kv[:, 0], torch.zeros_like(cache.kv[:, 0])), "layer 0 untouched"
    if pool is not None:
        pool.shutdown()


@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("trial", range(2))
def test_chained_dist_attention_is_one_runners_bit_for_bit(isa, dtype, trial):
    """The batch-invariant mode (DistContext.fixed_order): requests whose KV lies in parts on
    several runners get the bits of one runner holding all of it (the same kernel and block
    size), out and lse, decodes and prefill chunks alike; the new K/V lands where it did."""
    seed = int.from_bytes(os.urandom(4), "little")
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    block_size = rng.choice([1, 4, 16])
    hq, nkv = rng.choice([(4, 4), (9, 3), (8, 1)])
    d, layer = rng.choice([32, 40, 64]), 1
    spec = KVCacheSpec(2, nkv, d, block_size, dtype)
    impl = CpuAttention(isa, flash=False)
    local, owners, managers = _cluster(spec, impl)
    one = KVCache(spec, 1200, torch.device("cpu"))
    plain, seqs, _, new_k, new_v, row, one_spans = _requests(
        rng, gen, spec, local, owners, managers, layer, one
    )
    ctx = DistContext("me", Peers(managers), fixed_order=True)
    plan = plan_dist(impl, plain, seqs, row, block_size, torch.device("cpu"), ctx)
    q = torch.randn(row, hq, d, generator=gen).to(dtype)
    plan.write_kv(local.kv, layer, new_k, new_v)
    out, lse = plan.attend(q, local.kv, layer, d**-0.5)
    ref = impl.plan(one_spans, block_size, torch.device("cpu"))
    ref.write_kv(one.kv, layer, new_k, new_v)
    ref_out, ref_lse = ref.attend(q, one.kv, layer, d**-0.5)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse), f"seed={seed}"
    assert ctx.stats.calls == len(plan.remote) > 0


def test_chained_dist_attention_needs_the_kernels_state():
    spec = KVCacheSpec(1, 2, 32, 4, torch.float32)
    impl = _backend("torch")
    local, owners, managers = _cluster(spec, impl, peers=1)
    ids = managers["peer-0"].lend("me", "r0", 2)
    seq = DistSeq(0, 1, 9, local.allocator.allocate(1), (RemoteExtent("peer-0", ids),), "r0")
    ctx = DistContext("me", Peers(managers), fixed_order=True)
    with pytest.raises(ValueError, match="batch-invariant DistKV needs the cpu attention"):
        plan_dist(impl, [], [seq], 1, 4, torch.device("cpu"), ctx)


def test_segment_work_splits_rows_by_position():
    # rows at positions 6..9 (kv_len 10); a segment holding positions 4..7 (2 blocks of 2)
    work = segment_work(num_rows=4, kv_len=10, t0=4, block_ids=[7, 3], block_size=2)
    assert work.first_row == 0
    # positions 6, 7 attend causally (kv 0..2, 0..3 of the segment); 8, 9 see all 4 keys
    assert [(s.row_start, s.num_rows, s.kv_len) for s in work.spans] == [
        (0, 2, 4),
        (2, 1, 4),
        (3, 1, 4),
    ]
    assert work.writes == ((0, 3, 0), (1, 3, 1))
    assert segment_work(num_rows=1, kv_len=10, t0=10, block_ids=[1], block_size=2) is None
    later = segment_work(num_rows=4, kv_len=10, t0=8, block_ids=[5], block_size=2)
    assert later.first_row == 2 and [(s.row_start, s.num_rows, s.kv_len) for s in later.spans] == [
        (0, 2, 2)
    ]


def test_a_lost_peer_raises_peer_lost():
    spec = KVCacheSpec(1, 1, 8, 4, torch.float32)
    impl = _backend("torch")
    peer = RManager("p", KVCache(spec, 4, torch.device("cpu")), impl, LendCaps(4))
    ids = peer.lend("me", "r", 1)
    seq = DistSeq(0, 1, 3, [], (RemoteExtent("p", ids),), "r")
    peer.stop()
    with pytest.raises(PeerLost):
        plan_dist(impl, [], [seq], 1, 4, torch.device("cpu"), DistContext("me", Peers({"p": peer})))


@pytest.mark.parametrize("isa", CPU_ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_merge_equals_scale_reduce(isa, dtype):
    """CpuAttention.merge_rows (one call per creditor and layer) = merge_into per row over
    random pairs, including rows with no key yet (lse = -inf) and repeated targets; and
    both equal attention over the union of the keys, in float32."""
    seed = int.from_bytes(os.urandom(4), "little")
    gen = torch.Generator().manual_seed(seed)
    t, r, h, d = 7, 5, 9, 64
    out = torch.randn(t, h, d, generator=gen).to(dtype)
    lse = torch.randn(t, h, generator=gen) * 3
    lse[2] = float("-inf")  # a row whose local part saw no key (its out is 0 by contract)
    out[2] = 0
    o = torch.randn(r, h, d, generator=gen).to(dtype)
    s = torch.randn(r, h, generator=gen) * 3
    dst = torch.tensor([0, 2, 4, 6, 0])
    src = torch.tensor([3, 1, 0, 4, 2])
    want_out, want_lse = out.float().clone(), lse.clone()
    for a, b in zip(dst.tolist(), src.tolist()):
        merge_into(want_out[a : a + 1], want_lse[a : a + 1], o[b : b + 1].float(), s[b : b + 1])
    got_out, got_lse = out.clone(), lse.clone()
    CpuAttention(isa).merge_rows(got_out, got_lse, o, s, dst, src)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got_lse, want_lse, atol=1e-5, rtol=1e-5, msg=f"seed {seed}")
    torch.testing.assert_close(got_out.float(), want_out, atol=tol, rtol=tol, msg=f"seed {seed}")
    untouched = [1, 3, 5]
    assert torch.equal(got_out[untouched], out[untouched]) and torch.equal(
        got_lse[untouched], lse[untouched]
    )
    with pytest.raises(RuntimeError, match="out of range"):
        CpuAttention(isa).merge_rows(got_out, got_lse, o, s, torch.tensor([t]), torch.tensor([0]))
