"""bench_serve --batch-invariant both: what the batch-invariant mode costs through the HTTP
server. Two servers, `--batch-invariant on` and `off`, hold the same tenant and adapters; the
same closed-loop streaming workload runs on each in every round, "on" first in even rounds
and "off" first in odd ones (the idle server waits), so each round's on / off ratio of
elapsed time compares two runs on nearly the same machine."""

from __future__ import annotations

import asyncio
import contextlib
import statistics

from common.engine_timing import paired_ratio
from common.invariance_pairs import MODES
from common.report import print_table, write_json
from common.server import bench_server
from common.stream_clients import run_clients
from common.timing import latency_ms

COLUMNS = ["mode", "tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"]


def compare_servers(args, tmp, paths, jobs_of, extra: tuple[str, ...]) -> tuple[list, dict]:
    """jobs_of(model_id) -> the (model, prompt) jobs. Returns (a row per mode: median tok/s
    and the latencies of the median round, {"elapsed_on_over_off": paired ratio, "rounds":
    {mode: [seconds]}})."""
    rounds: dict[str, list] = {m: [] for m in MODES}
    for m in MODES:
        (tmp / m).mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        servers = {
            m: stack.enter_context(
                bench_server(tmp / m, paths, (*extra, "--batch-invariant", m), args.engine_threads)
            )
            for m in MODES
        }
        jobs = {m: jobs_of(s[3]) for m, s in servers.items()}
        for m, (_, url, key, _) in servers.items():  # warm-up
            asyncio.run(run_clients(url, key, jobs[m][:4], 4, 4))
        for r in range(args.rounds):
            for m in MODES if r % 2 == 0 else MODES[::-1]:
                _, url, key, _ = servers[m]
                rounds[m].append(
                    asyncio.run(run_clients(url, key, jobs[m], args.clients, args.max_tokens))
                )
    rows = [mode_row(m, rounds[m]) for m in MODES]
    elapsed = {m: [r[0] for r in rounds[m]] for m in MODES}
    return rows, {
        "elapsed_on_over_off": paired_ratio(elapsed["on"], elapsed["off"]),
        "rounds_s": elapsed,
    }


def mode_row(mode: str, rounds: list[tuple]) -> dict:
    """A mode's row: the median round's tok/s, TTFT and inter-token percentiles."""
    by_elapsed = sorted(rounds, key=lambda r: r[0])
    elapsed, tokens, ttft, itl = by_elapsed[(len(by_elapsed) - 1) // 2]
    return {
        "mode": mode,
        "tok_s": tokens / elapsed,
        **latency_ms(ttft, itl),
        "elapsed_s_median": statistics.median(r[0] for r in rounds),
    }


def report_servers(args, rows: list, paired: dict, auto: str, name: str) -> None:
    """The table, the paired cost against the 5% target and what auto chose; the JSON."""
    cost = paired["elapsed_on_over_off"]
    title = (
        f"Server, batch_invariant on vs off: {args.requests} streams x {args.max_tokens} "
        f"tokens, {args.clients} clients, {args.adapters} adapters (Zipf 1.5)"
    )
    print_table(rows, COLUMNS, title)
    print(
        f"elapsed on / off paired by round: {cost['median']:.3f} (rounds {cost['min']:.3f}-"
        f"{cost['max']:.3f}; target <= 1.05); auto here: {auto}"
    )
    path = write_json(name, {"args": vars(args), "rows": rows, "auto": auto, **paired})
    print(f"wrote {path}")
