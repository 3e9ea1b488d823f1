"""Attention over the paged KV cache in pure PyTorch (any device): the reference backend.

Rows of a step belong to sequences; a sequence with one new row is a decode, with more a
prefill (or a prefill chunk): its rows are the last ``num_rows`` positions of its
``kv_len`` tokens and attend causally; with a sliding window W a row sees only its last W
keys (HF's ``sliding_window``), and soft-capping (Gemma 2) maps each scaled score s to
cap * tanh(s / cap) before the mask. Every call returns the output AND the natural-log
log-sum-exp of each row's scores, so partial results over disjoint key sets can be merged
exactly (attention.merge). GQA: query head h reads KV head h // (H_q / N_kv).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Query rows per chunk of a long prefill: bounds the [N_kv, G, rows, kv_len] score tensor.
PREFILL_CHUNK = 256


@dataclass(slots=True)
class SeqSpan:
    """A sequence's rows in the step: rows [row_start, row_start + num_rows) are its last
    num_rows tokens of kv_len; block_ids holds all of them. (Not frozen: a step makes one per
    request, and a frozen constructor costs three times as much; none is changed once made.)"""

    row_start: int
    num_rows: int
    kv_len: int
    block_ids: list[int]


@dataclass(frozen=True)
class PrefillSeq:
    row_start: int
    num_rows: int
    kv_len: int
    blocks: torch.Tensor  # [ceil(kv_len / P)] int64


@dataclass(frozen=True)
class AttentionMeta:
    """Plan of the torch backend: made once per step, read by every layer.

    slot_blocks / slot_offsets: [T] where each row's new K/V is written.
    decode_rows: [B_d] rows that are decodes; decode_blocks: [B_d, max_blocks] their block
    tables (padded with 0); decode_bias: [B_d, max_blocks * P] 0 for real keys, -inf for padding;
    decode_lens: [B_d] their kv_len.
    """

    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor
    prefills: tuple[PrefillSeq, ...]
    decode_rows: torch.Tensor
    decode_blocks: torch.Tensor
    decode_bias: torch.Tensor
    decode_lens: torch.Tensor

    @classmethod
    def plan(cls, spans: list[SeqSpan], block_size: int, device: torch.device) -> AttentionMeta:
        slot_blocks: list[int] = []
        slot_offsets: list[int] = []
        prefills: list[PrefillSeq] = []
        dec_rows: list[int] = []
        dec_tables: list[list[int]] = []
        dec_lens: list[int] = []
        for sp in sorted(spans, key=lambda s: s.row_start):
            for pos in range(sp.kv_len - sp.num_rows, sp.kv_len):
                slot_blocks.append(sp.block_ids[pos // block_size])
                slot_offsets.append(pos % block_size)
            nb = -(-sp.kv_len // block_size)
            if sp.num_rows == 1:
                dec_rows.append(sp.row_start)
                dec_tables.append(sp.block_ids[:nb])
                dec_lens.append(sp.kv_len)
            else:
                blocks = torch.tensor(sp.block_ids[:nb], dtype=torch.int64, device=device)
                prefills.append(PrefillSeq(sp.row_start, sp.num_rows, sp.kv_len, blocks))
        width = max((len(t) for t in dec_tables), default=0)
        tables = [t + [0] * (width - len(t)) for t in dec_tables]
        keys = torch.arange(width * block_size, device=device)
        lens = torch.tensor(dec_lens, dtype=torch.int64, device=device)
        bias = torch.zeros(len(dec_lens), width * block_size, device=device)
        bias.masked_fill_(keys[None, :] >= lens[:, None], float("-inf"))

        def ints(xs):
            return torch.tensor(xs, dtype=torch.int64, device=device)

        return cls(
            slot_blocks=ints(slot_blocks),
            slot_offsets=ints(slot_offsets),
            prefills=tuple(prefills),
            decode_rows=ints(dec_rows),
            decode_blocks=ints(tables).view(len(tables), width),
            decode_bias=bias,
            decode_lens=lens,
        )

    def write_kv(self, kv: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        write_kv(kv, layer, k, v, self)

    def attend(self, q, kv, layer: int, scale: float, window: int = 0, softcap: float = 0.0):
        return paged_attention(q, kv, layer, self, scale, window, softcap)


class TorchAttention:
    """The pure-PyTorch backend (reference; any device)."""

    name = "torch"

    def plan(self, spans: list[SeqSpan], block_size: int, device: torch.device) -> AttentionMeta:
        return AttentionMeta.plan(spans, block_size, device)


def write_kv(
    kv: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta
) -> None:
    """Store the step's K/V rows. kv: [num_blocks, L, 2, N_kv, P, D]; k, v: [T, N_kv, D]."""
    kv[meta.slot_blocks, layer, 0, :, meta.slot_offsets] = k
    kv[meta.slot_blocks, layer, 1, :, meta.slot_offsets] = v


def paged_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    layer: int,
    meta: AttentionMeta,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, H_q, D] -> (out [T, H_q, D], lse [T, H_q] float32). K/V of the step's rows
    must already be written (write_kv). window: each row sees its last `window` keys (0:
    all); softcap: scores capped to softcap * tanh(s / softcap) (0: none)."""
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    kvl = kv[:, layer]  # [num_blocks, 2, N_kv, P, D]
    for seq in meta.prefills:
        prefill_attention(q, kvl, seq, scale, out, lse, window, softcap)
    if meta.decode_rows.numel():
        o, s = _decode(q[meta.decode_rows], kvl, meta, scale, window, softcap)
        out[meta.decode_rows] = o
        lse[meta.decode_rows] = s
    return out, lse


def _gqa(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[rows, H_q, D] -> [rows, N_kv, G, D]."""
    rows, hq, d = q.shape
    return q.view(rows, num_kv_heads, hq // num_kv_heads, d)


def _capped(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    return torch.tanh(scores / softcap) * softcap if softcap else scores


def _decode(q, kvl, meta: AttentionMeta, scale: float, window: int = 0, softcap: float = 0.0):
    bd, hq, d = q.shape
    kv = kvl[meta.decode_blocks]  # [B_d, nb, 2, N_kv, P, D]
    nkv, p = kv.shape[3], kv.shape[4]
    k, v = kv[:, :, 0], kv[:, :, 1]  # [B_d, nb, N_kv, P, D]
    qg = _gqa(q, nkv).float()
    scores = torch.einsum("bngd,bjnpd->bngjp", qg, k.float()).flatten(3) * scale
    scores = _capped(scores, softcap) + meta.decode_bias[:, None, None, :]
    if window:  # the row (position kv_len - 1) sees keys > kv_len - 1 - window
        keys = torch.arange(scores.shape[-1], device=q.device)
        old = keys[None, :] <= (meta.decode_lens - 1 - window)[:, None]  # [B_d, keys]
        scores = scores.masked_fill(old[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B_d, N_kv, G]
    probs = torch.exp(scores - lse.unsqueeze(-1)).view(bd, nkv, hq // nkv, -1, p)
    out = torch.einsum("bngjp,bjnpd->bngd", probs, v.float())
    return out.reshape(bd, hq, d).to(q.dtype), lse.reshape(bd, hq)


def prefill_attention(
    q, kvl, seq: PrefillSeq, scale: float, out, lse, window: int = 0, softcap: float = 0.0
) -> None:
    """Causal attention of one sequence's rows (written into out / lse); kvl = kv[:, layer];
    window, softcap: as paged_attention's."""
    kv = kvl[seq.blocks]  # [nb, 2, N_kv, P, D]
    nb, _, nkv, p, d = kv.shape
    k = kv[:, 0].transpose(0, 1).reshape(nkv, nb * p, d)[:, : seq.kv_len].float()
    v = kv[:, 1].transpose(0, 1).reshape(nkv, nb * p, d)[:, : seq.kv_len].float()
    first_pos = seq.kv_len - seq.num_rows
    keys = torch.arange(seq.kv_len, device=q.device)
    for c0 in range(0, seq.num_rows, PREFILL_CHUNK):
        rows = min(PREFILL_CHUNK, seq.num_rows - c0)
        r0 = seq.row_start + c0
        qg = _gqa(q[r0 : r0 + rows], nkv).float().permute(1, 2, 0, 3)  # [N_kv, G, rows, D]
        scores = (qg @ k.transpose(1, 2).unsqueeze(1)) * scale  # [N_kv, G, rows, kv_len]
        pos = torch.arange(first_pos + c0, first_pos + c0 + rows, device=q.device)
        hidden = keys[None, :] > pos[:, None]
        if window:
            hidden |= keys[None, :] <= pos[:, None] - window
        scores = _capped(scores, softcap).masked_fill(hidden, float("-inf"))
        s = torch.logsumexp(scores, dim=-1)  # [N_kv, G, rows]
        o = torch.exp(scores - s.unsqueeze(-1)) @ v.unsqueeze(1)  # [N_kv, G, rows, D]
        out[r0 : r0 + rows] = o.permute(2, 0, 1, 3).reshape(rows, -1, d).to(q.dtype)
        lse[r0 : r0 + rows] = s.permute(2, 0, 1).reshape(rows, -1)
