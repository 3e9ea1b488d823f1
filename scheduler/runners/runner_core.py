"""The engine side of a runner in a process of its own, shared by the Ray actor
(ray_actor.py) and the engine process (process_main.py): an Engine stepping on its
AsyncEngine thread, the calls the scheduler makes (open, take, abort, adapters) and the
events one poll returns (ray_events.py), numbered and kept until a poll acknowledges them."""

from __future__ import annotations

import asyncio
import contextlib

from punica_x.api import AsyncEngine, Engine, EngineRequest, Resume, RunnerLost
from scheduler.runners.interface import RunnerInfo, describe_runner
from scheduler.runners.ray_events import Event, LostEvent, OutputEvent, PreemptEvent, Snapshot

POLL_TIMEOUT = 1.0  # seconds an idle poll waits before returning (nothing) to the pump


class RunnerCore:
    """Runs where the engine runs, with an event loop (its methods share it)."""

    def _start(self, engine: Engine, runner_id: str) -> None:
        self.runner_id = runner_id
        self.engine = engine
        self.async_engine = AsyncEngine(engine, on_step_error="stop")
        self.info_ = describe_runner(engine.describe())
        # kept until a poll acknowledges them: a reply lost on the way (its caller gone) is
        # sent again, so no output is ever dropped
        self.events: list[Event] = []
        self.seq = 0
        self.wakeup: asyncio.Event | None = None

    def info(self) -> RunnerInfo:
        return self.info_

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

    def unregister_adapter(self, name: str) -> None:
        self.engine.unregister_adapter(name)

    def alive(self) -> str | None:
        """None while the engine steps, else why it stopped."""
        return None if self.async_engine.alive() else (self.async_engine.error or "stopped")
