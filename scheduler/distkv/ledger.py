"""gManager (Infinite-LLM / DistKV-LLM): the Global Debt Ledger and creditor suggestions.

Pure bookkeeping, no runner is called from here: runners send heartbeats with the blocks
they could lend now; the ledger keeps those, who owes whom how many blocks, and an order of
runners by free blocks that is re-sorted only every `resort_every` seconds. A debtor asks
for suggestions: up to MAX_SUGGESTIONS creditors, lowest communication cost first, then most
free blocks, leaving out runners whose last heartbeat is older than `stale_after`. The
debtor asks them in turn; a refusal zeroes that creditor's free blocks until its next
heartbeat; if all refuse, the debtor asks again later. Consistency is loose: between
heartbeats the ledger only subtracts what it saw lent."""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass

MAX_SUGGESTIONS = 3


@dataclass(frozen=True)
class Heartbeat:
    runner_id: str
    free_blocks: int  # blocks it could lend now (free and within its lending cap)
    time: float
    node: str = ""


def node_cost(a: Heartbeat, b: Heartbeat) -> float:
    """Communication cost between two runners: 1 on one node, 10 across nodes."""
    return 1.0 if a.node == b.node else 10.0


class DebtLedger:
    def __init__(
        self,
        stale_after: float = 5.0,
        resort_every: float = 0.5,
        cost: Callable[[Heartbeat, Heartbeat], float] = node_cost,
    ) -> None:
        self.stale_after = stale_after
        self.resort_every = resort_every
        self.cost = cost
        self._beats: dict[str, Heartbeat] = {}
        self._free: dict[str, int] = {}  # the heartbeat's figure, less what was lent since
        self._debts: collections.Counter[tuple[str, str]] = collections.Counter()
        self._order: list[str] = []
        self._sorted_at = float("-inf")
        self.refusals = 0

    # -- what runners report ----------------------------------------------------------------
    def heartbeat(self, beat: Heartbeat) -> None:
        """A runner's free blocks now. One never seen before joins the order at its end at
        once (it was invisible to suggestions until the next re-sort)."""
        if beat.runner_id not in self._beats:
            self._order.append(beat.runner_id)
        self._beats[beat.runner_id] = beat
        self._free[beat.runner_id] = beat.free_blocks

    def forget(self, runner_id: str) -> None:
        """A runner left (drained or dead): no more suggestions of it, its debts are gone."""
        self._beats.pop(runner_id, None)
        self._free.pop(runner_id, None)
        for key in [k for k in self._debts if runner_id in k]:
            del self._debts[key]
        self._order = [r for r in self._order if r != runner_id]

    def lent(self, debtor: str, creditor: str, blocks: int) -> None:
        self._debts[debtor, creditor] += blocks
        self._free[creditor] = max(0, self._free.get(creditor, 0) - blocks)

    def returned(self, debtor: str, creditor: str, blocks: int) -> None:
        left = self._debts[debtor, creditor] - blocks
        if left > 0:
            self._debts[debtor, creditor] = left
        else:
            self._debts.pop((debtor, creditor), None)

    def refused(self, creditor: str) -> None:
        """The creditor refused: treat it as full until it says otherwise."""
        self.refusals += 1
        if creditor in self._free:
            self._free[creditor] = 0

    # -- what debtors ask -------------------------------------------------------------------
    def suggest(self, debtor: str, num_blocks: int, now: float) -> list[str]:
        """Up to MAX_SUGGESTIONS creditors for num_blocks blocks (fewer, or none, when fewer
        runners report free blocks): lowest cost from the debtor first, then most free
        blocks in the last sorted order."""
        if now - self._sorted_at >= self.resort_every:
            self.resort(now)
        me = self._beats.get(debtor, Heartbeat(debtor, 0, now))
        live = [
            r
            for r in self._order
            if r != debtor
            and r in self._beats
            and now - self._beats[r].time <= self.stale_after
            and self._free.get(r, 0) > 0
        ]
        rank = {r: i for i, r in enumerate(self._order)}
        live.sort(key=lambda r: (self.cost(me, self._beats[r]), rank[r]))
        return live[:MAX_SUGGESTIONS]

    def resort(self, now: float) -> None:
        """Re-sort runners by free blocks (most first; the runner id breaks ties)."""
        self._order = sorted(self._beats, key=lambda r: (-self._free.get(r, 0), r))
        self._sorted_at = now

    # -- views --------------------------------------------------------------------------------
    def debts(self) -> dict[tuple[str, str], int]:
        """(debtor, creditor) -> blocks the debtor holds on the creditor."""
        return {k: v for k, v in self._debts.items() if v > 0}

    def free(self, runner_id: str) -> int:
        return self._free.get(runner_id, 0)

    def borrowed(self, runner_id: str) -> int:
        return sum(v for (d, _), v in self._debts.items() if d == runner_id)

    def lent_by(self, runner_id: str) -> int:
        return sum(v for (_, c), v in self._debts.items() if c == runner_id)
