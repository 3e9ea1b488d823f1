"""What do attention workers (Lamina, issue 49) cost or give on this machine?

Engines in one process over a random model of --model's shape (qwen2.5-0.5b: 2 KV heads, so
1 or 2 workers), float32, the same KV cache bytes each (--kv-cache-bytes: the attention
workers hold it between them, the plain runner alone): `plain` (one runner, its own KV),
`local-2` (2 attention workers in the engine's process: the split without the network),
`proc-1` and `proc-2` (1 or 2 attention worker processes over the DistKV data plane, one
torch thread each, the default of `serve --attention-workers`). Per engine and workload
(Backbone: no adapter; Distinct: --requests rank-16 adapters), the median decode step with
every request decoding (interleaved over --rounds rounds), split into model_ms (the model
worker's own work: the step less its wait for the workers), attention_ms (the workers'
attention compute, the slowest worker's, as they count it) and exchange_ms (the rest of the
wait: sockets, pickling, the workers' scheduling), decode tokens/s (requests / step), and
max_batch: the requests of this length the KV holds (the same memory in every variant, so
the same batch: Lamina's larger batches need memory of the attention workers' own).

    python benchmarks/bench_lamina.py [--model qwen2.5-0.5b] [--requests 16] [--rounds 3]
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import torch
from common.args import add_decode_steps, add_rank, add_requests, add_rounds, add_threads, parser
from common.engine_timing import unique_salts
from common.report import describe_machine, machine, print_table, pyplot, save_plot, write_json
from common.scratch import scratch_dir
from common.shapes import random_model
from common.workload import make_adapters, make_prompts

from punica_x import SamplingParams
from punica_x.config import EngineConfig
from punica_x.engine.engine import Engine
from punica_x.engine.llm import _apply_kwargs
from scheduler.lamina.launcher import ProcessWorkers

# engine label -> (attention workers, in processes)
VARIANTS = {"plain": (0, False), "local-2": (2, False), "proc-1": (1, True), "proc-2": (2, True)}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--kv-cache-bytes", type=int, default=512 << 20)
    add_requests(ap, default=16)
    add_rank(ap)
    add_threads(ap)
    add_decode_steps(ap)
    add_rounds(ap)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(describe_machine(), flush=True)
    model_dir = random_model(args.model)
    base = _apply_kwargs(
        EngineConfig(),
        dict(model=str(model_dir), dtype="float32", kv_cache_bytes=args.kv_cache_bytes),
    )
    engines = {v: build(base, *VARIANTS[v]) for v in VARIANTS}
    n = args.requests
    prompts = make_prompts(engines["plain"].tokenizer, n)
    paths = make_adapters(model_dir, n, args.rank, scratch_dir("bench-lamina-"))
    for e in engines.values():
        for i, p in enumerate(paths):
            e.adapters.register(f"a{i}", str(p))
    workloads = {"backbone": [None] * n, "distinct": [f"a{i}" for i in range(n)]}
    rows = measure(args, engines, prompts, workloads)
    for e in engines.values():
        e.shutdown()
    print(
        f"{args.model} (random), float32, {n} requests decoding, {args.threads} threads in the "
        f"engine, 1 per worker process; KV {args.kv_cache_bytes >> 20} MiB in each variant"
    )
    print_table(rows, list(rows[0]), "decode step, ms (median over rounds)")
    path = write_json(f"bench_lamina_{args.model}", {"args": vars(args), "rows": rows})
    plot(rows, args.model)
    print(f"wrote {path} and {path.with_suffix('.png')}")


def build(base: EngineConfig, workers: int, processes: bool) -> Engine:
    """An engine with `workers` attention workers (in processes, or in its own)."""
    launcher = ProcessWorkers(threads=1) if processes else None
    return Engine(replace(base, attention_workers=workers), attention_launcher=launcher)


def decode_steps(engine, prompts, adapters, sp, steps: int) -> tuple[float, float]:
    """(median step seconds, median seconds of it waiting for the workers) once every
    request decodes (engine_timing.decode_step_time's protocol, salted the same way)."""
    for p, a, salt in zip(prompts, adapters, unique_salts("decode-step", len(prompts))):
        engine.add_request(p, sp, a, cache_salt=salt)
    while any(
        r.num_computed_tokens < r.num_tokens - 1 or not r.output_token_ids
        for r in engine.requests.values()
    ):
        engine.step()
    backend = engine.planner.attention
    times, waits, computes = [], [], []
    for _ in range(steps):
        before, worked = getattr(backend, "seconds", 0.0), worker_seconds(engine)
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
        waits.append(getattr(backend, "seconds", 0.0) - before)
        computes.append(max((b - a for a, b in zip(worked, worker_seconds(engine))), default=0))
    for rid in list(engine.requests):
        engine.abort(rid)
    return statistics.median(times), statistics.median(waits), statistics.median(computes)


def worker_seconds(engine) -> list[float]:
    """Seconds each attention worker has spent computing attention so far (none: [])."""
    return [ref.peer.counters()[1] for ref in getattr(engine.cache, "workers", ())]


def max_batch(engine, tokens: int) -> int:
    """Requests of `tokens` tokens each that the engine's KV blocks hold at once."""
    block = engine.cache.block_size
    return engine.cache.allocator.num_blocks // -(-tokens // block)


def measure(args, engines: dict, prompts, workloads: dict) -> list[dict]:
    sp = SamplingParams(max_tokens=args.decode_steps + 8, temperature=0, ignore_eos=True)
    runs = {(v, w): [] for v in engines for w in workloads}  # (step, wait, compute) each
    for _ in range(args.rounds):
        for w, adapters in workloads.items():
            for v, engine in engines.items():
                runs[(v, w)].append(decode_steps(engine, prompts, adapters, sp, args.decode_steps))
    rows = []
    n = len(prompts)
    tokens = max(len(p) for p in prompts) + sp.max_tokens
    for (v, w), got in runs.items():
        s, wait, compute = (statistics.median(x) for x in zip(*got))
        plain = statistics.median(x[0] for x in runs[("plain", w)])
        rows.append(
            {
                "engine": v,
                "workload": w,
                "step_ms": s * 1e3,
                "model_ms": (s - wait) * 1e3,
                "attention_ms": compute * 1e3,
                "exchange_ms": max(0.0, wait - compute) * 1e3,
                "max_batch": max_batch(engines[v], tokens),
                "decode_tok_s": n / s,
                "x_plain": plain / s,
            }
        )
    return rows


def plot(rows, model: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [f"{r['engine']}\n{r['workload']}" for r in rows]
    bottom = [0.0] * len(rows)
    for key, label in (
        ("model_ms", "model worker"),
        ("attention_ms", "attention (workers)"),
        ("exchange_ms", "exchange"),
    ):
        ax.bar(labels, [r[key] for r in rows], bottom=bottom, label=label)
        bottom = [b + r[key] for b, r in zip(bottom, rows)]
    ax.set_ylabel("decode step, ms")
    m = machine()
    ax.set_title(f"punica-x, attention workers, {model} ({m['cpu']}, {m['isa']})")
    ax.legend()
    save_plot(f"bench_lamina_{model}", fig)


if __name__ == "__main__":
    main()
