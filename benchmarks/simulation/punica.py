"""Punica's cluster experiment: one simulated hour of rising then falling load over 16
runners with autoscale; runners in use against ceil(demand / batch) + 1."""

from __future__ import annotations

import math
import random

from common.report import pyplot, save_plot

from punica_x.workloads import output_lengths, zipf_sampler
from simulation.cluster import Sim, make_job
from simulation.cost import StepCost
from simulation.fastserve import saturated_rate


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
