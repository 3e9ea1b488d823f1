"""The batch-invariant paged attention on CUDA, in Triton (ops.invariance): one kernel for a
decode row, a prompt chunk and a whole prompt, a row's keys always in the same tiles.

Each program is one query row and one KV head (its G = H_q / N_kv query heads together): it
walks the row's visible keys 16 at a time (a KV-cache block's P keys where P < 16), in
position order from the tile of the first visible key, tiles aligned to positions, with an
online softmax in float32 (scores and P @ V as float32
sums of a fixed shape). Nothing of it depends on the other rows of the step: not how many
there are, not whether they are the same prompt's (a chunk, a whole prompt and a decode row
compute a position's output alike), not the block table's padded width (the torch
backend's decode reduces over it; FlashInfer splits the KV by the batch). The backend and
its per-step plan: attention.triton_plan.

Semantics as the torch reference (attention.paged): causal rows, a sliding window of W keys
(HF's sliding_window), Gemma 2's soft-capping before the mask, and the natural-log
log-sum-exp of each row's scores returned beside the output. kv: [num_blocks, L, 2, N_kv,
P, D]; P a power of two (the cache's block size).
"""

from __future__ import annotations

import torch

from punica_x.ops.triton_env import tl, triton

NUM_WARPS = 4
KEY_TILE = 16  # keys a step of the walk takes (fewer for a smaller cache block)


# one compiled kernel for every step, layer and window (no variants by their divisibility)
@triton.jit(do_not_specialize=["table_width", "layer_off", "window"])
def _attend_kernel(
    q,
    kv,
    out,
    lse,
    row_pos,
    row_seq,
    tables,
    table_width,
    layer_off,
    s_blk,
    s_kv,
    s_head,
    s_pos,
    scale,
    softcap,
    window,
    hq,
    G: tl.constexpr,
    D: tl.constexpr,
    P: tl.constexpr,
    KT: tl.constexpr,
    BG: tl.constexpr,
    BD: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """q: [T, hq, D] contiguous; out likewise; lse: [T, hq] float32; row_pos / row_seq: [T]
    int32 (a row's position, its sequence's row of `tables` [S, table_width] int32)."""
    t, head = tl.program_id(0), tl.program_id(1)
    pos, seq = tl.load(row_pos + t), tl.load(row_seq + t).to(tl.int64)
    g, d = tl.arange(0, BG), tl.arange(0, BD)
    heads = head * G + g
    q_at = t.to(tl.int64) * hq * D + heads[:, None] * D + d[None, :]
    q_keep = (g[:, None] < G) & (d[None, :] < D)
    qv = tl.load(q + q_at, q_keep, 0.0).to(tl.float32)
    start = tl.where(window > 0, tl.maximum(pos - window + 1, 0), 0)
    m, denom = tl.full((BG,), float("-inf"), tl.float32), tl.zeros((BG,), tl.float32)
    acc, offs = tl.zeros((BG, BD), tl.float32), tl.arange(0, KT)
    for tile in range(start // KT, pos // KT + 1):  # KT keys at a time, KT dividing P
        first = tile * KT
        blk = tl.load(tables + seq * table_width + first // P).to(tl.int64)
        base = kv + layer_off + blk * s_blk + head * s_head
        kv_at = ((first % P) + offs)[:, None] * s_pos + d[None, :]
        kt = tl.load(base + kv_at, d[None, :] < D, 0.0).to(tl.float32)  # [KT, BD]
        vt = tl.load(base + s_kv + kv_at, d[None, :] < D, 0.0).to(tl.float32)
        s = tl.sum(qv[:, None, :] * kt[None, :, :], axis=2) * scale  # [BG, KT]
        if SOFTCAP:
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)
        keys = first + offs
        s = tl.where(((keys <= pos) & (keys >= start))[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * vt[None, :, :], axis=1)
        m = m_new
    o = acc / denom[:, None]
    tl.store(out + q_at, o.to(out.dtype.element_ty), q_keep)
    tl.store(lse + t.to(tl.int64) * hq + heads, m + tl.log(denom), g < G)


def attend(q, kv, layer, plan, scale, window=0, softcap=0.0):
    """q: [T, H_q, D] -> (out [T, H_q, D], lse [T, H_q] float32) over `plan`'s rows
    (attention.triton_plan.TritonAttentionPlan)."""
    t, hq, d = q.shape
    nkv, p = kv.shape[3], kv.shape[4]
    if kv.stride(5) != 1 or p & (p - 1):
        raise ValueError(
            f"the triton attention needs a contiguous head dim and a power-of-two "
            f"block size, got strides {kv.stride()} and P={p}"
        )
    q = q.contiguous()
    out = torch.empty_like(q)
    lse = torch.empty(t, hq, dtype=torch.float32, device=q.device)
    if t == 0:
        return out, lse
    group = hq // nkv
    _attend_kernel[(t, nkv)](
        q, kv, out, lse, plan.row_pos, plan.row_seq, plan.tables, plan.tables.shape[1],
        layer * kv.stride(1), kv.stride(0), kv.stride(2), kv.stride(3), kv.stride(4),
        float(scale), float(softcap or 1.0), int(window), hq,
        G=group, D=d, P=p, KT=min(p, KEY_TILE), BG=max(2, triton.next_power_of_2(group)),
        BD=triton.next_power_of_2(d), SOFTCAP=bool(softcap), num_warps=NUM_WARPS,
    )  # fmt: skip
    return out, lse
