"""An in-process runner: an Engine stepping on its own thread behind the RunnerHandle API."""

from __future__ import annotations

import asyncio
from pathlib import Path

from punica_x.async_engine import AsyncEngine, RequestStream
from punica_x.config import EngineConfig
from punica_x.core import SamplingParams
from punica_x.engine import Engine
from punica_x.lora.pool import AdapterInfo
from scheduler.interface import ModelInfo, RunnerStats


class LocalRunner:
    def __init__(self, config: EngineConfig, runner_id: str = "local-0") -> None:
        self.runner_id = runner_id
        self.engine = Engine(config)
        self.async_engine = AsyncEngine(self.engine)
        loaded = self.engine.loaded
        self.model = ModelInfo(loaded.name, loaded.max_model_len, loaded.model_dir)
        self.tokenizer = loaded.tokenizer

    async def open(
        self, prompt: list[int], sampling: SamplingParams, adapter: str | None, request_id: str
    ) -> RequestStream:
        return await self.async_engine.open(prompt, sampling, adapter, request_id)

    async def register_adapter(
        self, name: str, path: Path, sha256: str | None = None
    ) -> AdapterInfo:
        # Parsing and validating read the files: a worker thread does it, so neither the event
        # loop nor the engine's step loop waits (the pool is thread-safe).
        return await asyncio.to_thread(self.engine.adapters.register, name, path, sha256)

    async def unregister_adapter(self, name: str) -> None:
        self.engine.adapters.unregister(name)

    def has_version(self, version: int) -> bool:
        return self.engine.adapters.has_version(version)

    def stats(self) -> RunnerStats:
        e = self.engine
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
        )

    def alive(self) -> bool:
        return self.async_engine.alive()

    def shutdown(self) -> None:
        self.async_engine.shutdown()
