"""Continuous batching on one runner: which requests run this step, and with how many tokens.

FCFS (Punica sec. 5): running requests keep their place, oldest first; waiting requests join
in arrival order while there is batch room, token budget and KV memory. A prompt longer
than the step's token budget is prefilled in chunks over several steps (chunks of at most
BatchConfig.long_prefill_tokens while other requests share the runner). When a running
request needs a block and none is free, the NEWEST running request is preempted: its blocks
are freed and it goes back to the head of the queue to be recomputed from its prompt and
the tokens it already generated (migration by recomputation, locally). Requests whose
adapter is still loading wait without holding anyone up. With prefix caching, a request
that holds no KV starts past the longest prefix of its tokens whose blocks are cached
(a recomputed request finds its own), see punica_x/kv/prefix.py.
"""

from __future__ import annotations

import time
from collections import deque

from punica_x.batching.schedule import Schedule, ScheduledRequest
from punica_x.config import BatchConfig
from punica_x.kv.blocks import KVCache, blocks_needed
from punica_x.kv.borrowing import Borrow, KVBorrowing
from punica_x.kv.prefix import PrefixCache
from punica_x.runtime import Request, RequestStatus


class Batcher:
    def __init__(self, cache: KVCache, config: BatchConfig) -> None:
        self.cache = cache
        self.config = config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_pauses = 0  # running requests left out for higher-priority ones (MLFQ only)
        self._preempted: list[Request] = []  # since the last schedule (Schedule.preempted)
        # DistKV: a request that cannot fit in this runner's whole cache borrows blocks on
        # peers (punica_x/kv/borrowing.py); None: such a request ends with LENGTH
        self.borrowing: KVBorrowing | None = None
        self._starved: list[Request] = []  # gave up borrowing (GIVE_UP): Schedule.starved
        # automatic prefix caching (punica_x/kv/prefix.py); None: off
        self.prefix: PrefixCache | None = None

    def add(self, request: Request, front: bool = False) -> None:
        """Queue a request (at the head with front: a request moved here from another runner
        was admitted before everything waiting)."""
        request.status = RequestStatus.WAITING
        if front:
            self.waiting.appendleft(request)
        else:
            self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Take a request out (finished or aborted) and free its KV blocks at once."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if request.block_ids:
            self.cache.release(request.block_ids)
        self._give_back(request)

    def _give_back(self, request: Request) -> None:
        """Free a request's blocks after its local prefix (DistKV)."""
        if request.remote and self.borrowing is not None:
            self.borrowing.give_back(request)
        request.remote = []

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> Schedule:
        """This step's rows: running requests first (FCFS), then waiting ones that fit."""
        scheduled: list[ScheduledRequest] = []
        overflow: list[Request] = []
        now = time.monotonic()
        if self.prefix is not None:
            self.prefix.pending.clear()
        budget = self._schedule_running(self.config.max_batched_tokens, now, scheduled, overflow)
        self._schedule_waiting(budget, now, scheduled)
        return self._schedule(scheduled, overflow)

    def _schedule(self, rows: list[ScheduledRequest], overflow: list[Request]) -> Schedule:
        """The step's Schedule, with the starved and preempted requests since the last one."""
        starved, self._starved = self._starved, []
        preempted, self._preempted = self._preempted, []
        return Schedule(rows, overflow, starved, preempted)

    def _schedule_running(
        self,
        budget: int,
        now: float,
        scheduled: list[ScheduledRequest],
        overflow: list[Request],
    ) -> int:
        """Running requests keep their place, oldest first (the newest are preempted when
        blocks run out). Returns the token budget left."""
        i = 0
        size = self.cache.block_size
        running = self.running
        while i < len(running) and budget > 0:
            r = running[i]
            if r.borrow_after > now or r.final_in_flight:
                # its peers refused blocks: it waits, keeping its KV; or its last token is on
                # the device (overlapped steps): it ends when that arrives
                i += 1
                continue
            done = r.num_computed_tokens
            n = self._chunk(r, budget)
            if r.remote or len(r.block_ids) * size < done + n:  # it needs more blocks
                got = self._grow(r, r.num_computed_tokens + n, overflow)
                if got is Borrow.WAIT:
                    i += 1
                if got is not Borrow.GOT:
                    continue
            scheduled.append(ScheduledRequest(r, n))
            budget -= n
            i += 1
            if n > 1:  # a decode completes no block before it is computed
                self._computing(r, n)
        return budget

    def _schedule_waiting(self, budget: int, now: float, scheduled: list[ScheduledRequest]) -> None:
        """Waiting requests join in arrival order while batch room, budget and blocks last."""
        for r in list(self.waiting):
            if len(self.running) >= self.config.max_batch_size or budget <= 0:
                break
            if (r.adapter is not None and not r.adapter.ready) or r.final_in_flight:
                continue
            if r.borrow_after > now:
                break
            fresh = self._fresh(r)
            if fresh and not self.prefix.reuse(r):
                continue  # its next block is computed this step: it reuses it next step
            n = self._chunk(r, budget)
            got = self._admit(r, r.num_computed_tokens + n)
            if got is not Borrow.GOT:
                if fresh and got is not Borrow.WAIT:
                    self.prefix.undo(r)
                if got in (Borrow.NO, Borrow.WAIT):
                    break
                continue
            self.waiting.remove(r)
            r.status = RequestStatus.RUNNING
            self.running.append(r)
            scheduled.append(ScheduledRequest(r, n))
            budget -= n
            if fresh:
                self.prefix.admitted(r)
            self._computing(r, n)

    def _chunk(self, r: Request, budget: int) -> int:
        """Tokens r computes this step: what it has left, within the budget; a long prefill
        at most long_prefill_tokens while other requests share the runner, so a step with
        it stays short for them and the token budget admits them beside it."""
        n = min(r.num_tokens - r.num_computed_tokens, budget)
        cap = self.config.long_prefill_tokens
        if 0 < cap < n and self.num_unfinished > 1:
            return cap
        return n

    def _fresh(self, r: Request) -> bool:
        """Whether r holds no KV and may look for a cached prefix (prefix caching is on)."""
        return (
            self.prefix is not None
            and r.num_computed_tokens == 0
            and not r.block_ids
            and not r.host_block_ids
            and not r.remote
        )

    def _computing(self, r: Request, n: int) -> None:
        """r computes n tokens this step: the blocks they fill are pending (prefix caching)."""
        if self.prefix is not None and n > 1:
            self.prefix.computing(r, n)

    def _admit(self, r: Request, need: int) -> Borrow:
        """Blocks for the first `need` tokens of a waiting request: GOT; NO when they are not
        free (it waits, and so do the ones after it); when it borrows and its peers refuse,
        WAIT (likewise, keeping its blocks) or YIELD (it waits without them, the ones after
        it may go); GIVE_UP when it ends (starved)."""
        if self._ensure(r, need):
            return Borrow.GOT
        got = self._borrow(r, need)
        if got is Borrow.GIVE_UP:  # the engine ends it (and frees what it holds)
            self._starved.append(r)
        elif got is Borrow.YIELD:  # it waits without blocks; later ones may use them
            self.cache.release(r.block_ids)
            self._give_back(r)
            r.num_computed_tokens = 0
        return got

    def after_step(self, scheduled: list[ScheduledRequest], seconds: float) -> None:
        """The step that ran `scheduled` took `seconds` (FCFS does not use it; see MLFQ)."""

    def _ensure(self, r: Request, num_tokens: int) -> bool:
        """Room for num_tokens of r: more local blocks, unless it borrows (it takes them
        through KVBorrowing.borrow, which leaves the others their headroom)."""
        if r.remote or self._borrows(r, num_tokens):
            held = len(r.block_ids) + sum(len(e.block_ids) for e in r.remote)
            return held >= blocks_needed(num_tokens, self.cache.block_size)
        return self.cache.ensure_capacity(r.block_ids, num_tokens)

    def _borrows(self, r: Request, num_tokens: int) -> bool:
        return self.borrowing is not None and self.borrowing.borrows(r, num_tokens)

    def _borrow(self, r: Request, num_tokens: int) -> Borrow:
        return Borrow.NO if self.borrowing is None else self.borrowing.borrow(r, num_tokens)

    def _grow(self, r: Request, num_tokens: int, overflow: list[Request]) -> Borrow:
        """Blocks for num_tokens of r (GOT), preempting the newest running requests that do
        not borrow if needed (NO when r itself went), or borrowing, for a request too long
        for this runner (WAIT when peers refuse; see KVBorrowing)."""
        need = blocks_needed(num_tokens, self.cache.block_size)
        while not self._ensure(r, num_tokens):
            if self._borrows(r, num_tokens):
                got = self._borrow(r, num_tokens)
                if got is Borrow.YIELD:  # back to the queue without its blocks (recomputes)
                    self._preempt(r)
                elif got is Borrow.GIVE_UP:
                    self.running.remove(r)
                    self._starved.append(r)
                elif got is Borrow.NO and need <= r.borrow_room:  # peers left: it waits
                    self._preempt(r)
                elif got is Borrow.NO:  # the whole cluster cannot hold it
                    self.running.remove(r)
                    overflow.append(r)
                return got if got in (Borrow.GOT, Borrow.WAIT) else Borrow.NO
            victim = self._victim(r)
            if victim is r and len(self.running) == 1:
                self.running.remove(r)
                overflow.append(r)
                return Borrow.NO
            self._preempt(victim)
            if victim is r:
                return Borrow.NO
        return Borrow.GOT

    def _victim(self, r: Request) -> Request:
        """The running request r preempts for a block: the newest that does not borrow (a
        borrower's prefill is long to redo, and it leaves the others headroom), else r."""
        for victim in reversed(self.running):
            if victim is r or not self._borrows(victim, victim.num_tokens):
                return victim
        return r

    def preempt(self, r: Request) -> None:
        """Send a running request back to the head of the queue, its KV freed (it
        recomputes from its tokens)."""
        self._preempt(r)

    def _preempt(self, r: Request) -> None:
        self.running.remove(r)
        self.cache.release(r.block_ids)
        self._give_back(r)
        r.num_computed_tokens = 0
        r.num_preemptions += 1
        r.status = RequestStatus.WAITING
        self.waiting.appendleft(r)
        self.num_preemptions += 1
        self._preempted.append(r)
