"""Paged KV cache: fixed-size rBlocks with the batch (block) dimension outermost.

Layout (Punica sec. 5.4): ``kv[num_blocks, L, 2, N_kv, P, D]``; a request owns a list of
block ids (its block table) and token ``i`` of it lives in block ``table[i // P]`` at offset
``i % P``. Blocks return to the free list the moment their request finishes or is cancelled.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch


class BlockAllocator:
    """Free list of block ids. allocate() is all-or-nothing. Thread-safe: a runner's own
    step and its rManager lending blocks to peers (DistKV) take blocks from one list."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._used = [False] * num_blocks
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """n block ids, or None (and nothing taken) when fewer than n are free."""
        with self._lock:
            if n > len(self._free):
                return None
            ids = [self._free.pop() for _ in range(n)]
            for i in ids:
                self._used[i] = True
            return ids

    def free(self, ids: list[int]) -> None:
        with self._lock:
            for i in ids:
                if not self._used[i]:
                    raise RuntimeError(f"block {i} freed twice")
                self._used[i] = False
                self._free.append(i)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.block_size * self.head_dim * elem


class KVCache:
    """The KV tensor of one runner plus its allocator."""

    def __init__(
        self, spec: KVCacheSpec, num_blocks: int, device: torch.device, pin_memory: bool = False
    ) -> None:
        """pin_memory: a host pool of a GPU runner (page-locked, for asynchronous copies)."""
        self.spec = spec
        shape = (num_blocks, spec.num_layers, 2, spec.num_kv_heads, spec.block_size, spec.head_dim)
        # [num_blocks, L, 2, N_kv, P, D]
        if pin_memory:
            self.kv = torch.empty(shape, dtype=spec.dtype, pin_memory=True)
        else:
            self.kv = torch.zeros(shape, dtype=spec.dtype, device=device)
        self.allocator = BlockAllocator(num_blocks)

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    def ensure_capacity(self, block_ids: list[int], num_tokens: int) -> bool:
        """Grow `block_ids` in place to hold num_tokens tokens; False if blocks ran out."""
        size = self.spec.block_size
        missing = (num_tokens + size - 1) // size - len(block_ids)
        if missing <= 0:
            return True
        new = self.allocator.allocate(missing)
        if new is None:
            return False
        block_ids.extend(new)
        return True

    def export_blocks(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """A copy of the blocks holding the first num_tokens tokens of a block table, on the
        CPU: [n, L, 2, N_kv, P, D] (n = blocks_needed(num_tokens)), for another runner."""
        ids = block_ids[: blocks_needed(num_tokens, self.block_size)]
        index = torch.tensor(ids, dtype=torch.int64, device=self.kv.device)
        return self.kv.index_select(0, index).cpu()

    def import_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Write export_blocks' tensor into the first len(blocks) blocks of a table."""
        index = torch.tensor(block_ids[: blocks.shape[0]], dtype=torch.int64, device=self.kv.device)
        self.kv.index_copy_(0, index, blocks.to(self.kv.device, self.kv.dtype))

    def release(self, block_ids: list[int]) -> None:
        self.allocator.free(block_ids)
        block_ids.clear()
