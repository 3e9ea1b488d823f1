"""The process side of a Ray runner: an Engine (on its AsyncEngine thread) inside an async
Ray actor. The scheduler's side is scheduler/runners/ray_runner.py (RayRunner); the events a poll
returns are scheduler/runners/ray_events.py; the DistKV and DGFM methods come from
scheduler/distkv/actor.py."""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

from punica_x.api import AdapterInfo, EngineConfig, EngineRequest, Resume, RunnerLost
from scheduler.distkv.actor import KVActorMethods
from scheduler.runners.interface import RunnerInfo, describe_runner
from scheduler.runners.ray_events import Event, LostEvent, OutputEvent, PreemptEvent, Snapshot

POLL_TIMEOUT = 1.0  # seconds an idle poll waits before returning (nothing) to the pump
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


class RunnerActor(KVActorMethods):
    """Runs in the actor's process (an async actor: its methods share one event loop)."""

    def __init__(self, config: EngineConfig, runner_id: str) -> None:
        import tempfile

        import torch

        from punica_x.api import AsyncEngine, Engine
        from scheduler.lamina.ray_workers import ray_attention_launcher

        # Ray starts actors with OMP_NUM_THREADS=1; a runner wants every core it was given
        # (the thread backend's default too), or PUNICA_X_RUNNER_THREADS when set.
        threads = int(os.environ.get("PUNICA_X_RUNNER_THREADS", 0)) or len(os.sched_getaffinity(0))
        torch.set_num_threads(threads)
        self.runner_id = runner_id
        # attention workers as detached actors: they outlive this process, with its KV
        self.launcher = ray_attention_launcher(config, runner_id, threads)
        self.engine = Engine(config, attention_launcher=self.launcher)
        self.async_engine = AsyncEngine(self.engine, on_step_error="stop")
        self.info_ = describe_runner(self.engine.describe())
        self.adapter_dir = Path(tempfile.mkdtemp(prefix=f"punica-x-{runner_id}-adapters-"))
        # kept until a poll acknowledges them: a reply lost on the way (its caller gone) is
        # sent again, so no output is ever dropped
        self.events: list[Event] = []
        self.seq = 0
        self.uploads = 0
        self.wakeup: asyncio.Event | None = None

    def info(self) -> RunnerInfo:
        return self.info_

    def lamina_workers(self):
        """Where this model worker's attention workers are (rescue.LaminaWorkers), None
        without them: the scheduler keeps it, to take their KV should this process die."""
        return self.launcher.describe() if self.launcher is not None else None

    def stop_lending(self) -> None:
        self.engine.stop_lending()

    def _push(self, event: type, request_id: str, *payload) -> None:
        self.seq += 1
        self.events.append(event(self.seq, request_id, *payload))
        if self.wakeup is not None:
            self.wakeup.set()

    async def open(self, request: EngineRequest) -> str:
        request_id = request.request_id

        def deliver(out):
            if isinstance(out, RunnerLost):
                self._push(LostEvent, request_id, str(out), out.in_failed_step)
            else:
                self._push(OutputEvent, request_id, out)

        def preempted():
            self._push(PreemptEvent, request_id)

        return await self.async_engine.add(request, deliver, preempted)

    async def take(
        self, request_id: str, with_kv: bool = False
    ) -> tuple[Resume | None, list[Event]]:
        """(where the request stands, its events not yet acknowledged): after a take the
        request produces nothing more here."""
        resume = await self.async_engine.take(request_id, with_kv)
        return resume, [e for e in self.events if e.request_id == request_id]

    async def abort(self, request_id: str) -> None:
        await self.async_engine.call(lambda: self.engine.abort(request_id))

    async def poll(self, after: int, timeout: float = POLL_TIMEOUT) -> tuple[list[Event], Snapshot]:
        """Events after seq `after` (those up to it are acknowledged and dropped), waiting up
        to `timeout` for one; and the runner's stats."""
        if self.wakeup is None:
            self.wakeup = asyncio.Event()
        self.events = [e for e in self.events if e.seq > after]
        if not self.events:
            self.wakeup.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.wakeup.wait(), timeout)
        return list(self.events), self._snapshot()

    def _snapshot(self) -> Snapshot:
        pool = self.engine.adapters
        return Snapshot(self.engine.stats(), pool.resident(), pool.versions())

    def register_adapter(
        self, name: str, files: dict[str, bytes], sha256: str | None, version: int | None
    ) -> AdapterInfo:
        self.uploads += 1  # (a folder per upload: a held version keeps its files)
        folder = self.adapter_dir / f"{abs(hash(name))}-{self.uploads}"
        folder.mkdir(parents=True, exist_ok=True)
        for fname in ADAPTER_FILES:
            (folder / fname).write_bytes(files[fname])
        return self.engine.adapters.register(name, folder, sha256, version)

    def unregister_adapter(self, name: str) -> None:
        self.engine.unregister_adapter(name)

    def alive(self) -> str | None:
        """None while the engine steps, else why it stopped."""
        return None if self.async_engine.alive() else (self.async_engine.error or "stopped")

    def shutdown(self) -> None:
        import shutil

        self.async_engine.shutdown()
        if getattr(self, "kv_server", None) is not None:
            self.kv_server.close()
            self.borrower.close()
        shutil.rmtree(self.adapter_dir, ignore_errors=True)
