"""The requests waiting at the scheduler for a runner with room: ordered across tenants by
their virtual token counters (scheduler/policy/fairness.py), first come first served within one.
With fair share off, every request counts as one tenant's: plain FCFS."""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

from scheduler.policy.fairness import FairQueue, Rebalance


class Waiter(Protocol):
    tenant: str


@dataclass(frozen=True)
class TenantRow:
    """A tenant's fair-share state, for /metrics."""

    tenant: str
    weight: float
    virtual_tokens: float
    served_tokens: int
    waiting: int
    running: int


class WaitingQueue:
    def __init__(self, fair_share: bool = True) -> None:
        self.fair_share = fair_share
        self.fair: FairQueue = FairQueue()

    def key(self, w: Waiter) -> str:
        return w.tenant if self.fair_share else ""

    def push(self, w: Waiter, front: bool = False) -> None:
        """Queue `w` (front: admitted before and moved back, so first of its tenant)."""
        self.fair.push(self.key(w), w, front)

    def peek(self):
        head = self.fair.peek()
        return None if head is None else head[1]

    def pop(self, w: Waiter) -> None:
        """Take `w`, the head of its tenant's queue (what peek returned)."""
        taken = self.fair.pop(self.key(w))
        assert taken is w, "pop takes the head of its tenant's queue"

    def remove(self, w: Waiter) -> bool:
        return self.fair.remove(self.key(w), w)

    def head(self, tenant: str):
        return self.fair.head(tenant if self.fair_share else "")

    def waiting_of(self, tenant: str) -> list:
        """The requests of `tenant` waiting, oldest (or moved back) first."""
        state = self.fair.tenants.get(tenant if self.fair_share else "")
        return list(state.waiting) if state is not None else []

    def __len__(self) -> int:
        return len(self.fair)

    def __iter__(self) -> Iterator:
        return iter(list(self.fair.items()))

    def clear(self) -> list:
        items = list(self)
        for w in items:
            self.remove(w)
        return items

    def set_weight(self, tenant: str, weight: float) -> None:
        if self.fair_share:
            self.fair.set_weight(tenant, weight)

    def sync_running(self, running: Iterable[Waiter]) -> None:
        """The requests placed on runners now (their tenants' running counts)."""
        self.fair.set_running(collections.Counter(self.key(w) for w in running))

    def served(self, w: Waiter, prompt_tokens: int = 0, output_tokens: int = 0) -> None:
        self.fair.charge(self.key(w), prompt_tokens, output_tokens)

    def admits(self, tenant: str, max_queue: int) -> bool:
        return self.fair.admits(tenant if self.fair_share else "", max_queue)

    def rebalance(self, slots: int) -> list[Rebalance]:
        return self.fair.rebalance(slots) if self.fair_share else []

    def rows(self) -> list[TenantRow]:
        return [
            TenantRow(str(t), s.weight, s.counter, s.served_tokens, len(s.waiting), s.running)
            for t, s in sorted(self.fair.tenants.items(), key=lambda x: str(x[0]))
        ]
