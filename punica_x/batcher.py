"""Continuous batching on one runner: which requests run this step, and with how many tokens.

FCFS (Punica sec. 5): running requests keep their place, oldest first; waiting requests join
in arrival order while there is batch room, token budget and KV memory. A prompt longer
than the step's token budget is prefilled in chunks over several steps. When a running
request needs a block and none is free, the NEWEST running request is preempted: its blocks
are freed and it goes back to the head of the queue to be recomputed from its prompt and
the tokens it already generated (migration by recomputation, locally). Requests whose
adapter is still loading wait without holding anyone up.
"""

from __future__ import annotations

from collections import deque

from punica_x.config import BatchConfig
from punica_x.core import Request, RequestStatus
from punica_x.kv.blocks import KVCache
from punica_x.planner import ScheduledRequest


class Batcher:
    def __init__(self, cache: KVCache, config: BatchConfig) -> None:
        self.cache = cache
        self.config = config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_pauses = 0  # running requests left out for higher-priority ones (MLFQ only)
        self.preempted: list[Request] = []  # since the engine last looked (Engine.step)

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

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> tuple[list[ScheduledRequest], list[Request]]:
        """Returns (scheduled requests, requests that cannot fit even alone in the KV cache)."""
        budget = self.config.max_batched_tokens
        scheduled: list[ScheduledRequest] = []
        overflow: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            r = self.running[i]
            n = min(r.num_tokens - r.num_computed_tokens, budget)
            if self._grow(r, r.num_computed_tokens + n, overflow):
                scheduled.append(ScheduledRequest(r, n))
                budget -= n
                i += 1
        for r in list(self.waiting):
            if len(self.running) >= self.config.max_batch_size or budget <= 0:
                break
            if r.adapter is not None and not r.adapter.ready:
                continue
            n = min(r.num_tokens - r.num_computed_tokens, budget)
            if not self.cache.ensure_capacity(r.block_ids, r.num_computed_tokens + n):
                break
            self.waiting.remove(r)
            r.status = RequestStatus.RUNNING
            self.running.append(r)
            scheduled.append(ScheduledRequest(r, n))
            budget -= n
        return scheduled, overflow

    def after_step(self, scheduled: list[ScheduledRequest], seconds: float) -> None:
        """The step that ran `scheduled` took `seconds` (FCFS does not use it; see MLFQ)."""

    def _grow(self, r: Request, num_tokens: int, overflow: list[Request]) -> bool:
        """Blocks for num_tokens of r, preempting the newest running requests if needed."""
        while not self.cache.ensure_capacity(r.block_ids, num_tokens):
            victim = self.running[-1]
            if victim is r and len(self.running) == 1:
                self.running.remove(r)
                overflow.append(r)
                return False
            self._preempt(victim)
            if victim is r:
                return False
        return True

    def _preempt(self, r: Request) -> None:
        self.running.remove(r)
        self.cache.release(r.block_ids)
        r.num_computed_tokens = 0
        r.num_preemptions += 1
        r.status = RequestStatus.WAITING
        self.waiting.appendleft(r)
        self.num_preemptions += 1
        self.preempted.append(r)
