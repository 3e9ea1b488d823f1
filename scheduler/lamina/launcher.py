"""ProcessWorkers: an engine's attention-worker launcher (Engine(attention_launcher=...))
that starts each attention worker in a process of its own and reaches it over a KVChannel.

The engine calls it with the workers' specs each time it builds its KV (memory planning
builds twice): the workers of an earlier call are stopped first. close() stops them all."""

from __future__ import annotations

import platform
import secrets

from punica_x.attention.lamina import WorkerRef
from punica_x.kv.attention_worker import WorkerSpec
from scheduler.distkv.channel import KVChannel
from scheduler.lamina.worker_process import WorkerProcess, start_worker


class ProcessWorkers:
    """model_id names the model worker to its attention workers; threads: torch threads per
    worker process."""

    def __init__(self, model_id: str = "model", threads: int = 1) -> None:
        self.model_id = model_id
        self.threads = threads
        self.authkey = secrets.token_bytes(32)
        self.processes: list[WorkerProcess] = []
        self.channels: list[KVChannel] = []

    def __call__(self, specs: list[WorkerSpec], device=None) -> list[WorkerRef]:
        self.close()
        node = platform.node()
        for spec in specs:
            proc = start_worker(spec, self.authkey, self.threads)
            self.processes.append(proc)
            owner = f"attention-{spec.heads.index}"
            self.channels.append(KVChannel(owner, proc.address, self.model_id, node, self.authkey))
        return [WorkerRef(ch, spec.heads) for ch, spec in zip(self.channels, specs)]

    def close(self) -> None:
        for ch in self.channels:
            ch.close()
        for proc in self.processes:
            proc.stop()
        self.channels, self.processes = [], []


def attention_launcher(config, runner_id: str, threads: int = 1) -> ProcessWorkers | None:
    """A runner's launcher: ProcessWorkers when its config asks for attention workers
    (EngineConfig.attention_workers), else None."""
    if not config.attention_workers:
        return None
    return ProcessWorkers(runner_id, threads)
