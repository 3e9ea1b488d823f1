"""Compiled CPU paged attention (csrc/attention): decodes and short prefill chunks in one
multi-threaded kernel that reads K/V straight from the blocks; prefill chunks longer than
LONG_PREFILL rows go through the PyTorch path, whose batched matmuls win on long runs."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from punica_x.attention.paged import PrefillSeq, SeqSpan, prefill_attention
from punica_x.ops._build import load_extension

LONG_PREFILL = 64


@dataclass(frozen=True)
class CpuAttentionPlan:
    """seqs: int32 [3, S] (row_start, num_rows, kv_len) of kernel-handled sequences,
    table_start: int32 [S + 1], block_table: int32 [sum of their blocks];
    long_prefills: sequences for the PyTorch path; slot_blocks / slot_offsets: [T] int64."""

    ext: ModuleType
    seqs: torch.Tensor
    table_start: torch.Tensor
    block_table: torch.Tensor
    long_prefills: tuple[PrefillSeq, ...]
    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor

    def write_kv(self, kv: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.ext.write_kv(
            kv, layer, k.contiguous(), v.contiguous(), self.slot_blocks, self.slot_offsets
        )

    def attend(self, q: torch.Tensor, kv: torch.Tensor, layer: int, scale: float):
        q = q.contiguous()
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], dtype=torch.float32)
        if self.seqs.shape[1]:
            self.ext.paged_attention(
                out, lse, q, kv, layer, self.seqs, self.table_start, self.block_table, scale
            )
        if self.long_prefills:
            kvl = kv[:, layer]
            for seq in self.long_prefills:
                prefill_attention(q, kvl, seq, scale, out, lse)
        return out, lse


class CpuAttention:
    name = "cpu"

    def __init__(self, isa: str | None = None) -> None:
        self.ext = load_extension("attention_cpu", isa)

    def plan(self, spans: list[SeqSpan], block_size: int, device: torch.device) -> CpuAttentionPlan:
        rows, counts, lens, starts, table = [], [], [], [0], []
        slot_blocks: list[int] = []
        slot_offsets: list[int] = []
        long = []
        for sp in spans:
            for pos in range(sp.kv_len - sp.num_rows, sp.kv_len):
                slot_blocks.append(sp.block_ids[pos // block_size])
                slot_offsets.append(pos % block_size)
            nb = -(-sp.kv_len // block_size)
            if sp.num_rows > LONG_PREFILL:
                blocks = torch.tensor(sp.block_ids[:nb], dtype=torch.int64)
                long.append(PrefillSeq(sp.row_start, sp.num_rows, sp.kv_len, blocks))
                continue
            rows.append(sp.row_start)
            counts.append(sp.num_rows)
            lens.append(sp.kv_len)
            table.extend(sp.block_ids[:nb])
            starts.append(len(table))
        i32 = torch.int32
        return CpuAttentionPlan(
            ext=self.ext,
            seqs=torch.tensor([rows, counts, lens], dtype=i32).view(3, len(rows)),
            table_start=torch.tensor(starts, dtype=i32),
            block_table=torch.tensor(table, dtype=i32),
            long_prefills=tuple(long),
            slot_blocks=torch.tensor(slot_blocks, dtype=torch.int64),
            slot_offsets=torch.tensor(slot_offsets, dtype=torch.int64),
        )
