"""The attention plan a decode graph reads (engine/cuda_graphs.py): fixed buffers for B rows
and a block-table width of W blocks, captured once, refilled from each step's own plan before
a replay. One kind per attention backend the graphs cover:
* "torch" (attention.paged.AttentionMeta): the decode rows' padded block tables, their
  lengths and the -inf bias past each length (made inside the captured forward);
* "triton", the batch-invariant one (attention.triton_plan.TritonAttentionPlan): each row's
  position and its own block table (row r reads table r).
Rows past the step's T repeat row T - 1 (same position, slot and table: the K/V they write is
that row's own and their outputs are never read)."""

from __future__ import annotations

import torch

from punica_x.attention.paged import AttentionMeta
from punica_x.attention.triton_plan import TritonAttentionPlan


def put(dst: torch.Tensor, src: torch.Tensor, t: int) -> None:
    """dst[:t] = src; the rows of dst past t repeat src's last row."""
    dst[:t].copy_(src)
    if dst.shape[0] > t:
        dst[t:].copy_(src[t - 1 : t].expand(dst.shape[0] - t, *src.shape[1:]))


def _ints(shape: int | tuple[int, ...], device, dtype=torch.int64, fill=0) -> torch.Tensor:
    shape = (shape,) if isinstance(shape, int) else shape
    return torch.full(shape, fill, dtype=dtype, device=device)


class TorchDecodeBuffers:
    """The torch backend's AttentionMeta over fixed buffers."""

    def __init__(self, rows: int, width: int, block_size: int, device: torch.device) -> None:
        self.slot_blocks, self.slot_offsets = _ints(rows, device), _ints(rows, device)
        self.lens, self.blocks = _ints(rows, device, fill=1), _ints((rows, width), device)
        self.keys = torch.arange(width * block_size, device=device)
        self.bias = torch.zeros(rows, width * block_size, device=device)
        sample = torch.arange(rows, device=device)
        self.meta = AttentionMeta(
            self.slot_blocks, self.slot_offsets, (), sample, self.blocks, self.bias, self.lens
        )

    @staticmethod
    def covers(meta, rows: int) -> bool:
        """Whether `meta` is this kind's plan with every one of the step's `rows` a decode."""
        return (
            isinstance(meta, AttentionMeta)
            and not meta.prefills
            and meta.decode_rows.shape[0] == rows
        )

    @staticmethod
    def width(meta) -> int:
        return meta.decode_blocks.shape[1]

    def prepare(self) -> None:
        """Inside the captured forward: the bias from the lengths."""
        self.bias.zero_()
        self.bias.masked_fill_(self.keys[None, :] >= self.lens[:, None], float("-inf"))

    def point_at(self, block: int) -> None:
        """Every row's new K/V and keys in `block` (the capture's warm-up writes there)."""
        self.slot_blocks.fill_(block)
        self.blocks.fill_(block)

    def load(self, meta: AttentionMeta, t: int) -> None:
        put(self.slot_blocks, meta.slot_blocks, t)
        put(self.slot_offsets, meta.slot_offsets, t)
        put(self.lens, meta.decode_lens, t)
        w = meta.decode_blocks.shape[1]
        if w < self.blocks.shape[1]:
            self.blocks[:, w:].zero_()
        put(self.blocks[:, :w], meta.decode_blocks, t)


class TritonDecodeBuffers:
    """The batch-invariant Triton backend's plan over fixed buffers: row r reads table r."""

    def __init__(self, rows: int, width: int, block_size: int, device: torch.device) -> None:
        self.slot_blocks, self.slot_offsets = _ints(rows, device), _ints(rows, device)
        self.row_pos = _ints(rows, device, torch.int32)
        self.tables = _ints((rows, width), device, torch.int32)
        row_seq = torch.arange(rows, dtype=torch.int32, device=device)
        self.meta = TritonAttentionPlan(
            self.slot_blocks, self.slot_offsets, self.row_pos, row_seq, self.tables, True
        )

    @staticmethod
    def covers(meta, rows: int) -> bool:
        return (
            isinstance(meta, TritonAttentionPlan)
            and meta.decode_only
            and meta.row_pos.shape[0] == rows
        )

    @staticmethod
    def width(meta) -> int:
        return meta.tables.shape[1]

    def prepare(self) -> None:
        """Nothing to derive: the kernel reads positions and tables as they are."""

    def point_at(self, block: int) -> None:
        self.slot_blocks.fill_(block)
        self.tables.fill_(block)
        self.row_pos.zero_()

    def load(self, meta: TritonAttentionPlan, t: int) -> None:
        put(self.slot_blocks, meta.slot_blocks, t)
        put(self.slot_offsets, meta.slot_offsets, t)
        put(self.row_pos, meta.row_pos, t)
        per_row = meta.tables.index_select(0, meta.row_seq.long())  # [t, w]
        w = per_row.shape[1]
        if w < self.tables.shape[1]:
            self.tables[:, w:].zero_()
        put(self.tables[:, :w], per_row, t)


# the attention backends whose plans the decode graphs take, by name
BUFFERS = {"torch": TorchDecodeBuffers, "triton": TritonDecodeBuffers}
