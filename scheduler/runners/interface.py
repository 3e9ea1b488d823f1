"""What the control plane needs from a runner, whether in-process or a Ray actor."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Protocol

from punica_x.api import (
    AdapterInfo,
    EngineInfo,
    EngineRequest,
    EngineStats,
    RequestLimits,
    RequestStream,
    Resume,
    SamplingParams,
)


@dataclass(frozen=True)
class RunnerInfo(EngineInfo):
    """What a runner is, built once by the runner (describe_runner) and read by the scheduler:
    where it runs (node, pid), and what its engine is (Engine.describe(): its model and LoRA
    limits, its batch and KV pool)."""

    node: str = ""
    pid: int = 0


def describe_runner(info: EngineInfo) -> RunnerInfo:
    """The RunnerInfo of a runner in this process over an engine `info` describes."""
    own = {f.name: getattr(info, f.name) for f in fields(EngineInfo)}
    return RunnerInfo(**own, node=socket.gethostname(), pid=os.getpid())


class RunnerHandle(Protocol):
    """A runner as the scheduler drives it: LocalRunner (a thread in this process) and
    RayRunner (an actor) implement all of it; the scheduler is typed against this."""

    runner_id: str
    backend: str  # "thread" or "ray"
    info: RunnerInfo
    tokenizer: object | None  # None: the scheduler brings its own (Ray runners)
    error: str | None  # why it stopped, once it has

    def validate(self, prompt: list[int], sampling: SamplingParams, adapter: str | None) -> None:
        """The refusals open() would raise (ValueError, UnknownAdapterError), without
        adding the request."""

    async def open(
        self, request: EngineRequest, on_preempt: Callable[[], None] | None = None
    ) -> RequestStream:
        """Add a request (refusals raise here) and return its output stream; closing the
        stream aborts the request. A request with `resume` continues one moved here from its
        tokens (or its KV); on_preempt: called when the runner preempts it."""

    async def take(self, request_id: str, with_kv: bool = False) -> Resume | None:
        """Take a request out to move it (its stream ends with StreamMoved); with_kv: its
        KV comes along."""

    async def register_adapter(
        self,
        name: str,
        path: Path,
        sha256: str | None = None,
        version: int | None = None,
        pinned: bool | None = None,
    ) -> AdapterInfo:
        """Install `path` as the current version of `name`; with `sha256`, files with another
        digest are refused (AdapterError "sha256_mismatch"). version: its id on every runner
        (AdapterPool.register; None: the runner numbers it); pinned: pin / unpin it there
        (AdapterError "pin_limit"), None: unchanged."""

    async def unregister_adapter(self, name: str) -> None: ...

    def has_version(self, version: int) -> bool:
        """Whether this runner still holds adapter version `version` (current, or in use)."""

    def resident_adapters(self) -> frozenset[str]: ...

    def stats(self) -> EngineStats: ...

    def limits(self) -> RequestLimits:
        """What validate() checks prompts against (kept while no runner is active)."""

    def stop_lending(self) -> None:
        """DistKV: lend no more blocks to peers (a runner being drained)."""

    def alive(self) -> bool: ...

    def shutdown(self) -> None: ...
