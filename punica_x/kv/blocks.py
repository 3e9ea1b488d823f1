"""Paged KV cache: fixed-size rBlocks with the batch (block) dimension outermost.

Layout (Punica sec. 5.4): ``kv[num_blocks, L, 2, N_kv, P, D]``; a request owns a list of
block ids (its block table) and token ``i`` of it lives in block ``table[i // P]`` at offset
``i % P``. Blocks return to the pool the moment their request finishes or is cancelled;
with prefix caching a full block keeps its content, named by a hash, until it is needed
for something else (BlockAllocator, kv/prefix.py).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch


class BlockAllocator:
    """Block ids with reference counts. A block is free (no reference, no content anyone
    asks for), held (referenced by the requests whose block tables list it), or cached: no
    reference, but named by the hash of the KV it holds (prefix caching, kv/prefix.py), so
    a later request with the same prefix can take it back with `lookup`. Cached blocks are
    evicted in LRU order, and only when no free block is left: `num_free` counts both.

    allocate() is all-or-nothing. Thread-safe: a runner's own step and its rManager lending
    blocks to peers (DistKV) take blocks from one pool."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._refs = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks  # the content's name, if cached
        self._cached: dict[bytes, int] = {}  # hash -> block
        self._lru: OrderedDict[int, None] = OrderedDict()  # unreferenced cached, oldest first
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        """Blocks allocate() can hand out: free ones and unreferenced cached ones."""
        return len(self._free) + len(self._lru)

    @property
    def num_used(self) -> int:
        """Blocks some request holds."""
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks kept for their content (evicted first-in-LRU when needed)."""
        return len(self._lru)

    def allocate(self, n: int) -> list[int] | None:
        """n block ids (each with one reference), or None (and nothing taken) when fewer
        than n are free. Free blocks go first; then the least recently used cached ones,
        whose names are forgotten."""
        with self._lock:
            if n > len(self._free) + len(self._lru):
                return None
            ids = []
            for _ in range(n):
                if self._free:
                    i = self._free.pop()
                else:
                    i, _ = self._lru.popitem(last=False)
                    del self._cached[self._hash[i]]
                    self._hash[i] = None
                self._refs[i] = 1
                ids.append(i)
            return ids

    def free(self, ids: list[int]) -> None:
        """Drop one reference to each block. A block left unreferenced is free again, or
        cached when it is named; a block table's tail is taken first (ids are released last
        to first), as a prefix is the likelier part to be asked for again (vLLM's order)."""
        with self._lock:
            for i in reversed(ids):
                if self._refs[i] <= 0:
                    raise RuntimeError(f"block {i} freed twice")
                self._refs[i] -= 1
                if self._refs[i] == 0:
                    if self._hash[i] is None:
                        self._free.append(i)
                    else:
                        self._lru[i] = None

    def name(self, block: int, digest: bytes) -> bool:
        """Name a held block by the hash of its (complete) content, so lookup() finds it.
        False, and nothing changes, when the block is named already or another block has
        that name (the content is cached once)."""
        with self._lock:
            if self._refs[block] <= 0:
                raise RuntimeError(f"block {block} is not held: it cannot be named")
            if self._hash[block] is not None or digest in self._cached:
                return False
            self._hash[block] = digest
            self._cached[digest] = block
            return True

    def forget_names(self) -> None:
        """Every block's content is gone (the attention worker holding a slice of every block
        was replaced): no block is named any more, unreferenced cached ones are free."""
        with self._lock:
            self._free.extend(reversed(self._lru))
            self._lru.clear()
            self._cached.clear()
            self._hash = [None] * self.num_blocks

    def lookup(self, digests: list[bytes]) -> list[int]:
        """The blocks named by the longest prefix of `digests` that is cached, each with a
        new reference taken (they are no longer evictable until freed)."""
        with self._lock:
            ids = []
            for digest in digests:
                i = self._cached.get(digest)
                if i is None:
                    break
                if self._refs[i] == 0:
                    del self._lru[i]
                self._refs[i] += 1
                ids.append(i)
            return ids


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

    @property
    def block_shape(self) -> tuple[int, ...]:
        """One block's shape, (L, 2, N_kv, P, D)."""
        s = self.spec
        return (s.num_layers, 2, s.num_kv_heads, s.block_size, s.head_dim)

    def read_blocks(self, ids: list[int]) -> torch.Tensor:
        """A copy of blocks `ids`, [n, L, 2, N_kv, P, D], on the cache's device (the one
        place, with write_blocks, that block data leaves or enters: a cache whose KV lives
        elsewhere overrides both)."""
        index = torch.tensor(ids, dtype=torch.int64, device=self.kv.device)
        return self.kv.index_select(0, index)

    def write_blocks(self, ids: list[int], data: torch.Tensor) -> None:
        """Write data [len(ids), L, 2, N_kv, P, D] (any device) into blocks `ids`."""
        index = torch.tensor(ids, dtype=torch.int64, device=self.kv.device)
        self.kv.index_copy_(0, index, data.to(self.kv.device, self.kv.dtype, non_blocking=True))

    def export_blocks(self, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """A copy of the blocks holding the first num_tokens tokens of a block table, on the
        CPU: [n, L, 2, N_kv, P, D] (n = blocks_needed(num_tokens)), for another runner."""
        return self.read_blocks(block_ids[: blocks_needed(num_tokens, self.block_size)]).cpu()

    def import_blocks(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Write export_blocks' tensor into the first len(blocks) blocks of a table."""
        self.write_blocks(block_ids[: blocks.shape[0]], blocks)

    def release(self, block_ids: list[int]) -> None:
        self.allocator.free(block_ids)
        block_ids.clear()
