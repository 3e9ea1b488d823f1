"""The scheduler's side of a runner whose engine lives in another process (a Ray actor,
ray_runner.py; an engine process, process_runner.py): one protocol for both. Calls go to the
runner's RunnerCore (runner_core.py) through `_remote(method, *args)`; outputs come back in
batches, a pump task long-polling the core, each reply carrying every event (ray_events.py)
since the last one and the runner's Snapshot: one message per engine step at most, never a
message per token per request. Events are numbered by the core and delivered here once, in
order, even when a take and a poll both carry one."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from punica_x.api import (
    EngineRequest,
    RequestLimits,
    RequestOutput,
    RequestStream,
    Resume,
    RunnerLost,
    SamplingParams,
    UnknownAdapterError,
)
from scheduler.runners.interface import RunnerInfo
from scheduler.runners.ray_events import Event, LostEvent, OutputEvent, PreemptEvent, Snapshot


class RemoteRunnerLost(Exception):
    """_remote's way to say the runner's process is gone (or unreachable): `reason`."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class EventStreams:
    """What RayRunner and ProcessRunner share. A subclass sets `info` and `_snapshot` (from
    its first poll) and implements `_remote` (raising RemoteRunnerLost when the process is
    gone, the core's own exception otherwise) and `_send` (fire and forget)."""

    info: RunnerInfo
    _snapshot: Snapshot

    def _init_streams(self) -> None:
        self.tokenizer = None  # the scheduler brings its own (describe_model)
        self.error: str | None = None
        self._names: set[str] = set()
        self._streams: dict[str, tuple[Callable, Callable | None]] = {}
        self._pump: asyncio.Task | None = None
        self._acked = 0  # highest event seq the pump has dispatched
        self._delivered: dict[str, int] = {}  # request id -> seq of its last delivered event
        # request id -> the last seq a take handed over: the pump may bring those events
        # again until it acknowledges past them, and a request taken here and placed back
        # here at once (a fair-share yield) has the same id: they are not its new stream's
        self._taken: dict[str, int] = {}
        self.kv_capacity = 0  # blocks its peers could lend one request (DistKV; RayKVGroup)

    async def _remote(self, method: str, *args):
        raise NotImplementedError

    def _send(self, method: str, *args) -> None:
        raise NotImplementedError

    async def _call(self, method: str, *args):
        """_remote, with a lost process failing every stream (RunnerLost)."""
        try:
            return await self._remote(method, *args)
        except RemoteRunnerLost as exc:
            self._lost(exc.reason)
            raise RunnerLost(self.error) from None

    # -- requests -----------------------------------------------------------------------------
    def validate(self, prompt: list[int], sampling: SamplingParams, adapter: str | None) -> None:
        self.limits().check(prompt, sampling)
        if adapter is not None and adapter not in self._names:
            raise UnknownAdapterError(adapter)

    def limits(self) -> RequestLimits:
        i = self.info
        return RequestLimits(
            i.vocab_size,
            i.model.max_model_len,
            i.block_size,
            i.kv_blocks_total + self.kv_capacity,
            "the cluster's KV caches (DistKV) hold" if self.kv_capacity else "the KV cache holds",
        )

    async def open(
        self, request: EngineRequest, on_preempt: Callable[[], None] | None = None
    ) -> RequestStream:
        self._ensure_pump()
        if self.error is not None:
            raise RunnerLost(self.error)
        request_id = request.request_id
        outputs: asyncio.Queue[RequestOutput | RunnerLost] = asyncio.Queue()
        self._streams[request_id] = (outputs.put_nowait, on_preempt)
        try:
            await self._call("open", request)
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return RequestStream(request_id, outputs, lambda: self._abort(request_id))

    def _abort(self, request_id: str) -> None:
        self._forget(request_id)
        if self.error is None:
            self._send("abort", request_id)  # fire and forget: its output is dropped

    async def take(self, request_id: str, with_kv: bool = False) -> Resume | None:
        resume, events = await self._call("take", request_id, with_kv)
        self._dispatch(events)  # what the pump has not delivered yet, in order
        self._forget(request_id)
        if events:
            self._taken[request_id] = max(e.seq for e in events)
        return resume

    # -- the pump -----------------------------------------------------------------------------
    def _ensure_pump(self) -> None:
        if (self._pump is None or self._pump.done()) and self.error is None:
            self._pump = asyncio.get_running_loop().create_task(self._run_pump())

    async def _run_pump(self) -> None:
        while self.error is None:
            try:
                events, snapshot = await self._remote("poll", self._acked)
            except RemoteRunnerLost as exc:
                self._lost(exc.reason)
                return
            except Exception as exc:  # an unexpected failure must not hang every stream
                self._lost(f"runner unreachable: {exc}")
                return
            self._snapshot = snapshot
            await self._on_snapshot(snapshot)
            self._dispatch(events)
            if events:
                self._acked = max(self._acked, events[-1].seq)
                if self._taken:  # what the core will not send again
                    self._taken = {r: s for r, s in self._taken.items() if s > self._acked}

    async def _on_snapshot(self, snapshot: Snapshot) -> None:
        """A subclass's look at each poll's snapshot (the Ray runner's Lamina workers)."""

    def _dispatch(self, events: list[Event]) -> None:
        """Deliver events in seq order, each once (a take and a poll may both carry one)."""
        for event in events:
            rid = event.request_id
            entry = self._streams.get(rid)
            floor = max(self._delivered.get(rid, 0), self._taken.get(rid, 0))
            if entry is None or event.seq <= floor:
                continue
            self._delivered[rid] = event.seq
            deliver, on_preempt = entry
            if isinstance(event, OutputEvent):
                deliver(event.output)
                if event.output.finished:
                    self._forget(rid)
            elif isinstance(event, PreemptEvent):
                if on_preempt is not None:
                    on_preempt()
            elif isinstance(event, LostEvent):
                self.error = self.error or event.error
                self._forget(rid)
                deliver(RunnerLost(event.error, event.in_failed_step))

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._delivered.pop(request_id, None)

    def _lost(self, error: str) -> None:
        self.error = self.error or error
        streams, self._streams = self._streams, {}
        for deliver, _ in streams.values():
            deliver(RunnerLost(self.error))

    # -- what the snapshot tells --------------------------------------------------------------
    def has_version(self, version: int) -> bool:
        return version in self._snapshot.versions

    def resident_adapters(self) -> frozenset[str]:
        return self._snapshot.resident

    def alive(self) -> bool:
        return self.error is None
