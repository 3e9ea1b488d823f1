"""The Global Debt Ledger: suggestions by cost then free blocks (at most 3), stale
heartbeats left out, refusals zero a creditor until its next heartbeat, the order re-sorted
only periodically (loose consistency), debts recorded and cancelled."""

from __future__ import annotations

from scheduler.distkv.ledger import MAX_SUGGESTIONS, DebtLedger, Heartbeat


def ledger_with(free: dict[str, int], now=0.0, nodes=None, **kw) -> DebtLedger:
    ledger = DebtLedger(**kw)
    for rid, n in free.items():
        ledger.heartbeat(Heartbeat(rid, n, now, (nodes or {}).get(rid, "")))
    return ledger


def test_suggests_most_free_first_at_most_three_never_the_debtor():
    ledger = ledger_with({"d": 50, "a": 5, "b": 30, "c": 20, "e": 10})
    assert ledger.suggest("d", 8, 0.0) == ["b", "c", "e"]
    assert len(ledger.suggest("d", 8, 0.0)) == MAX_SUGGESTIONS


def test_lower_communication_cost_wins_over_more_free_blocks():
    nodes = {"d": "n1", "a": "n1", "b": "n2", "c": "n2"}
    ledger = ledger_with({"d": 0, "a": 3, "b": 30, "c": 20}, nodes=nodes)
    assert ledger.suggest("d", 8, 0.0) == ["a", "b", "c"]


def test_stale_heartbeats_and_empty_runners_are_left_out():
    ledger = ledger_with({"d": 0, "a": 10, "b": 0}, stale_after=5.0)
    ledger.heartbeat(Heartbeat("c", 40, -10.0))  # last heard of 10 s ago
    assert ledger.suggest("d", 1, 0.0) == ["a"]
    ledger.heartbeat(Heartbeat("c", 40, 0.0))
    assert ledger.suggest("d", 1, 0.5) == ["c", "a"]


def test_a_refusal_zeroes_the_creditor_until_its_next_heartbeat():
    ledger = ledger_with({"d": 0, "a": 10, "b": 8})
    ledger.refused("a")
    assert ledger.suggest("d", 4, 1.0) == ["b"] and ledger.refusals == 1
    ledger.heartbeat(Heartbeat("a", 10, 1.0))
    assert ledger.suggest("d", 4, 2.0) == ["a", "b"]


def test_all_refuse_then_ask_again_later():
    ledger = ledger_with({"d": 0, "a": 10})
    ledger.refused("a")
    assert ledger.suggest("d", 4, 0.1) == []
    ledger.heartbeat(Heartbeat("a", 6, 1.0))
    assert ledger.suggest("d", 4, 1.0) == ["a"]


def test_order_is_resorted_only_periodically():
    ledger = ledger_with({"d": 0, "a": 10, "b": 5}, resort_every=1.0)
    assert ledger.suggest("d", 1, 0.0) == ["a", "b"]
    ledger.heartbeat(Heartbeat("b", 50, 0.2))
    assert ledger.suggest("d", 1, 0.5) == ["a", "b"]  # loose: the old order holds
    assert ledger.suggest("d", 1, 1.0) == ["b", "a"]  # re-sorted


def test_debts_are_recorded_lower_free_blocks_and_cancel_on_return():
    ledger = ledger_with({"d": 0, "a": 10})
    ledger.lent("d", "a", 4)
    assert ledger.debts() == {("d", "a"): 4} and ledger.free("a") == 6
    assert ledger.borrowed("d") == 4 and ledger.lent_by("a") == 4
    ledger.returned("d", "a", 3)
    assert ledger.debts() == {("d", "a"): 1}
    ledger.returned("d", "a", 1)
    assert ledger.debts() == {}
    ledger.lent("d", "a", 2)
    ledger.forget("a")
    assert ledger.debts() == {} and ledger.suggest("d", 1, 0.0) == []


def test_a_runner_first_heard_after_the_sort_is_suggested_at_once():
    """Heartbeats keep their sorted order until the next re-sort, but a runner never heard
    before joins it at once (it was invisible for up to resort_every seconds)."""
    ledger = ledger_with({"a": 4, "b": 4}, resort_every=10.0)
    assert ledger.suggest("b", 2, 0.1) == ["a"]  # sorted now, for 10 s
    ledger.heartbeat(Heartbeat("c", 9, 0.2))
    assert ledger.suggest("b", 2, 0.3) == ["a", "c"]
