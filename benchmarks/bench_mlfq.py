"""Does skip-join MLFQ cut job completion time on the real engine? (FCFS vs MLFQ, issue 9)

One runner in this process: SmolLM2-135M, the default engine config, 8 rank-16 adapters
(Zipf 1.5, 1 in 8 the base model). Requests have heavy-tailed output lengths
(punica_x.workloads.output_lengths: log-normal, median 24, clipped to 2..512) and arrive as
a Poisson process at --load times the measured capacity (the request rate of the same
requests all submitted at once, FCFS). The same arrival trace is served by an FCFS engine and
an MLFQ engine, alternating for --rounds rounds (the machine drifts over minutes). Job
completion time (JCT) = finish - arrival. Reports mean and p99 JCT, tokens/s, MLFQ pauses,
KV swap traffic and the recomputations the swap pool could not spare.

    python benchmarks/bench_mlfq.py [--requests 160] [--load 0.85] [--rounds 2]

Targets (issue 9): MLFQ mean JCT >= 1.5x better than FCFS, p99 no worse than 1.2x FCFS,
throughput within 5%.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

from bench_generate import make_adapters, make_prompts
from harness import describe_machine, print_table, save_plot, write_json

from punica_x import LLM, SamplingParams
from punica_x.workloads import assign_adapters, output_lengths, poisson_arrivals


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


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


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=160)
    ap.add_argument("--load", type=float, default=0.85, help="arrival rate / capacity")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--max-batch-size", type=int, default=32, help="the runner's batch (a memory-bound one: 8)"
    )
    args = ap.parse_args()
    print(describe_machine(), flush=True)

    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="bench-mlfq-"))
    fcfs = LLM(policy="fcfs", max_batch_size=args.max_batch_size)
    paths = make_adapters(fcfs.engine.loaded.model_dir, args.adapters, args.rank, tmp)
    for i, p in enumerate(paths):
        fcfs.load_adapter(f"a{i}", str(p))
    n = args.requests
    prompts = make_prompts(fcfs.tokenizer, n)
    picks = assign_adapters("zipf-1.5", n, rng)
    names = [
        None if k % args.adapters == args.adapters - 1 else f"a{k % args.adapters}" for k in picks
    ]
    lengths = output_lengths(n, rng)
    sps = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in lengths]
    jobs = list(zip(prompts, names, sps))
    fcfs.generate(prompts[:4], names[:4], SamplingParams(max_tokens=4, ignore_eos=True))

    t0 = time.perf_counter()
    fcfs.generate(prompts, names, sps)
    capacity = n / (time.perf_counter() - t0)
    rate = args.load * capacity
    arrivals = poisson_arrivals(n, rate, random.Random(args.seed + 1))
    print(
        f"{n} requests, output lengths median {statistics.median(lengths):.0f} mean "
        f"{statistics.fmean(lengths):.1f} max {max(lengths)}; capacity {capacity:.2f} req/s "
        f"(all at once, FCFS); arrivals at {rate:.2f} req/s ({args.load:.0%})",
        flush=True,
    )

    rounds: dict[str, list[dict]] = {"fcfs": [], "mlfq": []}
    jcts: dict[str, list[float]] = {"fcfs": [], "mlfq": []}
    for r in range(args.rounds):
        for policy in ("fcfs", "mlfq") if r % 2 == 0 else ("mlfq", "fcfs"):
            # fresh counters and step-time model per round
            llm = LLM(policy=policy, max_batch_size=args.max_batch_size)
            for i, p in enumerate(paths):
                llm.load_adapter(f"a{i}", str(p))
            llm.generate(prompts[:4], names[:4], SamplingParams(max_tokens=4, ignore_eos=True))
            row, jct = serve_trace(llm, jobs, arrivals)
            row["round"] = r
            rounds[policy].append(row)
            jcts[policy] += jct
            print(f"  round {r} {policy}: {row}", flush=True)

    def total(policy: str) -> dict:
        rows = rounds[policy]
        out = {"policy": policy}
        for key in ("mean_jct_s", "p50_jct_s", "p99_jct_s", "tok_s"):
            out[key] = statistics.fmean(row[key] for row in rows)
        for key in ("pauses", "swaps_out", "swaps_in", "swap_mb", "recomputes", "preemptions"):
            if key in rows[0]:
                out[key] = sum(row[key] for row in rows)
        return out

    table = [total("fcfs"), total("mlfq")]
    print_table(table, list(table[1]), "FCFS vs skip-join MLFQ, one runner, same arrival trace")
    f, m = table
    summary = {
        "mean_jct_speedup": f["mean_jct_s"] / m["mean_jct_s"],
        "p99_jct_ratio": m["p99_jct_s"] / f["p99_jct_s"],
        "throughput_ratio": m["tok_s"] / f["tok_s"],
    }
    print(
        f"\nMLFQ mean JCT {summary['mean_jct_speedup']:.2f}x better (target >= 1.5); p99 "
        f"{summary['p99_jct_ratio']:.2f}x FCFS's (target <= 1.2); throughput "
        f"{summary['throughput_ratio']:.3f}x (target within 5%)"
    )
    name = "bench_mlfq" if args.max_batch_size == 32 else f"bench_mlfq_b{args.max_batch_size}"
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


def plot(jcts: dict[str, list[float]], lengths: list[int], name: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
