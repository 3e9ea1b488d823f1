"""DGFM (Infinite-LLM / DistKV-LLM): cancel cycles of debt so borrowed KV moves back home.

Debts form a directed graph: an edge debtor -> creditor weighs the blocks the debtor's
requests hold on the creditor. Around a cycle A -> B -> C -> A every runner both holds m
blocks on the next one and lends m to the previous one; swapping m blocks along the cycle
(each debtor's m blocks move into the slots its own creditor-debtor vacates) leaves every
runner with the same memory use, cancels m blocks of every debt on the cycle and makes
m x len(cycle) remote blocks local. Swaps smaller than `min_swap` blocks are not worth
their pause and are skipped; the runners in a swap stop lending while it runs.

Pure: functions of the ledger's debts, so tests and the simulator call the same code."""

from __future__ import annotations

from dataclasses import dataclass

Debts = dict[tuple[str, str], int]  # (debtor, creditor) -> blocks


@dataclass(frozen=True)
class Swap:
    """Move `blocks` blocks home for every debtor on `cycle` (runner ids, each owing the
    next and the last owing the first)."""

    cycle: tuple[str, ...]
    blocks: int

    def edges(self) -> list[tuple[str, str]]:
        n = len(self.cycle)
        return [(self.cycle[i], self.cycle[(i + 1) % n]) for i in range(n)]


def find_cycle(debts: Debts, min_swap: int) -> tuple[str, ...] | None:
    """A cycle of edges weighing at least min_swap (deterministic: the smallest runner id
    first, neighbours in id order), or None."""
    graph: dict[str, list[str]] = {}
    for (d, c), n in sorted(debts.items()):
        if n >= min_swap and d != c:
            graph.setdefault(d, []).append(c)
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> tuple[str, ...] | None:
        state[node] = 1
        path.append(node)
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1:
                return tuple(path[path.index(nxt) :])
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = 2
        path.pop()
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def plan_swaps(debts: Debts, min_swap: int = 4) -> tuple[list[Swap], Debts]:
    """Cancel cycles until none of at least min_swap blocks is left. Returns the swaps in
    order and the debts after them (every block accounted for: what a swap takes off an
    edge comes home, nothing else changes)."""
    if min_swap < 1:
        raise ValueError("min_swap must be >= 1")
    left = {k: v for k, v in debts.items() if v > 0}
    swaps: list[Swap] = []
    while (cycle := find_cycle(left, min_swap)) is not None:
        swap = Swap(cycle, min(left[e] for e in Swap(cycle, 0).edges()))
        for e in swap.edges():
            left[e] -= swap.blocks
            if left[e] == 0:
                del left[e]
        swaps.append(swap)
    return swaps, left


def remote_blocks(debts: Debts) -> int:
    """Blocks held away from their debtor's runner."""
    return sum(debts.values())
