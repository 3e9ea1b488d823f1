"""The simulated cluster: discrete events over runners, placement / autoscale / drain by the
live policy code (scheduler.policy.placement), and the jobs a workload makes."""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from punica_x.core import SamplingParams
from punica_x.runtime import Request
from scheduler.policy import placement
from simulation.cost import EMPTY_SPEC, StepCost
from simulation.runner import JOB_IDS, Job, SimRunner, job_names


# -- the cluster ----------------------------------------------------------------------------
@dataclass
class Sim:
    cost: StepCost
    policy: str = "fcfs"
    runners: int = 1
    autoscale: tuple[int, int] | None = None  # (min, max) runners
    tick_s: float = 1.0  # as the live autoscaler (scheduler/autoscale.py)
    startup_s: float = 30.0
    idle_after_s: float = 30.0
    t: float = 0.0
    tokens_out: int = 0
    events: list = field(default_factory=list)
    seq: itertools.count = field(default_factory=itertools.count)
    pool: list[SimRunner] = field(default_factory=list)
    queue: list[Job] = field(default_factory=list)
    done: list[Job] = field(default_factory=list)
    moves: int = 0
    on_token: object = None  # called with the job of every sampled token (None: no call)
    ticks: int = 0
    tick_violations: int = 0  # autoscaler ticks after which more runners hold work than bound()
    prefix_caching: bool = False  # runners reuse cached prefixes (jobs carry real token ids)
    prefix_placement: bool = False  # placement weighs the cached prefix (else affinity only)

    def __post_init__(self) -> None:
        for _ in range(self.runners):
            self._new_runner()

    def now(self) -> float:
        return self.t

    def at(self, t: float, fn) -> None:
        heapq.heappush(self.events, (t, next(self.seq), fn))

    def run_until(self, t_end: float) -> None:
        while self.events and self.events[0][0] <= t_end:
            self.t, _, fn = heapq.heappop(self.events)
            fn()
        self.t = t_end

    # requests
    def arrive(self, job: Job) -> None:
        if self.queue or not self._place(job):
            self.queue.append(job)  # first come, first served at the scheduler

    def _place(self, job: Job, exclude: frozenset[str] = frozenset()) -> bool:
        cached = {}
        if self.prefix_placement:
            if job.names is None:
                job.names = job_names(job, job.request.prompt_token_ids)
            size = EMPTY_SPEC.block_size
            cached = {r.runner_id: r.prefix_index.match(job.names) * size for r in self.pool}
        demand = placement.Demand(str(job.adapter), job.request.num_tokens, cached)
        rid = placement.place([r.snapshot() for r in self.pool], demand, exclude)
        if rid is None:
            return False
        runner = next(r for r in self.pool if r.runner_id == rid)
        if self.prefix_caching:
            runner.prefix_index.record(job.names or job_names(job, job.request.prompt_token_ids))
        runner.add(job)
        return True

    def finished(self, runner: SimRunner, job: Job) -> None:
        self.done.append(job)
        while self.queue and self._place(self.queue[0]):
            self.queue.pop(0)
        if runner.state == "draining" and not runner.jobs:
            runner.state = "dead"

    # runners
    def _new_runner(self, delay: float = 0.0) -> None:
        r = SimRunner(f"runner-{len(self.pool)}", len(self.pool), self.policy, self.cost, self)
        self.pool.append(r)
        if delay:
            r.state = "starting"

            def up():
                r.state = "active"
                while self.queue and self._place(self.queue[0]):
                    self.queue.pop(0)

            self.at(self.t + delay, up)

    def autoscale_tick(self) -> None:
        lo, hi = self.autoscale
        snaps = [r.snapshot() for r in self.pool if r.state != "dead"]
        live = [s for s in snaps if s.state in ("active", "starting")]
        idle = {
            r.runner_id: (self.t - r.idle_since) if not r.jobs else 0.0
            for r in self.pool
            if r.state == "active"
        }
        advice = placement.advise(snaps, len(self.queue), idle, self.idle_after_s)
        starting = any(s.state == "starting" for s in snaps)
        if advice.action == "scale_up" and len(live) < hi and not starting:
            self._new_runner(self.startup_s)
        n, first = len(live), True
        # as scheduler/autoscale.py: after a drain, more drains while they consolidate
        while advice.action == "scale_down" and n > lo and (first or advice.consolidate):
            self._retire(advice.runner_id)  # idle, or its work fits on the others
            n, first = n - 1, False
            idle.pop(advice.runner_id, None)
            snaps = [r.snapshot() for r in self.pool if r.state != "dead"]
            advice = placement.advise(snaps, len(self.queue), idle, self.idle_after_s)
        self.ticks += 1
        self.tick_violations += self.in_use() > self.bound()
        self.at(self.t + self.tick_s, self.autoscale_tick)

    def working_set(self) -> int:
        return sum(len(r.jobs) for r in self.pool) + len(self.queue)

    def in_use(self) -> int:
        return sum(1 for r in self.pool if r.jobs)

    def bound(self) -> int:
        """ceil(demand / capacity) + 1 runners: demand = requests held or queued, capacity
        = a runner's batch."""
        return -(-self.working_set() // self.cost.max_batch_size) + 1

    def _retire(self, runner_id: str) -> None:
        """Drain: stop placing on it, move its requests (recompute) to runners with room."""
        r = next(r for r in self.pool if r.runner_id == runner_id)
        r.state = "draining"
        for job in list(r.jobs.values()):
            r.take(job)
            job.moves += 1
            self.moves += 1
            if not self._place(job, frozenset({runner_id})):
                self.queue.insert(0, job)
        if not r.jobs:
            r.state = "dead"


# -- workloads ------------------------------------------------------------------------------
def make_job(t: float, prompt_len: int, out_len: int, adapter: int, tenant: str = "") -> Job:
    sp = SamplingParams(max_tokens=out_len, ignore_eos=True)
    r = Request(prompt_token_ids=[0] * prompt_len, sampling=sp, request_id=f"j{next(JOB_IDS)}")
    return Job(r, adapter, t, tenant=tenant)
