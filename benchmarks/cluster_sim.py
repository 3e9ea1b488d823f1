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

import concurrent.futures
import dataclasses
import multiprocessing as mp
import time

from common.args import add_output_lengths, add_seed, add_tenant_load, parser
from common.report import describe_machine, print_table, write_json
from simulation.chat import chat_run, plot_prefix, prefix
from simulation.cluster import Sim, job_names, make_job
from simulation.cost import PROFILES, StepCost
from simulation.fairness import fairness
from simulation.fastserve import fastserve, plot_fastserve
from simulation.punica import plot_punica, punica, report_punica, rising_then_falling

from scheduler.policy import placement

__all__ = [
    "PROFILES",
    "Sim",
    "StepCost",
    "chat_run",
    "job_names",
    "make_job",
    "placement",
    "rising_then_falling",
]


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


def variant(args) -> str:
    """Result-name suffix for a KV pool or output lengths other than the profile's."""
    name = f"_kv{args.kv_blocks}" if args.kv_blocks else ""
    if (args.output_sigma, args.output_max) != (1.2, 512):
        name += f"_sigma{args.output_sigma:g}_max{args.output_max}"
    return name


if __name__ == "__main__":
    main()
