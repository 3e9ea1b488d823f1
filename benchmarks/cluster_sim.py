"""Cluster simulator: Punica's cluster experiment and FastServe's FCFS-vs-MLFQ comparison in
simulated time, with the live system's policy code.

Discrete events over many simulated runners. Every decision is made by the code the server
runs, imported and not copied: which runner takes a request (`scheduler.policy.placement.place`),
when to add a runner (`scheduler.policy.placement.advise`) and which to drain
(`scheduler.policy.placement.consolidation_choice`), and which requests run each step
(`punica_x.batching.batcher.Batcher` for FCFS,
`punica_x.batching.batcher_mlfq.MLFQBatcher` for skip-join MLFQ,
over a KV pool with the runner's block count whose blocks hold no data). Only time is
modelled: a step takes `StepCost(tokens computed, distinct adapters, KV tokens attended)`.

Profiles: `cpu` is this project's default model (SmolLM2-135M, fp32) on the 2-core AVX2 EPYC,
fitted to profile_step / bench_serve measurements; `a100` is Punica's published Llama-2-7B on
an A100 (decode step 11 -> 13 ms from batch 1 to 32 on short sequences, 17 -> 34 ms on long
ones; about 2 ms more per step for LoRA).

    python benchmarks/cluster_sim.py [--experiment punica|fastserve|all] [--profile a100|cpu]

punica: 16 runners, one simulated hour, Poisson arrivals whose rate rises then falls,
Zipf-1.5 adapter popularity, ShareGPT-like output lengths, autoscale on. Plots request rate,
tokens/s, runners in use and per-runner batch size over time; checks that runners in use
never exceed ceil(working set / batch) + 1.
fastserve: one runner, heavy-tailed output lengths, load swept from 0.5 to 0.95 of measured
capacity: mean and p99 job completion time of FCFS and MLFQ.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import heapq
import itertools
import math
import multiprocessing as mp
import random
import statistics
import time
from dataclasses import dataclass, field

import torch
from common.args import add_output_lengths, add_seed, add_tenant_load, parser
from common.oracle import OracleBatcher
from common.report import describe_machine, print_table, pyplot, save_plot, write_json

from punica_x.batching.batcher import Batcher
from punica_x.batching.batcher_mlfq import MLFQBatcher
from punica_x.batching.step_time import StepTimeModel
from punica_x.config import BatchConfig
from punica_x.core import SamplingParams
from punica_x.kv.blocks import KVCache, KVCacheSpec
from punica_x.kv.prefix import PrefixCache, cache_key
from punica_x.kv.swap import SwapPool
from punica_x.runtime import Request
from punica_x.workloads import output_lengths, poisson_arrivals, zipf_sampler
from scheduler.policy import placement
from scheduler.policy.fairness import FairQueue
from scheduler.prefix_index import PrefixIndex, block_names

# A block holds no data here: 1 layer, 1 head, 1 dim (the batcher only counts blocks).
EMPTY_SPEC = KVCacheSpec(1, 1, 1, 16, torch.float32)


@dataclass(frozen=True)
class StepCost:
    """Seconds of one engine step: base + per computed token (prefill or decode) + per
    distinct adapter in the batch (SGMV segments) + per KV token attended; plus swap_block_s
    for each KV block the MLFQ batcher swapped out or in before the step (a synchronous
    copy, the worst case: on a GPU proactive swaps overlap compute)."""

    name: str
    base_s: float
    token_s: float
    adapter_s: float
    kv_token_s: float
    kv_blocks: int  # KV pool of a runner
    max_batch_size: int = 32
    output_median: int = 24  # output-length distribution sized to the profile's speed
    swap_block_s: float = 0.0
    swap_blocks: int | None = None  # host pool of the MLFQ batcher (None: as many as kv_blocks)

    def __call__(self, tokens: int, adapters: int, kv_tokens: int) -> float:
        return (
            self.base_s
            + self.token_s * tokens
            + self.adapter_s * adapters
            + self.kv_token_s * kv_tokens
        )


PROFILES = {
    # Punica (sec. 2 and 7): Llama-2-7B fp16 on an A100. Decode: 11 ms at batch 1,
    # 13 ms at 32 (short sequences) -> 0.065 ms a token; 34 ms at 32 long (2k) sequences ->
    # 0.32 us a KV token; LoRA adds ~2 ms a step over 32 adapters -> 0.06 ms an adapter.
    # Prefill is compute-bound: 14 GFLOP a token at ~200 TFLOP/s -> 0.07 ms (the token term).
    # KV: 80 GB - 14 GB of weights at 0.5 MB a token = ~130k tokens = 8k blocks.
    # A block of 16 tokens is 8 MB: 0.32 ms a way over PCIe 4 x16 (25 GB/s).
    "a100": StepCost(
        "a100 (Punica, Llama-2-7B)", 0.011, 0.065e-3, 0.06e-3, 0.32e-6, 8000, 32, 128, 0.32e-3
    ),
    # SmolLM2-135M fp32 on the 2-core AVX2 EPYC (benchmarks/results/avx2): a batch of 32
    # decodes takes 68 ms without adapters and 94 ms with 32 distinct rank-16 ones
    # (profile_step) -> 0.8 ms an adapter; a single request's step ~25 ms, and a 512-token
    # prefill ~0.9 s (bench_migration's recompute fit: ~1 ms a token + a quadratic term
    # folded into the KV term). KV: 2 GiB at 46 KB a token = ~2900 blocks.
    # A block is 0.74 MB: ~0.15 ms a way as a memcpy; the host pool is the engine's default
    # swap_bytes, 1 GiB = 1400 blocks.
    "cpu": StepCost(
        "cpu (SmolLM2-135M, 2-core AVX2 EPYC)",
        0.022,
        1.4e-3,
        0.8e-3,
        2.0e-6,
        2900,
        32,
        24,
        0.15e-3,
        1400,
    ),
}


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
_ids = itertools.count()


def job_names(job: Job, tokens: list[int]) -> list[bytes]:
    """The scheduler's names of a job's full blocks (scheduler/prefix_index.py)."""
    return block_names(tokens, EMPTY_SPEC.block_size, str(job.adapter), job.tenant)


def make_job(t: float, prompt_len: int, out_len: int, adapter: int, tenant: str = "") -> Job:
    sp = SamplingParams(max_tokens=out_len, ignore_eos=True)
    r = Request(prompt_token_ids=[0] * prompt_len, sampling=sp, request_id=f"j{next(_ids)}")
    return Job(r, adapter, t, tenant=tenant)


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


# -- prefix caching: multi-turn chat, cache-aware placement vs adapter affinity ---------------
def chat_job(t: float, prompt: list[int], out_len: int, adapter: int, tenant: str) -> Job:
    """A chat turn with real token ids, cached under its adapter and tenant."""
    sp = SamplingParams(max_tokens=out_len, ignore_eos=True)
    r = Request(prompt_token_ids=prompt, sampling=sp, request_id=f"j{next(_ids)}")
    r.cache_key = cache_key(str(adapter), tenant)
    return Job(r, adapter, t, tenant=tenant)


@dataclass
class ChatSim(Sim):
    """Multi-turn chat: when a turn ends, its conversation's next turn arrives think_s later,
    its prompt the previous prompt, the reply and a new question (followups: per request id,
    the conversation's remaining turns as (question tokens, output length))."""

    think_s: float = 1.0
    followups: dict = field(default_factory=dict)
    turns: list = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.on_token = self._token

    def _token(self, job: Job) -> None:
        if job.first_token is None:
            job.first_token = self.t

    def finished(self, runner: SimRunner, job: Job) -> None:
        super().finished(runner, job)
        rest = self.followups.pop(job.request.request_id, None)
        if not rest:
            return
        (question, out_len), *later = rest
        prompt = job.request.all_token_ids + question
        nxt = chat_job(self.t + self.think_s, prompt, out_len, job.adapter, job.tenant)
        if later:
            self.followups[nxt.request.request_id] = later
        self.turns.append(nxt)
        self.at(nxt.arrival, lambda: self.arrive(nxt))


def prefix(args, cost: StepCost) -> list[dict]:
    """Multi-turn chat at 4 and 16 runners, placement by adapter affinity and consolidation
    only, and with the cached prefix weighed first: the prefix cache hit rate each buys."""
    rows = []
    for runners in (4, 16):
        for mode in ("affinity", "prefix"):
            row = chat_run(args, cost, runners, mode)
            rows.append(row)
            print(f"  {row}", flush=True)
    return rows


def chat_run(args, cost: StepCost, runners: int, mode: str) -> dict:
    """args.chat_conversations conversations per runner of args.chat_turns turns, each on one
    of 2 adapters per runner (its tenant's, with its own system prompt of
    args.system_tokens), Poisson starts at args.chat_rate per runner per second."""
    rng = random.Random(args.seed)
    adapters = 2 * runners
    systems = [
        [rng.randrange(3, 50_000) for _ in range(args.system_tokens)] for _ in range(adapters)
    ]
    sim = ChatSim(cost, "fcfs", runners=runners, prefix_caching=True, think_s=args.think_s)
    sim.prefix_placement = mode == "prefix"
    n = args.chat_conversations * runners
    for t in poisson_arrivals(n, args.chat_rate * runners, rng):
        a = rng.randrange(adapters)
        outs = output_lengths(args.chat_turns, rng, cost.output_median)
        turns = [([rng.randrange(3, 50_000) for _ in range(25)], m) for m in outs]
        first = chat_job(t, systems[a] + turns[0][0], turns[0][1], a, f"t{a}")
        sim.followups[first.request.request_id] = turns[1:]
        sim.turns.append(first)
        sim.at(t, lambda job=first: sim.arrive(job))
    sim.run_until(1e9)
    stats = [r.batcher.prefix.stats for r in sim.pool]
    queries = sum(sum(s.queries.values()) for s in stats)
    hits = sum(sum(s.hits.values()) for s in stats)
    ttft = sorted(j.first_token - j.arrival for j in sim.turns)
    return {
        "runners": runners,
        "placement": mode,
        "turns": len(sim.turns),
        "finished": len(sim.done),
        "hit_rate": hits / queries,
        "prefill_tokens": queries - hits,
        "ttft_mean_s": statistics.fmean(ttft),
        "ttft_p99_s": ttft[int(0.99 * (len(ttft) - 1))],
        "jct_mean_s": statistics.fmean(j.finish - j.arrival for j in sim.turns),
    }


def rising_then_falling(t: float, duration: float, peak: float) -> float:
    """Request rate at time t: from 5% of peak up to peak at half time and back down."""
    return peak * (0.05 + 0.95 * math.sin(math.pi * t / duration) ** 2)


# -- experiment 1: Punica's cluster ---------------------------------------------------------
def punica(args, cost: StepCost) -> dict:
    rng = random.Random(args.seed)
    duration = args.duration
    popularity = zipf_sampler(1000, 1.5)
    # capacity of one runner: its saturated request rate on a sample of the same workload
    sample = random.Random(args.seed + 7)
    per_runner_rps = saturated_rate(
        cost,
        [sample.randint(16, 512) for _ in range(1000)],
        output_lengths(1000, sample, cost.output_median),
        [popularity(sample) for _ in range(1000)],
    )
    peak = args.peak_load * args.runners * per_runner_rps
    sim = Sim(cost, args.policy, runners=1, autoscale=(1, args.runners))
    sim.at(0.0, sim.autoscale_tick)
    # Poisson arrivals of the rising-then-falling rate, by thinning a rate-`peak` process
    t, n = 0.0, 0
    while True:
        t += rng.expovariate(peak)
        if t >= duration:
            break
        if rng.random() < rising_then_falling(t, duration, peak) / peak:
            n += 1
            out = output_lengths(1, rng, cost.output_median)[0]
            job = make_job(t, rng.randint(16, 512), out, popularity(rng))
            sim.at(t, lambda job=job: sim.arrive(job))
    samples = []
    last_tokens = 0
    for k in range(int(duration // args.sample_s)):
        sim.run_until((k + 1) * args.sample_s)
        live = [r for r in sim.pool if r.state in ("active", "draining")]
        working, in_use = sim.working_set(), sim.in_use()
        samples.append(
            {
                "t": sim.t,
                "rate": rising_then_falling(sim.t, duration, peak),
                "tok_s": (sim.tokens_out - last_tokens) / args.sample_s,
                "working_set": working,
                "queued": len(sim.queue),
                "runners_live": len([r for r in sim.pool if r.state != "dead"]),
                "runners_in_use": in_use,
                "bound": sim.bound(),
                "batches": {r.runner_id: r.last_batch for r in live},
            }
        )
        last_tokens = sim.tokens_out
    sim.run_until(duration * 3)  # let the last requests finish
    violations = [s for s in samples if s["runners_in_use"] > s["bound"]]
    return {
        "runner_capacity_req_s": per_runner_rps,
        "requests": n,
        "finished": len(sim.done),
        "moves": sim.moves,
        "peak_rate": peak,
        "samples": samples,
        "violations": len(violations),  # at the samples (between autoscaler ticks)
        "ticks": sim.ticks,
        "tick_violations": sim.tick_violations,  # right after the autoscaler acted
        "max_runners": max(s["runners_live"] for s in samples),
    }


# -- experiment 2: FastServe's FCFS vs MLFQ --------------------------------------------------
def saturated_rate(cost: StepCost, prompts, lengths, adapters) -> float:
    """Requests/s one FCFS runner completes while saturated: all jobs submitted at once,
    counted until the last one is admitted (after that the batch empties, the tail of long
    jobs running in small batches, which is not the capacity)."""
    sim = Sim(cost, "fcfs", runners=1)
    jobs = [make_job(0.0, p, m, a) for p, m, a in zip(prompts, lengths, adapters)]
    for job in jobs:
        sim.arrive(job)
    while sim.queue:
        t, _, fn = heapq.heappop(sim.events)
        sim.t = t
        fn()
    return len(sim.done) / sim.t


def fastserve(args, cost: StepCost) -> list[dict]:
    rng = random.Random(args.seed)
    n = args.jobs
    lengths = output_lengths(n, rng, cost.output_median, args.output_sigma, 2, args.output_max)
    prompts = [rng.randint(16, 256) for _ in range(n)]
    popularity = zipf_sampler(64, 1.5)
    adapters = [popularity(rng) for _ in range(n)]

    def serve(policy: str, rate: float) -> list[float]:
        """JCTs of the n jobs arriving at `rate`."""
        arrivals = poisson_arrivals(n, rate, random.Random(args.seed + 1))
        sim = Sim(cost, policy, runners=1)
        jobs = [make_job(arrivals[i], prompts[i], lengths[i], adapters[i]) for i in range(n)]
        for job in jobs:
            sim.at(job.arrival, lambda job=job: sim.arrive(job))
        sim.run_until(1e9)
        return [j.finish - j.arrival for j in jobs]

    capacity = saturated_rate(cost, prompts, lengths, adapters)
    rows = []
    for load in args.loads:
        row = {"load": load, "rate": load * capacity}
        for policy in ("fcfs", "mlfq", "oracle"):
            jct = serve(policy, load * capacity)
            row[f"{policy}_mean_s"] = statistics.fmean(jct)
            row[f"{policy}_p99_s"] = sorted(jct)[int(0.99 * (len(jct) - 1))]
        row["mean_speedup"] = row["fcfs_mean_s"] / row["mlfq_mean_s"]
        row["p99_ratio"] = row["mlfq_p99_s"] / row["fcfs_p99_s"]
        row["oracle_speedup"] = row["fcfs_mean_s"] / row["oracle_mean_s"]
        rows.append(row)
        print(f"  load {load:.2f}: {row}", flush=True)
    return rows


def parse_args():
    ap = parser(__doc__)
    ap.add_argument(
        "--experiment",
        default="all",
        choices=["punica", "fastserve", "fairness", "prefix", "all"],
    )
    ap.add_argument("--profile", default="a100", choices=sorted(PROFILES))
    ap.add_argument("--runners", type=int, default=16)
    ap.add_argument("--duration", type=float, default=3600.0, help="simulated seconds")
    ap.add_argument("--sample-s", type=float, default=30.0)
    ap.add_argument("--peak-load", type=float, default=0.8, help="peak demand / 16 runners")
    ap.add_argument("--policy", default="fcfs", choices=["fcfs", "mlfq"])
    ap.add_argument("--jobs", type=int, default=2000, help="fastserve: requests per run")
    ap.add_argument(
        "--loads",
        type=lambda s: [float(x) for x in s.split(",")],
        default=[0.5, 0.7, 0.8, 0.9, 0.95],
    )
    add_seed(ap)
    ap.add_argument("--kv-blocks", type=int, default=None, help="a runner's KV pool (blocks)")
    add_output_lengths(ap, "fastserve: log-normal sigma of outputs", "fastserve: longest output")
    add_tenant_load(ap, "fairness: tenant A's requests", "fairness: tenant B's requests")
    ap.add_argument(
        "--chat-rate", type=float, default=None, help="prefix: conversations/s per runner"
    )
    ap.add_argument("--chat-conversations", type=int, default=40, help="prefix: per runner")
    ap.add_argument("--chat-turns", type=int, default=4, help="prefix: turns a conversation")
    ap.add_argument("--system-tokens", type=int, default=1000, help="prefix: a system prompt")
    ap.add_argument("--think-s", type=float, default=2.0, help="prefix: pause between turns")
    args = ap.parse_args()
    if args.chat_rate is None:  # runners busy enough that conversations spill over several
        args.chat_rate = CHAT_RATES[args.profile]
    return args


# prefix: conversations started per second per runner, by profile
CHAT_RATES = {"a100": 1.5, "cpu": 0.2}


def main() -> None:
    args = parse_args()
    print(describe_machine() + " (simulation: wall time only)", flush=True)
    cost = PROFILES[args.profile]
    if args.kv_blocks:
        cost = dataclasses.replace(cost, kv_blocks=args.kv_blocks)
    out: dict = {"args": vars(args), "profile": cost.__dict__}
    t0 = time.perf_counter()
    pending = None
    if args.experiment == "all":  # two processes: the two experiments share nothing
        pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=mp.get_context("fork"))
        pending = pool.submit(punica, args, cost)
    if args.experiment in ("fastserve", "all"):
        rows = fastserve(args, cost)
        out["fastserve"] = rows
        print_table(rows, list(rows[0]), f"FCFS vs MLFQ, one runner, {cost.name}")
        plot_fastserve(rows, cost, f"cluster_sim_fastserve_{args.profile}{variant(args)}")
    if args.experiment in ("fairness", "all"):
        rows = fairness(args, cost)
        out["fairness"] = rows
        print_table(rows, list(rows[0]), f"B's first token in A's flood, one runner, {cost.name}")
    if args.experiment in ("prefix", "all"):
        rows = prefix(args, cost)
        out["prefix"] = rows
        title = f"multi-turn chat, prefix-aware vs affinity-only placement, {cost.name}"
        print_table(rows, list(rows[0]), title)
        plot_prefix(rows, cost, f"cluster_sim_prefix_{args.profile}{variant(args)}")
    if args.experiment in ("punica", "all"):
        res = pending.result() if pending else punica(args, cost)
        out["punica"] = res
        report_punica(args, res, time.perf_counter() - t0)
        plot_punica(res, cost)
    out["wall_s"] = time.perf_counter() - t0
    # one experiment alone has its own file (the default, all of them, keeps the old name)
    alone = "" if args.experiment == "all" else f"_{args.experiment}"
    name = f"cluster_sim{alone}_{args.profile}{variant(args)}"
    path = write_json(name, out, group="sim")
    print(f"wrote {path} ({out['wall_s']:.0f} s wall)")


def report_punica(args, res: dict, wall_s: float) -> None:
    print(
        f"punica: {res['requests']} requests over {args.duration:.0f} s, {res['finished']} "
        f"finished, {res['moves']} moved; up to {res['max_runners']} runners; runners in "
        f"use above ceil(demand / batch) + 1 after {res['tick_violations']} of "
        f"{res['ticks']} autoscaler ticks, at {res['violations']} of {len(res['samples'])} "
        f"samples between ticks ({wall_s:.0f} s wall)",
        flush=True,
    )


def plot_punica(res: dict, cost: StepCost) -> None:
    plt = pyplot()
    s = res["samples"]
    ts = [x["t"] / 60 for x in s]
    fig, ax = plt.subplots(4, 1, figsize=(9, 10), sharex=True)
    ax[0].plot(ts, [x["rate"] for x in s])
    ax[0].set_ylabel("requests/s")
    ax[1].plot(ts, [x["tok_s"] for x in s])
    ax[1].set_ylabel("tokens/s")
    ax[2].plot(ts, [x["runners_in_use"] for x in s], label="in use")
    ax[2].plot(ts, [x["runners_live"] for x in s], label="started")
    ax[2].plot(ts, [x["bound"] for x in s], ":", label="ceil(demand/batch)+1")
    ax[2].set_ylabel("runners")
    ax[2].legend()
    ids = sorted({rid for x in s for rid in x["batches"]}, key=lambda r: int(r.split("-")[1]))
    for rid in ids:
        ax[3].plot(ts, [x["batches"].get(rid, 0) for x in s], lw=0.8)
    ax[3].set_ylabel("batch size per runner")
    ax[3].set_xlabel("minutes")
    fig.suptitle(f"Punica-style cluster run, simulated ({cost.name})")
    save_plot(f"cluster_sim_punica_{cost.name.split()[0]}", fig, group="sim")


def variant(args) -> str:
    """Result-name suffix for a KV pool or output lengths other than the profile's."""
    name = f"_kv{args.kv_blocks}" if args.kv_blocks else ""
    if (args.output_sigma, args.output_max) != (1.2, 512):
        name += f"_sigma{args.output_sigma:g}_max{args.output_max}"
    return name


def plot_prefix(rows: list[dict], cost: StepCost, name: str) -> None:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, dx in (("affinity", -0.2), ("prefix", 0.2)):
        mine = [r for r in rows if r["placement"] == mode]
        x = [i + dx for i in range(len(mine))]
        a.bar(x, [r["hit_rate"] for r in mine], 0.4, label=mode)
        b.bar(x, [r["ttft_mean_s"] for r in mine], 0.4, label=mode)
    labels = [f"{r['runners']} runners" for r in rows if r["placement"] == "prefix"]
    for ax, label in ((a, "prefix cache hit rate (tokens)"), (b, "mean TTFT (s)")):
        ax.set_xticks(range(len(labels)), labels)
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(f"multi-turn chat, cache-aware placement, simulated ({cost.name})")
    save_plot(name, fig, group="sim")


def plot_fastserve(rows: list[dict], cost: StepCost, name: str) -> None:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    loads = [r["load"] for r in rows]
    for policy, style in (("fcfs", "o-"), ("mlfq", "o-"), ("oracle", "k:")):
        label = "SRPT, lengths known (bound)" if policy == "oracle" else policy
        a.plot(loads, [r[f"{policy}_mean_s"] for r in rows], style, label=label)
        b.plot(loads, [r[f"{policy}_p99_s"] for r in rows], style, label=label)
    a.set_ylabel("mean JCT (s)")
    b.set_ylabel("p99 JCT (s)")
    for x in (a, b):
        x.set_xlabel("load (of capacity)")
        x.set_yscale("log")
        x.legend()
    fig.suptitle(f"FCFS vs skip-join MLFQ, simulated ({cost.name})")
    save_plot(name, fig, group="sim")


if __name__ == "__main__":
    main()
