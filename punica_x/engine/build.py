"""An engine's parts sized from its config: the KV cache (and the host swap pool and MLFQ
batcher when the policy is mlfq), the attention backend, the CUDA decode graphs, and the log
line naming the serving dtype."""

from __future__ import annotations

import logging

import torch

from punica_x.attention import choose_attention, get_attention_backend
from punica_x.batching.batcher import Batcher
from punica_x.batching.batcher_mlfq import MLFQBatcher
from punica_x.config import EngineConfig
from punica_x.dtypes import dtype_name
from punica_x.engine.cuda_graphs import DecodeGraphs
from punica_x.engine.graph_attention import BUFFERS as GRAPH_BUFFERS
from punica_x.env import ATTENTION_BACKEND, SGMV_BACKEND
from punica_x.kv.blocks import KVCache, KVCacheSpec
from punica_x.kv.head_split import HeadSplitKV
from punica_x.kv.prefix import PrefixCache
from punica_x.kv.swap import SwapPool
from punica_x.lora.peft_checks import LoraTarget
from punica_x.lora.slots import with_slots
from punica_x.models.simulated import SimulatedForward
from punica_x.ops.invariance import Invariance, invariant_backend, with_engine_backends
from punica_x.ops.sgmv import choose_sgmv, sgmv_fixed_order

log = logging.getLogger("punica_x.engine.engine")


def lora_target(d, edge_digests: dict[str, str]) -> LoraTarget:
    """What a model of dims `d` offers adapters (lora.peft_checks.LoraTarget): its
    projections, fused modules, edges (with the base weights' digests) and experts."""
    return LoraTarget(
        d.num_layers,
        d.lora_shapes(),
        d.fused_modules(),
        d.family,
        d.vocab_size,
        d.hidden_size,
        dict(edge_digests),
        d.moe.num_experts if d.moe else 0,
        d.expert_lora_shapes(),
        d.moe.sparse_layers if d.moe else (),
    )


def slotted_config(config: EngineConfig, model, lora_dtype: torch.dtype) -> EngineConfig:
    """`config` with the adapter budgets max_loras / max_cpu_loras stand for (lora/slots.py)."""
    if config.lora.max_loras is None and config.lora.max_cpu_loras is None:
        return config
    element_size = torch.empty((), dtype=lora_dtype).element_size()
    return with_slots(config, lora_target(model.dims, model.edge_digests), element_size)


def kv_geometry(config: EngineConfig, dims, dtype: torch.dtype) -> tuple[KVCacheSpec, int]:
    """(the KV cache's spec, its block count: cache.num_blocks, or as many as
    cache.kv_cache_bytes hold)."""
    cache_config = config.cache
    spec = KVCacheSpec(
        dims.num_layers, dims.num_kv_heads, dims.head_dim, cache_config.block_size, dtype
    )
    size = cache_config.kv_cache_bytes or cache_config.DEFAULT_KV_CACHE_BYTES
    return spec, cache_config.num_blocks or max(1, size // spec.bytes_per_block)


def build_kv(
    config: EngineConfig, dims, device: torch.device, dtype: torch.dtype, workers=None
) -> tuple[KVCache, SwapPool | None, Batcher]:
    """The paged KV cache (kv_geometry), and under the mlfq policy its host swap pool with
    an MLFQBatcher; else no pool and FCFS. With cache.prefix_caching the batcher reuses
    cached prefixes (kv/prefix.py). workers: Lamina's attention workers (WorkerRef), which
    then hold the blocks' data (kv/head_split.py)."""
    cache_config = config.cache
    spec, num_blocks = kv_geometry(config, dims, dtype)
    cache = HeadSplitKV(spec, num_blocks, workers) if workers else KVCache(spec, num_blocks, device)
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


def engine_invariance(loaded: Invariance, config: EngineConfig) -> Invariance:
    """The model's batch-invariance decision (made at load) held against the attention and
    SGMV backends the config or environment names (ops.invariance.with_engine_backends)."""
    named = {
        "attention": config.attention_backend or ATTENTION_BACKEND.get() or None,
        "SGMV": config.sgmv_backend or SGMV_BACKEND.get() or None,
    }
    device_type = config.model.torch_device().type
    invariance = with_engine_backends(loaded, config.model.batch_invariant, named, device_type)
    if invariance is not loaded:
        log.info("batch invariance: %s", invariance.reason)
    return invariance


def build_sgmv(config: EngineConfig, dims, device, dtype, lora_dtype, fixed_order: bool):
    """The SGMV backend (config.sgmv_backend chooses), in batch-invariant order where
    fixed_order (the device's compiled kernels: ops.invariance)."""
    if fixed_order:
        return sgmv_fixed_order(torch.device(device))
    return choose_sgmv(device, dtype, dims.lora_shapes(), config.sgmv_backend, lora_dtype)


def build_attention(
    config: EngineConfig, dims, device: torch.device, dtype: torch.dtype, fixed_order=False
):
    """The paged attention backend for the device (config.attention_backend chooses; the
    cpu kernel without flash attention, or the triton one on CUDA, where fixed_order:
    ops.invariance)."""
    if fixed_order:
        name = invariant_backend(torch.device(device).type, "attention")
        return get_attention_backend(device, name, dtype).fixed_order()
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


def serving_dtypes(config: EngineConfig) -> tuple[torch.device, torch.dtype, torch.dtype]:
    """(device, serving dtype, the adapters' dtype) for `config`, logged with how they were
    chosen; ValueError for a LoRA dtype no kernel takes (LoraConfig.torch_dtype)."""
    model = config.model
    device, dtype = model.torch_device(), model.torch_dtype()
    lora_dtype = config.lora.torch_dtype(dtype, device)
    reason = ""
    if model.dtype == "auto" and device.type == "cpu":
        from punica_x.ops import isa

        has = "has" if isa.native_bf16() else "lacks"
        reason = f": this CPU {has} AVX512-BF16 / AMX-BF16"
    lora = "" if lora_dtype == dtype else f"; adapters in {dtype_name(lora_dtype)}"
    log.info(
        "serving dtype %s on %s (dtype=%s%s)%s",
        dtype_name(dtype),
        device,
        model.dtype,
        reason,
        lora,
    )
    return device, dtype, lora_dtype


def build_decode_graphs(engine, config: EngineConfig) -> DecodeGraphs | None:
    """CUDA graphs for `engine`'s decode steps (an Engine, built but for them), captured now
    (engine/cuda_graphs.py); None on a CPU, with config.cuda_graphs off, on a mixture of
    experts, or with an attention backend they do not cover."""
    if engine.device.type != "cuda" or not config.cuda_graphs:
        return None
    if engine.model.dims.moe is not None:  # the experts' row counts are read on the host
        log.info("CUDA graphs: off (a mixture of experts groups its rows by expert each step)")
        return None
    attention = engine.planner.attention.name
    if attention not in GRAPH_BUFFERS:
        log.info("CUDA graphs: off (the %s attention backend runs eagerly)", attention)
        return None
    graphs = DecodeGraphs(
        engine.model,
        engine.cache.kv,
        engine.sgmv,
        engine.cache.allocator,
        engine.planner.lora.h_out,
        config.cache.block_size,
        engine.max_model_len,
        config.batch.max_batch_size,
        config.lora.max_lora_rank,
        engine.device,
        attention=attention,
    )
    graphs.capture_start()
    return graphs


def simulated_forward(engine, config: EngineConfig) -> SimulatedForward | None:
    """The simulated device of config.model.simulated_step_ms (models/simulated.py), called
    instead of the model; None when off. CPU only (its logits are host tensors): ValueError."""
    step_ms = config.model.simulated_step_ms
    if step_ms is None:
        return None
    if engine.device.type != "cpu":
        raise ValueError(f"simulated_step_ms runs on the CPU only, not on {engine.device.type}")
    log.info("simulated device: the forward holds %.3g ms a step (benchmarks only)", step_ms)
    vocab = engine.model.dims.vocab_size
    return SimulatedForward(step_ms, vocab, len(engine.tokenizer))
