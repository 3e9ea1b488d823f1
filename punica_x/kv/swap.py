"""Host-memory KV pool for preempted requests (FastServe's KV swapping).

When the MLFQ batcher needs device blocks held by a lower-priority request it does not run
this step, it swaps that request's KV out: its blocks are copied into this pool and the
device blocks freed. Before the request runs again its KV is copied back (swap in), so a
preemption costs two copies instead of recomputing the prompt and every token so far. On a
GPU the pool is pinned host memory; on the CPU it is a second tensor (a memcpy each way).
When the pool is full, the request loses its KV and recomputes (counted in `recomputes`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from punica_x.kv.blocks import KVCache, KVCacheSpec, blocks_needed
from punica_x.runtime import Request


@dataclass
class SwapStats:
    swaps_out: int = 0
    swaps_in: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    recomputes: int = 0  # preemptions that lost their KV (no pool, or the pool was full)


class SwapPool:
    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device) -> None:
        self.num_blocks = num_blocks
        self.host = (
            KVCache(spec, num_blocks, torch.device("cpu"), pin_memory=device.type == "cuda")
            if num_blocks > 0
            else None
        )
        self.bytes_per_block = spec.bytes_per_block
        self.stats = SwapStats()

    @property
    def num_free(self) -> int:
        return self.host.allocator.num_free if self.host is not None else 0

    def swap_out(self, cache: KVCache, r: Request) -> bool:
        """Move r's computed KV (its first num_computed_tokens tokens) from the device cache
        to this pool and free its device blocks. False (nothing moved) when it does not fit."""
        n = blocks_needed(r.num_computed_tokens, cache.block_size)
        ids = self.host.allocator.allocate(n) if self.host is not None and n > 0 else None
        if ids is None:
            return False
        try:  # the cache's data may be on peers (Lamina's attention workers), which can fail
            data = cache.read_blocks(r.block_ids[:n]).to("cpu")
        except BaseException:
            self.host.allocator.free(ids)
            raise
        self.host.kv.index_copy_(0, torch.tensor(ids, dtype=torch.int64), data)
        cache.release(r.block_ids)
        r.host_block_ids = ids
        self.stats.swaps_out += 1
        self.stats.bytes_out += n * self.bytes_per_block
        return True

    def swap_in(self, cache: KVCache, r: Request) -> bool:
        """Copy r's KV back into newly allocated device blocks and free its host blocks.
        False (nothing moved) when the device has too few free blocks."""
        n = len(r.host_block_ids)
        if not cache.ensure_capacity(r.block_ids, r.num_computed_tokens):
            return False
        src = torch.tensor(r.host_block_ids, dtype=torch.int64)
        try:
            cache.write_blocks(r.block_ids[:n], self.host.kv.index_select(0, src))
        except BaseException:  # it stays swapped out, whole
            cache.release(r.block_ids)
            raise
        self.release(r)
        self.stats.swaps_in += 1
        self.stats.bytes_in += n * self.bytes_per_block
        return True

    def export(self, r: Request) -> torch.Tensor:
        """r's swapped KV as export_blocks gives it: [n, L, 2, N_kv, P, D] on the CPU."""
        return self.host.kv.index_select(0, torch.tensor(r.host_block_ids, dtype=torch.int64))

    def release(self, r: Request) -> None:
        if r.host_block_ids:
            self.host.allocator.free(r.host_block_ids)
            r.host_block_ids = []
