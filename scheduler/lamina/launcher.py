"""ProcessWorkers: an engine's attention-worker launcher (Engine(attention_launcher=...))
that starts each attention worker in a process of its own and reaches it over a KVChannel.

The engine calls it with the workers' specs each time it builds its KV (memory planning
builds twice): the workers of an earlier call are stopped first. close() stops them all."""

from __future__ import annotations

import platform
import secrets

from punica_x.api import PeerLost, WorkerRef, WorkerSpec
from scheduler.distkv.channel import KVChannel
from scheduler.lamina.rescue import LaminaWorkers, WorkerAt
from scheduler.lamina.worker_process import WorkerProcess, start_worker


class RemoteWorker:
    """An attention worker in a process of its own, as the model worker's peer: prepare /
    read_blocks / write_blocks go over its KVChannel; restart() replaces the process (a
    fresh one, empty KV) when the old one died."""

    def __init__(self, spec: WorkerSpec, launcher: ProcessWorkers) -> None:
        self.spec, self.launcher = spec, launcher
        self.owner = f"attention-{spec.heads.index}"
        self.process: WorkerProcess | None = None
        self.channel: KVChannel | None = None
        self.start()

    def start(self) -> None:
        ln = self.launcher
        self.process = start_worker(self.spec, ln.authkey, ln.threads)
        address, node = self.process.address, platform.node()
        self.channel = KVChannel(self.owner, address, ln.model_id, node, ln.authkey)

    def restart(self) -> None:
        self.stop()
        self.start()

    def stop(self) -> None:
        if self.channel is not None:
            self.channel.close()
        if self.process is not None:
            self.process.stop()
        self.channel = self.process = None

    @property
    def pid(self) -> int:
        return self.process.pid if self.process is not None else 0

    def prepare(self, debtor: str, plan) -> KVChannel:
        return self._channel().prepare(debtor, plan)

    def read_blocks(self, ids: list[int]):
        return self._channel().read_blocks(ids)

    def write_blocks(self, ids: list[int], data) -> None:
        self._channel().write_blocks(ids, data)

    def _channel(self) -> KVChannel:
        if self.channel is None:
            raise PeerLost(self.owner, "the attention worker is stopped")
        return self.channel


class ProcessWorkers:
    """model_id names the model worker to its attention workers; threads: torch threads per
    worker process."""

    def __init__(self, model_id: str = "model", threads: int = 1) -> None:
        self.model_id = model_id
        self.threads = threads
        self.authkey = secrets.token_bytes(32)
        self.workers: list[RemoteWorker] = []

    def __call__(self, specs: list[WorkerSpec], device=None) -> list[WorkerRef]:
        self.close()
        self.workers = [RemoteWorker(spec, self) for spec in specs]
        return [WorkerRef(w, w.spec.heads) for w in self.workers]

    def close(self) -> None:
        for w in self.workers:
            w.stop()
        self.workers = []

    def describe(self) -> LaminaWorkers:
        """Where the workers are and their key (rescue.py reads their KV with it)."""
        at = tuple(
            WorkerAt(w.owner, w.process.address, w.spec.heads.lo, w.spec.heads.hi)
            for w in self.workers
            if w.process is not None
        )
        return LaminaWorkers(self.model_id, self.authkey, at)


def attention_launcher(config, runner_id: str, threads: int = 1) -> ProcessWorkers | None:
    """A runner's launcher: ProcessWorkers when its config asks for attention workers
    (EngineConfig.attention_workers), else None."""
    if not config.attention_workers:
        return None
    return ProcessWorkers(runner_id, threads)
