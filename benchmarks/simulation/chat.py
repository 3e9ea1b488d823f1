"""Prefix caching: multi-turn chat, cache-aware placement (scheduler.prefix_index) against
adapter affinity alone."""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field

from common.report import pyplot, save_plot

from punica_x.core import SamplingParams
from punica_x.kv.prefix import cache_key
from punica_x.runtime import Request
from punica_x.workloads import output_lengths, poisson_arrivals
from simulation.cluster import Sim
from simulation.cost import StepCost
from simulation.runner import JOB_IDS, Job, SimRunner


# -- prefix caching: multi-turn chat, cache-aware placement vs adapter affinity ---------------
def chat_job(t: float, prompt: list[int], out_len: int, adapter: int, tenant: str) -> Job:
    """A chat turn with real token ids, cached under its adapter and tenant."""
    sp = SamplingParams(max_tokens=out_len, ignore_eos=True)
    r = Request(prompt_token_ids=prompt, sampling=sp, request_id=f"j{next(JOB_IDS)}")
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
