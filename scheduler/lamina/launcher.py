"""ProcessWorkers: an engine's attention-worker launcher (Engine(attention_launcher=...))
that starts each attention worker in a process of its own and reaches it over a KVChannel
(the thread runners' and the offline engine's; a Ray runner's are ray_workers.py's).

The engine calls it with the workers' specs each time it builds its KV (memory planning
builds twice): the workers of an earlier call are stopped first. close() stops them all."""

from __future__ import annotations

from punica_x.api import WorkerSpec
from scheduler.distkv.channel import ChannelAddress
from scheduler.lamina.peer import ChannelPeer, Launcher
from scheduler.lamina.worker_process import WorkerProcess, start_worker


class RemoteWorker(ChannelPeer):
    """An attention worker in a process of its own (worker_process.py), a child of the model
    worker's: it ends with it."""

    def __init__(self, spec: WorkerSpec, launcher: ProcessWorkers) -> None:
        self.process: WorkerProcess | None = None
        super().__init__(spec, launcher)

    def _launch(self) -> ChannelAddress:
        ln = self.launcher
        self.process = start_worker(self.spec, ln.authkey, ln.threads)
        return self.process.address

    def _halt(self) -> None:
        if self.process is not None:
            self.process.stop()
        self.process = self.address = None

    @property
    def pid(self) -> int:
        return self.process.pid if self.process is not None else 0


class ProcessWorkers(Launcher):
    """model_id names the model worker to its attention workers; threads: torch threads per
    worker process."""

    peer = RemoteWorker


def attention_launcher(config, runner_id: str, threads: int = 1) -> ProcessWorkers | None:
    """A runner's launcher: ProcessWorkers when its config asks for attention workers
    (EngineConfig.attention_workers), else None."""
    if not config.attention_workers:
        return None
    return ProcessWorkers(runner_id, threads)
