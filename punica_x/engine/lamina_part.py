"""Lamina on one engine (punica_x/attention/lamina.py): the attention workers an engine
builds in its own process when config.attention_workers > 0, and the model worker's
attention backend over them."""

from __future__ import annotations

import torch

from punica_x.attention.lamina import HeadSplitAttention, WorkerRef
from punica_x.config import EngineConfig
from punica_x.engine.build import kv_geometry
from punica_x.kv.attention_worker import AttentionWorker, WorkerSpec, head_slices


def worker_specs(config: EngineConfig, dims, dtype: torch.dtype, backend: str) -> list[WorkerSpec]:
    """One WorkerSpec per attention worker of `config` (ValueError, naming the model's KV
    heads, when their count does not divide them): the engine's KV geometry, each worker a
    slice of the heads, the model's windows and soft-cap, the engine's attention backend."""
    slices = head_slices(dims.num_heads, dims.num_kv_heads, config.attention_workers)
    _, num_blocks = kv_geometry(config, dims, dtype)
    windows = tuple(dims.layer_windows) if any(dims.layer_windows) else ()
    return [
        WorkerSpec(
            heads=s,
            num_layers=dims.num_layers,
            head_dim=dims.head_dim,
            block_size=config.cache.block_size,
            num_blocks=num_blocks,
            dtype=dtype,
            windows=windows,
            softcap=float(dims.attn_softcap),
            backend=backend,
        )
        for s in slices
    ]


def local_workers(
    config: EngineConfig, dims, device: torch.device, dtype: torch.dtype, backend: str
) -> list[WorkerRef]:
    """config.attention_workers AttentionWorkers in this process, on `device`."""
    specs = worker_specs(config, dims, dtype, backend)
    return [WorkerRef(AttentionWorker(spec, device), spec.heads) for spec in specs]


def model_side(workers: list[WorkerRef], runner_id: str = "model") -> HeadSplitAttention:
    """The model worker's attention backend over `workers`."""
    return HeadSplitAttention(workers, runner_id)
