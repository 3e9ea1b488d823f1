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
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

from punica_x.async_engine import RunnerLost
from punica_x.core import SamplingParams
from punica_x.heap import thaw
from punica_x.lora.adapter import LoraTarget
from punica_x.lora.pool import AdapterInfo, UnknownAdapterError
from scheduler.distkv.dgfm import Swap
from scheduler.distkv.group import KVGroup, make_kv_group
from scheduler.interface import ModelInfo, RequestLimits, RunnerStats
from scheduler.local import LocalRunner
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
KEEP_DEAD = 8  # dead runners still listed (GET /admin/runners) before the oldest is dropped


class ClusterError(Exception):
    """A refused cluster operation; `status` is the HTTP status the admin API answers."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


class NoRunner(RuntimeError):
    """No runner is active or starting: nothing can take a request now."""


@dataclass(frozen=True)
class RestartPolicy:
    """How a dead runner is replaced (through the scheduler's factory): at once the first
    time; while each replacement dies within stable_s of taking work, the next one starts
    after backoff_s, then twice that, ... up to max_backoff_s; a runner that stayed up
    stable_s is replaced at once again. A replacement whose start fails is tried again
    (with the next delay) up to start_attempts times, then left dead."""

    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    stable_s: float = 60.0
    start_attempts: int = 3

    def delay(self, level: int) -> float:
        """Seconds before a replacement when `level` runners of its line died quickly
        before the one it replaces."""
        if level <= 0:
            return 0.0
        return min(self.max_backoff_s, self.backoff_s * 2 ** (level - 1))


@dataclass(frozen=True)
class SchedulerInfo:
    model: ModelInfo
    lora_target: LoraTarget
    max_lora_rank: int


@dataclass(eq=False)
class RunnerSlot:
    """A runner as the scheduler tracks it (handle is None while it starts)."""

    runner_id: str
    index: int
    backend: str
    handle: LocalRunner | None = None
    state: str = "starting"
    streams: dict[str, ClusterStream] = field(default_factory=dict)
    idle_since: float = field(default_factory=time.monotonic)
    error: str | None = None
    active_since: float = field(default_factory=time.monotonic)
    replaces: str | None = None  # the dead runner this one was started in place of
    # runners of its line (each replaced the one before) that died in a row just before it,
    # all but the first within the restart policy's stable_s of taking work (its backoff)
    streak: int = 0
    start_failures: int = 0  # failed starts of this replacement
    replace_due: bool = False  # dead, and to be replaced once an event loop runs
    where: tuple = (None, None, None)  # node, pid, device (kept after the handle is let go)

    def snapshot(self) -> RunnerSnapshot:
        h = self.handle
        if h is None:
            return RunnerSnapshot(self.runner_id, self.state, 0, 0, 0, 0, 1, index=self.index)
        committed = sum(
            min(blocks_for(s.num_tokens, h.block_size), h.kv_blocks_total)  # a DistKV one
            for s in self.streams.values()  # holds at most this runner's blocks here
        )
        committed += kv_lent(h)
        return RunnerSnapshot(
            runner_id=self.runner_id,
            state=self.state,
            working_set=len(self.streams),
            max_batch_size=h.max_batch_size,
            max_working_set=h.max_working_set,
            kv_blocks_total=h.kv_blocks_total,
            kv_blocks_committed=committed,
            kv_blocks_swap=h.kv_blocks_swap,
            block_size=h.block_size,
            resident_adapters=h.resident_adapters(),
            index=self.index,
        )


def kv_lent(handle) -> int:
    """Blocks a runner lends to peers' requests (DistKV); 0 when it takes no part."""
    return handle.stats().kv_blocks_lent


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
        runners: list[LocalRunner],
        factory: Callable[[str], LocalRunner] | None = None,
        idle_after: float = 60.0,
        tokenizer=None,
        distkv: bool = True,
        lend_fraction: float = 0.9,
        distkv_overlap: bool = False,
        distkv_transport: str = "socket",
        restart: RestartPolicy | None = RestartPolicy(),
        fair_share: bool = True,
    ) -> None:
        if not runners:
            raise ValueError("the scheduler needs at least one runner")
        first = runners[0]
        self.info = SchedulerInfo(first.model, first.lora_target, first.max_lora_rank)
        self.tokenizer = tokenizer if tokenizer is not None else first.tokenizer
        self.factory = factory
        self.idle_after = idle_after
        self.restart = restart
        self.restarts = 0  # dead runners replaced (the replacement took work)
        self.quarantined = 0  # requests ended as poison (in QUARANTINE_STEPS failed steps)
        # what open() checks a request against while no runner is active (one is starting)
        self._limits: RequestLimits = first.limits()
        self._index = itertools.count()
        self.slots: list[RunnerSlot] = []
        for r in runners:
            slot = RunnerSlot(r.runner_id, next(self._index), r.backend, r, state=ACTIVE)
            slot.where = _where(r)
            self.slots.append(slot)
        self._queue = WaitingQueue(fair_share)
        self._arrivals = itertools.count()  # the order requests arrived in (newest: largest)
        self._adapters: dict[str, tuple[Path, str | None]] = {}
        # the scheduler's adapter versions -> each runner's own version of the same files
        self._versions: dict[int, dict[str, int]] = {}
        self._version_ids = itertools.count(1)
        self._current: dict[str, int] = {}  # adapter key -> its current scheduler version
        self.migrations: collections.Counter[tuple[str, str]] = collections.Counter(
            {
                (reason, mode): 0
                for reason in ("kv_pressure", "drain", "failure", "fair_share")
                for mode in (RECOMPUTE, COPY)
                if not (reason == "failure" and mode == COPY)
            }
        )
        self.costs: dict[str, MigrationCosts] = dict(DEFAULT_COSTS)  # per backend
        self.failures: collections.Counter[str] = collections.Counter()  # runner deaths
        self._tasks: set[asyncio.Task] = set()
        self._replacing: set[asyncio.Task] = set()  # dead runners' replacements starting
        self.kv_swapped_blocks = 0  # blocks DGFM brought home
        self._closed = False
        self._dgfm_started = False
        # DistKV (scheduler/distkv/group.py), None when off
        self.kv_group: KVGroup | None = None
        if distkv:
            self.kv_group = make_kv_group(
                {r.backend for r in runners}, lend_fraction, distkv_overlap, distkv_transport
            )
            for slot in self.slots:
                self._join_distkv(slot)

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
        active = self._active()
        if active:
            active[0].handle.validate(prompt, sampling, adapter)
            return
        self._limits.check(prompt, sampling)
        if adapter is not None and adapter not in self._adapters:
            raise UnknownAdapterError(adapter)

    def _active(self) -> list[RunnerSlot]:
        return [s for s in self.slots if s.state == ACTIVE]

    def _slot(self, runner_id: str) -> RunnerSlot:
        for s in self.slots:
            if s.runner_id == runner_id:
                return s
        raise ClusterError(404, "runner_not_found", f"no runner {runner_id!r}")

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
        return None if rid is None else self._slot(rid)

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
            self._runner_died(slot, str(exc))
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
        if not self._active() and not self._starting():
            stream.fail(self._no_runner_message())
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
            for s in self._active()
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
        return choose_mode(stream.num_tokens - 1, h.kv_bytes_per_token, costs, reason)

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
            self._runner_died(slot, error)
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

    def _runner_died(self, slot: RunnerSlot, error: str) -> None:
        if slot.state == "dead":
            return
        log.error("runner %s failed: %s; its requests continue elsewhere", slot.runner_id, error)
        draining = slot.state == "draining"
        slot.state, slot.error = "dead", error
        self._leave_distkv(slot, dead=True)
        self.failures[slot.runner_id] += 1
        if not draining:  # (a runner being drained was on its way out anyway)
            slot.replace_due = self._can_replace()
            self._replace(slot)
        dead = [s for s in self.slots if s.state == "dead"]
        for old in dead[: max(0, len(dead) - KEEP_DEAD)]:
            self.slots.remove(old)
        self._fail_queue_if_none_left()

    def _fail_queue_if_none_left(self) -> None:
        """No runner is active or starting: nothing will ever take the waiting requests."""
        if not self._active() and not self._starting():
            message = self._no_runner_message()
            for stream in self._queue.clear():
                stream.fail(message)

    # -- replacing dead runners ---------------------------------------------------------------
    def _can_replace(self) -> bool:
        return self.restart is not None and self.factory is not None and not self._closed

    def _replace(self, dead: RunnerSlot) -> None:
        """Start a runner in the dead one's place (see RestartPolicy), unless no event loop
        runs here (check_runners does it on the next call from one)."""
        if not dead.replace_due:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        dead.replace_due = False
        old, dead.handle = dead.handle, None  # let its engine (and KV cache) go
        if old is not None:
            with contextlib.suppress(Exception):
                self._limits = old.limits()
        quick = time.monotonic() - dead.active_since < self.restart.stable_s
        streak = dead.streak if quick else 0  # quick failures before this one
        index = next(self._index)
        slot = RunnerSlot(f"runner-{index}", index, dead.backend, replaces=dead.runner_id)
        slot.streak = streak + 1
        self.slots.append(slot)
        delay = self.restart.delay(streak)
        log.warning(
            "starting runner %s in place of %s%s",
            slot.runner_id,
            dead.runner_id,
            f" in {delay:g} s" if delay else "",
        )
        task = asyncio.get_running_loop().create_task(self._replacement(slot, old, delay))
        self._replacing.add(task)
        task.add_done_callback(self._replacing.discard)

    async def _replacement(self, slot: RunnerSlot, old, delay: float) -> None:
        """Stop the dead runner's handle (its process, its thread's engine), wait `delay`,
        start `slot` as add_runners would (every adapter, DistKV); a failed start is tried
        again after the next delay, up to start_attempts times."""
        try:
            if old is not None:
                box = [old]
                del old  # the worker thread holds the last reference, and drops it
                await asyncio.to_thread(_let_go, box)
            while True:
                if delay > 0:
                    await asyncio.sleep(delay)
                if self._closed or slot not in self.slots:
                    return
                try:
                    await self._start(slot)
                except Exception as exc:  # _start left it dead
                    slot.start_failures += 1
                    log.error("replacement runner %s failed to start: %s", slot.runner_id, exc)
                    if slot.start_failures >= self.restart.start_attempts or self._closed:
                        self._fail_queue_if_none_left()
                        return
                    slot.state = "starting"
                    delay = self.restart.delay(slot.streak + slot.start_failures - 1)
                    continue
                self.restarts += 1
                self.kick()
                return
        except asyncio.CancelledError:  # its event loop ended: a later one starts it over
            if slot.state != ACTIVE:
                slot.state, slot.error = "dead", "its start was cancelled"
                slot.replace_due = self._can_replace()
            raise

    def _no_runner_message(self) -> str:
        errors = [f"{s.runner_id}: {s.error}" for s in self.slots if s.error]
        return "no runner is left to serve the request" + (f" ({errors[-1]})" if errors else "")

    def _starting(self) -> list[RunnerSlot]:
        return [s for s in self.slots if s.state == "starting"]

    def check_runners(self) -> None:
        """Notice runners that died between requests (a thread that exited), and replace
        dead ones that could not be replaced where they died (no event loop there)."""
        for slot in list(self.slots):
            if slot.state in (ACTIVE, "draining") and not slot.handle.alive():
                self._runner_died(slot, slot.handle.error or "the runner stopped")
            elif slot.state == "dead" and slot.replace_due:
                self._replace(slot)

    def accepting(self) -> bool:
        """A runner is active or starting: open() takes requests (they may wait here while
        a dead runner's replacement starts). ready() is narrower: a runner takes work now."""
        self.check_runners()
        return bool(self._active() or self._starting())

    # -- scale --------------------------------------------------------------------------------
    async def add_runners(self, count: int) -> list[str]:
        """Start `count` runners; each takes work once loaded and given every adapter."""
        if self.factory is None:
            raise ClusterError(409, "fixed_size", "this server cannot start runners")
        if not 1 <= count <= 16:
            raise ClusterError(400, "invalid_value", "count must be in [1, 16]")
        slots = []
        for _ in range(count):
            index = next(self._index)
            slot = RunnerSlot(f"runner-{index}", index, self.slots[0].backend)
            self.slots.append(slot)
            slots.append(slot)
        results = await asyncio.gather(*(self._start(s) for s in slots), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        self.kick()
        if errors:
            raise ClusterError(500, "runner_start_failed", f"a runner failed to start: {errors[0]}")
        return [s.runner_id for s in slots]

    async def _start(self, slot: RunnerSlot) -> None:
        try:
            slot.handle = await asyncio.to_thread(self._build, slot.runner_id)
            slot.backend = slot.handle.backend
            slot.where = _where(slot.handle)
            for key, (path, sha256) in list(self._adapters.items()):
                info = await slot.handle.register_adapter(key, path, sha256)
                version = self._current.get(key)
                if version in self._versions:
                    self._versions[version][slot.runner_id] = info.version
        except BaseException as exc:
            slot.state, slot.error = "dead", f"start failed: {exc}"
            if slot.handle is not None:
                await asyncio.to_thread(slot.handle.shutdown)
            raise
        await asyncio.to_thread(self._join_distkv, slot)
        slot.state = ACTIVE
        slot.idle_since = slot.active_since = time.monotonic()
        slot.error = None
        log.info("runner %s is active", slot.runner_id)

    def _build(self, runner_id: str):
        """factory(runner_id), on a worker thread; a runner built after shutdown() is stopped
        at once instead of being left running."""
        handle = self.factory(runner_id)
        if self._closed:
            handle.shutdown()
            raise RuntimeError("the scheduler shut down while the runner started")
        return handle

    async def drain(self, runner_id: str | None = None, mode: str | None = None) -> str:
        """Stop placing on a runner (None: the least loaded), move its requests away (mode:
        see migrate), stop it. The last active runner is refused (409)."""
        if runner_id is None:
            runner_id = drain_choice(self.snapshots())
            if runner_id is None:
                raise ClusterError(409, "last_runner", "the last active runner cannot be removed")
        slot = self._slot(runner_id)
        if slot.state == "dead":
            self.slots.remove(slot)
            return runner_id
        if slot.state != ACTIVE:
            raise ClusterError(409, "not_active", f"runner {runner_id} is {slot.state}")
        if len(self._active()) <= 1:
            raise ClusterError(409, "last_runner", "the last active runner cannot be removed")
        slot.state = "draining"
        rm = getattr(getattr(slot.handle, "engine", None), "rmanager", None)
        if rm is not None:
            rm.caps = dataclasses.replace(rm.caps, max_blocks=0)  # lends nothing more
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

    def runners(self) -> list[dict]:
        """What GET /admin/runners lists, one dict per runner."""
        self.check_runners()
        rows = []
        for slot in self.slots:
            h = slot.handle
            stats = h.stats() if h is not None and slot.state != "dead" else None
            node, pid, device = slot.where
            rows.append(
                {
                    "id": slot.runner_id,
                    "backend": slot.backend,
                    "node": node,
                    "pid": pid,
                    "device": device,
                    "state": slot.state,
                    "running": stats.running if stats else 0,
                    "waiting": stats.waiting if stats else 0,
                    "kv_blocks_used": stats.kv_blocks_used if stats else 0,
                    "kv_blocks_free": stats.kv_blocks_free if stats else 0,
                    # DistKV: blocks lent to peers' requests / its requests hold on peers
                    "kv_blocks_lent": stats.kv_blocks_lent if stats else 0,
                    "kv_blocks_borrowed": stats.kv_blocks_borrowed if stats else 0,
                    "remote_attention_calls": stats.remote_attention_calls if stats else 0,
                    "remote_attention_seconds": stats.remote_attention_seconds if stats else 0.0,
                    "resident_adapters": len(h.resident_adapters()) if stats else 0,
                    "error": slot.error,
                    "replaces": slot.replaces,  # the dead runner it was started in place of
                }
            )
        return rows

    # -- adapters -----------------------------------------------------------------------------
    async def register_adapter(
        self, key: str, path: Path, sha256: str | None = None
    ) -> AdapterInfo:
        """Register on every live runner; the version returned is the scheduler's own (runners
        number their versions independently), valid for has_version()."""
        live = [s for s in self.slots if s.handle is not None and s.state != "dead"]
        infos = {s.runner_id: await s.handle.register_adapter(key, path, sha256) for s in live}
        self._adapters[key] = (path, sha256)
        version = next(self._version_ids)
        self._versions[version] = {rid: info.version for rid, info in infos.items()}
        self._current[key] = version
        return dataclasses.replace(next(iter(infos.values())), version=version)

    async def unregister_adapter(self, key: str) -> None:
        self._adapters.pop(key, None)
        self._current.pop(key, None)
        missing = None
        for s in self.slots:
            if s.handle is not None and s.state != "dead":
                try:
                    await s.handle.unregister_adapter(key)
                except UnknownAdapterError as exc:
                    missing = exc
        if missing is not None:
            raise missing

    def has_version(self, version: int) -> bool:
        """Whether any live runner still holds this version (current, or in use)."""
        per_runner = self._versions.get(version, {})
        held = any(
            s.handle.has_version(per_runner[s.runner_id])
            for s in self.slots
            if s.handle is not None and s.state != "dead" and s.runner_id in per_runner
        )
        if not held:
            self._versions.pop(version, None)
        return held

    # -- health -------------------------------------------------------------------------------
    def stats(self) -> RunnerStats:
        """Sums over live runners; `waiting` includes requests waiting at the scheduler."""
        per = [s.handle.stats() for s in self.slots if s.handle is not None and s.state != "dead"]
        total = {f.name: sum(getattr(p, f.name) for p in per) for f in fields(RunnerStats)}
        total["waiting"] += len(self._queue)
        return RunnerStats(**total)

    def ready(self) -> bool:
        self.check_runners()
        return bool(self._active())

    def shutdown(self) -> None:
        self._closed = True
        for task in list(self._replacing):  # (a runner its factory builds now is stopped)
            with contextlib.suppress(RuntimeError):  # its loop is closed: nothing runs it
                task.get_loop().call_soon_threadsafe(task.cancel)
        for s in self.slots:
            if s.handle is not None and s.state != "dead":
                s.handle.shutdown()
        if self.kv_group is not None:
            self.kv_group.shutdown()


def _where(handle) -> tuple:
    """(node, pid, device) of a runner, listed after it is let go."""
    return (
        getattr(handle, "node", None),
        getattr(handle, "pid", None),
        getattr(handle, "device", None),
    )


def _let_go(box: list) -> None:
    """Stop the dead runner's handle in `box` (a Ray actor is killed; a thread runner's
    engine joins its thread), drop it and collect its engine, so its memory is free before a
    replacement loads."""
    handle = box.pop()
    try:
        handle.shutdown()
    except Exception:
        log.exception("stopping dead runner %s failed", getattr(handle, "runner_id", "?"))
    del handle
    thaw("a dead runner let go")  # its engine's objects, frozen at its start, are collected
