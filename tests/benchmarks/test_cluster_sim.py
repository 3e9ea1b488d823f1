"""The cluster simulator (benchmarks/cluster_sim.py) runs the live policy code: patching
placement or the MLFQ order changes what it simulates; small runs finish every request and
keep the consolidation bound."""

from __future__ import annotations

import dataclasses
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
cluster_sim = pytest.importorskip("cluster_sim")

COST = dataclasses.replace(cluster_sim.PROFILES["a100"], max_batch_size=4, kv_blocks=400)


def small_run(policy: str, runners: int = 1, n: int = 60, rate: float = 40.0):
    """n jobs with mixed lengths at `rate`/s; returns (sim, jobs)."""
    rng = random.Random(3)
    sim = cluster_sim.Sim(COST, policy, runners=runners)
    t, jobs = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        job = cluster_sim.make_job(t, rng.randint(8, 64), rng.choice([4, 8, 200]), i % 5)
        jobs.append(job)
        sim.at(t, lambda job=job: sim.arrive(job))
    sim.run_until(1e9)
    return sim, jobs


def jcts(jobs) -> list[float]:
    return [j.finish - j.arrival for j in jobs]


def test_every_job_finishes_with_its_tokens_under_both_policies():
    for policy in ("fcfs", "mlfq"):
        sim, jobs = small_run(policy)
        assert all(j.finish is not None for j in jobs)
        assert all(len(j.request.output_token_ids) == j.request.sampling.max_tokens for j in jobs)
        assert sim.tokens_out == sum(j.request.sampling.max_tokens for j in jobs)
        runner = sim.pool[0]
        assert runner.committed == 0 and not runner.jobs
        assert runner.batcher.cache.allocator.num_free == COST.kv_blocks


def test_the_simulation_runs_the_live_mlfq_order(monkeypatch):
    base = jcts(small_run("mlfq")[1])
    from punica_x.batching import mlfq

    monkeypatch.setattr(mlfq, "order_key", lambda p: (-p.arrival,))  # newest first, levels off
    assert jcts(small_run("mlfq")[1]) != base


def test_the_simulation_runs_the_live_placement(monkeypatch):
    """Consolidation packs a light load onto few runners; patched to pick the emptiest
    runner, the same run spreads over all three."""

    def runners_used(jobs) -> set[str]:
        return {j.runner for j in jobs}

    packed = runners_used(small_run("fcfs", runners=3, rate=5.0)[1])
    from scheduler.policy import placement

    def emptiest(runners, demand, exclude=frozenset()):
        fits = [r for r in runners if placement.has_room(r, demand)]
        return min(fits, key=lambda r: (r.working_set, r.index)).runner_id if fits else None

    monkeypatch.setattr(placement, "place", emptiest)
    spread = runners_used(small_run("fcfs", runners=3, rate=5.0)[1])
    assert len(packed) < len(spread) == 3


def test_consolidation_keeps_runners_in_use_within_the_bound():
    sim = cluster_sim.Sim(COST, "fcfs", runners=1, autoscale=(1, 6), tick_s=1.0, startup_s=2.0)
    sim.at(0.0, sim.autoscale_tick)
    rng = random.Random(5)
    t = 0.0
    for i in range(400):
        t += rng.expovariate(cluster_sim.rising_then_falling(t, 60.0, 30.0) + 0.5)
        job = cluster_sim.make_job(t, 32, rng.choice([8, 16, 300]), i % 7)
        sim.at(t, lambda job=job: sim.arrive(job))
    peak, worst = 0, 0
    while sim.t < 120:
        sim.run_until(sim.t + 1.0)
        live = [r for r in sim.pool if r.state in ("active", "draining")]
        working = sum(len(r.jobs) for r in live) + len(sim.queue)
        in_use = sum(1 for r in live if r.jobs)
        peak = max(peak, len([r for r in sim.pool if r.state != "dead"]))
        worst = max(worst, in_use - (-(-working // COST.max_batch_size) + 1))
    sim.run_until(600.0)  # autoscale ticks forever: a horizon, not "until no events"
    assert len(sim.done) == 400
    assert peak > 1  # it scaled up
    assert worst <= 0, worst
    assert sim.ticks > 100 and sim.tick_violations == 0


def test_one_tick_consolidates_a_fall_of_several_runners(monkeypatch):
    """8 runners each hold one long job and three short ones; when the short ones finish at
    once, the work (8 jobs, batch 4) needs 2 + 1 runners: the next tick drains five, not one
    (the autoscaler asks again after each consolidation). Red with one drain a tick."""

    def run() -> cluster_sim.Sim:
        sim = cluster_sim.Sim(COST, "fcfs", runners=8, autoscale=(1, 8), tick_s=1.0)
        for i in range(32):  # placement fills the busiest runner first: 1 long + 3 short each
            job = cluster_sim.make_job(0.0, 16, 2000 if i % 4 == 0 else 4, i % 3)
            sim.arrive(job)
        sim.at(0.5, sim.autoscale_tick)
        sim.run_until(30.0)
        return sim

    sim = run()
    assert sim.moves > 0 and sim.ticks >= 29
    assert sim.tick_violations == 0
    real = cluster_sim.placement.advise
    monkeypatch.setattr(
        cluster_sim.placement,
        "advise",
        lambda *a, **k: dataclasses.replace(real(*a, **k), consolidate=False),
    )
    assert run().tick_violations > 0


def test_the_prefix_experiment_runs_the_live_cache_and_placement(monkeypatch):
    """Multi-turn chat over 4 runners: the runners' own prefix caches (punica_x/kv/prefix.py)
    find the conversations' prefixes, cache-aware placement finds more of them, and with the
    placement patched to ignore what is cached the run is the affinity-only one."""
    from types import SimpleNamespace

    args = SimpleNamespace(
        seed=0, chat_conversations=8, chat_turns=3, system_tokens=160, think_s=1.0, chat_rate=4.0
    )

    def run(mode: str) -> dict:
        return cluster_sim.chat_run(args, COST, 4, mode)

    affinity, aware = run("affinity"), run("prefix")
    for row in (affinity, aware):
        assert row["finished"] == row["turns"] == 4 * 8 * 3
        assert 0 < row["hit_rate"] < 1
    assert aware["hit_rate"] > affinity["hit_rate"]
    assert aware["prefill_tokens"] < affinity["prefill_tokens"]
    real = cluster_sim.placement.place

    def blind(runners, demand, exclude=frozenset()):
        return real(runners, dataclasses.replace(demand, cached={}), exclude)

    monkeypatch.setattr(cluster_sim.placement, "place", blind)
    assert {**run("prefix"), "placement": "affinity"} == affinity
