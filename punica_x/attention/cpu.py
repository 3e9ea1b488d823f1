"""Compiled CPU paged attention (csrc/attention): decodes and prefill chunks in one
multi-threaded kernel that reads K/V straight from the blocks, except chunks of more than
LONG_PREFILL rows whose rows x keys exceed FLASH_MIN_WORK, which go through PyTorch's fused
CPU flash attention (its tiles win on large ones).

Measured on an AMD EPYC Zen 4, 2 cores, bf16, SmolLM2 heads (9 q / 3 kv, D 64), one layer,
medians of 5 interleaved runs, kernel / flash (the reference's batched matmuls, which chunks
over 64 rows used before, in brackets): 128 rows x 128 keys 0.39 / 0.39 (1.22) ms; 128 x 1024
5.2 / 4.6 (8.8, flash ranging 3.2-6.4); 512 x 512 6.4 / 7.0; 1024 x 1024 23.8 / 20.5;
2048 x 2048 84 / 46 (323) ms. Between them they are within noise, so the kernel keeps what
it does as fast, flash takes the large chunks.

Batch-invariant mode (ModelConfig.batch_invariant; CpuAttention(flash=False)): every chunk
runs through the kernel, whose sums over the keys of a (row, head) go block by block from
position 0 in one order whatever the chunk's size, so a row's output is the same bits as a
prompt, a chunk of one or a decode row (flash attention tiles a long chunk's keys by its
size: a cached prefix, a chunked or a recomputed prompt then changes the bits).

A layer with a sliding window or logit soft-capping (Mistral, Qwen2's and Gemma's local
layers; Gemma 2) runs every sequence through the kernel: it skips the blocks before a tile's
window (cost ~ rows x window, where flash with a mask would pay rows x kv_len), and flash has
no soft-capping."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from punica_x.attention.paged import PrefillSeq, SeqSpan
from punica_x.host_ints import int32, int64
from punica_x.ops._build import load_extension

LONG_PREFILL = 64
FLASH_MIN_WORK = 1024 * 768  # rows x keys of a chunk above which flash attention runs it


@dataclass(frozen=True)
class KernelSeqs:
    """The kernel's view of some sequences: seqs int32 [3, S] (row_start, num_rows, kv_len),
    table_start int32 [S + 1], block_table int32 [sum of their blocks]."""

    seqs: torch.Tensor
    table_start: torch.Tensor
    block_table: torch.Tensor

    def args(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(seqs, table_start, block_table), as the kernel's calls take them."""
        return self.seqs, self.table_start, self.block_table

    @classmethod
    def of(cls, spans: list[SeqSpan], block_size: int) -> KernelSeqs:
        starts, table = [0], []
        for sp in spans:
            table.extend(sp.block_ids[: -(-sp.kv_len // block_size)])
            starts.append(len(table))
        cols = [sp.row_start for sp in spans] + [sp.num_rows for sp in spans]
        cols += [sp.kv_len for sp in spans]
        return cls(
            seqs=int32(cols).view(3, len(spans)),
            table_start=int32(starts),
            block_table=int32(table),
        )


@dataclass(frozen=True)
class CpuAttentionPlan:
    """short: the kernel's sequences; long_prefills: sequences for flash attention,
    long_masks: each one's additive causal mask [rows, kv_len] float32 (None for a first
    chunk: is_causal), built once per step; every: all sequences for the kernel (layers with
    a window or soft-capping), or None when there are no long prefills (short has them all);
    slot_blocks / slot_offsets: [T] int64."""

    ext: ModuleType
    short: KernelSeqs
    long_prefills: tuple[PrefillSeq, ...]
    long_masks: tuple[torch.Tensor | None, ...]
    every: KernelSeqs | None
    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor

    @property
    def fuses_rope(self) -> bool:
        """Whether rope_write_attend() can run this step's layers (no long prefill chunks)."""
        return not self.long_prefills

    def rope_write_attend(
        self, qkv, kv, layer: int, heads: int, positions, cos, sin, scale, window=0, softcap=0.0
    ) -> torch.Tensor:
        """A layer's attention from its fused projection output qkv [T, (H_q + 2 N_kv) D] in
        one native call: q's and k's heads rotated in place by the RoPE tables cos/sin
        [max_pos, D] at positions [T] (the cpu fused backend's rope_, bit for bit), then
        write_kv(k, v) and attend(q). Returns out [T, H_q * D]. Only where fuses_rope."""
        rope, slots = (positions, cos, sin), (self.slot_blocks, self.slot_offsets)
        attention = (*self.short.args(), scale, window, softcap)
        out, _ = self.ext.rope_write_attend(qkv, heads, *rope, kv, layer, *slots, *attention)
        return out

    def write_kv(self, kv: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.ext.write_kv(
            kv, layer, k.contiguous(), v.contiguous(), self.slot_blocks, self.slot_offsets
        )

    def attend(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        layer: int,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ):
        """q [T, H_q, D] -> (out [T, H_q, D], lse [T, H_q] float32); window: each row sees
        its last `window` keys (0: all); softcap: scores capped to softcap * tanh(s / softcap)
        (0: none)."""
        q = q.contiguous()
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], dtype=torch.float32)
        plain = not window and not softcap
        ks = self.short if plain or self.every is None else self.every
        if ks.seqs.shape[1]:
            self.ext.paged_attention(out, lse, q, kv, layer, *ks.args(), scale, window, softcap)
        if self.long_prefills and plain:
            kvl = kv[:, layer]
            for seq, mask in zip(self.long_prefills, self.long_masks):
                flash_prefill(q, kvl, seq, scale, out, lse, mask)
        return out, lse

    def attend_state(self, q: torch.Tensor, kv: torch.Tensor, layer: int, scale: float, state):
        """The kernel over every sequence (never flash), going on from `state` float32
        [T, H_q, D + 2] (each (row, head)'s online softmax: acc [D], max, sum; empty_state) and
        leaving it there: a request's keys attended part after part, in key order, give the
        bits of one attend() over all of them (finish_state). DistKV's chain (attention.dist)."""
        ks = self.every if self.every is not None else self.short
        if ks.seqs.shape[1]:
            self.ext.paged_attention_state(
                state, q.contiguous(), kv, layer, *ks.args(), scale, 0, 0.0
            )
        return state


def causal_mask(seq: PrefillSeq) -> torch.Tensor | None:
    """The additive mask of a chunk after a cached part (row i sees keys up to first + i:
    causal aligned bottom-right), [rows, kv_len] float32; None for a first chunk."""
    first = seq.kv_len - seq.num_rows
    if first == 0:
        return None
    keys = torch.arange(seq.kv_len)
    pos = torch.arange(first, seq.kv_len)
    mask = torch.zeros(seq.num_rows, seq.kv_len)
    return mask.masked_fill_(keys[None, :] > pos[:, None], float("-inf"))


def flash_prefill(q, kvl, seq: PrefillSeq, scale: float, out, lse, mask=None) -> None:
    """Causal attention of one prefill chunk (its rows are the last num_rows of kv_len keys),
    written into out [T, H_q, D] / lse [T, H_q] float32 at seq.row_start, by PyTorch's fused
    CPU flash attention (aten._scaled_dot_product_flash_attention_for_cpu, which returns the
    log-sum-exp too). kvl = kv[:, layer]; mask: causal_mask(seq) (None: a first chunk).
    GQA by repeating each K/V head for its group.
    Computed in float32 whatever the cache's dtype (bf16 flash would round the probabilities
    to bf16 before P @ V, ~1e-3 off; in float32 the output is rounded once, like the kernel),
    at about the same speed on CPU."""
    kv = kvl[seq.blocks]  # [nb, 2, N_kv, P, D]
    nb, _, nkv, p, d = kv.shape
    group = q.shape[1] // nkv
    k = kv[:, 0].transpose(0, 1).reshape(nkv, nb * p, d)[:, : seq.kv_len]
    v = kv[:, 1].transpose(0, 1).reshape(nkv, nb * p, d)[:, : seq.kv_len]
    k = k.float().repeat_interleave(group, 0).unsqueeze(0)  # [1, H_q, kv_len, D]
    v = v.float().repeat_interleave(group, 0).unsqueeze(0)
    r0, rows = seq.row_start, seq.num_rows
    qh = q[r0 : r0 + rows].float().transpose(0, 1).unsqueeze(0)  # [1, H_q, rows, D]
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    if mask is None:
        o, s = flash(qh, k, v, is_causal=True, scale=scale)[:2]
    else:
        o, s = flash(qh, k, v, attn_mask=mask, scale=scale)[:2]
    out[r0 : r0 + rows] = o[0].transpose(0, 1)
    lse[r0 : r0 + rows] = s[0].transpose(0, 1)


class CpuAttention:
    name = "cpu"

    def __init__(self, isa: str | None = None, flash: bool = True) -> None:
        """flash: large chunks through PyTorch's flash attention (False: every chunk through
        the kernel, the batch-invariant mode)."""
        self.ext = load_extension("attention_cpu", isa)
        self.isa, self.flash = isa, flash
        self._consts: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def fixed_order(self) -> CpuAttention:
        """This backend in batch-invariant mode (no flash attention)."""
        return CpuAttention(self.isa, flash=False)

    def finish_state(self, state: torch.Tensor, dtype: torch.dtype):
        """(out [T, H, D] of `dtype`, lse [T, H] float32) of online-softmax states [T, H, D + 2]
        (CpuAttentionPlan.attend_state), bit for bit as the kernel finishes its own."""
        out = torch.empty(state.shape[0], state.shape[1], state.shape[2] - 2, dtype=dtype)
        lse = torch.empty(state.shape[:2], dtype=torch.float32)
        self.ext.finish_state(out, lse, state)
        return out, lse

    def merge_rows(self, out, lse, o, s, dst: torch.Tensor, src: torch.Tensor) -> None:
        """In place: row dst[i] of (out [T, H, D], lse [T, H] float32) absorbs row src[i] of
        (o, s), the same query's attention over other keys (exact ScaleReduce, one call)."""
        self.ext.merge_rows(out, lse, o, s, dst, src)

    def decode_plan(
        self, tables: torch.Tensor, kv_len: torch.Tensor, block_size: int, device: torch.device
    ) -> CpuAttentionPlan:
        """The plan of S single-row decodes (batching/persistent.py): row i is sequence i, of
        kv_len[i] tokens (int64 [S], its new token's included) in blocks tables[i] (int32
        [S, W], padded with block 0: the kernel reads a sequence's first ceil(kv_len / P)).
        The same plan as plan() of their spans, the block table padded."""
        s, width = tables.shape
        last = kv_len - 1
        seqs, table_start = self._decode_consts(s, width)
        seqs[2] = kv_len
        block = tables.gather(1, (last // block_size).unsqueeze_(1)).squeeze_(1)
        return CpuAttentionPlan(
            ext=self.ext,
            short=KernelSeqs(seqs, table_start, tables.view(-1)),
            long_prefills=(),
            long_masks=(),
            every=None,
            slot_blocks=block.to(torch.int64),
            slot_offsets=last.remainder_(block_size),
        )

    def _decode_consts(self, s: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For S decodes of tables W wide: a fresh seqs int32 [3, S] (rows 0..S-1, one row
        each, kv_len to fill) and the table starts int32 [S + 1] (0, W, 2W, ...: read only)."""
        key = (s, width)
        kept = self._consts.get(key)
        if kept is None:
            if len(self._consts) > 64:
                self._consts.clear()
            i32 = torch.int32
            rows = torch.stack([torch.arange(s), torch.ones(s, dtype=torch.int64)]).to(i32)
            starts = torch.arange(0, (s + 1) * width, width, dtype=i32)
            kept = self._consts[key] = (torch.cat([rows, rows[:1]]), starts)
        return kept[0].clone(), kept[1]

    def plan(self, spans: list[SeqSpan], block_size: int, device: torch.device) -> CpuAttentionPlan:
        slot_blocks: list[int] = []
        slot_offsets: list[int] = []
        short, long = [], []
        for sp in spans:
            for pos in range(sp.kv_len - sp.num_rows, sp.kv_len):
                slot_blocks.append(sp.block_ids[pos // block_size])
                slot_offsets.append(pos % block_size)
            flash = sp.num_rows > LONG_PREFILL and sp.num_rows * sp.kv_len > FLASH_MIN_WORK
            if flash and self.flash:
                nb = -(-sp.kv_len // block_size)
                blocks = torch.tensor(sp.block_ids[:nb], dtype=torch.int64)
                long.append(PrefillSeq(sp.row_start, sp.num_rows, sp.kv_len, blocks))
            else:
                short.append(sp)
        return CpuAttentionPlan(
            ext=self.ext,
            short=KernelSeqs.of(short, block_size),
            long_prefills=tuple(long),
            long_masks=tuple(causal_mask(seq) for seq in long),
            every=KernelSeqs.of(spans, block_size) if long else None,
            slot_blocks=int64(slot_blocks),
            slot_offsets=int64(slot_offsets),
        )


def empty_state(rows: int, heads: int, dim: int) -> torch.Tensor:
    """Online-softmax states [rows, heads, dim + 2] float32 that have seen no key yet (acc 0,
    max -inf, sum 0): where CpuAttentionPlan.attend_state's chain begins."""
    state = torch.zeros(rows, heads, dim + 2)
    state[..., dim] = float("-inf")
    return state
