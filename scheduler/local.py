"""An in-process runner: an Engine stepping on its own thread behind the RunnerHandle API.

Several thread runners in one process share the backbone's weights (read-only) and each
has its own KV cache, adapter pool, batcher and step thread."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import os
import socket
from collections.abc import Callable
from pathlib import Path

from punica_x.config import EngineConfig
from punica_x.core import Resume, SamplingParams
from punica_x.dtypes import dtype_name
from punica_x.engine import Engine
from punica_x.engine.async_engine import AsyncEngine, RequestStream
from punica_x.engine.memory import weights_bytes
from punica_x.lora.pool import AdapterInfo
from punica_x.models.loader import LoadedModel
from punica_x.request import EngineRequest
from scheduler.interface import ModelInfo, RequestLimits, RunnerInfo, RunnerStats


def engine_stats(e: Engine) -> RunnerStats:
    """An engine's gauges and counters (read by thread runners and inside Ray actors)."""
    pool = e.adapters.stats
    return RunnerStats(
        running=len(e.batcher.running),
        waiting=len(e.batcher.waiting),
        kv_blocks_used=e.cache.allocator.num_used,
        kv_blocks_free=e.cache.allocator.num_free,
        adapter_loads=pool.loads,
        adapter_evictions=pool.evictions,
        adapter_device_bytes=pool.device_bytes_used,
        preemptions=e.batcher.num_preemptions,
        aborts=e.num_aborts,
        pauses=e.batcher.num_pauses,
        **(_swap_counters(e.swap.stats) if e.swap is not None else {}),
        **_distkv_gauges(e),
        **_prefix_counters(e),
        **_graph_counters(e),
    )


def _graph_counters(e: Engine) -> dict:
    g = getattr(e, "graphs", None)
    if g is None:
        return {}
    s = g.stats
    return dict(cuda_graphs=s.captures, cuda_graph_steps=s.replays, eager_decode_steps=s.eager)


def _prefix_counters(e: Engine) -> dict:
    prefix = e.batcher.prefix
    if prefix is None:
        return {}
    queries, hits = dict(prefix.stats.queries), dict(prefix.stats.hits)  # (another thread's)
    # a deleted adapter's requests still running may record after its counters were dropped
    # (Engine.unregister_adapter): only the base model's and registered adapters' are shown
    shown = {""} | set(e.adapters.names())
    return dict(
        kv_blocks_cached=e.cache.allocator.num_cached,
        prefix_cache=tuple((a, queries[a], hits.get(a, 0)) for a in sorted(queries) if a in shown),
    )


def _distkv_gauges(e: Engine) -> dict[str, float]:
    rm = e.rmanager
    if rm is None:
        return {}
    borrowed = sum(
        len(x.block_ids)
        for r in list(e.requests.values())  # read from another thread: a gauge, not a ledger
        for x in list(r.remote)
        if x.owner != rm.runner_id
    )
    remote = e.planner.dist.stats
    return dict(
        kv_blocks_lent=rm.lent_blocks,
        kv_blocks_borrowed=borrowed,
        remote_attention_calls=remote.calls,
        remote_attention_seconds=remote.seconds,
    )


def _swap_counters(s) -> dict[str, int]:
    return dict(
        swaps_out=s.swaps_out,
        swaps_in=s.swaps_in,
        swap_bytes_out=s.bytes_out,
        swap_bytes_in=s.bytes_in,
    )


def stop_lending(engine: Engine) -> None:
    """DistKV: the engine's rManager lends no more blocks (none when it takes no part)."""
    rm = getattr(engine, "rmanager", None)
    if rm is not None:
        rm.caps = dataclasses.replace(rm.caps, max_blocks=0)


def describe_runner(engine: Engine, config: EngineConfig) -> RunnerInfo:
    """The RunnerInfo of a runner over `engine` (in this process or in a Ray actor's)."""
    loaded = engine.loaded
    spec = engine.cache.spec
    return RunnerInfo(
        node=socket.gethostname(),
        pid=os.getpid(),
        device=str(engine.device),
        model=ModelInfo(
            loaded.name,
            engine.max_model_len,  # the memory plan may cap the model's own
            loaded.model_dir,
            dtype_name(engine.dtype),
            engine.model.dims.family,
            engine.model.weight_formats(),
            weights_bytes(engine.model),
        ),
        lora_target=engine.adapters.target,
        max_lora_rank=config.lora.max_lora_rank,
        vocab_size=engine.model.dims.vocab_size,
        max_batch_size=config.batch.max_batch_size,
        max_working_set=config.batch.max_working_set,
        block_size=engine.cache.block_size,
        kv_blocks_total=engine.cache.allocator.num_blocks,
        kv_bytes_per_token=spec.bytes_per_block // spec.block_size,
        kv_blocks_swap=engine.swap.num_blocks if engine.swap is not None else 0,
        prefix_caching=engine.batcher.prefix is not None,
    )


class LocalRunner:
    backend = "thread"

    def __init__(
        self,
        config: EngineConfig,
        runner_id: str = "runner-0",
        shared: LoadedModel | None = None,
    ) -> None:
        self.runner_id = runner_id
        loaded = None
        if shared is not None:  # the same weights; a tokenizer of its own (not thread-safe)
            loaded = dataclasses.replace(shared, tokenizer=copy.deepcopy(shared.tokenizer))
        self.engine = Engine(config, loaded)
        self.async_engine = AsyncEngine(self.engine, on_step_error="stop")
        self.info = describe_runner(self.engine, config)
        self.tokenizer = self.engine.loaded.tokenizer

    def validate(self, prompt: list[int], sampling: SamplingParams, adapter: str | None) -> None:
        """The refusals open() would raise (ValueError, UnknownAdapterError), checked without
        adding the request (for requests that wait at the scheduler first)."""
        self.engine.check_prompt(prompt, sampling)
        if adapter is not None:
            self.engine.adapters.check(adapter)

    def limits(self) -> RequestLimits:
        """validate()'s limits now (the scheduler keeps them for while no runner is up)."""
        e = self.engine
        blocks = e.capacity_blocks()
        lends = blocks > e.cache.allocator.num_blocks
        return RequestLimits(
            e.model.dims.vocab_size,
            e.max_model_len,
            e.cache.block_size,
            blocks,
            "the cluster's KV caches (DistKV) hold" if lends else "the KV cache holds",
        )

    async def open(
        self, request: EngineRequest, on_preempt: Callable[[], None] | None = None
    ) -> RequestStream:
        return await self.async_engine.open(request, on_preempt)

    async def take(self, request_id: str, with_kv: bool = False) -> Resume | None:
        return await self.async_engine.take(request_id, with_kv)

    async def register_adapter(
        self, name: str, path: Path, sha256: str | None = None, version: int | None = None
    ) -> AdapterInfo:
        # Parsing and validating read the files: a worker thread does it, so neither the event
        # loop nor the engine's step loop waits (the pool is thread-safe; its torch ops run on a
        # thread of their own, lora.adapter.load_peft_adapter).
        pool = self.engine.adapters
        return await asyncio.to_thread(pool.register, name, path, sha256, version)

    async def unregister_adapter(self, name: str) -> None:
        self.engine.unregister_adapter(name)

    def has_version(self, version: int) -> bool:
        return self.engine.adapters.has_version(version)

    def resident_adapters(self) -> frozenset[str]:
        return self.engine.adapters.resident()

    def stats(self) -> RunnerStats:
        return engine_stats(self.engine)

    def stop_lending(self) -> None:
        stop_lending(self.engine)

    def alive(self) -> bool:
        return self.async_engine.alive()

    @property
    def error(self) -> str | None:
        return self.async_engine.error

    def shutdown(self) -> None:
        self.async_engine.shutdown()
