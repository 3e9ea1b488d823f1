"""The batch-invariant Triton attention's backend and per-step plan (the kernel:
attention.triton_paged, imported when the backend is made, so a missing Triton is said then).

A plan holds, per row of the step: where its new K/V goes (slot_blocks / slot_offsets, as the
torch plan's), its position (row_pos) and its sequence's row of the block tables (row_seq,
tables [S, width], padded with block 0: never read, the kernel stops at a row's position).
Plans are plain tensors, so a decode graph (engine/graph_attention.py) refills fixed copies of
them before a replay."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from punica_x.attention.paged import SeqSpan


@dataclass(frozen=True)
class TritonAttentionPlan:
    """slot_blocks / slot_offsets [T] int64; row_pos / row_seq [T] int32; tables [S, width]
    int32; decode_only: every sequence of the step has one row (a decode)."""

    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor
    row_pos: torch.Tensor
    row_seq: torch.Tensor
    tables: torch.Tensor
    decode_only: bool = False

    def write_kv(self, kv: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [T, N_kv, D] into kv [num_blocks, L, 2, N_kv, P, D] (copies: exact)."""
        kv[self.slot_blocks, layer, 0, :, self.slot_offsets] = k
        kv[self.slot_blocks, layer, 1, :, self.slot_offsets] = v

    def attend(self, q, kv, layer: int, scale: float, window: int = 0, softcap: float = 0.0):
        """q: [T, H_q, D] -> (out [T, H_q, D], lse [T, H_q] float32)."""
        from punica_x.attention.triton_paged import attend

        return attend(q, kv, layer, self, scale, window, softcap)


class TritonAttention:
    """The attention backend of the batch-invariant mode on CUDA (attention's interface)."""

    name = "triton"

    def __init__(self) -> None:
        import punica_x.attention.triton_paged  # noqa: F401 - ImportError naming Triton

    def fixed_order(self) -> TritonAttention:
        """Batch-invariant already: this backend."""
        return self

    def decode_plan(
        self, tables: torch.Tensor, kv_len: torch.Tensor, block_size: int, device: torch.device
    ) -> TritonAttentionPlan:
        """The plan of S single-row decodes (batching/persistent.py): row i is sequence i, of
        kv_len[i] tokens (int64 [S] on the host, its new token's included) in blocks
        tables[i] (int32 [S, W] on the host, padded with block 0); tensors moved to `device`.
        The same plan as plan() of their spans, its tables as wide as the persistent batch's."""
        last = kv_len - 1
        block = tables.gather(1, (last // block_size).unsqueeze(1)).squeeze(1)
        rows = torch.arange(kv_len.numel(), dtype=torch.int32)
        host = (block.to(torch.int64), last % block_size, last.to(torch.int32), rows, tables)
        return TritonAttentionPlan(*(t.to(device) for t in host), decode_only=True)

    def plan(self, spans: list[SeqSpan], block_size: int, device: torch.device):
        rows = max((sp.row_start + sp.num_rows for sp in spans), default=0)
        slot_blocks, slot_offsets = [0] * rows, [0] * rows
        row_pos, row_seq = [0] * rows, [0] * rows
        tables = []
        for i, sp in enumerate(spans):
            tables.append(sp.block_ids[: -(-sp.kv_len // block_size)])
            for j in range(sp.num_rows):
                pos = sp.kv_len - sp.num_rows + j
                r = sp.row_start + j
                slot_blocks[r], slot_offsets[r] = sp.block_ids[pos // block_size], pos % block_size
                row_pos[r], row_seq[r] = pos, i
        width = max((len(tb) for tb in tables), default=1)
        padded = [tb + [0] * (width - len(tb)) for tb in tables] or [[0]]

        def ints(xs, dtype=torch.int64):
            return torch.tensor(xs, dtype=dtype, device=device)

        return TritonAttentionPlan(
            ints(slot_blocks),
            ints(slot_offsets),
            ints(row_pos, torch.int32),
            ints(row_seq, torch.int32),
            ints(padded, torch.int32),
            decode_only=bool(spans) and all(sp.num_rows == 1 for sp in spans),
        )
