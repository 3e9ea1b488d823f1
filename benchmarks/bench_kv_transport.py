"""What is the per-layer round trip of shipping a decode query to another runner and getting
its micro-attention result back, for several data-plane options, on this machine?

    python benchmarks/bench_kv_transport.py [--calls 2000] [--rows 1,16]
                                            [--options inprocess,threadpool,shm_pipe,gloo,
                                                       kv_channel_unix,kv_channel_tcp,ray]
                                            [--budget 15]

In DistKV (Infinite-LLM) a runner sends, at every transformer layer, the query rows of a
request to a peer runner that holds part of its KV cache; the peer attends over its blocks
and returns (out, lse). The messages here have SmolLM2-135M's shapes: q float32 [R, 9, 64]
and the new token's k, v [R, 3, 64] go out; out [R, 9, 64] and lse [R, 9] come back. The
peer's attention is replaced by a fixed tiny op (out = 2 q, lse = q.sum(-1)), so only the
transport is timed. R = 1 is a decode step of one request, R = 16 a small batch.

Per option and R: a warm-up, one checked call, then --calls timed round trips (fewer once
they pass --budget / len(rows) seconds); the median and p90 of the per-call wall time, and
what 30 layers x 1 peer would add to every decode token (30 x median). Server processes use
one torch thread; the sockets this script opens listen on 127.0.0.1 only (Ray's own gRPC
servers listen on every interface whatever the node IP; its traffic here stays on loopback);
child processes are always stopped."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.kv_transports import OPTIONS, Call, make_inputs, peer_compute  # noqa: E402
from common.report import describe_machine, print_table, pyplot, save_plot, write_json  # noqa: E402

LAYERS = 30  # SmolLM2-135M: a decode token's round trips, one per layer


def check(call: Call, rows: int) -> None:
    """One call must return the peer's answer (transport bugs would otherwise look fast)."""
    q, k, v = make_inputs(rows, seed=1)
    out, lse = call(q, k, v)
    want_out, want_lse = peer_compute(q, k, v)
    if not (torch.equal(out, want_out) and torch.allclose(lse, want_lse)):
        raise AssertionError(f"wrong reply for {rows} rows")


def time_calls(call: Call, rows: int, calls: int, budget_s: float) -> list[float]:
    """Seconds per round trip: warm-up, a checked call, then up to `calls` timed ones (fewer
    once budget_s has passed)."""
    q, k, v = make_inputs(rows)
    for _ in range(max(10, min(200, calls // 10))):
        call(q, k, v)
    check(call, rows)
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    for _ in range(calls):
        t0 = time.perf_counter()
        call(q, k, v)
        t1 = time.perf_counter()
        times.append(t1 - t0)
        if t1 > deadline:
            break
    return times


def summarize(name: str, rows: int, times: list[float]) -> dict:
    """Median and p90 in microseconds, and 30 layers x 1 peer x median in ms per token."""
    times = sorted(times)
    median_us = 1e6 * statistics.median(times)
    return {
        "option": name,
        "rows": rows,
        "calls": len(times),
        "median_us": median_us,
        "p90_us": 1e6 * times[(len(times) * 9) // 10],
        "per_token_ms_30_layers": LAYERS * median_us / 1e3,
    }


def add_ratios(results: list[dict]) -> None:
    """vs_inprocess: each median over the in-process call's at the same R (when measured)."""
    base = {r["rows"]: r["median_us"] for r in results if r["option"] == "inprocess"}
    for r in results:
        if r["rows"] in base:
            r["vs_inprocess"] = r["median_us"] / base[r["rows"]]


def run_option(name: str, args: argparse.Namespace) -> list[dict]:
    """All row counts of one option, on one transport set up for the largest."""
    t0 = time.perf_counter()
    results = []
    with OPTIONS[name](max(args.rows)) as call:
        setup_s = time.perf_counter() - t0
        for rows in args.rows:
            times = time_calls(call, rows, args.calls, args.budget / len(args.rows))
            r = summarize(name, rows, times) | {"setup_s": setup_s}
            results.append(r)
            print(
                f"  {name} R={rows}: median {r['median_us']:.1f} us, p90 {r['p90_us']:.1f} us "
                f"({r['calls']} calls; setup {setup_s:.1f} s)",
                flush=True,
            )
    return results


def plot(results: list[dict], rows: list[int]) -> None:
    plt = pyplot()
    names = list(dict.fromkeys(r["option"] for r in results))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        pts = {r["rows"]: r for r in results if r["option"] == name}
        xs = [j + (i - (len(names) - 1) / 2) * width for j, n in enumerate(rows) if n in pts]
        med = [pts[n]["median_us"] for n in rows if n in pts]
        up = [pts[n]["p90_us"] - pts[n]["median_us"] for n in rows if n in pts]
        ax.bar(xs, med, width, yerr=[[0] * len(up), up], capsize=3, label=name)
    ax.set_xticks(range(len(rows)), [f"R = {n}" for n in rows])
    ax.set_yscale("log")
    ax.set_ylabel("round trip per layer (us; bar = median, whisker = p90)")
    ax.set_title("decode query -> peer -> (out, lse), SmolLM2-135M shapes")
    ax.legend()
    ax.grid(True, axis="y", which="both", alpha=0.3)
    save_plot("bench_kv_transport", fig)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--options", default=",".join(OPTIONS))
    ap.add_argument("--budget", type=float, default=15.0, help="seconds of timed calls per option")
    args = ap.parse_args()
    args.rows = [int(x) for x in args.rows.split(",")]
    args.options = args.options.split(",")
    unknown = set(args.options) - set(OPTIONS)
    if unknown:
        ap.error(f"unknown options: {sorted(unknown)}")
    machine_line = describe_machine()
    print(machine_line)
    started = time.perf_counter()
    results: list[dict] = []
    errors: dict[str, str] = {}
    for name in args.options:
        try:
            results += run_option(name, args)
        except Exception as exc:  # one broken transport must not sink the others
            errors[name] = f"{type(exc).__name__}: {exc}"
            print(f"  {name}: FAILED ({errors[name]})", flush=True)
    add_ratios(results)
    columns = ["option", "rows", "calls", "median_us", "p90_us", "per_token_ms_30_layers"]
    title = f"round trip per layer; per_token_ms_30_layers = {LAYERS} layers x 1 peer x median"
    print_table(results, columns + ["vs_inprocess"], title)
    for name, err in errors.items():
        print(f"{name}: skipped ({err})")
    elapsed = time.perf_counter() - started
    print(f"total {elapsed:.1f} s; load average {os.getloadavg()[0]:.2f}")
    payload = {
        "machine_line": machine_line,
        "args": vars(args),
        "results": results,
        "errors": errors,
        "elapsed_s": elapsed,
        "loadavg_1m": os.getloadavg()[0],
    }
    write_json("bench_kv_transport", payload)
    if results:
        plot(results, args.rows)


if __name__ == "__main__":
    main()
