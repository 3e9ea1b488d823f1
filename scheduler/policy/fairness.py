"""Fair share between tenants: the Virtual Token Counter (VTC; Sheng et al., "Fairness in
Serving Large Language Models", OSDI 2024, by the S-LoRA authors). Pure policy: no clock,
no runner, so the scheduler and the cluster simulator run this very code.

Each tenant has a counter of the service it received: a placed request's prompt tokens cost
`prompt_weight` each, every generated token `output_weight` (decoding is what a batch slot
is held for), divided by the tenant's weight (an admin setting, default 1). Requests waiting
for a runner are served from the tenant with the LEAST counter, oldest first within it (the
order inside one tenant stays FCFS; an MLFQ runner orders what it holds itself). A tenant
whose queue was empty is lifted on arrival to the least counter of the tenants waiting (or,
if none waits, of those running), so idling banks no credit.

Two more rules keep a flooding tenant from hurting the others:
- `admits`: the shared queue (max_queue) is shared fairly. While it is full, a tenant may
  still queue up to its weighted share of max_queue; one above its share is refused (429).
- `rebalance`: while requests wait and every batch slot is held, a tenant below its share
  of the slots may take one from the tenant furthest above its share (the scheduler moves
  that tenant's newest request back to the queue: Punica's migration, its KV copied or
  recomputed)."""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")

PROMPT_WEIGHT = 1.0  # counter units per prompt token (the VTC paper's w_p)
OUTPUT_WEIGHT = 2.0  # per generated token (the paper's w_q)
QUEUE_OVERFLOW = 2  # the queue never holds more than this times max_queue


@dataclass
class TenantState(Generic[T]):
    weight: float = 1.0
    counter: float = 0.0
    waiting: deque = field(default_factory=deque)
    running: int = 0
    served_tokens: int = 0  # prompt + generated tokens of its placed requests

    @property
    def active(self) -> bool:
        return bool(self.waiting) or self.running > 0


@dataclass(frozen=True)
class Rebalance:
    """Take a slot of `giver` (its newest running request goes back to the queue) for the
    next waiting request of `taker`."""

    giver: Hashable
    taker: Hashable


class FairQueue(Generic[T]):
    """Waiting requests of many tenants (items: anything; tenants: hashable keys), the VTC
    counters, and the running count of each tenant (kept by the caller: started / stopped)."""

    def __init__(self, prompt_weight: float = PROMPT_WEIGHT, output_weight: float = OUTPUT_WEIGHT):
        self.prompt_weight, self.output_weight = prompt_weight, output_weight
        self.tenants: dict[Hashable, TenantState[T]] = {}

    def _get(self, tenant: Hashable) -> TenantState[T]:
        state = self.tenants.get(tenant)
        if state is None:
            state = self.tenants[tenant] = TenantState()
        return state

    def set_weight(self, tenant: Hashable, weight: float) -> None:
        if not weight > 0:
            raise ValueError(f"a tenant's weight must be > 0, got {weight}")
        self._get(tenant).weight = float(weight)

    # -- the queue ------------------------------------------------------------------------------
    def push(self, tenant: Hashable, item: T, front: bool = False) -> None:
        """Queue `item` (front: a request admitted before, moved back: first of its tenant)."""
        state = self._get(tenant)
        if not state.waiting:
            state.counter = max(state.counter, self._floor(tenant))
        if front:
            state.waiting.appendleft(item)
        else:
            state.waiting.append(item)

    def _floor(self, tenant: Hashable) -> float:
        """The least counter of the other tenants waiting, else of those running (0: none)."""
        others = [s for t, s in self.tenants.items() if t != tenant]
        pool = [s.counter for s in others if s.waiting] or [s.counter for s in others if s.running]
        return min(pool, default=0.0)

    def peek(self) -> tuple[Hashable, T] | None:
        """(tenant, item) to serve next: the oldest item of the least-served waiting tenant
        (on a tie, the one with fewer requests running)."""
        waiting = [(s.counter, s.running, t) for t, s in self.tenants.items() if s.waiting]
        if not waiting:
            return None
        tenant = min(waiting, key=lambda x: x[:2])[2]
        return tenant, self.tenants[tenant].waiting[0]

    def pop(self, tenant: Hashable) -> T:
        return self.tenants[tenant].waiting.popleft()

    def remove(self, tenant: Hashable, item: T) -> bool:
        state = self.tenants.get(tenant)
        if state is None or item not in state.waiting:
            return False
        state.waiting.remove(item)
        return True

    def items(self) -> Iterable[T]:
        for s in self.tenants.values():
            yield from s.waiting

    def __len__(self) -> int:
        return sum(len(s.waiting) for s in self.tenants.values())

    def waiting(self, tenant: Hashable) -> int:
        state = self.tenants.get(tenant)
        return len(state.waiting) if state is not None else 0

    # -- service --------------------------------------------------------------------------------
    def charge(self, tenant: Hashable, prompt_tokens: int = 0, output_tokens: int = 0) -> None:
        state = self._get(tenant)
        cost = self.prompt_weight * prompt_tokens + self.output_weight * output_tokens
        state.counter += cost / state.weight
        state.served_tokens += prompt_tokens + output_tokens

    def set_running(self, counts: dict[Hashable, int]) -> None:
        """The running count of every tenant (0 for those not in `counts`)."""
        for tenant, state in self.tenants.items():
            state.running = counts.get(tenant, 0)
        for tenant, n in counts.items():
            self._get(tenant).running = n

    def head(self, tenant: Hashable) -> T | None:
        state = self.tenants.get(tenant)
        return state.waiting[0] if state is not None and state.waiting else None

    def started(self, tenant: Hashable) -> None:
        self._get(tenant).running += 1

    def stopped(self, tenant: Hashable) -> None:
        state = self._get(tenant)
        state.running = max(0, state.running - 1)

    # -- sharing --------------------------------------------------------------------------------
    def shares(self, total: float, extra: Hashable | None = None) -> dict[Hashable, float]:
        """Each active tenant's weighted share of `total` (extra: count it as active too)."""
        active = {t: s for t, s in self.tenants.items() if s.active or t == extra}
        if extra is not None and extra not in active:
            active[extra] = TenantState()
        weights = sum(s.weight for s in active.values())
        return {t: total * s.weight / weights for t, s in active.items()}

    def admits(self, tenant: Hashable, max_queue: int) -> bool:
        """Whether one more request of `tenant` may wait: always while the queue holds fewer
        than max_queue; beyond, only while the tenant holds less than its weighted share of
        max_queue (and never past QUEUE_OVERFLOW * max_queue)."""
        queued = len(self)
        if queued < max_queue:
            return True
        if queued >= QUEUE_OVERFLOW * max_queue:
            return False
        return self.waiting(tenant) < self.shares(max_queue, extra=tenant)[tenant]

    def rebalance(self, slots: int) -> list[Rebalance]:
        """With `slots` batch slots all held and requests waiting, the slots to move: while
        a waiting tenant holds fewer slots than its weighted share (minus one), the least
        served of them takes one from the tenant furthest above its share (by at least one
        slot), as often as it has requests waiting. Shares count the tenants waiting or
        running; counters order the takers, shares decide who gives (a slot is not taken
        back from a tenant at or below its share, however much it was served)."""
        if slots <= 0:
            return []
        share = self.shares(slots)  # active tenants only: an idle one has none, gives none
        running = {t: s.running for t, s in self.tenants.items() if t in share}
        wanting = {t: len(s.waiting) for t, s in self.tenants.items() if s.waiting}
        moves = []
        while True:
            under = [t for t, n in wanting.items() if n and running[t] + 1 <= share[t] + 1e-9]
            if not under:
                return moves
            taker = min(under, key=lambda t: (self.tenants[t].counter, running[t]))
            over = [t for t, n in running.items() if t != taker and n - 1 >= share[t] - 1e-9]
            if not over:
                return moves
            giver = max(over, key=lambda t: (running[t] - share[t], self.tenants[t].counter))
            moves.append(Rebalance(giver, taker))
            running[giver] -= 1
            running[taker] += 1
            wanting[taker] -= 1
