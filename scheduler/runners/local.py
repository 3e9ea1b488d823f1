"""An in-process runner: an Engine stepping on its own thread behind the RunnerHandle API.

Several thread runners in one process share the backbone's weights (read-only) and each
has its own KV cache, adapter pool, batcher and step thread."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
from collections.abc import Callable
from pathlib import Path

from punica_x.api import (
    AdapterInfo,
    AsyncEngine,
    Engine,
    EngineConfig,
    EngineRequest,
    EngineStats,
    LoadedModel,
    RequestLimits,
    RequestStream,
    Resume,
    SamplingParams,
)
from scheduler.lamina.launcher import attention_launcher
from scheduler.runners.interface import describe_runner


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
        self.engine = Engine(
            config, loaded, attention_launcher=attention_launcher(config, runner_id)
        )
        self.async_engine = AsyncEngine(self.engine, on_step_error="stop")
        self.info = describe_runner(self.engine.describe())
        self.tokenizer = self.engine.tokenizer

    def validate(self, prompt: list[int], sampling: SamplingParams, adapter: str | None) -> None:
        """The refusals open() would raise (ValueError, UnknownAdapterError), checked without
        adding the request (for requests that wait at the scheduler first)."""
        self.engine.check_prompt(prompt, sampling)
        if adapter is not None:
            self.engine.adapters.check(adapter)

    def limits(self) -> RequestLimits:
        """validate()'s limits now (the scheduler keeps them for while no runner is up)."""
        return self.engine.limits()

    async def open(
        self, request: EngineRequest, on_preempt: Callable[[], None] | None = None
    ) -> RequestStream:
        return await self.async_engine.open(request, on_preempt)

    async def take(self, request_id: str, with_kv: bool = False) -> Resume | None:
        return await self.async_engine.take(request_id, with_kv)

    async def register_adapter(
        self,
        name: str,
        path: Path,
        sha256: str | None = None,
        version: int | None = None,
        pinned: bool | None = None,
    ) -> AdapterInfo:
        # Parsing and validating read the files: a worker thread does it, so neither the event
        # loop nor the engine's step loop waits (the pool is thread-safe; its torch ops run on a
        # thread of their own, lora.adapter.load_peft_adapter).
        pool = self.engine.adapters
        return await asyncio.to_thread(pool.register, name, path, sha256, version, pinned)

    async def unregister_adapter(self, name: str) -> None:
        self.engine.unregister_adapter(name)

    def has_version(self, version: int) -> bool:
        return self.engine.adapters.has_version(version)

    def resident_adapters(self) -> frozenset[str]:
        return self.engine.adapters.resident()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def stop_lending(self) -> None:
        self.engine.stop_lending()

    def alive(self) -> bool:
        return self.async_engine.alive()

    @property
    def error(self) -> str | None:
        return self.async_engine.error

    def shutdown(self) -> None:
        self.async_engine.shutdown()
