"""The scheduler object the frontend talks to.

One in-process runner today; placement over many runners (Punica sec. 5.1), migration and
MLFQ arrive with their issue behind this same object. Adapters are registered on every
runner under the key the frontend chooses (tenant-scoped, so tenants never collide)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, fields
from pathlib import Path

from punica_x.core import RequestOutput, SamplingParams
from punica_x.lora.adapter import LoraTarget
from punica_x.lora.pool import AdapterInfo
from scheduler.interface import ModelInfo, RunnerStats
from scheduler.local import LocalRunner


@dataclass(frozen=True)
class SchedulerInfo:
    model: ModelInfo
    lora_target: LoraTarget
    max_lora_rank: int


class Scheduler:
    def __init__(self, runners: list[LocalRunner]) -> None:
        if not runners:
            raise ValueError("the scheduler needs at least one runner")
        self.runners = runners
        first = runners[0]
        engine = first.engine
        self.info = SchedulerInfo(
            first.model, engine.adapters.target, engine.config.lora.max_lora_rank
        )
        self.tokenizer = first.tokenizer

    def _pick(self) -> LocalRunner:
        return self.runners[0]

    async def open(
        self, prompt: list[int], sampling: SamplingParams, adapter: str | None, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Place a request on a runner; see RunnerHandle.open."""
        return await self._pick().open(prompt, sampling, adapter, request_id)

    async def register_adapter(
        self, key: str, path: Path, sha256: str | None = None
    ) -> AdapterInfo:
        infos = [await r.register_adapter(key, path, sha256) for r in self.runners]
        return infos[0]

    async def unregister_adapter(self, key: str) -> None:
        for r in self.runners:
            await r.unregister_adapter(key)

    def has_version(self, version: int) -> bool:
        return any(r.has_version(version) for r in self.runners)

    def stats(self) -> RunnerStats:
        per = [r.stats() for r in self.runners]
        return RunnerStats(
            **{f.name: sum(getattr(s, f.name) for s in per) for f in fields(RunnerStats)}
        )

    def ready(self) -> bool:
        return all(r.alive() for r in self.runners)

    def shutdown(self) -> None:
        for r in self.runners:
            r.shutdown()
