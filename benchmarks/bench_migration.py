"""How long a client's stream pauses when its request moves to another runner, against the
sequence length, for recomputation and for a live KV copy, between thread runners and
between Ray actors; where they cross; whether the cost model picks within 10% of the better.

    python benchmarks/bench_migration.py [--lengths 64,128,256,512,1024,2048]
                                         [--backends thread,ray] [--reps 3] [--model PATH]

Per point: a greedy request with an n-token prompt streams a few tokens on runner A; it is
moved to runner B (Scheduler.migrate, mode forced) while the client reads; the pause is the
gap between the last token from A and the first from B (the median of --reps moves), next
to the same stream's ordinary inter-token gap. Then the cost model's constants are fitted
(least squares) and its choice is checked at every point."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.args import add_model  # noqa: E402
from common.report import describe_machine, print_table, pyplot, save_plot, write_json  # noqa: E402

from punica_x.config import BatchConfig, CacheConfig, EngineConfig, ModelConfig  # noqa: E402
from punica_x.core import SamplingParams  # noqa: E402
from scheduler.cluster import Scheduler  # noqa: E402
from scheduler.policy.migration import COPY, RECOMPUTE, MigrationCosts, choose_mode  # noqa: E402

MODES = (RECOMPUTE, COPY)


def build(backend: str, config: EngineConfig) -> Scheduler:
    if backend == "ray":
        from punica_x.models.loader import describe_model
        from scheduler.runners.ray_runner import RayRunner, ensure_ray

        ensure_ray()
        runners = [RayRunner(config, f"runner-{i}") for i in range(2)]
        return Scheduler(runners, tokenizer=describe_model(config.model).tokenizer)
    from scheduler.runners.local import LocalRunner

    first = LocalRunner(config, "runner-0")
    second = LocalRunner(config, "runner-1", shared=first.engine.loaded)
    return Scheduler([first, second])


async def one_move(sched: Scheduler, n: int, mode: str, seed: int) -> tuple[float, float]:
    """(pause in seconds, median ordinary gap) for one move of an n-token request."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(100, 20000, size=n).tolist()
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    stream = await sched.open(prompt, sp, None, f"m{n}-{mode}-{seed}")
    stamps: list[float] = []
    moved_after = None
    async for out in stream:
        stamps.append(time.perf_counter())
        if len(stamps) == 6 and moved_after is None:
            moved_after = len(stamps)
            target = next(s for s in sched.slots if s is not stream.slot)
            await sched.migrate(stream, "bench", target=target, mode=mode)
        if out.finished:
            break
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    # the source may still deliver a token it made before the take: the pause is the longest
    # gap from the move on
    pause = max(gaps[moved_after - 1 :])
    ordinary = statistics.median(gaps[1 : moved_after - 1])
    return pause, ordinary


def fit(points: list[dict], kv_bytes_per_token: int) -> MigrationCosts:
    """Least squares: recompute pause = a + b n + c n^2; copy pause = d + e bytes."""
    n = np.array([p["tokens"] for p in points], dtype=float)
    rec = np.array([p["recompute_s"] for p in points])
    cop = np.array([p["copy_s"] for p in points])
    a, b, c = np.linalg.lstsq(np.stack([np.ones_like(n), n, n * n], 1), rec, rcond=None)[0]
    nbytes = n * kv_bytes_per_token
    d, e = np.linalg.lstsq(np.stack([np.ones_like(n), nbytes], 1), cop, rcond=None)[0]
    return MigrationCosts(
        float(max(a, 0.0)), float(max(b, 0.0)), float(max(c, 0.0)), float(max(d, 0.0)), float(e)
    )


async def measure_backend(backend: str, args) -> tuple[list[dict], MigrationCosts, int]:
    config = EngineConfig(
        model=ModelConfig(model=args.model, max_model_len=max(args.lengths) + 64),
        cache=CacheConfig(kv_cache_bytes=512 << 20),
        batch=BatchConfig(max_batch_size=4),
    )
    sched = await asyncio.to_thread(build, backend, config)
    kv_bpt = sched.slots[0].handle.info.kv_bytes_per_token
    await one_move(sched, 64, COPY, 0)  # warm both runners (first steps, kernels, pools)
    await one_move(sched, 64, RECOMPUTE, 1)
    points = []
    for n in args.lengths:
        row = {"backend": backend, "tokens": n, "kv_mb": n * kv_bpt / 1e6}
        for mode in MODES:
            runs = [await one_move(sched, n, mode, 10 * r) for r in range(args.reps)]
            row[f"{mode}_s"] = statistics.median(p for p, _ in runs)
            row[f"{mode}_itl_s"] = statistics.median(g for _, g in runs)
        points.append(row)
        print(
            f"  {backend} n={n}: recompute {row['recompute_s'] * 1e3:.1f} ms, "
            f"copy {row['copy_s'] * 1e3:.1f} ms",
            flush=True,
        )
    sched.shutdown()
    costs = fit(points, kv_bpt)
    for row in points:
        choice = choose_mode(row["tokens"] - 1, kv_bpt, costs, "bench")
        best = min(row["recompute_s"], row["copy_s"])
        row["policy"] = choice
        row["policy_vs_best"] = row[f"{choice}_s"] / best
    return points, costs, kv_bpt


def crossover(points: list[dict]) -> int | None:
    """The first length where copying is faster (None: never within the range)."""
    for p in points:
        if p["copy_s"] < p["recompute_s"]:
            return p["tokens"]
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="64,128,256,512,1024,2048")
    ap.add_argument("--backends", default="thread,ray")
    ap.add_argument("--reps", type=int, default=3)
    add_model(ap)
    args = ap.parse_args()
    args.lengths = [int(x) for x in args.lengths.split(",")]
    print(describe_machine())
    results, fits = [], {}
    for backend in args.backends.split(","):
        points, costs, kv_bpt = asyncio.run(measure_backend(backend, args))
        results += points
        fits[backend] = {"costs": costs.__dict__, "kv_bytes_per_token": kv_bpt}
        print(f"{backend}: fitted {costs}; copy faster from {crossover(points)} tokens")
    columns = ["backend", "tokens", "kv_mb", "recompute_s", "copy_s", "recompute_itl_s"]
    print_table(results, columns + ["policy", "policy_vs_best"], "pause seen by the client (s)")
    worst = max(p["policy_vs_best"] for p in results)
    print(f"policy within {100 * (worst - 1):.1f}% of the better mode at every point")
    write_json("bench_migration", {"points": results, "fits": fits, "policy_worst": worst})
    plot(results)


def plot(results: list[dict]) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for backend in sorted({p["backend"] for p in results}):
        pts = [p for p in results if p["backend"] == backend]
        n = [p["tokens"] for p in pts]
        for mode, style in ((RECOMPUTE, "-o"), (COPY, "--s")):
            ax.plot(n, [1e3 * p[f"{mode}_s"] for p in pts], style, label=f"{backend} {mode}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("pause seen by the client (ms)")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    save_plot("bench_migration", fig)


if __name__ == "__main__":
    main()
