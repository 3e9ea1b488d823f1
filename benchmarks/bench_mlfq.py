"""Does skip-join MLFQ cut job completion time on the real engine? (FCFS vs MLFQ, issue 9)

One runner in this process: SmolLM2-135M, the default engine config, 8 rank-16 adapters
(Zipf 1.5, 1 in 8 the base model). Requests have heavy-tailed output lengths
(punica_x.workloads.output_lengths: log-normal, median 24, sigma --output-sigma, clipped to
2..--output-max) and arrive as a Poisson process at --load times the measured capacity: the
rate at which an FCFS runner completes the same requests while saturated (all submitted at
once, counted until the last one is admitted: the drain after it, long jobs in small batches,
is not capacity). The same arrival trace is served by an FCFS engine, an MLFQ engine and, as
the bound, an SRPT "oracle" (the MLFQ engine ordering by remaining output with every length
known in advance: common/oracle.py's OracleBatcher), alternating for --rounds rounds (the machine
drifts over minutes). Job completion time (JCT) = finish - arrival. Reports mean and p99 JCT,
tokens/s, MLFQ pauses, KV swap traffic and the recomputations the swap pool could not spare.
--kv-cache-mb makes a memory-bound runner (FastServe's setting: the KV, not the batch size,
bounds how many requests run).

    python benchmarks/bench_mlfq.py [--requests 160] [--load 0.85] [--rounds 2]
    python benchmarks/bench_mlfq.py --kv-cache-mb 48 --output-sigma 2 --output-max 1024

Targets (issue 9): MLFQ mean JCT >= 1.5x better than FCFS, p99 no worse than 1.2x FCFS,
throughput within 5%.
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path

from common.args import (
    add_adapters,
    add_output_lengths,
    add_rank,
    add_requests,
    add_rounds,
    add_seed,
    parser,
)
from common.oracle import OracleBatcher
from common.report import describe_machine, print_table, pyplot, save_plot, write_json
from common.scratch import scratch_dir
from common.timing import percentile
from common.workload import load_adapters, make_adapters, make_prompts, with_base_model

from punica_x import LLM, SamplingParams
from punica_x.workloads import assign_adapters, output_lengths, poisson_arrivals


def saturated_rate(llm: LLM, jobs: list[tuple]) -> float:
    """Requests/s the engine completes with every job submitted at once, counted until the
    last one is admitted (its first token)."""
    e = llm.engine
    for i, (prompt, adapter, sp) in enumerate(jobs):
        e.add_request(prompt, sp, adapter, request_id=f"cap{i}")
    start = time.perf_counter()
    started: set[str] = set()
    finished: list[float] = []
    admitted_at = None
    while e.has_unfinished():
        for out in e.step():
            started.add(out.request_id)
            if out.finished:
                finished.append(time.perf_counter() - start)
        if admitted_at is None and len(started) == len(jobs):
            admitted_at = time.perf_counter() - start
    return sum(t <= admitted_at for t in finished) / admitted_at


def make_engine(policy: str, args, paths: list[Path]) -> LLM:
    """An engine of `policy` (fcfs, mlfq, or oracle: the MLFQ engine with the SRPT batcher)
    with the adapters loaded."""
    kwargs = {"max_batch_size": args.max_batch_size}
    if args.kv_cache_mb:
        kwargs["kv_cache_bytes"] = args.kv_cache_mb << 20
    llm = LLM(policy="fcfs" if policy == "fcfs" else "mlfq", **kwargs)
    if policy == "oracle":
        e = llm.engine
        e.batcher = OracleBatcher(e.cache, e.config.batch, e.swap)
    load_adapters(llm, paths)
    return llm


def serve_trace(llm: LLM, jobs: list[tuple], arrivals: list[float]) -> dict:
    """Feed the jobs (prompt, adapter, sampling) at their arrival times (seconds from the
    start), stepping the engine in between; JCT per job."""
    e = llm.engine
    start = time.perf_counter()
    finish: dict[str, float] = {}
    tokens = 0
    i = 0
    while len(finish) < len(jobs):
        now = time.perf_counter() - start
        while i < len(jobs) and arrivals[i] <= now:
            prompt, adapter, sp = jobs[i]
            e.add_request(prompt, sp, adapter, request_id=str(i))
            i += 1
        if not e.has_unfinished():
            time.sleep(max(0.0, arrivals[i] - now))
            continue
        for out in e.step():
            if out.finished:
                finish[out.request_id] = time.perf_counter() - start
                tokens += len(out.token_ids)
    jct = [finish[str(k)] - arrivals[k] for k in range(len(jobs))]
    makespan = max(finish.values()) - arrivals[0]
    row = {
        "mean_jct_s": statistics.fmean(jct),
        "p50_jct_s": percentile(jct, 0.5),
        "p99_jct_s": percentile(jct, 0.99),
        "tok_s": tokens / makespan,
    }
    b = e.batcher
    row["pauses"] = b.num_pauses
    row["preemptions"] = b.num_preemptions
    if e.swap is not None:
        s = e.swap.stats
        row.update(
            swaps_out=s.swaps_out,
            swaps_in=s.swaps_in,
            swap_mb=(s.bytes_out + s.bytes_in) / 2**20,
            recomputes=s.recomputes,
        )
    return row, jct


def parse_args():
    ap = parser(__doc__)
    add_requests(ap, 160)
    ap.add_argument("--load", type=float, default=0.85, help="arrival rate / capacity")
    add_rounds(ap, 2)
    add_adapters(ap)
    add_rank(ap)
    add_seed(ap)
    ap.add_argument("--max-batch-size", type=int, default=32, help="the runner's batch")
    ap.add_argument(
        "--kv-cache-mb", type=int, default=0, help="the runner's KV cache (0: the default)"
    )
    add_output_lengths(ap, "log-normal sigma", "longest output")
    ap.add_argument(
        "--policies", default="fcfs,mlfq,oracle", help="oracle: SRPT with lengths known (bound)"
    )
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    policies = args.policies.split(",")
    print(describe_machine(), flush=True)

    paths, fcfs, jobs, lengths = workload(args)
    capacity = saturated_rate(fcfs, jobs)
    rate = args.load * capacity
    arrivals = poisson_arrivals(args.requests, rate, random.Random(args.seed + 1))
    print(
        f"{args.requests} requests, output lengths median {statistics.median(lengths):.0f} mean "
        f"{statistics.fmean(lengths):.1f} max {max(lengths)}; capacity {capacity:.2f} req/s "
        f"(saturated FCFS); arrivals at {rate:.2f} req/s ({args.load:.0%})",
        flush=True,
    )

    rounds, jcts = run_rounds(args, policies, paths, jobs, arrivals)
    table = [total(rounds[p], p) for p in policies]
    print_table(table, list(table[1]), "FCFS vs skip-join MLFQ, one runner, same arrival trace")
    f, m = table[0], table[1]
    summary = summarize(table, policies)
    print_summary(summary, policies)
    name = result_name(args)
    path = write_json(
        name,
        {
            "args": vars(args),
            "capacity_req_s": capacity,
            "rate_req_s": rate,
            "fcfs_mean_jct_s": f["mean_jct_s"],
            "mlfq_mean_jct_s": m["mean_jct_s"],
            "fcfs_p99_jct_s": f["p99_jct_s"],
            "mlfq_p99_jct_s": m["p99_jct_s"],
            "fcfs_tok_s": f["tok_s"],
            "mlfq_tok_s": m["tok_s"],
            **summary,
            "rounds": rounds,
            "lengths": lengths,
        },
    )
    plot(jcts, lengths * args.rounds, name)
    print(f"wrote {path} and {path.with_suffix('.png')}")


def workload(args) -> tuple[list[Path], LLM, list[tuple], list[int]]:
    """The adapters, a warmed-up FCFS engine holding them, the jobs (prompt, adapter or None,
    sampling) and their output lengths: --adapters slots drawn Zipf 1.5 (the last one the
    base model), heavy-tailed lengths, all from --seed."""
    rng = random.Random(args.seed)
    tmp = scratch_dir("bench-mlfq-")
    probe = LLM(policy="fcfs")
    paths = make_adapters(probe.engine.loaded.model_dir, args.adapters, args.rank, tmp)
    del probe
    fcfs = make_engine("fcfs", args, paths)
    n = args.requests
    prompts = make_prompts(fcfs.tokenizer, n)
    names = with_base_model(assign_adapters("zipf-1.5", n, rng), args.adapters)
    lengths = output_lengths(n, rng, sigma=args.output_sigma, high=args.output_max)
    sps = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in lengths]
    jobs = list(zip(prompts, names, sps))
    fcfs.generate(prompts[:4], names[:4], SamplingParams(max_tokens=4, ignore_eos=True))
    return paths, fcfs, jobs, lengths


def run_rounds(args, policies, paths, jobs, arrivals) -> tuple[dict, dict]:
    """The trace served by a fresh engine of each policy, alternating the order every round:
    ({policy: [row per round]}, {policy: every JCT})."""
    prompts = [j[0] for j in jobs[:4]]
    names = [j[1] for j in jobs[:4]]
    rounds: dict[str, list[dict]] = {p: [] for p in policies}
    jcts: dict[str, list[float]] = {p: [] for p in policies}
    for r in range(args.rounds):
        for policy in policies if r % 2 == 0 else policies[::-1]:
            # fresh counters and step-time model per round
            llm = make_engine(policy, args, paths)
            llm.generate(prompts, names, SamplingParams(max_tokens=4, ignore_eos=True))
            row, jct = serve_trace(llm, jobs, arrivals)
            row["round"] = r
            rounds[policy].append(row)
            jcts[policy] += jct
            print(f"  round {r} {policy}: {row}", flush=True)
    return rounds, jcts


def total(rows: list[dict], policy: str) -> dict:
    """A policy's rounds together: mean of the JCT figures and tok/s, sum of the counters."""
    out = {"policy": policy}
    for key in ("mean_jct_s", "p50_jct_s", "p99_jct_s", "tok_s"):
        out[key] = statistics.fmean(row[key] for row in rows)
    for key in ("pauses", "swaps_out", "swaps_in", "swap_mb", "recomputes", "preemptions"):
        if key in rows[0]:
            out[key] = sum(row[key] for row in rows)
    return out


def summarize(table: list[dict], policies: list[str]) -> dict:
    f, m = table[0], table[1]
    summary = {
        "mean_jct_speedup": f["mean_jct_s"] / m["mean_jct_s"],
        "p99_jct_ratio": m["p99_jct_s"] / f["p99_jct_s"],
        "throughput_ratio": m["tok_s"] / f["tok_s"],
    }
    if "oracle" in policies:
        o = table[policies.index("oracle")]
        summary["oracle_mean_jct_speedup"] = f["mean_jct_s"] / o["mean_jct_s"]
        summary["oracle_p99_jct_ratio"] = o["p99_jct_s"] / f["p99_jct_s"]
    return summary


def print_summary(summary: dict, policies: list[str]) -> None:
    print(
        f"\nMLFQ mean JCT {summary['mean_jct_speedup']:.2f}x better (target >= 1.5); p99 "
        f"{summary['p99_jct_ratio']:.2f}x FCFS's (target <= 1.2); throughput "
        f"{summary['throughput_ratio']:.3f}x (target within 5%)"
    )
    if "oracle" in policies:
        print(
            f"bound (SRPT, lengths known): mean JCT {summary['oracle_mean_jct_speedup']:.2f}x "
            f"better, p99 {summary['oracle_p99_jct_ratio']:.2f}x FCFS's"
        )


def result_name(args) -> str:
    """bench_mlfq, with the batch, KV cache and output lengths when not the defaults."""
    name = "bench_mlfq" if args.max_batch_size == 32 else f"bench_mlfq_b{args.max_batch_size}"
    if args.kv_cache_mb:
        name += f"_kv{args.kv_cache_mb}mb"
    if (args.output_sigma, args.output_max) != (1.2, 512):
        name += f"_sigma{args.output_sigma:g}_max{args.output_max}"
    return name


def plot(jcts: dict[str, list[float]], lengths: list[int], name: str) -> None:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for policy, values in jcts.items():
        xs = sorted(values)
        a.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=policy)
        b.scatter(lengths, values, s=6, label=policy, alpha=0.6)
    a.set_xscale("log")
    a.set_xlabel("job completion time (s)")
    a.set_ylabel("fraction of requests")
    a.legend()
    b.set_xscale("log")
    b.set_yscale("log")
    b.set_xlabel("output tokens")
    b.set_ylabel("JCT (s)")
    b.legend()
    fig.suptitle("FCFS vs skip-join MLFQ (one runner, heavy-tailed output lengths)")
    save_plot(name, fig)


if __name__ == "__main__":
    main()
