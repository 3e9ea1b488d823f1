"""One simulated runner: the live batcher (FCFS or skip-join MLFQ) over a KV pool whose
blocks hold no data, stepping in simulated time."""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from common.oracle import OracleBatcher

from punica_x.batching.batcher import Batcher
from punica_x.batching.batcher_mlfq import MLFQBatcher
from punica_x.batching.step_time import StepTimeModel
from punica_x.config import BatchConfig
from punica_x.kv.blocks import KVCache
from punica_x.kv.prefix import PrefixCache
from punica_x.kv.swap import SwapPool
from punica_x.runtime import Request
from scheduler.policy import placement
from scheduler.prefix_index import PrefixIndex, block_names
from simulation.cost import EMPTY_SPEC, StepCost

if TYPE_CHECKING:
    from simulation.cluster import Sim


# -- one simulated runner -------------------------------------------------------------------
@dataclass
class Job:
    request: Request
    adapter: int
    arrival: float
    finish: float | None = None
    moves: int = 0
    runner: str | None = None  # the last runner that took it
    tenant: str = ""
    first_token: float | None = None  # when its first token came (the fairness experiment)
    names: list[bytes] | None = None  # its prompt's block names (prefix experiment)

    def __post_init__(self) -> None:
        self.prompt_len = len(self.request.prompt_token_ids)
        self.max_tokens = self.request.sampling.max_tokens


class SimRunner:
    """A runner's batcher (the live code) over an empty KV pool, stepping in simulated time."""

    def __init__(self, runner_id: str, index: int, policy: str, cost: StepCost, sim: Sim) -> None:
        self.runner_id, self.index, self.cost, self.sim = runner_id, index, cost, sim
        cache = KVCache(EMPTY_SPEC, cost.kv_blocks, torch.device("cpu"))
        config = BatchConfig(
            max_batch_size=cost.max_batch_size, policy="fcfs" if policy == "fcfs" else "mlfq"
        )
        self.max_working_set = config.max_working_set
        if policy in ("mlfq", "oracle"):
            swap = SwapPool(EMPTY_SPEC, cost.swap_blocks or cost.kv_blocks, torch.device("cpu"))
            timer = StepTimeModel(cost.base_s, cost.token_s)
            kind = MLFQBatcher if policy == "mlfq" else OracleBatcher
            self.batcher: Batcher = kind(cache, config, swap, timer, clock=sim.now)
            self.swap_blocks = swap.num_blocks
        else:
            self.batcher = Batcher(cache, config)
            self.swap_blocks = 0
        # prefix caching (the prefix experiment): the runner's own cache, and what the
        # scheduler believes it holds (scheduler/prefix_index.py)
        self.prefix_index = PrefixIndex(cost.kv_blocks)
        if sim.prefix_caching:
            self.batcher.prefix = PrefixCache(cache.allocator, EMPTY_SPEC.block_size)
        self.jobs: dict[str, Job] = {}
        # kept as requests come, grow and go (a snapshot per placement must be cheap)
        self.blocks: dict[str, int] = {}  # request id -> blocks_for(its tokens)
        self.committed = 0
        self.adapters: collections.Counter[int] = collections.Counter()
        self._resident: frozenset[str] | None = None
        self.state = "active"
        self.busy = False  # a step is scheduled or running
        self.idle_since = 0.0
        self.last_batch = 0

    def snapshot(self) -> placement.RunnerSnapshot:
        if self._resident is None:
            self._resident = frozenset(str(a) for a in self.adapters)
        return placement.RunnerSnapshot(
            runner_id=self.runner_id,
            state=self.state,
            working_set=len(self.jobs),
            max_batch_size=self.cost.max_batch_size,
            kv_blocks_total=self.cost.kv_blocks,
            kv_blocks_committed=self.committed,
            block_size=EMPTY_SPEC.block_size,
            resident_adapters=self._resident,
            index=self.index,
            max_working_set=self.max_working_set,
            kv_blocks_swap=self.swap_blocks,
        )

    def _track(self, job: Job, present: bool) -> None:
        """Keep committed blocks and resident adapters current as a job comes, grows, goes."""
        rid = job.request.request_id
        self.committed -= self.blocks.pop(rid, 0)
        if present:
            self.blocks[rid] = placement.blocks_for(job.request.num_tokens, EMPTY_SPEC.block_size)
            self.committed += self.blocks[rid]
        else:
            self.adapters[job.adapter] -= 1
            if not self.adapters[job.adapter]:
                del self.adapters[job.adapter]
                self._resident = None

    def add(self, job: Job) -> None:
        self.jobs[job.request.request_id] = job
        job.runner = self.runner_id
        if job.adapter not in self.adapters:
            self._resident = None
        self.adapters[job.adapter] += 1
        self._track(job, True)
        self.batcher.add(job.request, front=job.moves > 0)
        if not self.busy:
            self.busy = True
            self.sim.at(self.sim.t, self.step)

    def take(self, job: Job) -> None:
        """Leave this runner to recompute elsewhere (migration by recomputation)."""
        r = job.request
        self.batcher.remove(r)
        r.num_computed_tokens = 0
        self._track(job, False)
        del self.jobs[r.request_id]

    def step(self) -> None:
        swapped = self._swapped_blocks()
        schedule = self.batcher.schedule()
        scheduled = schedule.rows
        swapped = self._swapped_blocks() - swapped
        for r in schedule.overflow:
            self._finish(self.jobs[r.request_id])
        self.last_batch = len(scheduled)
        if not scheduled:
            self.busy = False
            self.idle_since = self.sim.t
            return
        tokens = kv = 0
        adapters = set()
        jobs = self.jobs
        for r, new in scheduled:
            tokens += new
            kv += r.num_computed_tokens
            adapters.add(jobs[r.request_id].adapter)
        dt = self.cost(tokens, len(adapters), kv) + swapped * self.cost.swap_block_s
        self.sim.at(self.sim.t + dt, lambda: self._done(scheduled, dt))

    def _swapped_blocks(self) -> int:
        swap = getattr(self.batcher, "swap", None)
        if swap is None:
            return 0
        return (swap.stats.bytes_out + swap.stats.bytes_in) // EMPTY_SPEC.bytes_per_block

    def _done(self, scheduled, dt: float) -> None:
        """The step's effect on its requests (as Engine._postprocess), then the next step."""
        jobs, block = self.jobs, EMPTY_SPEC.block_size
        sampled = 0
        on_token = self.sim.on_token
        prefix = self.batcher.prefix
        for r, new in scheduled:
            job = jobs.get(r.request_id)
            if job is None:
                continue  # moved away while the step ran
            if prefix is not None:
                prefix.computed(r, r.num_computed_tokens, new)
            computed = r.num_computed_tokens = r.num_computed_tokens + new
            out = r.output_token_ids
            length = job.prompt_len + len(out)
            if computed < length:
                continue  # a prefill chunk
            out.append(0)
            sampled += 1
            if on_token is not None:
                on_token(job)
            if length - job.prompt_len + 1 >= job.max_tokens:
                self._finish(job)
            elif (length + 1) % block == 0:
                self._track(job, True)  # a block more committed
        self.sim.tokens_out += sampled
        self.batcher.after_step(scheduled, dt)
        self.step()

    def _finish(self, job: Job) -> None:
        job.finish = self.sim.t
        if self.sim.prefix_caching:  # its prompt and output stay cached here
            self.prefix_index.record(job_names(job, job.request.all_token_ids))
        self._track(job, False)
        self.batcher.remove(job.request)
        del self.jobs[job.request.request_id]
        self.sim.finished(self, job)


JOB_IDS = itertools.count()  # request ids of the jobs the workloads make: j0, j1, ...


def job_names(job: Job, tokens: list[int]) -> list[bytes]:
    """The scheduler's names of a job's full blocks (scheduler/prefix_index.py)."""
    return block_names(tokens, EMPTY_SPEC.block_size, str(job.adapter), job.tenant)
