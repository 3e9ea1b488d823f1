"""DGFM on constructed debt graphs: a cycle is cancelled, nothing is lost (every runner's
lent minus borrowed is unchanged), remote blocks drop by what the swaps bring home, small
swaps are skipped; random graphs keep those invariants and end with no cycle left."""

from __future__ import annotations

import collections
import os
import random

import pytest

from scheduler.distkv.dgfm import Swap, find_cycle, plan_swaps, remote_blocks


def balance(debts) -> dict[str, int]:
    """Per runner: blocks lent minus blocks borrowed (its memory use for others)."""
    out: collections.Counter[str] = collections.Counter()
    for (d, c), n in debts.items():
        out[c] += n
        out[d] -= n
    return {k: v for k, v in out.items() if v}


def test_a_three_cycle_is_cancelled_and_its_blocks_come_home():
    debts = {("a", "b"): 6, ("b", "c"): 8, ("c", "a"): 5, ("a", "d"): 3}
    swaps, left = plan_swaps(debts, min_swap=2)
    assert swaps == [Swap(("a", "b", "c"), 5)]
    assert left == {("a", "b"): 1, ("b", "c"): 3, ("a", "d"): 3}
    assert remote_blocks(left) == remote_blocks(debts) - 15
    assert balance(left) == balance(debts)


def test_a_two_cycle_is_an_exchange():
    swaps, left = plan_swaps({("a", "b"): 4, ("b", "a"): 4}, min_swap=4)
    assert swaps == [Swap(("a", "b"), 4)] and left == {}


def test_no_cycle_no_swap_and_small_swaps_are_skipped():
    chain = {("a", "b"): 9, ("b", "c"): 9}
    assert plan_swaps(chain) == ([], chain)
    small = {("a", "b"): 9, ("b", "a"): 2}
    assert plan_swaps(small, min_swap=4) == ([], small)
    assert plan_swaps(small, min_swap=2)[0] == [Swap(("a", "b"), 2)]
    with pytest.raises(ValueError):
        plan_swaps(small, min_swap=0)


@pytest.mark.parametrize("trial", range(20))
def test_random_debt_graphs_keep_every_block(trial):
    seed = int.from_bytes(os.urandom(4), "little")
    rng = random.Random(seed)
    runners = [f"r{i}" for i in range(rng.randint(2, 7))]
    debts = {}
    for d in runners:
        for c in runners:
            if d != c and rng.random() < 0.5:
                debts[d, c] = rng.randint(1, 20)
    min_swap = rng.randint(1, 6)
    swaps, left = plan_swaps(debts, min_swap)
    assert balance(left) == balance(debts), seed
    assert all(n > 0 for n in left.values()), seed
    brought_home = sum(s.blocks * len(s.cycle) for s in swaps)
    assert remote_blocks(left) == remote_blocks(debts) - brought_home, seed
    assert all(s.blocks >= min_swap for s in swaps), seed
    assert find_cycle(left, min_swap) is None, seed
