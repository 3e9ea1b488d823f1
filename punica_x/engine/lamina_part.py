"""Lamina on one engine (punica_x/attention/lamina.py): the attention workers an engine
builds in its own process when config.attention_workers > 0, and the model worker's
attention backend over them."""

from __future__ import annotations

import logging

import torch

from punica_x.attention.lamina import HeadSplitAttention, WorkerRef
from punica_x.config import EngineConfig
from punica_x.engine.build import build_attention, kv_geometry
from punica_x.kv.attention_worker import AttentionWorker, WorkerSpec, head_slices
from punica_x.kv.head_split import HeadSplitKV
from punica_x.kv.rmanager import PeerLost

log = logging.getLogger(__name__)


def worker_specs(
    config: EngineConfig, dims, dtype: torch.dtype, backend: str, fixed_order: bool = False
) -> list[WorkerSpec]:
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
            fixed_order=fixed_order,
        )
        for s in slices
    ]


def build_workers(
    config: EngineConfig,
    dims,
    device: torch.device,
    dtype: torch.dtype,
    backend: str,
    launcher=None,
    fixed_order: bool = False,
) -> list[WorkerRef]:
    """config.attention_workers attention workers: AttentionWorkers in this process on
    `device`, or what launcher(specs, device) starts (e.g. scheduler/lamina/launcher.py's
    ProcessWorkers: a process each, reached over the DistKV data plane)."""
    specs = worker_specs(config, dims, dtype, backend, fixed_order)
    if launcher is not None:
        return launcher(specs, device)
    return [WorkerRef(AttentionWorker(spec, device), spec.heads) for spec in specs]


def attention_and_workers(engine, config: EngineConfig) -> tuple:
    """(the attention backend, the attention workers) of an engine being built for `config`:
    the device's backend and None without attention workers; else the workers (build_workers,
    with the backend's kernels, started by engine.attention_launcher) and the model worker's
    HeadSplitAttention over them."""
    d, device, dtype = engine.model.dims, engine.device, engine.dtype
    fixed = engine.invariance.on
    attention = build_attention(config, d, device, dtype, fixed)
    if not config.attention_workers:
        return attention, None
    launcher = engine.attention_launcher
    workers = build_workers(config, d, device, dtype, attention.name, launcher, fixed)
    return HeadSplitAttention(workers, "model", tables=lambda: block_tables(engine)), workers


def block_tables(engine) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """(request id, block ids) of every request of the engine holding blocks (running,
    waiting or paused), as MicroPlan.tables sends them to the attention workers."""
    return tuple((rid, tuple(r.block_ids)) for rid, r in engine.requests.items() if r.block_ids)


def close(launcher) -> None:
    """Stop the attention workers a launcher started (nothing for in-process ones)."""
    if launcher is not None and hasattr(launcher, "close"):
        launcher.close()


def schedule(engine):
    """The batcher's schedule, or None when an attention worker was lost while it swapped
    blocks (lost_peer has dealt with it; the requests run again next step)."""
    try:
        return engine.batcher.schedule()
    except PeerLost as exc:
        lost_peer(engine, exc.owner)
        return None


def lost_peer(engine, owner: str) -> None:
    """A peer holding KV of this step is gone: under Lamina an attention worker (lost_worker),
    else a DistKV creditor (DistKVPart.lost_peer)."""
    if isinstance(engine.cache, HeadSplitKV):
        lost_worker(engine, owner)
    else:
        engine.distkv.lost_peer(owner)


def lost_worker(engine, owner: str) -> None:
    """Attention worker `owner` ("attention-<index>") is gone with its slice of every block:
    it is replaced (restart: a fresh process, or a fresh cache in this one), every request
    holding blocks recomputes from its tokens (Lamina 4.5: the frontend's tokens are the
    state), and no cached prefix is trusted any more. Swapped-out copies on the host are
    whole and stay. The step that met the loss runs again, with the others, next step."""
    log.warning("attention worker %s is gone: replacing it; its requests recompute", owner)
    cache, batcher = engine.cache, engine.batcher
    try:
        for ref in cache.workers:
            if f"attention-{ref.heads.index}" == owner:
                ref.peer.restart()
    finally:  # counted once the replacement is up: a reader of the count (a Ray runner's
        engine.attention_worker_losses += 1  # handle) then finds every worker's address
    if isinstance(engine.planner.attention, HeadSplitAttention):
        engine.planner.attention.forget_tables()
    for r in list(batcher.running):
        batcher.preempt(r)
    for r in engine.requests.values():  # paused (MLFQ) requests hold blocks too
        if r.block_ids:
            cache.release(r.block_ids)
            r.num_computed_tokens = 0
            r.num_preemptions += 1
    cache.allocator.forget_names()
