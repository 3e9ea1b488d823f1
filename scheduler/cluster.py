"""The scheduler the frontend talks to: one control plane over N runners.

Placement is scheduler/placement.py (consolidation, Punica sec. 5.1); requests that find no
room wait here, first come first served, and are placed as room appears. The scheduler
holds every request's prompt and everything it has streamed, so a request can move:

- kv_pressure: a runner that runs out of KV memory preempts its newest request (batcher.py);
  if another runner has room, the request moves there instead of waiting on its own runner;
- drain: `drain(runner_id)` (scale-down) moves every request away, then stops the runner;
- failure: a runner whose engine stopped (a step raised, its thread or process died) loses
  nothing: its requests continue on the other runners from what they had streamed.

A dead runner is replaced (RestartPolicy; a scheduler with a factory does it unless told not
to): a new runner from the factory takes its place, at once the first time and with a
growing delay while replacements keep dying soon after they start, so one fault is never an
outage, even for a server of one runner (requests wait here while it starts). Poison
requests: the requests that were in a step that raised (RunnerLost.in_failed_step) are
retried one per runner (so a step that fails again names one suspect); one that was in two
failed steps in a row (no token in between) ends with an error and is never moved again.

DistKV (scheduler/distkv/network.py): a request whose KV fits on no single runner is placed on the
runner with the most room and borrows blocks on the others through the gManager's ledger
(thread runners; `distkv=False` refuses such a prompt, naming one runner's limit).

A move recomputes (Punica sec. 5.3): the target prefills prompt + generated tokens and goes
on (see punica_x.core.Resume); the client's stream continues with no token missing or
repeated, and greedy and seeded output equal a run that never moved. A request that fails
on MAX_FAILURES runners ends with an error instead of taking the cluster down with it.

Adapters are registered on every runner (new runners get all current ones before they take
work) under the key the frontend chooses (tenant-scoped, so tenants never collide)."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

from punica_x.async_engine import RunnerLost
from punica_x.core import SamplingParams
from punica_x.lora.adapter import LoraTarget
from punica_x.lora.pool import AdapterInfo, UnknownAdapterError
from scheduler.adapters import AdapterRegistry
from scheduler.distkv.dgfm import Swap
from scheduler.distkv.group import KVGroup, make_kv_group
from scheduler.errors import ClusterError, NoRunner
from scheduler.fleet import DEFAULT_RESTART, Fleet, RestartPolicy, RunnerSlot
from scheduler.interface import ModelInfo, RunnerHandle, RunnerStats
from scheduler.migration import COPY, DEFAULT_COSTS, RECOMPUTE, MigrationCosts, choose_mode
from scheduler.placement import (
    ACTIVE,
    Advice,
    RunnerSnapshot,
    advise,
    blocks_for,
    drain_choice,
    fits_alone,
    has_room,
    place,
    place_distributed,
)
from scheduler.stream import ClusterStream
from scheduler.waiting import TenantRow, WaitingQueue

log = logging.getLogger(__name__)

DGFM_INTERVAL_S = 1.0  # how often the scheduler looks for debt cycles to swap home
DGFM_MIN_SWAP = 4  # blocks: smaller swaps are not worth pausing the runners
MAX_FAILURES = 3  # runners a request may see fail under it before it ends with an error
QUARANTINE_STEPS = 2  # failed steps in a row a request may be in before it ends with an error


@dataclass(frozen=True)
class SchedulerInfo:
    model: ModelInfo
    lora_target: LoraTarget
    max_lora_rank: int


class Scheduler:
    """runners: started runners (at least one). factory(runner_id) builds one more runner of
    the same backend (blocking; it runs on a worker thread) for scale-up; None: fixed size.
    distkv: thread runners lend each other KV blocks for requests no single one can hold
    (lend_fraction of each runner's blocks at most). distkv_overlap: run the peers'
    micro-attention on worker threads while the local part runs; off by default because
    thread runners share the CPU's cores, and there it measured slower (bench_distkv); Ray
    runners always overlap (their own processes). distkv_transport: Ray runners' data plane,
    "socket" (scheduler/distkv/channel.py) or "ray" (actor calls, slower; for comparison).
    restart: how a dead runner is replaced through the factory (RestartPolicy); None, or no
    factory, leaves dead runners dead. `restarts` counts the replacements that took work.
    fair_share: requests waiting here are served across tenants by their virtual token
    counters, and a tenant below its share of the batch slots takes one from the tenant
    furthest above its share (scheduler/fairness.py); False: first come, first served."""

    def __init__(
        self,
        runners: list[RunnerHandle],
        factory: Callable[[str], RunnerHandle] | None = None,
        idle_after: float = 60.0,
        tokenizer=None,
        distkv: bool = True,
        lend_fraction: float = 0.9,
        distkv_overlap: bool = False,
        distkv_transport: str = "socket",
        restart: RestartPolicy | None = DEFAULT_RESTART,
        fair_share: bool = True,
    ) -> None:
        if not runners:
            raise ValueError("the scheduler needs at least one runner")
        first = runners[0]
        info = first.info
        self.info = SchedulerInfo(info.model, info.lora_target, info.max_lora_rank)
        self.tokenizer = tokenizer if tokenizer is not None else first.tokenizer
        self.idle_after = idle_after
        self.quarantined = 0  # requests ended as poison (in QUARANTINE_STEPS failed steps)
        self.fleet = Fleet(runners, factory, restart, self)
        self._queue = WaitingQueue(fair_share)
        self._arrivals = itertools.count()  # the order requests arrived in (newest: largest)
        self.adapters = AdapterRegistry()
        self.migrations: collections.Counter[tuple[str, str]] = collections.Counter(
            {
                (reason, mode): 0
                for reason in ("kv_pressure", "drain", "failure", "fair_share")
                for mode in (RECOMPUTE, COPY)
                if not (reason == "failure" and mode == COPY)
            }
        )
        self.costs: dict[str, MigrationCosts] = dict(DEFAULT_COSTS)  # per backend
        self._tasks: set[asyncio.Task] = set()
        self.kv_swapped_blocks = 0  # blocks DGFM brought home
        self._dgfm_started = False
        # DistKV (scheduler/distkv/group.py), None when off
        self.kv_group: KVGroup | None = None
        if distkv:
            self.kv_group = make_kv_group(
                {r.backend for r in runners}, lend_fraction, distkv_overlap, distkv_transport
            )
            for slot in self.slots:
                self._join_distkv(slot)

    # -- the fleet (scheduler/fleet.py) and what it tells the scheduler (FleetHooks) ----------
    @property
    def slots(self) -> list[RunnerSlot]:
        return self.fleet.slots

    @property
    def restarts(self) -> int:
        return self.fleet.restarts

    @property
    def failures(self) -> collections.Counter[str]:
        return self.fleet.failures

    @property
    def _closed(self) -> bool:
        return self.fleet.closed

    async def install(self, handle) -> None:
        await self.adapters.install(handle)

    def join(self, slot: RunnerSlot) -> None:
        self._join_distkv(slot)

    def runner_left(self, slot: RunnerSlot) -> None:
        self._leave_distkv(slot, dead=True)

    def none_left(self, message: str) -> None:
        for stream in self._queue.clear():
            stream.fail(message)

    def _join_distkv(self, slot: RunnerSlot) -> None:
        """The runner lends blocks and may borrow them (before it takes any request)."""
        if self.kv_group is not None:
            self.kv_group.join(slot.handle)

    def _leave_distkv(self, slot: RunnerSlot, dead: bool) -> None:
        if self.kv_group is not None:
            self.kv_group.leave(slot.runner_id, dead)

    async def defragment_kv(self, min_swap: int = DGFM_MIN_SWAP) -> list[Swap]:
        """DGFM: swap the debt cycles of at least min_swap blocks home (scheduler/distkv/dgfm.py)
        among the live runners, each cycle's runners held between two steps. Returns the
        swaps done."""
        if self.kv_group is None:
            return []
        live = {s.runner_id: s.handle for s in self.slots if s.state in (ACTIVE, "draining")}
        done = await self.kv_group.defragment(live, min_swap)
        for s in done:
            self.kv_swapped_blocks += s.blocks * len(s.cycle)
            log.info("DGFM: %d blocks of each of %s came home", s.blocks, " -> ".join(s.cycle))
        return done

    async def _dgfm_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(DGFM_INTERVAL_S)
            try:
                if self.kv_group.has_work():
                    await self.defragment_kv()
            except Exception:
                log.exception("DGFM swap failed")

    # -- requests -----------------------------------------------------------------------------
    async def open(
        self,
        prompt: list[int],
        sampling: SamplingParams,
        adapter: str | None,
        request_id: str,
        tenant: str = "",
        weight: float = 1.0,
    ) -> ClusterStream:
        """Place a request (or queue it here when no runner has room, or while the only
        runners are starting: a dead one being replaced) and return its output stream;
        refusals (ValueError, UnknownAdapterError) raise here, NoRunner when no runner is
        active or starting. Closing the stream aborts the request. tenant, weight: whose
        request it is and that tenant's weight, for fair share."""
        if not self.accepting():
            raise NoRunner("no runner is active")
        if self.kv_group is not None and not self._dgfm_started:
            self._dgfm_started = True
            self._spawn(self._dgfm_loop())
        self._validate(prompt, sampling, adapter)
        stream = ClusterStream(self, list(prompt), sampling, adapter, request_id, tenant)
        stream.arrival = next(self._arrivals)
        self._queue.set_weight(tenant, weight)
        if self._queue:  # requests wait: the fair order decides who goes next
            self._queue.push(stream)
            self.kick()
        else:
            target = self._place(stream)
            if target is None:
                self._queue.push(stream)
                self.kick()  # a tenant below its share may take a slot
            else:
                await self._attach(stream, target, initial=True)
        return stream

    @property
    def fair_share(self) -> bool:
        return self._queue.fair_share

    def admits(self, tenant: str, max_queue: int) -> bool:
        """Whether a request of `tenant` may wait here: the queue (max_queue) is shared
        fairly (scheduler/fairness.py FairQueue.admits)."""
        return self._queue.admits(tenant, max_queue)

    def tenant_rows(self) -> list[TenantRow]:
        """Each tenant's fair-share state (counters, waiting, running), for /metrics."""
        self._queue.sync_running(self._placed())
        return self._queue.rows()

    def _validate(self, prompt: list[int], sampling: SamplingParams, adapter: str | None) -> None:
        """The refusals a runner would raise; with no runner active, against the last
        runner's limits and the adapters registered here."""
        active = self.fleet.active()
        if active:
            active[0].handle.validate(prompt, sampling, adapter)
            return
        self.fleet.limits.check(prompt, sampling)
        if adapter is not None and adapter not in self.adapters:
            raise UnknownAdapterError(adapter)

    def snapshots(self) -> list[RunnerSnapshot]:
        return [s.snapshot() for s in self.slots]

    def _place(
        self, stream: ClusterStream, exclude: frozenset[str] = frozenset(), isolate: bool = True
    ):
        """The runner to open `stream` on, or None. isolate: a suspect (a request that was in
        a failed step) goes only to a runner holding no other suspect."""
        if isolate and stream.suspect:
            exclude = exclude | self._holding_suspects(stream)
        snaps, demand = self.snapshots(), stream.demand()
        rid = place(snaps, demand, exclude)
        if rid is None and self.kv_group is not None:
            active = [s for s in snaps if s.state == ACTIVE and s.runner_id not in exclude]
            if active and not any(fits_alone(s, demand) for s in active):
                rid = place_distributed(snaps, demand, exclude)
        return None if rid is None else self.fleet.slot(rid)

    def _holding_suspects(self, stream: ClusterStream) -> frozenset[str]:
        """Runners that hold a suspect other than `stream` (see ClusterStream.suspect)."""
        return frozenset(
            s.runner_id
            for s in self.slots
            if any(o.suspect and o is not stream for o in s.streams.values())
        )

    async def _attach(self, stream: ClusterStream, slot: RunnerSlot, initial: bool = False) -> None:
        """Open `stream` on `slot`. initial: the caller's open() (refusals raise to it);
        otherwise failures end the stream with an error output or move it on."""
        slot.streams[stream.request_id] = stream  # counted by placement from now on
        stream.slot = slot
        stream.runners_seen.append(slot.runner_id)
        try:
            inner = await slot.handle.open(
                stream.prompt,
                stream.sampling,
                stream.adapter,
                stream.request_id,
                stream.resume,
                on_preempt=lambda: self._preempted(stream),
            )
        except RunnerLost as exc:
            slot.streams.pop(stream.request_id, None)
            stream.slot = None
            self.fleet.died(slot, str(exc))
            if initial:
                target = self._place(stream)
                if target is None:
                    self._queue.push(stream)
                    return
                return await self._attach(stream, target, initial=True)
            return self._requeue(stream)
        except BaseException as exc:
            slot.streams.pop(stream.request_id, None)
            stream.slot = None
            if initial:
                raise
            stream.fail(f"the request could not be placed again: {exc}")
            self.kick()
            return
        if stream.closed:  # the caller left while it was being placed
            await inner.aclose()
            slot.streams.pop(stream.request_id, None)
            self.kick()
            return
        stream.inner = inner
        if stream.queue_wait is None:  # its first placement: the prompt is served now
            stream.queue_wait = time.monotonic() - stream.created
            self._queue.served(stream, prompt_tokens=len(stream.prompt))
        if stream.resume is not None and stream.resume.kv is not None:
            stream.resume = dataclasses.replace(stream.resume, kv=None)  # imported: let it go
        stream.placed.set()

    def _requeue(self, stream: ClusterStream) -> None:
        """Place a moving stream now if a runner has room, else queue it (ahead of new ones:
        it was admitted first)."""
        if stream.closed:
            return
        if not self.fleet.active() and not self.fleet.starting():
            stream.fail(self.fleet.no_runner_message())
            return
        target = self._place(stream)
        if target is None:
            self._queue.push(stream, front=True)
        else:
            self._spawn(self._attach(stream, target))

    def kick(self) -> None:
        """Place waiting requests while runners have room, in the fair order (the least
        served tenant's oldest first; with fair share off, the oldest). A suspect that only
        waits for a runner without another suspect keeps its place but lets others by. When
        the next request finds no room, a tenant below its share may take a slot."""
        held: list[ClusterStream] = []
        self._queue.sync_running(self._placed())
        while (stream := self._queue.peek()) is not None:
            if stream.closed:
                self._queue.pop(stream)
                continue
            target = self._place(stream)
            if target is None:
                if stream.suspect and self._place(stream, isolate=False) is not None:
                    self._queue.pop(stream)
                    held.append(stream)
                    continue
                self._rebalance()
                break
            self._queue.pop(stream)
            target.streams[stream.request_id] = stream  # count it before the open completes
            self._queue.fair.started(self._queue.key(stream))
            self._spawn(self._attach(stream, target))
        for stream in reversed(held):
            self._queue.push(stream, front=True)

    def stream_served(self, stream: ClusterStream, tokens: int) -> None:
        """`stream` received `tokens` new tokens: its tenant's counter grows."""
        self._queue.served(stream, output_tokens=tokens)

    def _placed(self) -> list[ClusterStream]:
        """Requests on live runners, less those giving their slot up (fair share)."""
        return [
            st
            for s in self.slots
            if s.state != "dead"
            for st in s.streams.values()
            if not st.yielding
        ]

    def _rebalance(self) -> None:
        """Requests wait and no runner has room: while a tenant below its share of the batch
        slots waits and another holds more than its share, that tenant's newest request
        moves back to the queue (migration: its KV copied or recomputed) and the waiting one
        takes its slot (scheduler/fairness.py FairQueue.rebalance). Requests giving their
        slot up no longer count as running, so rounds may overlap."""
        snaps = [s for s in self.snapshots() if s.state == ACTIVE]
        moves = self._queue.rebalance(sum(s.max_working_set or s.max_batch_size for s in snaps))
        chosen: set[str] = set()
        takers: dict[str, list[ClusterStream]] = {}
        for move in moves:
            waiting = takers.setdefault(move.taker, self._queue.waiting_of(move.taker))
            if not waiting:
                continue
            victim = self._victim(move.giver, waiting[0], chosen)
            if victim is None:
                continue
            chosen.add(victim.request_id)
            taker = waiting.pop(0)
            self._queue.remove(taker)
            victim.slot.streams[taker.request_id] = taker  # its slot, held for the taker
            victim.yielding = True
            self._spawn(self._yield_slot(victim, taker, victim.slot))

    def _victim(self, tenant: str, taker: ClusterStream, chosen: set[str]) -> ClusterStream | None:
        """The newest running request of `tenant` (not already chosen) whose runner, without
        it, has room for `taker`."""
        candidates = [
            st
            for s in self.fleet.active()
            for st in s.streams.values()
            if self._queue.key(st) == tenant
            and st.inner is not None
            and st.request_id not in chosen
            and not (st.moving or st.closed or st.suspect or st.yielding)
        ]
        for st in sorted(candidates, key=lambda st: st.arrival, reverse=True):
            snap = st.slot.snapshot()
            # without it, and without those already giving their slots up there
            leaving = [st, *(o for o in st.slot.streams.values() if o.yielding)]
            freed = sum(
                min(blocks_for(o.num_tokens, snap.block_size), snap.kv_blocks_total)
                for o in leaving
            )
            after = dataclasses.replace(
                snap,
                working_set=snap.working_set - len(leaving),
                kv_blocks_committed=snap.kv_blocks_committed - freed,
            )
            if has_room(after, taker.demand()):
                return st
        return None

    async def _yield_slot(
        self, victim: ClusterStream, taker: ClusterStream, slot: RunnerSlot
    ) -> None:
        """Move `victim` back to the queue and open `taker` in its slot (held for it). Both
        are sent at once: on a thread runner the take and the open run between the same
        two steps (the batcher holds the taker until the victim is gone)."""
        try:
            await asyncio.gather(
                self.migrate(victim, "fair_share", requeue=True), self._attach(taker, slot)
            )
        finally:
            victim.yielding = False
            self.kick()

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def stream_done(self, stream: ClusterStream) -> None:
        """A stream ended (finished, aborted, failed): its place is free."""
        if stream.slot is not None:
            stream.slot.streams.pop(stream.request_id, None)
            if not stream.slot.streams:
                stream.slot.idle_since = time.monotonic()
            stream.slot = None
        self._queue.remove(stream)
        self.kick()

    # -- migration ----------------------------------------------------------------------------
    def _preempted(self, stream: ClusterStream) -> None:
        """Its runner ran out of KV and sent it back to its own queue: move it to a runner
        with room, if there is one (else it recomputes where it is, as soon as room frees)."""
        source = stream.slot
        if source is None or stream.closed or stream.moving:
            return
        if not any(fits_alone(s, stream.demand()) for s in self.snapshots() if s.state == ACTIVE):
            return  # a DistKV request: no runner holds it alone, moving it gains nothing
        target = self._place(stream, exclude=frozenset({source.runner_id}))
        if target is not None:
            self._spawn(self.migrate(stream, "kv_pressure", target))

    def choose_mode(self, stream: ClusterStream, reason: str) -> str:
        h = stream.slot.handle
        costs = self.costs[stream.slot.backend]
        return choose_mode(stream.num_tokens - 1, h.info.kv_bytes_per_token, costs, reason)

    async def migrate(
        self,
        stream: ClusterStream,
        reason: str,
        target: RunnerSlot | None = None,
        mode: str | None = None,
        requeue: bool = False,
    ) -> bool:
        """Move a request off its runner: take it there (its outputs so far stay ahead of the
        move in its stream), then place it elsewhere (target, if it still has room) or queue
        it (requeue: always queue it, first of its tenant). mode: RECOMPUTE or COPY (its KV
        goes along); None lets the cost model choose (scheduler/migration.py). False if it
        finished or left first."""
        source = stream.slot
        if source is None or stream.closed or stream.moving or stream.inner is None:
            return False
        mode = mode or self.choose_mode(stream, reason)
        stream.moving = True
        try:
            try:
                resume = await source.handle.take(stream.request_id, mode == COPY)
            except RunnerLost:
                return False  # the reader sees RunnerLost and recomputes from what it had
            if resume is None:
                return False  # finished (or aborted) on the source meanwhile
            source.streams.pop(stream.request_id, None)
            if not source.streams:
                source.idle_since = time.monotonic()
            inner, stream.inner, stream.slot = stream.inner, None, None
            stream.placed.clear()
            stream.resume = resume
            inner.moved()
            stream.retired.append(inner)  # read to its end before the new runner's outputs
            mode = COPY if resume.kv is not None else RECOMPUTE
            self.migrations[(reason, mode)] += 1
            log.info(
                "moving %s off %s (%s, %s, %d tokens)",
                stream.request_id,
                source.runner_id,
                reason,
                mode,
                stream.num_tokens,
            )
            if requeue:
                self._queue.push(stream, front=True)
                return True
            exclude = frozenset({source.runner_id})
            if target is not None and target.state == ACTIVE:
                snaps = [target.snapshot()]
                if place(snaps, stream.demand(), exclude) is None:
                    target = None
            target = target or self._place(stream, exclude)
            if target is None:
                self._requeue(stream)
            else:
                await self._attach(stream, target)
            return True
        finally:
            stream.moving = False
            self.kick()

    async def stream_lost(
        self, stream: ClusterStream, error: str, in_failed_step: bool = False
    ) -> None:
        """The stream's runner died: continue from what the client was sent. in_failed_step:
        the request was in the step that raised; a request in QUARANTINE_STEPS failed steps
        in a row ends with an error (a poison request is not retried for ever, nor allowed
        to take runner after runner down)."""
        slot = stream.slot
        if slot is not None:
            slot.streams.pop(stream.request_id, None)
            self.fleet.died(slot, error)
        stream.slot, stream.inner = None, None
        stream.placed.clear()
        stream.failures += 1
        if in_failed_step:
            stream.failed_steps += 1
            if stream.failed_steps >= QUARANTINE_STEPS:
                self.quarantined += 1
                log.error("request %s quarantined: %s", stream.request_id, error)
                stream.fail(
                    f"this request was in {stream.failed_steps} engine steps that failed "
                    f"(last: {error}); it is not retried"
                )
                self.kick()
                return
        if stream.failures >= MAX_FAILURES:
            stream.fail(f"the request failed on {stream.failures} runners; last: {error}")
            return
        stream.resume = stream.resume_point()
        self.migrations[("failure", "recompute")] += 1
        self._requeue(stream)
        self.kick()

    def check_runners(self) -> None:
        """Notice runners that died between requests, replace dead ones (Fleet.check)."""
        self.fleet.check()

    async def add_runners(self, count: int) -> list[str]:
        """Start `count` runners; each takes work once loaded and given every adapter."""
        return await self.fleet.add(count)

    def runners(self) -> list[dict]:
        """What GET /admin/runners lists, one dict per runner."""
        return self.fleet.rows()

    def accepting(self) -> bool:
        """A runner is active or starting: open() takes requests (they may wait here while
        a dead runner's replacement starts). ready() is narrower: a runner takes work now."""
        self.fleet.check()
        return bool(self.fleet.active() or self.fleet.starting())

    async def drain(self, runner_id: str | None = None, mode: str | None = None) -> str:
        """Stop placing on a runner (None: the least loaded), move its requests away (mode:
        see migrate), stop it. The last active runner is refused (409)."""
        if runner_id is None:
            runner_id = drain_choice(self.snapshots())
            if runner_id is None:
                raise ClusterError(409, "last_runner", "the last active runner cannot be removed")
        slot = self.fleet.slot(runner_id)
        if slot.state == "dead":
            self.slots.remove(slot)
            return runner_id
        if slot.state != ACTIVE:
            raise ClusterError(409, "not_active", f"runner {runner_id} is {slot.state}")
        if len(self.fleet.active()) <= 1:
            raise ClusterError(409, "last_runner", "the last active runner cannot be removed")
        slot.state = "draining"
        slot.handle.stop_lending()
        log.info("draining runner %s (%d requests)", runner_id, len(slot.streams))
        while slot.streams:
            for stream in list(slot.streams.values()):
                if stream.inner is not None and not stream.moving:
                    await self.migrate(stream, "drain", mode=mode)
            await asyncio.sleep(0.01)  # requests still being opened there, or finishing
        self._leave_distkv(slot, dead=True)  # blocks it still lends go with it: debtors recompute
        await asyncio.to_thread(slot.handle.shutdown)
        self.slots.remove(slot)
        log.info("runner %s drained and stopped", runner_id)
        return runner_id

    @property
    def queued(self) -> int:
        """Requests waiting at the scheduler for a runner with room."""
        return len(self._queue)

    def advice(self) -> Advice:
        now = time.monotonic()
        idle = {s.runner_id: now - s.idle_since for s in self.slots if not s.streams}
        return advise(self.snapshots(), len(self._queue), idle, self.idle_after)

    # -- adapters -----------------------------------------------------------------------------
    async def register_adapter(
        self, key: str, path: Path, sha256: str | None = None
    ) -> AdapterInfo:
        """Register on every live runner at once (scheduler/adapters.py: a refusal rolls the
        others back); the version returned is the scheduler's own, valid for has_version()."""
        return await self.adapters.register(key, path, sha256, self.fleet.live_handles())

    async def unregister_adapter(self, key: str) -> None:
        await self.adapters.unregister(key, self.fleet.live_handles())

    def has_version(self, version: int) -> bool:
        """Whether any live runner still holds this version (current, or in use)."""
        return self.adapters.has_version(version, self.fleet.live_handles())

    # -- health -------------------------------------------------------------------------------
    def stats(self) -> RunnerStats:
        """Sums over live runners; `waiting` includes requests waiting at the scheduler."""
        per = [s.handle.stats() for s in self.slots if s.handle is not None and s.state != "dead"]
        total = {f.name: sum(getattr(p, f.name) for p in per) for f in fields(RunnerStats)}
        total["waiting"] += len(self._queue)
        return RunnerStats(**total)

    def ready(self) -> bool:
        self.fleet.check()
        return bool(self.fleet.active())

    def shutdown(self) -> None:
        self.fleet.shutdown()
        if self.kv_group is not None:
            self.kv_group.shutdown()
