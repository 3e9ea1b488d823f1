"""An engine's parts sized from its config: the KV cache (and the host swap pool and MLFQ
batcher when the policy is mlfq), the attention backend, and the log line naming the
serving dtype."""

from __future__ import annotations

import torch

from punica_x.attention import choose_attention
from punica_x.batching.batcher import Batcher
from punica_x.batching.batcher_mlfq import MLFQBatcher
from punica_x.config import EngineConfig, ModelConfig
from punica_x.kv.blocks import KVCache, KVCacheSpec
from punica_x.kv.prefix import PrefixCache
from punica_x.kv.swap import SwapPool


def build_kv(
    config: EngineConfig, dims, device: torch.device, dtype: torch.dtype
) -> tuple[KVCache, SwapPool | None, Batcher]:
    """The paged KV cache (cache.num_blocks, or as many as cache.kv_cache_bytes hold), and
    under the mlfq policy its host swap pool with an MLFQBatcher; else no pool and FCFS.
    With cache.prefix_caching the batcher reuses cached prefixes (kv/prefix.py)."""
    cache_config = config.cache
    spec = KVCacheSpec(
        dims.num_layers, dims.num_kv_heads, dims.head_dim, cache_config.block_size, dtype
    )
    size = cache_config.kv_cache_bytes or cache_config.DEFAULT_KV_CACHE_BYTES
    num_blocks = cache_config.num_blocks or max(1, size // spec.bytes_per_block)
    cache = KVCache(spec, num_blocks, device)
    swap = None
    if config.batch.policy != "mlfq":
        batcher = Batcher(cache, config.batch)
    else:
        swap_blocks = cache_config.swap_blocks
        if swap_blocks is None:
            swap_blocks = cache_config.swap_bytes // spec.bytes_per_block
        swap = SwapPool(spec, swap_blocks, device)
        batcher = MLFQBatcher(cache, config.batch, swap)
    if cache_config.prefix_caching:
        batcher.prefix = PrefixCache(cache.allocator, cache_config.block_size)
    return cache, swap, batcher


def build_attention(config: EngineConfig, dims, device: torch.device, dtype: torch.dtype):
    """The paged attention backend for the device (config.attention_backend chooses)."""
    attention = choose_attention(
        device,
        dtype,
        dims.num_heads,
        dims.num_kv_heads,
        dims.head_dim,
        config.cache.block_size,
        config.attention_backend,
    )
    if hasattr(attention, "configure"):  # backends that plan with head counts (flashinfer)
        attention = attention.configure(dims.num_heads, dims.num_kv_heads, dims.head_dim, dtype)
    return attention


def dtype_reason(model: ModelConfig) -> str:
    """What the log line adds after the serving dtype: how it was chosen."""
    reason = ""
    device = model.torch_device()
    if model.dtype == "auto" and device.type == "cpu":
        from punica_x.ops import isa

        has = "has" if isa.native_bf16() else "lacks"
        reason = f": this CPU {has} AVX512-BF16 / AMX-BF16"
    return f" (dtype={model.dtype}{reason})"
