"""The scheduler the frontend talks to: one control plane over N runners, composed of parts:

- fleet.py: the runners (start, drain, death, replacement under a RestartPolicy);
- waiting.py + policy/fairness.py: requests that find no room wait here, served across tenants by
  fair share (VTC), first come first served within one;
- dispatch.py: placement (policy/placement.py: consolidation, Punica sec. 5.1) and opening a
  request on its runner, and placing what waits as room appears;
- mover.py: moves (Punica sec. 5.3) under KV pressure, off a draining runner, off a dead
  one (nothing is lost: requests continue from what they streamed; poison requests end
  with an error), recomputed or with their KV copied (policy/migration.py);
- sharing.py: a tenant below its share of the batch slots takes one from the tenant
  furthest above its share;
- distkv/: a request whose KV fits on no single runner borrows blocks on the others
  (`distkv=False` refuses such a prompt, naming one runner's limit);
- adapters.py: adapters registered on every runner at once (new runners get every current
  one before they take work) under the key the frontend chooses (tenant-scoped).

The scheduler holds every request's prompt and everything it has streamed (stream.py), so a
request can move: the client's stream continues with no token missing or repeated, and
greedy and seeded output equal a run that never moved."""

from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

from punica_x.api import (
    AdapterInfo,
    EngineRequest,
    EngineStats,
    LoraTarget,
    ModelInfo,
    SamplingParams,
)
from scheduler.adapters import AdapterRegistry
from scheduler.dispatch import Dispatcher, DispatchEvents
from scheduler.distkv.dgfm import Swap
from scheduler.distkv.service import DGFM_MIN_SWAP, DistKV, holdable_runners, make_distkv
from scheduler.errors import ClusterError, NoRunner
from scheduler.fleet import DEFAULT_RESTART, Fleet, RestartPolicy, RunnerSlot
from scheduler.mover import Mover
from scheduler.policy.placement import Advice, advise, drain_choice
from scheduler.rows import RunnerRow
from scheduler.runners.interface import RunnerHandle
from scheduler.sharing import SlotSharing
from scheduler.stream import ClusterStream
from scheduler.waiting import TenantRow, WaitingQueue

__all__ = ["ClusterError", "NoRunner", "RestartPolicy", "Scheduler", "SchedulerConfig"]
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerInfo:
    model: ModelInfo
    lora_target: LoraTarget
    max_lora_rank: int


@dataclass(frozen=True)
class SchedulerConfig:
    """idle_after: seconds a runner stays idle before the autoscaler may stop it.
    distkv: thread runners lend each other KV blocks for requests no single one can hold
    (lend_fraction of each runner's blocks at most). distkv_overlap: run the peers'
    micro-attention on worker threads while the local part runs; off by default because
    thread runners share the CPU's cores, and there it measured slower (bench_distkv); Ray
    runners always overlap (their own processes). distkv_transport: Ray runners' data plane,
    "socket" (scheduler/distkv/channel.py) or "ray" (actor calls, slower; for comparison).
    restart: how a dead runner is replaced through the factory; None leaves dead runners
    dead. fair_share: requests waiting here are served across tenants by their virtual token
    counters, and a tenant below its share of the batch slots takes one from the tenant
    furthest above its share (scheduler/policy/fairness.py); False: first come, first served."""

    idle_after: float = 60.0
    distkv: bool = True
    lend_fraction: float = 0.9
    distkv_overlap: bool = False
    distkv_transport: str = "socket"
    restart: RestartPolicy | None = DEFAULT_RESTART
    fair_share: bool = True


class Scheduler:
    """runners: started runners (at least one). factory(runner_id) builds one more runner of
    the same backend (blocking; it runs on a worker thread) for scale-up; None: fixed size,
    and dead runners stay dead. tokenizer: the first runner's unless given. The other
    options are SchedulerConfig's."""

    def __init__(
        self,
        runners: list[RunnerHandle],
        factory: Callable[[str], RunnerHandle] | None = None,
        tokenizer=None,
        **options,
    ) -> None:
        if not runners:
            raise ValueError("the scheduler needs at least one runner")
        self.config = config = SchedulerConfig(**options)
        info = runners[0].info
        self.info = SchedulerInfo(info.model, info.lora_target, info.max_lora_rank)
        self.tokenizer = tokenizer if tokenizer is not None else runners[0].tokenizer
        self.idle_after = config.idle_after
        self.fleet = Fleet(runners, factory, config.restart, self)
        self.adapters = AdapterRegistry()
        self._queue = WaitingQueue(config.fair_share)
        self._arrivals = itertools.count()  # the order requests arrived in (newest: largest)
        self.distkv: DistKV | None = None
        if config.distkv:
            backends = {r.backend for r in runners}
            self.distkv = make_distkv(
                backends, config.lend_fraction, config.distkv_overlap, config.distkv_transport
            )
        distributed = self.distkv is not None
        self.dispatch = Dispatcher(self.fleet, self._queue, distributed, self.adapters.version_of)
        self.mover = Mover(self.fleet, self.dispatch)
        self.sharing = SlotSharing(self.dispatch, self.mover)
        self.dispatch.connect(DispatchEvents(self.mover.preempted, self.sharing.rebalance))
        for slot in self.slots:
            self.join(slot)

    @classmethod
    def from_config(
        cls,
        config: SchedulerConfig,
        runners: list[RunnerHandle],
        factory: Callable[[str], RunnerHandle] | None = None,
        tokenizer=None,
    ) -> Scheduler:
        options = {f.name: getattr(config, f.name) for f in fields(SchedulerConfig)}
        return cls(runners, factory, tokenizer, **options)

    # -- the parts' counters ------------------------------------------------------------------
    slots = property(lambda self: self.fleet.slots)
    restarts = property(lambda self: self.fleet.restarts)
    failures = property(lambda self: self.fleet.failures)
    migrations = property(lambda self: self.mover.migrations)
    quarantined = property(lambda self: self.mover.quarantined)
    kv_swapped_blocks = property(lambda self: self.distkv.swapped_blocks if self.distkv else 0)
    fair_share = property(lambda self: self._queue.fair_share)

    # -- FleetHooks: what the fleet tells the scheduler ---------------------------------------
    async def install(self, handle) -> None:
        await self.adapters.install(handle)

    def join(self, slot: RunnerSlot) -> None:
        """The runner lends blocks and may borrow them (before it takes any request)."""
        if self.distkv is not None:
            self.distkv.join(slot.handle)

    def runner_left(self, slot: RunnerSlot) -> None:
        if self.distkv is not None:
            self.distkv.leave(slot.runner_id, dead=True)

    def none_left(self, message: str) -> None:
        for stream in self._queue.clear():
            stream.fail(message)

    # -- StreamOwner: what a request's stream tells the scheduler -----------------------------
    async def stream_lost(
        self, stream: ClusterStream, error: str, in_failed_step: bool = False
    ) -> None:
        self.mover.lost(stream, error, in_failed_step)

    def stream_served(self, stream: ClusterStream, tokens: int) -> None:
        """`stream` received `tokens` new tokens: its tenant's counter grows."""
        self._queue.served(stream, output_tokens=tokens)

    def stream_done(self, stream: ClusterStream) -> None:
        """A stream ended (finished, aborted, failed): its place is free."""
        self.dispatch.left(stream)
        stream.slot = None
        self._queue.remove(stream)
        self.kick()

    def kick(self) -> None:
        self.dispatch.kick()

    # -- requests -----------------------------------------------------------------------------
    async def open(
        self, request: EngineRequest, tenant: str = "", weight: float = 1.0
    ) -> ClusterStream:
        """Place a request (or queue it here when no runner has room, or while the only
        runners are starting: a dead one being replaced) and return its output stream;
        refusals (ValueError, UnknownAdapterError) raise here, NoRunner when no runner is
        active or starting. Closing the stream aborts the request. tenant, weight: whose
        request it is and that tenant's weight, for fair share."""
        if not self.accepting():
            raise NoRunner("no runner is active")
        if self.distkv is not None:
            self.distkv.start(self.dispatch.spawn, self._live, lambda: self.fleet.closed)
        self._validate(list(request.prompt), request.sampling, request.adapter)
        stream = ClusterStream(self, request, tenant)
        stream.arrival = next(self._arrivals)
        self._queue.set_weight(tenant, weight)
        target = None if self._queue else self.dispatch.place(stream)
        if target is None:  # requests wait (the fair order decides who goes next) or no room
            self._queue.push(stream)
            self.kick()  # a tenant below its share may take a slot
        else:
            await self.dispatch.attach(stream, target, initial=True)
        return stream

    def _validate(self, prompt: list[int], sampling: SamplingParams, adapter: str | None) -> None:
        """The refusals a runner would raise; with no runner active, against the last
        runner's limits and the adapters registered here."""
        self.fleet.validate(prompt, sampling, adapter, self.adapters)

    def admits(self, tenant: str, max_queue: int) -> bool:
        """Whether a request of `tenant` may wait here: the queue (max_queue) is shared
        fairly (scheduler/policy/fairness.py FairQueue.admits)."""
        return self._queue.admits(tenant, max_queue)

    def tenant_rows(self) -> list[TenantRow]:
        """Each tenant's fair-share state (counters, waiting, running), for /metrics."""
        self._queue.sync_running(self.dispatch.running())
        return self._queue.rows()

    def adapter_requests(self) -> tuple[Counter, Counter]:
        """Requests per adapter key (the base model's not counted): (placed on runners,
        waiting at the scheduler), for vLLM's lora_requests_info gauge."""
        running = Counter(st.adapter for st in self.dispatch.running() if st.adapter)
        waiting = Counter(st.adapter for st in self._queue if st.adapter)
        return running, waiting

    @property
    def queued(self) -> int:
        """Requests waiting at the scheduler for a runner with room."""
        return len(self._queue)

    async def migrate(self, stream: ClusterStream, reason: str, **how) -> bool:
        """Move a request off its runner (Mover.migrate: target, mode, requeue)."""
        return await self.mover.migrate(stream, reason, **how)

    async def defragment_kv(self, min_swap: int = DGFM_MIN_SWAP) -> list[Swap]:
        """DGFM: swap the debt cycles of at least min_swap blocks home now (distkv/service.py)."""
        return [] if self.distkv is None else await self.distkv.defragment(self._live(), min_swap)

    def _live(self) -> dict[str, object]:
        return holdable_runners(self.slots)

    # -- runners ------------------------------------------------------------------------------
    def check_runners(self) -> None:
        """Notice runners that died between requests, replace dead ones (Fleet.check)."""
        self.fleet.check()

    async def add_runners(self, count: int) -> list[str]:
        """Start `count` runners; each takes work once loaded and given every adapter."""
        return await self.fleet.add(count)

    def runners(self) -> list[RunnerRow]:
        """What GET /admin/runners lists, one row per runner."""
        return self.fleet.rows()

    def accepting(self) -> bool:
        """A runner is active or starting: open() takes requests (they may wait here while
        a dead runner's replacement starts). ready() is narrower: a runner takes work now."""
        self.fleet.check()
        return bool(self.fleet.active() or self.fleet.starting())

    def ready(self) -> bool:
        self.fleet.check()
        return bool(self.fleet.active())

    async def drain(self, runner_id: str | None = None, mode: str | None = None) -> str:
        """Stop placing on a runner (None: the least loaded), move its requests away (mode:
        see migrate), stop it. The last active runner is refused (409)."""
        runner_id = runner_id or drain_choice(self.dispatch.snapshots())
        if runner_id is None:
            raise ClusterError(409, "last_runner", "the last active runner cannot be removed")
        slot = self.fleet.begin_drain(runner_id)
        if slot is not None:
            await self.mover.drain(slot, mode)
            self.runner_left(slot)  # blocks it still lends go with it: debtors recompute
            await self.fleet.stop(slot)
        return runner_id

    def advice(self) -> Advice:
        now = time.monotonic()
        idle = {s.runner_id: now - s.idle_since for s in self.slots if not s.streams}
        return advise(self.dispatch.snapshots(), len(self._queue), idle, self.idle_after)

    def stats(self) -> EngineStats:
        """Sums over live runners; `waiting` includes requests waiting at the scheduler."""
        return self.fleet.stats(waiting=len(self._queue))

    def shutdown(self) -> None:
        self.fleet.shutdown()
        if self.distkv is not None:
            self.distkv.shutdown()

    # -- adapters (adapters.py) ---------------------------------------------------------------
    async def register_adapter(
        self,
        key: str,
        path: Path,
        sha256: str | None = None,
        version: int | None = None,
        pinned: bool | None = None,
    ) -> AdapterInfo:
        """Register on every live runner at once as `version` (a refusal rolls the others
        back; None: the scheduler numbers it), pinned as `pinned` says (None: as before);
        the version returned is valid for has_version()."""
        handles = self.fleet.live_handles()
        return await self.adapters.register(key, path, sha256, handles, version, pinned)

    async def unregister_adapter(self, key: str) -> None:
        await self.adapters.unregister(key, self.fleet.live_handles())

    def has_version(self, version: int) -> bool:
        """Whether any live runner still holds this version (current, or in use)."""
        return self.adapters.has_version(version, self.fleet.live_handles())
