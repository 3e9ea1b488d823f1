"""Fair share between tenants (scheduler.policy.fairness): tenant B's first token while
tenant A floods one runner."""

from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass, field

from scheduler.policy.fairness import FairQueue
from simulation.cluster import Sim, make_job
from simulation.cost import StepCost
from simulation.runner import Job, SimRunner


# -- fair share between tenants ---------------------------------------------------------------
@dataclass
class FairSim(Sim):
    """A Sim whose scheduler queue is the live fair-share policy (scheduler/policy/fairness.py
    FairQueue: VTC order across tenants, a slot taken back from a tenant above its share, the
    moved request recomputing later), with one fixed pool of runners (no autoscaling)."""

    fair: FairQueue = field(default_factory=FairQueue)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.on_token = self._served

    def _served(self, job: Job) -> None:
        if job.first_token is None:
            job.first_token = self.t
        self.fair.charge(job.tenant, output_tokens=1)

    def arrive(self, job: Job) -> None:
        self.fair.push(job.tenant, job)
        self._kick()

    def finished(self, runner: SimRunner, job: Job) -> None:
        self.done.append(job)
        self._kick()

    def _kick(self) -> None:
        running = collections.Counter(j.tenant for r in self.pool for j in r.jobs.values())
        self.fair.set_running(running)
        while (head := self.fair.peek()) is not None:
            tenant, job = head
            if not self._place(job):
                self._rebalance()
                return
            self.fair.pop(tenant)
            self._started(job)

    def _started(self, job: Job) -> None:
        self.fair.started(job.tenant)
        if job.moves == 0 or job.first_token is None:
            self.fair.charge(job.tenant, prompt_tokens=job.prompt_len)

    def _rebalance(self) -> None:
        """As the scheduler's: each move sends the giver's newest request back to the queue
        (it recomputes later) and opens the taker's oldest waiting one in its place."""
        slots = sum(r.max_working_set or self.cost.max_batch_size for r in self.pool)
        for move in self.fair.rebalance(slots):
            held = [(j, r) for r in self.pool for j in r.jobs.values() if j.tenant == move.giver]
            job, runner = max(held, key=lambda x: x[0].arrival)
            runner.take(job)
            job.moves += 1
            self.moves += 1
            self.fair.push(job.tenant, job, front=True)
            taker = self.fair.pop(move.taker)
            runner.add(taker)
            self._started(taker)


def fairness(args, cost: StepCost) -> list[dict]:
    """One runner: tenant A floods it (args.flood requests at t=0), tenant B sends
    args.light requests at t=5 s; B's median time to first token against B alone, with the
    scheduler's queue FCFS (Sim) and fair (FairSim). Every job is --output-median tokens."""
    out_len = cost.output_median * 2

    def run(kind, flood: bool) -> dict:
        sim = kind(cost, "fcfs", runners=1)
        if flood:
            for _ in range(args.flood):
                sim.arrive(make_job(0.0, 32, out_len, 0, "a"))
        light = [make_job(5.0, 32, out_len, 1, "b") for _ in range(args.light)]
        sim.on_token = sim.on_token or (lambda j: setattr(j, "first_token", j.first_token or sim.t))
        for job in light:
            sim.at(5.0, lambda job=job: sim.arrive(job))
        sim.run_until(1e6)
        ttft = statistics.median(j.first_token - j.arrival for j in light)
        return {"ttft": ttft, "moves": sim.moves, "done": len(sim.done)}

    rows = []
    for name, kind in (("fcfs", Sim), ("fair share (VTC)", FairSim)):
        alone, flood = run(kind, False), run(kind, True)
        rows.append(
            {
                "queue": name,
                "b_ttft_alone_s": round(alone["ttft"], 3),
                "b_ttft_flood_s": round(flood["ttft"], 3),
                "ratio": round(flood["ttft"] / alone["ttft"], 2),
                "moves": flood["moves"],
                "finished": flood["done"],
            }
        )
    return rows
