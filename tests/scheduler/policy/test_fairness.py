"""The fair-share policy (scheduler/policy/fairness.py) on its own: VTC order across tenants, FCFS
within one, no banked credit, weights, the shared queue shared fairly, and which tenant
gives a batch slot to which."""

from __future__ import annotations

import pytest

from scheduler.policy.fairness import QUEUE_OVERFLOW, FairQueue, Rebalance


def drain(q: FairQueue, charge_each: int = 10) -> list:
    """Serve everything, one at a time, charging each served item `charge_each` tokens."""
    order = []
    while (head := q.peek()) is not None:
        tenant, item = head
        assert q.pop(tenant) == item
        q.charge(tenant, output_tokens=charge_each)
        order.append(item)
    return order


def test_least_served_tenant_first_fcfs_within_a_tenant():
    q = FairQueue()
    for i in range(4):
        q.push("a", f"a{i}")
    for i in range(2):
        q.push("b", f"b{i}")
    # equal counters: the tie goes to the first tenant seen, then they alternate
    assert drain(q) == ["a0", "b0", "a1", "b1", "a2", "a3"]


def test_a_flooding_tenant_does_not_delay_a_newcomer():
    q = FairQueue()
    for i in range(100):
        q.push("flood", i)
    for _ in range(10):  # the flood is being served
        q.pop("flood")
        q.started("flood")
        q.charge("flood", prompt_tokens=10, output_tokens=64)
    q.push("b", "b0")
    assert q.peek() == ("b", "b0")


def test_no_banked_credit_after_idling():
    q = FairQueue()
    q.push("a", "a0")
    q.charge("a", output_tokens=1000)
    q.pop("a")
    q.started("a")
    q.push("a", "a1")
    # b never ran; it arrives while a waits: lifted to a's counter, not served 500 times in a row
    q.push("b", "b0")
    assert q.tenants["b"].counter == q.tenants["a"].counter
    q.push("b", "b1")
    q.push("b", "b2")
    assert drain(q, charge_each=1000)[:3] == ["b0", "a1", "b1"]  # a tie: fewer running first


def test_weights_scale_the_service():
    q = FairQueue()
    q.set_weight("gold", 3)
    for i in range(40):
        q.push("gold", ("gold", i))
        q.push("std", ("std", i))
    served = drain(q)[:40]
    assert sum(1 for t, _ in served if t == "gold") == 30
    with pytest.raises(ValueError):
        q.set_weight("x", 0)


def test_front_push_keeps_a_moved_request_first_of_its_tenant():
    q = FairQueue()
    q.push("a", "a1")
    q.push("a", "a0", front=True)
    assert q.peek() == ("a", "a0") and len(q) == 2 and q.remove("a", "a1") and len(q) == 1


def test_shared_queue_is_shared_fairly():
    q = FairQueue()
    for i in range(10):
        assert q.admits("flood", 10)
        q.push("flood", i)
    assert not q.admits("flood", 10)  # full, and the flood holds the whole queue
    assert q.admits("b", 10)  # b holds nothing: below its share of 5
    for i in range(5):
        q.push("b", i)
    assert not q.admits("b", 10)
    q.set_weight("c", 100)
    for i in range(5):
        q.push("c", i)
    assert len(q) == 2 * 10 and not q.admits("c", 10)  # never past QUEUE_OVERFLOW * max_queue
    assert QUEUE_OVERFLOW == 2


def test_rebalance_gives_a_slot_to_a_tenant_below_its_share():
    q = FairQueue()
    for _ in range(32):
        q.started("a")
    q.push("a", "a-waiting")
    q.charge("a", output_tokens=640)
    assert q.rebalance(32) == []  # nobody else waits
    q.push("b", "b0")
    assert q.rebalance(32) == [Rebalance("a", "b")]  # as many as b has waiting
    for i in range(1, 30):
        q.push("b", f"b{i}")
    assert q.rebalance(32) == [Rebalance("a", "b")] * 16  # b up to its share, 16 of 32
    for _ in range(16):
        q.stopped("a")
        q.started("b")
    assert q.rebalance(32) == []


def test_rebalance_passes_over_a_tenant_with_nothing_running_or_waiting():
    """A tenant once seen but idle now has no share: rebalancing never looks its share up
    (it raised KeyError into every request that was handing a dead runner's streams on, a
    fault campaign found: benchmarks/bench_faults.py)."""
    q = FairQueue()
    q.started("idle")
    q.stopped("idle")
    for _ in range(32):
        q.started("a")
    q.push("b", "b0")
    assert q.rebalance(32) == [Rebalance("a", "b")]


def test_rebalance_takes_from_those_above_their_share():
    q = FairQueue()
    for _ in range(16):
        q.started("a")
        q.started("b")
    q.push("c", "c0")  # three tenants: shares of 10.7 each; a and b are above theirs
    q.push("c", "c1")
    q.charge("a", output_tokens=100)
    # c takes one slot from each: a first (served more), then b (now further above)
    assert q.rebalance(32) == [Rebalance("a", "c"), Rebalance("b", "c")]
    assert q.rebalance(0) == []
