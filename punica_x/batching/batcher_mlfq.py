"""Continuous batching by skip-join MLFQ (FastServe) instead of arrival order.

Each step the batcher orders every unfinished request by its MLFQ priority (mlfq.py:
level, then arrival) and runs the highest ones that fit: batch size, token budget, KV blocks
- across adapters, so SGMV batching is unchanged. A request that was running and is not
chosen is preempted at token granularity: it keeps its KV blocks while nobody needs them.
When a chosen request needs blocks, the lowest-priority requests not chosen give theirs up:
their KV is swapped out to the host pool (punica_x/kv/swap.py) and swapped back in before
they run again; when the pool is full they lose it and recompute, like an FCFS preemption
(and the engine's on_preempt tells the scheduler, which may move them). After choosing, the
batcher swaps in, while free blocks allow, the swapped requests next in line (proactive
swap-in), so their copy is done before they are picked.

Iteration times come from the engine (`after_step`): they charge every request that ran
(demotion) and feed the step-time model the levels are derived from: q_1 = the minimal
iteration; enough levels that the last quantum covers both a full token budget's prefill
(so skip-join has a level for every prompt) and the service of a generation of
mlfq_job_tokens (64) decode steps in a full batch. Generations longer than that share the
last level, where arrival order (FCFS) decides: telling long generations apart too (levels up
to 2048 tokens, least attained service first among them) spreads the KV over many half-done
long generations that all finish late; in the cluster simulator (heavy-tailed outputs, a
KV-bound runner, 0.9 / 0.95 load) that gave a mean JCT 1.34x / 1.41x better than FCFS
against 1.53x / 1.89x with 64, and on Punica's A100 profile p99 1.77x / 1.89x FCFS's
against 1.08x / 1.17x. BatchConfig overrides either.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable

from punica_x.batching import mlfq
from punica_x.batching.batcher import Batcher
from punica_x.batching.schedule import Schedule, ScheduledRequest
from punica_x.batching.step_time import StepTimeModel
from punica_x.config import BatchConfig
from punica_x.kv.blocks import KVCache, blocks_needed
from punica_x.kv.swap import SwapPool
from punica_x.runtime import Request, RequestStatus


class MLFQBatcher(Batcher):
    def __init__(
        self,
        cache: KVCache,
        config: BatchConfig,
        swap: SwapPool,
        timer: StepTimeModel | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(cache, config)
        self.swap = swap
        self.timer = timer or StepTimeModel()
        self.clock = clock
        self.priority: dict[str, mlfq.Priority] = {}
        self._arrivals = itertools.count()

    # -- levels -----------------------------------------------------------------------------
    def levels(self) -> mlfq.Levels:
        c = self.config
        q1 = c.mlfq_quantum_s or self.timer.predict(1)
        longest = max(  # a full token budget's prefill; a long generation in a full batch
            self.timer.predict(c.max_batched_tokens),
            c.mlfq_job_tokens * self.timer.predict(c.max_batch_size),
        )
        derived = mlfq.Levels.derive(q1, longest, c.mlfq_starve_s)
        return mlfq.Levels(q1, c.mlfq_levels or derived.count, c.mlfq_starve_s)

    # -- requests ---------------------------------------------------------------------------
    def add(self, request: Request, front: bool = False) -> None:
        """Join the level covering its (estimated) prefill; a request moved here from another
        runner (front) keeps an earlier arrival than everything waiting."""
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        arrival = -next(self._arrivals) - 1 if front else next(self._arrivals)
        todo = request.num_tokens - request.num_computed_tokens
        prefill = self.timer.predict(min(todo, self.config.max_batched_tokens))
        self.priority[request.request_id] = mlfq.join(self.levels(), prefill, arrival, self.clock())

    def remove(self, request: Request) -> None:
        super().remove(request)
        self.swap.release(request)
        self.priority.pop(request.request_id, None)

    # -- the step ---------------------------------------------------------------------------
    def schedule(self) -> Schedule:
        """This step's rows: the most urgent first (skip-join MLFQ order), as many as fit."""
        levels, now = self.levels(), self.clock()
        for p in self.priority.values():
            mlfq.promote_if_starved(p, levels, now)
        order = sorted(
            [*self.running, *self.waiting],
            key=lambda r: mlfq.order_key(self.priority[r.request_id]),
        )
        scheduled, overflow = self._choose(order, strict=True)
        if not scheduled:  # everyone waits on blocks held within one level: order decides
            scheduled, overflow = self._choose(order, strict=False)
        chosen = {s.request.request_id for s in scheduled}
        self.num_pauses += sum(r.request_id not in chosen for r in self.running)
        left = [r for r in order if r.request_id not in chosen and r not in overflow]
        self.running = [s.request for s in scheduled]
        for r in self.running:
            r.status = RequestStatus.RUNNING
        for r in left:
            r.status = RequestStatus.WAITING
        self.waiting = deque(left)
        self._prefetch(left)
        return self._schedule(scheduled, overflow)

    def _choose(
        self, order: list[Request], strict: bool
    ) -> tuple[list[ScheduledRequest], list[Request]]:
        """The requests of `order` that fit, in order; `strict`: blocks are taken only from
        requests of a lower level (see _make_room)."""
        budget, batch_size = self.config.max_batched_tokens, self.config.max_batch_size
        scheduled: list[ScheduledRequest] = []
        overflow: list[Request] = []
        if self.prefix is not None:
            self.prefix.pending.clear()
        for i, r in enumerate(order):
            if len(scheduled) >= batch_size or budget <= 0:
                break
            if r.adapter is not None and not r.adapter.ready:
                continue
            fresh = self._fresh(r)
            if fresh and not self.prefix.reuse(r):
                continue  # its next block is computed this step: it reuses it next step
            n = self._chunk(r, budget)
            if self._make_room(r, r.num_computed_tokens + n, order[i + 1 :], strict):
                scheduled.append(ScheduledRequest(r, n))
                budget -= n
                if fresh:
                    self.prefix.admitted(r)
                self._computing(r, n)
                continue
            if fresh:
                self.prefix.undo(r)
            if not scheduled and not self._holders(order[i + 1 :]):
                overflow.append(r)  # it cannot fit even alone
        return scheduled, overflow

    def after_step(self, scheduled: list[ScheduledRequest], seconds: float) -> None:
        """The step that ran `scheduled` took `seconds`: charge each of them (demotion) and
        teach the step-time model."""
        self.timer.observe(sum(s.num_new_tokens for s in scheduled), seconds)
        levels, now = self.levels(), self.clock()
        for s in scheduled:
            p = self.priority.get(s.request.request_id)
            if p is not None:
                mlfq.charge(p, levels, seconds, now)

    # -- KV ---------------------------------------------------------------------------------
    def _make_room(self, r: Request, num_tokens: int, lower: list[Request], strict: bool) -> bool:
        """Device blocks for num_tokens of r (its swapped KV copied back first), taken from
        the lowest-priority requests in `lower` when none are free. `strict`: only from
        requests of a lower level than r's. Within a level the order is arrival, and a
        request that lost its blocks to a higher level would otherwise take them back from a
        later arrival of its own level, which would take them back after the next demotion:
        swaps of the largest KVs back and forth, every copy a step's worth of time (in the
        simulator, at 90% load with the KV full, 4766 swaps and a mean JCT 7x FCFS's; 355
        swaps and 1.1x with the rule)."""
        level = self.priority[r.request_id].level
        while True:
            if r.host_block_ids and self.swap.swap_in(self.cache, r):
                continue
            if not r.host_block_ids and self.cache.ensure_capacity(r.block_ids, num_tokens):
                return True
            victim = next(
                (
                    v
                    for v in reversed(lower)
                    if v.block_ids and (not strict or self.priority[v.request_id].level > level)
                ),
                None,
            )
            if victim is None:
                return False
            self._evict(victim)

    def _evict(self, r: Request) -> None:
        """Free r's device blocks: swapped out when the host pool has room, else dropped
        (r recomputes: an FCFS-style preemption the engine reports)."""
        if r.num_computed_tokens > 0 and self.swap.swap_out(self.cache, r):
            return
        self.cache.release(r.block_ids)
        r.num_computed_tokens = 0
        r.num_preemptions += 1
        self.num_preemptions += 1
        self.swap.stats.recomputes += 1
        self._preempted.append(r)

    def _holders(self, requests: list[Request]) -> bool:
        return any(r.block_ids for r in requests)

    def _prefetch(self, waiting: list[Request]) -> None:
        """Proactive swap-in: the swapped requests next in line come back while free blocks
        remain beyond one per running request (room for them to grow)."""
        reserve = len(self.running)
        for r in waiting:
            if not r.host_block_ids:
                continue
            need = blocks_needed(r.num_computed_tokens, self.cache.block_size)
            if self.cache.allocator.num_free - need < reserve or not self.swap.swap_in(
                self.cache, r
            ):
                break
