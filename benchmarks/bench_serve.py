"""How much does the HTTP server add on top of the engine? (throughput, TTFT, inter-token latency)

Starts `punica-x serve` (default model) on 127.0.0.1, uploads rank-16 adapters, and runs N
concurrent streaming clients (the official openai client) over a Zipf-1.5 mix of the
adapters and the base model. Then runs the same requests through the offline engine
(LLM.generate) in this process and reports the throughput ratio server / offline (target
>= 0.9). Client and server share the machine's cores, as they would on one box, so the
client's own CPU time is measured and reported, and each round also runs the same requests
through a minimal SSE client (httpx, one json.loads per event): the gap between the two
ratios is what the openai client's parsing costs on the shared cores, not the server.

    python benchmarks/bench_serve.py [--clients 32] [--requests 64] [--max-tokens 64] [--adapters 8]

With --features it answers another question on the same server and workload: how much of
their throughput do plain requests keep when 1 in 8 requests asks for logprobs and 1 in 8 is
constrained by a JSON schema (server formatting included)? See features().

--runners N and --runner-backend thread|ray serve with N runners of that backend (the
result files are named after both). --open-loop RATES (requests/s, e.g. 0.5,1,2,4) replaces
the closed loop with Poisson arrivals at each rate, the way vLLM's serving benchmark reports:
TTFT and inter-token p50/p99 per rate, and the throughput achieved (see open_loop()).

--batch-invariant auto|on|off serves (and runs the offline engine) in that mode
(ModelConfig.batch_invariant; auto, the default, decides by its measured cost); both answers
what the mode costs through the server instead: two servers, on and off, the same closed loop
on each in every round, alternating (common/serve_invariance.py).

--client vllm runs vLLM's own serving benchmark client against
punica-x and against vLLM's OpenAI server instead: bench_serve_vllm.py.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import sys
import time
from pathlib import Path

from common.args import add_adapters, add_max_tokens, add_rank, add_requests, add_rounds, parser
from common.report import describe_machine, print_table, pyplot, save_plot, write_json
from common.scratch import scratch_dir
from common.serve_invariance import compare_servers, report_servers
from common.server import bench_server
from common.stream_clients import cpu_seconds, open_loop_rate, run_clients, run_raw_clients
from common.timing import latency_ms
from common.workload import load_adapters, make_adapters, make_prompts, with_base_model

from punica_x import LLM, SamplingParams
from punica_x.workloads import assign_adapters


def vllm_client_argv(argv: list[str]) -> list[str] | None:
    """With `--client vllm` (or `--client=vllm`): the other arguments, bench_serve_vllm.py's;
    else None."""
    argv = " ".join(argv).replace("--client=", "--client ").split()
    if "--client" in argv and argv[argv.index("--client") + 1 :][:1] == ["vllm"]:
        i = argv.index("--client")
        return argv[:i] + argv[i + 2 :]
    return None


def parse_args():
    ap = parser(__doc__)
    ap.add_argument(
        "--client",
        default="openai",
        choices=["openai", "vllm"],
        help="vllm: vLLM's serving benchmark against punica-x and vLLM's server (the "
        "arguments of bench_serve_vllm.py)",
    )
    ap.add_argument("--clients", type=int, default=32)
    add_requests(ap, 128)
    add_max_tokens(ap)
    add_adapters(ap)
    add_rank(ap)
    add_rounds(ap, help="alternating offline/server rounds")
    ap.add_argument(
        "--features",
        action="store_true",
        help="instead: what logprobs and JSON-schema requests cost the plain ones (see features)",
    )
    ap.add_argument(
        "--batch-invariant",
        default="auto",
        choices=["auto", "on", "off", "both"],
        help="the servers' batch-invariant mode; both: its cost, servers on and off in turn",
    )
    ap.add_argument("--runners", type=int, default=1)
    ap.add_argument("--runner-backend", default="thread", choices=["thread", "ray"])
    ap.add_argument(
        "--open-loop", default=None, metavar="RATES", help="Poisson arrivals at these req/s"
    )
    ap.add_argument(
        "--engine-threads",
        type=int,
        default=None,
        help="torch threads of the offline engine and of the server's runner (default: every "
        "core); fewer leaves cores to the server and the clients, as on a larger machine",
    )
    args = ap.parse_args()
    if args.batch_invariant == "both" and (args.features or args.open_loop):
        ap.error(
            "--batch-invariant both is a question of its own: not with --features or --open-loop"
        )
    return args


def main() -> None:
    rest = vllm_client_argv(sys.argv[1:])
    if rest is not None:  # vLLM's own client, against vLLM's own server too
        script = str(Path(__file__).resolve().with_name("bench_serve_vllm.py"))
        os.execv(sys.executable, [sys.executable, script, *rest])
    args = parse_args()
    if args.engine_threads:
        import torch

        torch.set_num_threads(args.engine_threads)
    print(describe_machine(), flush=True)
    if args.features:
        features(args)
    elif args.batch_invariant == "both":
        invariance(args)
    elif args.open_loop:
        open_loop(args)
    else:
        closed_loop(args)


def closed_loop(args) -> None:
    """Server and offline engine on the same requests, --rounds rounds alternating (the
    machine's speed drifts over minutes); the server process idles while the offline engine
    runs in this one. Reports the round of the median ratio."""
    tmp = scratch_dir("bench-serve-")
    llm = LLM(batch_invariant=args.batch_invariant)
    prompts, paths, names = workload(args, llm.tokenizer, llm.engine.loaded.model_dir, tmp)

    load_adapters(llm, paths)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:4], names[:4], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up

    def offline() -> float:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, names, sp)
        return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)

    rounds = []
    with bench_server(tmp, paths, runner_args(args), args.engine_threads) as (
        server,
        url,
        key,
        model_id,
    ):
        jobs = [(n or model_id, p) for n, p in zip(names, prompts)]
        asyncio.run(run_clients(url, key, jobs[:4], 4, 4))  # warm-up
        for _ in range(args.rounds):
            rounds.append(closed_loop_round(args, offline, server.pid, url, key, jobs))
    report_closed_loop(args, rounds)


def closed_loop_round(args, offline, server_pid: int, url: str, key: str, jobs) -> tuple:
    """One round: offline tok/s, then the openai clients (elapsed, tokens, TTFTs, inter-token
    gaps, the cores the clients and the server used), then the minimal SSE client's ratio."""
    offline_tps = offline()
    cpu = cpu_seconds(), cpu_seconds(server_pid)
    elapsed, tokens, ttft, itl = asyncio.run(
        run_clients(url, key, jobs, args.clients, args.max_tokens)
    )
    client_cores = (cpu_seconds() - cpu[0]) / elapsed
    server_cores = (cpu_seconds(server_pid) - cpu[1]) / elapsed
    raw_elapsed, raw_tokens = asyncio.run(
        run_raw_clients(url, key, jobs, args.clients, args.max_tokens)
    )
    return (
        offline_tps,
        elapsed,
        tokens,
        ttft,
        itl,
        raw_tokens / raw_elapsed / offline_tps,
        client_cores,
        server_cores,
    )


def report_closed_loop(args, rounds: list[tuple]) -> None:
    ratios = [r[2] / r[1] / r[0] for r in rounds]
    raw_ratios = [r[5] for r in rounds]
    offline_tps, elapsed, tokens, ttft, itl, raw_ratio, client_cores, server_cores = rounds[
        ratios.index(statistics.median_low(ratios))  # a round that ran (even counts too)
    ]
    server_tps = tokens / elapsed
    row = {
        "backend": f"{args.runner_backend} x{args.runners}",
        "clients": args.clients,
        "requests": args.requests,
        "req_per_s": args.requests / elapsed,
        "server_tok_s": server_tps,
        "offline_tok_s": offline_tps,
        "ratio": server_tps / offline_tps,
        **latency_ms(ttft, itl),
        "itl_mean_ms": statistics.fmean(itl) * 1e3 if itl else float("nan"),
        "client_cores": client_cores,
        "server_cores": server_cores,
        "ratio_minimal_client": raw_ratio,
    }
    print(
        "ratios of the rounds: " + ", ".join(f"{r:.3f}" for r in ratios) + " (median round below)"
    )
    print("with the minimal SSE client: " + ", ".join(f"{r:.3f}" for r in raw_ratios))
    print(
        f"SmolLM2-135M, {args.requests} streaming requests x {args.max_tokens} tokens from "
        f"{args.clients} concurrent openai clients, {args.adapters} rank-{args.rank} adapters "
        "(Zipf 1.5)"
    )
    print_table([row], list(row), "Server vs offline engine on the same workload")
    print(
        f"\nthroughput ratio server / offline = {row['ratio']:.2f} (target >= 0.9), median over "
        f"rounds {statistics.median(ratios):.3f}; with the minimal SSE client "
        f"{statistics.median(raw_ratios):.3f}; the openai clients used {client_cores:.2f} cores "
        f"of {os.cpu_count()}, the server {server_cores:.2f}"
    )
    path = write_json(
        result_name("bench_serve", args),
        {
            "ratios": ratios,
            "ratios_minimal_client": raw_ratios,
            "args": vars(args),
            "result": row,
            "ttft_ms": [t * 1e3 for t in ttft],
            "itl_ms": [t * 1e3 for t in itl],
        },
    )
    plot(ttft, itl, result_name("bench_serve", args))
    print(f"wrote {path} and {path.with_suffix('.png')}")


def workload(args, tokenizer, model_dir: Path, tmp: Path):
    """(prompts, adapter folders a0.., per-request adapter name or None) of every mode: a
    Zipf-1.5 mix of the adapters, the last slot the base model."""
    prompts = make_prompts(tokenizer, args.requests)
    paths = make_adapters(model_dir, args.adapters, args.rank, tmp / "adapters")
    names = with_base_model(
        assign_adapters("zipf-1.5", args.requests, random.Random(3)), args.adapters
    )
    return prompts, paths, names


def runner_args(args) -> tuple[str, ...]:
    on_off = args.batch_invariant in ("on", "off")
    mode = ("--batch-invariant", args.batch_invariant) if on_off else ()
    return ("--runners", str(args.runners), "--runner-backend", args.runner_backend, *mode)


def result_name(base: str, args) -> str:
    """bench_serve for the default one thread runner, else e.g. bench_serve_ray_x2."""
    threads = f"_t{args.engine_threads}" if args.engine_threads else ""
    if args.batch_invariant != "auto":
        threads += f"_invariant_{args.batch_invariant}"
    if args.runners == 1 and args.runner_backend == "thread":
        return base + threads
    return f"{base}_{args.runner_backend}_x{args.runners}{threads}"


def open_loop(args) -> None:
    """TTFT and inter-token latency against the arrival rate (Poisson), one server."""
    rates = [float(r) for r in args.open_loop.split(",")]
    tmp = scratch_dir("bench-serve-open-")
    from punica_x.config import ModelConfig
    from punica_x.models.loader import describe_model

    meta = describe_model(ModelConfig())  # the default model, without loading its weights
    prompts, paths, names = workload(args, meta.tokenizer, meta.model_dir, tmp)
    rows = []
    with bench_server(tmp, paths, runner_args(args), args.engine_threads) as (
        _,
        url,
        key,
        model_id,
    ):
        jobs = [(n or model_id, p) for n, p in zip(names, prompts)]
        asyncio.run(run_raw_clients(url, key, jobs[:4], 4, 4))  # warm-up
        for rate in rates:
            row = asyncio.run(
                open_loop_rate(url, key, jobs, rate, args.max_tokens, random.Random(7))
            )
            row["backend"] = f"{args.runner_backend} x{args.runners}"
            rows.append(row)
            print(f"  rate {rate:g}/s: {row}", flush=True)
    print(
        f"SmolLM2-135M, {args.requests} streaming requests x {args.max_tokens} tokens, "
        f"Poisson arrivals, {args.adapters} rank-{args.rank} adapters (Zipf 1.5)"
    )
    print_table(rows, list(rows[0]), "Open loop: latency against the arrival rate")
    name = result_name("bench_serve_open_loop", args)
    path = write_json(name, {"args": vars(args), "rows": rows})
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    x = [r["rate"] for r in rows]
    for q in ("p50", "p99"):
        a.plot(x, [r[f"ttft_{q}_ms"] for r in rows], "-o", label=f"TTFT {q}")
        b.plot(x, [r[f"itl_{q}_ms"] for r in rows], "-o", label=f"inter-token {q}")
    for ax in (a, b):
        ax.set_xlabel("arrival rate (requests/s)")
        ax.set_ylabel("ms")
        ax.legend()
        ax.grid(alpha=0.3)
    save_plot(name, fig)
    print(f"wrote {path} and {path.with_suffix('.png')}")


# An array of many integers: a constrained request keeps decoding until max_tokens, like the
# plain ones, so both modes do the same number of tokens.
FEATURE_SCHEMA = {"type": "array", "items": {"type": "integer"}, "minItems": 200}


def features(args) -> None:
    """Server rounds alternating `plain` (every request plain) and `mixed` (1 in 8 asks for
    logprobs with 5 alternatives, 1 in 8 is constrained by FEATURE_SCHEMA). The plain
    requests are the same in both and every request runs to max_tokens, so elapsed(plain) /
    elapsed(mixed) is the throughput the plain requests keep (target >= 0.95)."""
    tmp = scratch_dir("bench-serve-features-")
    llm = LLM()
    prompts, paths, names = workload(args, llm.tokenizer, llm.engine.loaded.model_dir, tmp)
    del llm
    fmt = {"type": "json_schema", "json_schema": {"name": "ints", "schema": FEATURE_SCHEMA}}
    extras = [
        {"logprobs": 5} if i % 8 == 3 else {"response_format": fmt} if i % 8 == 7 else {}
        for i in range(args.requests)
    ]
    elapsed: dict[str, list[float]] = {"plain": [], "mixed": []}
    with bench_server(tmp, paths) as (_, url, key, model_id):
        names = [n or model_id for n in names]
        jobs = {
            "plain": [(n, p, {}) for n, p in zip(names, prompts)],
            "mixed": [(n, p, e) for n, p, e in zip(names, prompts, extras)],
        }
        asyncio.run(run_clients(url, key, jobs["mixed"][:8], 8, 4))  # warm-up, grammar compiled
        for _ in range(args.rounds):
            for mode in ("plain", "mixed"):
                t, *_ = asyncio.run(
                    run_clients(url, key, jobs[mode], args.clients, args.max_tokens)
                )
                elapsed[mode].append(t)
    ratios = [p / m for p, m in zip(elapsed["plain"], elapsed["mixed"])]
    row = {
        "requests": args.requests,
        "logprobs_requests": sum("logprobs" in e for e in extras),
        "constrained_requests": sum("response_format" in e for e in extras),
        "plain_s": statistics.median(elapsed["plain"]),
        "mixed_s": statistics.median(elapsed["mixed"]),
        "plain_kept": statistics.median(ratios),
    }
    print_table([row], list(row), "Server: plain requests next to logprobs and JSON-schema ones")
    print(
        "rounds: " + ", ".join(f"{r:.3f}" for r in ratios) + " (throughput the plain requests "
        "keep, target >= 0.95)"
    )
    path = write_json("bench_serve_features", {"args": vars(args), "ratios": ratios, "row": row})
    print(f"wrote {path}")


def invariance(args) -> None:
    """The batch-invariant mode on against off through the server (serve_invariance), on the
    closed loop's workload; what `auto` decides here, from an engine in this process."""
    tmp = scratch_dir("bench-serve-invariance-")
    llm = LLM()  # auto
    auto = llm.engine.describe().batch_invariant_reason
    prompts, paths, names = workload(args, llm.tokenizer, llm.engine.loaded.model_dir, tmp)
    del llm

    def jobs_of(model_id: str) -> list[tuple[str, str]]:
        return [(n or model_id, p) for n, p in zip(names, prompts)]

    rows, paired = compare_servers(args, tmp, paths, jobs_of, runner_args(args))
    report_servers(args, rows, paired, auto, result_name("bench_serve", args))


def plot(ttft, itl, name: str = "bench_serve") -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
    for ax, values, title in (
        (axes[0], ttft, "time to first token"),
        (axes[1], itl, "inter-token latency"),
    ):
        ax.hist([v * 1e3 for v in values], bins=40)
        ax.set_title(title)
        ax.set_xlabel("ms")
    axes[0].set_ylabel("count")
    save_plot(name, fig)


if __name__ == "__main__":
    main()
