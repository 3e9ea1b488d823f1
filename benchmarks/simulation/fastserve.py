"""FastServe's comparison: one runner, heavy-tailed outputs, FCFS against skip-join MLFQ
(and the SRPT bound, common/oracle.py) over a load sweep."""

from __future__ import annotations

import heapq
import random
import statistics

from common.report import pyplot, save_plot

from punica_x.workloads import output_lengths, poisson_arrivals, zipf_sampler
from simulation.cluster import Sim, make_job
from simulation.cost import StepCost


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
