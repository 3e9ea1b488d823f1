"""A model worker's KV cache under Lamina (punica_x/attention/lamina.py): the allocator and
every block-table decision stay here, the block data lives on the attention workers, each
holding a slice of the KV heads of every block (punica_x/kv/attention_worker.py)."""

from __future__ import annotations

import torch

from punica_x.kv.blocks import BlockAllocator, KVCache, KVCacheSpec


class HeadSplitKV(KVCache):
    """KVCache's interface over attention workers: `workers` are WorkerRefs whose peers
    also read_blocks / write_blocks their slice. `kv` is an empty placeholder (the model
    worker holds no KV): code that reads it instead of read_blocks fails loudly."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, workers: list) -> None:
        self.spec = spec
        self.kv = torch.empty(0, dtype=spec.dtype)
        self.allocator = BlockAllocator(num_blocks)
        self.workers = list(workers)

    def read_blocks(self, ids: list[int]) -> torch.Tensor:
        """Blocks `ids` gathered from every worker, [n, L, 2, N_kv, P, D] on the CPU."""
        return torch.cat([w.peer.read_blocks(list(ids)) for w in self.workers], dim=3)

    def write_blocks(self, ids: list[int], data: torch.Tensor) -> None:
        """data [len(ids), L, 2, N_kv, P, D]: each worker gets its heads' slice."""
        data = data.to("cpu", self.spec.dtype)
        for w in self.workers:
            w.peer.write_blocks(list(ids), data[:, :, :, w.heads.kv_heads()].contiguous())
