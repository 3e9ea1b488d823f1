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

import random
import time
from collections import deque

from punica_x.config import BatchConfig
from punica_x.core import Request, RequestStatus
from punica_x.kv.blocks import KVCache, blocks_needed
from punica_x.kv.rmanager import KVBorrower, RemoteExtent
from punica_x.planner import ScheduledRequest

BORROW_RETRY_S = 0.05  # a request whose borrow was refused asks again after this long
# A request refused for this long gives back every block it holds and starts over (recompute)
# after a random pause of up to this long: two requests that each hold blocks the other
# needs (on one runner or on two) would otherwise wait for each other forever.
BORROW_PATIENCE_S = 2.0
# A request that has had no block from its peers for this long, over all its yields and
# retries, ends with an error saying so instead of waiting for ever (the cluster's free blocks
# are held by others, or a lender's loss left too few).
BORROW_GIVE_UP_S = 120.0
WAIT = "wait"  # _grow: blocks are not there yet (peers refused); try again later
YIELD = "yield"  # _borrow: refused for longer than BORROW_PATIENCE_S; give its blocks back
GIVE_UP = "give_up"  # _borrow: refused for longer than BORROW_GIVE_UP_S; the request ends


class Batcher:
    def __init__(self, cache: KVCache, config: BatchConfig) -> None:
        self.cache = cache
        self.config = config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_pauses = 0  # running requests left out for higher-priority ones (MLFQ only)
        self.preempted: list[Request] = []  # since the engine last looked (Engine.step)
        # DistKV: a request that cannot fit in this runner's whole cache borrows blocks on
        # peers (punica_x/kv/rmanager.py); None: such a request ends with LENGTH
        self.borrower: KVBorrower | None = None
        self.borrow_refusals = 0
        self.borrow_yields = 0  # requests that gave their blocks back (BORROW_PATIENCE_S)
        self.patience_s = BORROW_PATIENCE_S
        self.give_up_s = BORROW_GIVE_UP_S
        self.starved: list[Request] = []  # gave up borrowing (GIVE_UP): the engine ends them

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
        """Free a request's blocks after its local prefix: its own (moved home by a DGFM
        swap) here, the others back to their owners."""
        if request.remote:
            me = self.borrower.runner_id if self.borrower is not None else None
            home = [i for e in request.remote if e.owner == me for i in e.block_ids]
            if home:
                self.cache.allocator.free(home)
            away = [e for e in request.remote if e.owner != me]
            if away and self.borrower is not None:
                self.borrower.give_back(request.request_id, away)
        request.remote = []

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> tuple[list[ScheduledRequest], list[Request]]:
        """Returns (scheduled requests, requests that cannot fit even alone in the KV cache)."""
        budget = self.config.max_batched_tokens
        scheduled: list[ScheduledRequest] = []
        overflow: list[Request] = []
        i = 0
        now = time.monotonic()
        size = self.cache.block_size
        running = self.running
        while i < len(running) and budget > 0:
            r = running[i]
            if r.borrow_after > now:  # its peers refused blocks: it waits, keeping its KV
                i += 1
                continue
            done = r.num_computed_tokens
            n = len(r.prompt_token_ids) + len(r.output_token_ids) - done
            if n > budget:
                n = budget
            if not r.remote and len(r.block_ids) * size >= done + n:
                scheduled.append(ScheduledRequest(r, n))  # its blocks hold it already
                budget -= n
                i += 1
                continue
            got = self._grow(r, r.num_computed_tokens + n, overflow)
            if got == WAIT:
                i += 1
            elif got:
                scheduled.append(ScheduledRequest(r, n))
                budget -= n
                i += 1
        for r in list(self.waiting):
            if len(self.running) >= self.config.max_batch_size or budget <= 0:
                break
            if r.adapter is not None and not r.adapter.ready:
                continue
            if r.borrow_after > now:
                break
            n = min(r.num_tokens - r.num_computed_tokens, budget)
            need = r.num_computed_tokens + n
            if not self._ensure(r, need):
                got = self._borrow(r, need)
                if got == GIVE_UP:  # the engine ends it (and frees what it holds)
                    self.starved.append(r)
                    continue
                if got == YIELD:  # it waits without blocks; later ones may use them
                    self.cache.release(r.block_ids)
                    self._give_back(r)
                    continue
                if got is not True:
                    break
            self.waiting.remove(r)
            r.status = RequestStatus.RUNNING
            self.running.append(r)
            scheduled.append(ScheduledRequest(r, n))
            budget -= n
        return scheduled, overflow

    def after_step(self, scheduled: list[ScheduledRequest], seconds: float) -> None:
        """The step that ran `scheduled` took `seconds` (FCFS does not use it; see MLFQ)."""

    def _ensure(self, r: Request, num_tokens: int) -> bool:
        """Room for num_tokens of r: more local blocks, unless it already grows on peers."""
        if r.remote:
            held = len(r.block_ids) + sum(len(e.block_ids) for e in r.remote)
            return held >= blocks_needed(num_tokens, self.cache.block_size)
        return self.cache.ensure_capacity(r.block_ids, num_tokens)

    def _borrows(self, r: Request, num_tokens: int) -> bool:
        """Whether r takes blocks from peers: it cannot fit in this runner's whole cache."""
        need = blocks_needed(num_tokens, self.cache.block_size)
        return self.borrower is not None and (
            bool(r.remote) or need > self.cache.allocator.num_blocks
        )

    def _borrow(self, r: Request, num_tokens: int) -> bool | str:
        """Blocks for num_tokens of a request that borrows: the free local ones first (while
        it holds no remote block), then from peers. True when it has them, WAIT when peers
        refused (it asks again after BORROW_RETRY_S, keeping its blocks), YIELD when they
        have refused it for longer than patience_s (the caller frees its blocks; it asks
        again after a random pause), GIVE_UP when it has had no blocks from them for
        give_up_s over all its tries (the caller ends it), False when it does not borrow or
        the whole cluster could never hold it."""
        if not self._borrows(r, num_tokens):
            return False
        size = self.cache.block_size
        need = blocks_needed(num_tokens, size)
        if need > self.cache.allocator.num_blocks + self.borrower.capacity_blocks():
            return False
        missing = need - len(r.block_ids) - sum(len(e.block_ids) for e in r.remote)
        local = self.cache.allocator.allocate(min(missing, self.cache.allocator.num_free)) or []
        if r.remote:  # past the local prefix: free local blocks join as an extent of ours
            self._append(r, [RemoteExtent(self.borrower.runner_id, tuple(local))] if local else [])
        else:
            r.block_ids.extend(local)
        missing -= len(local)
        if missing <= 0:
            return True
        got = self.borrower.borrow(r.request_id, missing)
        now = time.monotonic()
        if got is None:
            self.borrow_refusals += 1
            if r.starving_since is None:
                r.starving_since = now
            elif now - r.starving_since > self.give_up_s:
                return GIVE_UP
            if r.borrow_since is None:
                r.borrow_since = now
            elif now - r.borrow_since > self.patience_s:
                r.borrow_since = None
                r.borrow_after = now + random.uniform(0.1, 1.0) * self.patience_s
                self.borrow_yields += 1
                return YIELD
            r.borrow_after = now + BORROW_RETRY_S
            return WAIT
        r.borrow_since = r.starving_since = None
        self._append(r, got)
        return True

    @staticmethod
    def _append(r: Request, extents: list[RemoteExtent]) -> None:
        """Add extents after r's blocks; one segment per owner run (one micro-attention
        call per owner per layer)."""
        for extent in extents:
            last = r.remote[-1] if r.remote else None
            if last is not None and last.owner == extent.owner:
                r.remote[-1] = RemoteExtent(last.owner, last.block_ids + extent.block_ids)
            else:
                r.remote.append(extent)

    def _grow(self, r: Request, num_tokens: int, overflow: list[Request]) -> bool | str:
        """Blocks for num_tokens of r, preempting the newest running requests if needed (or
        borrowing, for a request too long for this runner: WAIT when peers refuse)."""
        while not self._ensure(r, num_tokens):
            if self._borrows(r, num_tokens):
                got = self._borrow(r, num_tokens)
                if got is True or got == WAIT:
                    return got
                if got == YIELD:  # back to the queue without its blocks (recomputes)
                    self._preempt(r)
                    return False
                if got == GIVE_UP:
                    self.running.remove(r)
                    self.starved.append(r)
                    return False
                self.running.remove(r)  # the whole cluster cannot hold it
                overflow.append(r)
                return False
            victim = self.running[-1]
            if victim is r and len(self.running) == 1:
                self.running.remove(r)
                overflow.append(r)
                return False
            self._preempt(victim)
            if victim is r:
                return False
        return True

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
        self.preempted.append(r)
