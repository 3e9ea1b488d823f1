"""DGFM's holds between Ray runners (scheduler/distkv/ray_group.py, actor.py), without Ray
processes: a hold that timed out on the scheduler's side (a runner stopped by SIGSTOP, or
in a long step) is released all the same, and a release that reaches a runner before its
hold keeps that hold from ever holding the engine (before, such a runner's engine stopped
for 120 s and it never lent a block again)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import ray

from scheduler.distkv.actor import KVActorMethods
from scheduler.distkv.dgfm import Swap
from scheduler.distkv.ray_group import RayKVGroup


class FakeActor:
    """Records every `actor.method.remote(*args)` as (actor, method, args); the ref is
    (actor, method)."""

    def __init__(self, name: str, calls: list) -> None:
        self.name, self.calls = name, calls

    def __getattr__(self, method: str):
        def remote(*args):
            self.calls.append((self.name, method, args))
            return (self.name, method)

        return SimpleNamespace(remote=remote)


def test_a_hold_that_timed_out_is_released_with_the_others(monkeypatch):
    calls: list = []
    group = RayKVGroup.__new__(RayKVGroup)
    group.members = {r: SimpleNamespace(actor=FakeActor(r, calls)) for r in ("A", "B")}
    group.gmanager = FakeActor("ledger", calls)

    def get(ref, timeout=None):
        if ref == ("B", "dgfm_hold"):  # B is stopped: its hold runs only after SIGCONT
            raise ray.exceptions.GetTimeoutError("no reply")
        return True

    monkeypatch.setattr(ray, "get", get)
    with pytest.raises(ray.exceptions.GetTimeoutError):
        group._swap(Swap(("A", "B"), 4))
    holds = [(a, args) for a, m, args in calls if m == "dgfm_hold"]
    releases = [(a, args) for a, m, args in calls if m == "dgfm_release"]
    assert [a for a, _ in holds] == ["A", "B"]
    assert sorted(releases) == sorted(holds)  # B's too, with the same token


class FakeEngine:
    def __init__(self) -> None:
        self.held = 0

    def hold(self, timeout: float, limit: float):
        self.held += 1

        def release():
            self.held -= 1

        return release


def runner() -> KVActorMethods:
    r = KVActorMethods()
    r.runner_id, r.async_engine, r.rm = "A", FakeEngine(), SimpleNamespace(frozen=False)
    r._dgfm_holds, r._dgfm_cancelled = {}, set()
    return r


def test_a_hold_then_its_release_freezes_lending_only_in_between():
    r = runner()
    assert r.dgfm_hold("t1") is True
    assert r.async_engine.held == 1 and r.rm.frozen
    r.dgfm_release("t1")
    assert r.async_engine.held == 0 and not r.rm.frozen


def test_a_release_that_arrives_before_its_hold_keeps_it_from_holding():
    r = runner()
    r.dgfm_release("t1")  # the swap gave up on this runner before the hold ran here
    assert r.dgfm_hold("t1") is False
    assert r.async_engine.held == 0 and not r.rm.frozen
    assert r.dgfm_hold("t2") is True  # a later swap holds as before
    r.dgfm_release("t2")
    assert r.async_engine.held == 0 and not r.rm.frozen and not r._dgfm_cancelled
