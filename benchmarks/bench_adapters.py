"""Can one server take its adapters from an object store, on first use, at platform scale?
(issue 74)

--adapters N random PEFT adapters for the default model (ranks drawn from --ranks with
--rank-weights, independent of popularity; peft's default targets for Llama, q_proj and
v_proj) sit in an S3-compatible store (moto's standalone server, its own process), one folder
each under s3://adapters/root/bench/. `punica-x serve --lora-source-root s3://adapters/root`
starts with none of them. Then:

1. cold: --requests streamed completions (greedy, --max-tokens each, eos ignored) from
   --streams concurrent clients, each naming an adapter drawn Zipf(--zipf) over --hot of
   them: the server loads each adapter the first time a request names it (S3 -> its checks
   -> its store -> the runners), while the other streams go on.
2. warm: the same requests again, every adapter they name now loaded (registered, its files
   on the server's disk; on the device as its pool's LRU allows): delivered tokens/s, and the
   cold run's over it (issue 74: >= 0.8). Each pass sends its own cache_salt, so the warm one
   reuses no prefix KV the cold one computed (both start with none: what differs is only
   whether the adapters are loaded); within a pass, requests repeating an adapter and a
   prompt reuse their KV as a server's would.
   Cold start = time to first token of the first request naming an adapter never fetched.
   Each pass also reports the CPU seconds the server, the store and the clients spent in it:
   all three share this machine's cores, and an object store's work is not the server's.
3. register: the store's other adapters loaded through vLLM's POST /v1/load_lora_adapter
   (--register-clients at a time) until the tenant holds all N; the server's RSS before and
   after: bytes per registered-but-cold adapter (beyond the adapter pools, which were full
   before), and its disk per adapter.
4. at N: GET /v1/models (every adapter) and a page of GET /v1/adapters, timed.
5. restart: the server stopped and started again on its data: seconds until it is ready
   (every stored adapter registered again), its RSS then.

--rounds R runs 1-2 R times, each on a fresh server (its own data folder, no adapter
loaded) over the same store, one round after the other; 3-5 follow the last round. The
report gives each round's figures, and the cold / warm ratio's median and range; its
`cold` and `warm` are those of the median round.

    python benchmarks/bench_adapters.py [--adapters 10000] [--hot 1000] [--streams 64]
        [--requests 2000] [--max-tokens 32] [--zipf 1.0] [--ranks 8,16,32,64]
        [--rank-weights 4,3,2,1] [--rounds 3]
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import statistics
import time
from pathlib import Path

import httpx
from common.adapter_store import BUCKET, PREFIX, AdapterStore, draw_ranks, model_shapes
from common.args import add_seed, parser
from common.report import describe_machine, log, print_table, pyplot, save_plot, write_json
from common.scratch import scratch_dir
from common.server import free_port, start_server
from common.stream_clients import cpu_seconds, stream_body
from common.timing import percentile

TENANT = "bench"
TARGETS = ["q_proj", "v_proj"]
RESTART_S = 3600  # a restart registers every stored adapter again
CHECKPOINTS = 10  # RSS and disk readings while the store's other adapters are registered


def zipf_names(hot: int, n: int, s: float, seed: int) -> list[str]:
    """n adapter names drawn with P(k-th most popular) ~ 1/k^s over `hot` adapters, the
    popularity order a seeded shuffle of a0..a{hot-1} (so popularity is not rank)."""
    rng = random.Random(seed)
    order = [f"a{i}" for i in range(hot)]
    rng.shuffle(order)
    weights = [1.0 / (k**s) for k in range(1, hot + 1)]
    return rng.choices(order, weights=weights, k=n)


def first_uses(names: list[str]) -> list[bool]:
    """Whether each request is the first to name its adapter."""
    seen: set[str] = set()
    out = []
    for name in names:
        out.append(name not in seen)
        seen.add(name)
    return out


async def run_streams(url: str, key: str, jobs: list[tuple[str, str]], streams: int,
                      max_tokens: int, salt: str | None = None) -> dict:  # fmt: skip
    """The jobs over `streams` connections in order; per job (status, ttft s, tokens, error)
    and the run's seconds. salt: every request's cache_salt (its prefix KV is reused only by
    requests of the same salt)."""
    results: list = [None] * len(jobs)
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(len(jobs)):
        queue.put_nowait(i)
    limits = httpx.Limits(max_connections=streams + 4)
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits,
                                 timeout=600) as http:  # fmt: skip

        async def worker():
            while not queue.empty():
                i = queue.get_nowait()
                results[i] = await _one(http, jobs[i], max_tokens, salt)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(streams)))
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "results": results}


async def _one(http: httpx.AsyncClient, job: tuple[str, str], max_tokens: int,
               salt: str | None = None) -> dict:  # fmt: skip
    name, prompt = job
    body = stream_body(name, prompt, max_tokens, usage=True)
    if salt is not None:
        body["cache_salt"] = salt
    sent = time.perf_counter()
    ttft, tokens = None, 0
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode(errors="replace")[:300]
            return {"status": r.status_code, "ttft": None, "tokens": 0, "error": text}
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if ttft is None and event.get("choices") and event["choices"][0].get("text"):
                ttft = time.perf_counter() - sent
            if "error" in event:
                return {"status": 200, "ttft": ttft, "tokens": tokens, "error": event["error"]}
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return {"status": 200, "ttft": ttft, "tokens": tokens, "error": None}


def summarize(run: dict, cold_marks: list[bool]) -> dict:
    """tok/s, errors, and time to first token of first uses and of the rest (ms)."""
    res = run["results"]
    tokens = sum(r["tokens"] for r in res)
    errors = [r for r in res if r["error"] is not None or r["status"] != 200]
    first = [r["ttft"] * 1e3 for r, c in zip(res, cold_marks) if c and r["ttft"] is not None]
    rest = [r["ttft"] * 1e3 for r, c in zip(res, cold_marks) if not c and r["ttft"] is not None]
    return {
        "seconds": round(run["seconds"], 2),
        "tokens": tokens,
        "tok_s": round(tokens / run["seconds"], 1),
        "errors": len(errors),
        "first_errors": [e["error"] for e in errors[:5]],
        "first_use_ttft_ms": _quantiles(first),
        "other_ttft_ms": _quantiles(rest),
    }


def _quantiles(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    return {"n": len(values), "p50": round(percentile(values, 0.5), 1),
            "p99": round(percentile(values, 0.99), 1), "max": round(max(values), 1)}  # fmt: skip


def rss_bytes(pid: int) -> int:
    """Resident bytes of process pid and its children (a runner process is one)."""
    total = 0
    for p in [pid, *_children(pid)]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids = (task / "children").read_text().split()
        except OSError:
            continue
        for k in kids:
            out += [int(k), *_children(int(k))]
    return out


def disk_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


async def register_rest(url: str, key: str, names: list[str], clients: int) -> dict:
    """POST /v1/load_lora_adapter for each name, `clients` at a time: each load's ms, failures."""
    queue: asyncio.Queue = asyncio.Queue()
    for n in names:
        queue.put_nowait(n)
    ms, failed = [], []
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600) as http:

        async def worker():
            while not queue.empty():
                name = queue.get_nowait()
                t0 = time.perf_counter()
                body = {"lora_name": name, "lora_path": name}
                r = await http.post("/v1/load_lora_adapter", json=body)
                ms.append((time.perf_counter() - t0) * 1e3)
                if r.status_code != 200:
                    failed.append(f"{name}: {r.status_code} {r.text[:200]}")

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        seconds = time.perf_counter() - start
    return {"loads": len(names), "seconds": round(seconds, 1), "ms": ms,
            "failed": len(failed), "first_failures": failed[:5]}  # fmt: skip


def timed_get(url: str, key: str, path: str) -> dict:
    t0 = time.perf_counter()
    r = httpx.get(url + path, headers={"Authorization": f"Bearer {key}"}, timeout=120)
    r.raise_for_status()
    ms = (time.perf_counter() - t0) * 1e3
    return {"ms": round(ms, 1), "bytes": len(r.content), "entries": len(r.json()["data"])}


def parse_args(argv=None):
    ap = parser(__doc__)
    ap.add_argument("--adapters", type=int, default=10_000, help="adapters in the store")
    ap.add_argument("--hot", type=int, default=1_000, help="adapters the workload draws from")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--requests", type=int, default=2_000)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--ranks", default="8,16,32,64")
    ap.add_argument("--rank-weights", default="4,3,2,1")
    ap.add_argument("--register-clients", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3, help="cold + warm passes, fresh servers")
    ap.add_argument("--no-register", action="store_true",
                    help="skip loading the store's other adapters (phase 3)")  # fmt: skip
    add_seed(ap)
    args = ap.parse_args(argv)
    try:
        args.rank_list = [int(r) for r in args.ranks.split(",")]
        args.weight_list = [float(w) for w in args.rank_weights.split(",")]
    except ValueError:
        ap.error("--ranks and --rank-weights are comma-separated numbers")
    if len(args.rank_list) != len(args.weight_list):
        ap.error("--ranks and --rank-weights need as many values each")
    if any(not 1 <= r <= 64 for r in args.rank_list):
        ap.error("--ranks: 1..64 (the server's maximum rank)")
    if any(not (w >= 0 and w < float("inf")) for w in args.weight_list) or not any(
        w > 0 for w in args.weight_list
    ):
        ap.error("--rank-weights: finite, >= 0, one of them > 0")
    flags = ("adapters", "hot", "streams", "requests", "max_tokens", "register_clients", "rounds")
    for flag in flags:
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')} must be >= 1")
    if args.hot > args.adapters:
        ap.error("--hot cannot exceed --adapters")
    if not (0 <= args.zipf <= 10):
        ap.error("--zipf: 0..10")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    log(describe_machine())
    from transformers import AutoConfig, AutoTokenizer

    from punica_x.models.loader import resolve_model_dir

    model_dir = resolve_model_dir(None)
    shapes = model_shapes(AutoConfig.from_pretrained(model_dir), TARGETS)
    from common.workload import make_prompts

    prompts = make_prompts(AutoTokenizer.from_pretrained(model_dir), 16)
    scratch = scratch_dir("punica-x-bench-adapters-")
    store = AdapterStore(scratch, free_port())
    try:
        report = _run(args, store, shapes, prompts, scratch)
    finally:
        store.stop()
    _publish(args, report)


def _run(args, store: AdapterStore, shapes, prompts, scratch: Path) -> dict:
    ranks = draw_ranks(args.adapters, args.rank_list, args.weight_list, args.seed)
    t0 = time.perf_counter()
    stored = store.fill(TENANT, ranks, shapes, TARGETS)
    log(f"store: {args.adapters} adapters, {stored / 1e9:.2f} GB in "
        f"{time.perf_counter() - t0:.0f} s")  # fmt: skip
    t0 = time.perf_counter()
    os.sync()  # the store's bytes on disk now, not written back under the first cold pass
    log(f"store written back in {time.perf_counter() - t0:.0f} s")
    os.environ.update(store.environment())
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    extra = ("--lora-source-root", f"s3://{BUCKET}/{PREFIX}", "--lora-source-timeout-s", "60")
    names = zipf_names(args.hot, args.requests, args.zipf, args.seed)
    jobs = [(n, prompts[i % len(prompts)]) for i, n in enumerate(names)]
    report = {
        "store": {"adapters": args.adapters, "bytes": stored, "ranks": _counts(ranks),
                  "targets": TARGETS},
        "workload": {"hot": args.hot, "requests": args.requests, "streams": args.streams,
                     "max_tokens": args.max_tokens, "zipf": args.zipf,
                     "adapters_named": len(set(names))},
        "rounds": [],
    }  # fmt: skip
    for r in range(args.rounds):
        data = scratch / f"data{r}"
        server = start_server(data, port, extra)
        try:
            key = _tenant(url, data, args.adapters)
            pids = {"server": server.pid, "store": store.proc.pid}
            report["rounds"].append(_passes(args, url, key, pids, data, jobs))
            if r == args.rounds - 1:
                report.update(_at_scale(args, url, key, server.pid, data, names))
                server = _stop(server)
                report["restart"] = _restart(url, key, data, port, extra)
        finally:
            if server is not None:
                _stop(server)
        if r < args.rounds - 1:
            shutil.rmtree(data)
    return {**report, **_median_round(report["rounds"])}


def _restart(url: str, key: str, data: Path, port: int, extra) -> dict:
    """The server started again on `data`: seconds until ready, its RSS, /v1/models."""
    t0 = time.perf_counter()
    server = start_server(data, port, extra, ready_s=RESTART_S)
    try:
        out = {
            "ready_s": round(time.perf_counter() - t0, 1),
            "rss": rss_bytes(server.pid),
            "models": timed_get(url, key, "/v1/models"),
        }
    finally:
        _stop(server)
    log(f"restart: {out}")
    return out


def _median_round(rounds: list[dict]) -> dict:
    """cold, warm and their ratio of the median round (by ratio), the ratios' median/range."""
    ratios = [r["cold_over_warm"] for r in rounds]
    median = sorted(rounds, key=lambda r: r["cold_over_warm"])[(len(rounds) - 1) // 2]
    return {
        "cold": median["cold"],
        "warm": median["warm"],
        "cold_over_warm": median["cold_over_warm"],
        "cold_over_warm_median": round(statistics.median(ratios), 3),
        "cold_over_warm_range": [min(ratios), max(ratios)],
    }


def _stop(server) -> None:
    server.terminate()
    server.wait(60)


def _tenant(url: str, data: Path, adapters: int) -> str:
    token = (data / "admin_token").read_text().strip()
    r = httpx.post(url + "/admin/tenants", json={"name": TENANT},
                   headers={"Authorization": f"Bearer {token}"})  # fmt: skip
    r.raise_for_status()
    return r.json()["api_key"]


def _streams_run(url, key, jobs, args, marks, pids: dict[str, int], salt: str) -> dict:
    """One pass of the jobs with cache_salt `salt`, summarized, with the CPU seconds each
    process spent in it (the store shares this machine's cores: an object store's own work,
    not the server's)."""
    before = {name: cpu_seconds(p) for name, p in pids.items()}
    client = cpu_seconds()
    run = asyncio.run(run_streams(url, key, jobs, args.streams, args.max_tokens, salt))
    out = summarize(run, marks)
    out["cpu_s"] = {name: round(cpu_seconds(p) - before[name], 2) for name, p in pids.items()}
    out["cpu_s"]["client"] = round(cpu_seconds() - client, 2)
    return out


def _passes(args, url, key, pids: dict[str, int], data: Path, jobs) -> dict:
    """One round on a fresh server: the cold pass, then the warm one."""
    marks = first_uses([name for name, _ in jobs])
    rss_start = rss_bytes(pids["server"])
    cold = _streams_run(url, key, jobs, args, marks, pids, "cold")
    log(f"cold: {cold}")
    warm = _streams_run(url, key, jobs, args, marks, pids, "warm")
    log(f"warm: {warm}")
    ratio = round(cold["tok_s"] / warm["tok_s"], 3)
    log(f"cold / warm tok/s: {ratio}")
    return {
        "cold": cold,
        "warm": warm,
        "cold_over_warm": ratio,
        "rss": {"start": rss_start, "after_workload": rss_bytes(pids["server"])},
        "disk": {"after_workload": disk_bytes(data)},
    }


def _at_scale(args, url, key, pid, data: Path, names: list[str]) -> dict:
    """The store's other adapters registered (unless --no-register), then the listings at N."""
    out = {}
    if not args.no_register:
        rest = sorted(set(f"a{i}" for i in range(args.adapters)) - set(names))
        out["register"] = _register(url, key, pid, data, rest, args)
    out["at_scale"] = {
        "models": timed_get(url, key, "/v1/models"),
        "adapters_page": timed_get(url, key, "/v1/adapters?limit=100"),
    }
    return out


def _register(url, key, pid, data: Path, rest: list[str], args) -> dict:
    """Load `rest` in CHECKPOINTS chunks, RSS and disk after each: the RSS per adapter is
    the slope over the second half, when the adapter pools (host LRU, device) are long full
    and only what each registered adapter costs beyond them grows."""
    points = [(0, rss_bytes(pid), disk_bytes(data))]
    loads = []
    step = max(1, -(-len(rest) // CHECKPOINTS))
    for i in range(0, len(rest), step):
        loads.append(
            asyncio.run(register_rest(url, key, rest[i : i + step], args.register_clients))
        )
        done = i + len(rest[i : i + step])
        points.append((done, rss_bytes(pid), disk_bytes(data)))
        log(f"registered {done}/{len(rest)}: RSS {points[-1][1] / 2**30:.2f} GiB")
    ms = [m for chunk in loads for m in chunk.pop("ms")]
    out = {
        "loads": sum(c["loads"] for c in loads),
        "seconds": round(sum(c["seconds"] for c in loads), 1),
        "load_ms": _quantiles(ms),
        "failed": sum(c["failed"] for c in loads),
        "first_failures": [f for c in loads for f in c["first_failures"]][:5],
        "points": [{"registered": n, "rss": r, "disk": d} for n, r, d in points],
    }
    if len(points) >= 3 and out["failed"] == 0:
        (n0, r0, d0), (n1, r1, d1) = points[len(points) // 2], points[-1]
        if n1 > n0:
            out["rss_per_cold_adapter"] = round((r1 - r0) / (n1 - n0))
            out["disk_per_adapter"] = round((d1 - d0) / (n1 - n0))
    log(f"register: { {k: v for k, v in out.items() if k != 'points'} }")
    return out


def _counts(values: list[int]) -> dict:
    out: dict = {}
    for v in values:
        out[str(v)] = out.get(str(v), 0) + 1
    return out


def _publish(args, report: dict) -> None:
    rows = [
        {
            "round": i + 1,
            "run": run,
            "tok/s": rnd[run]["tok_s"],
            "errors": rnd[run]["errors"],
            "first-use TTFT p50 ms": rnd[run]["first_use_ttft_ms"].get("p50"),
            "first-use TTFT p99 ms": rnd[run]["first_use_ttft_ms"].get("p99"),
            "other TTFT p50 ms": rnd[run]["other_ttft_ms"].get("p50"),
            "other TTFT p99 ms": rnd[run]["other_ttft_ms"].get("p99"),
            "server CPU s": rnd[run]["cpu_s"]["server"],
            "store CPU s": rnd[run]["cpu_s"]["store"],
            "client CPU s": rnd[run]["cpu_s"]["client"],
        }
        for i, rnd in enumerate(report["rounds"])
        for run in ("cold", "warm")
    ]
    print_table(rows, list(rows[0]), f"{args.adapters} adapters in S3, Zipf {args.zipf} over "
                f"{args.hot}, {args.streams} streams")  # fmt: skip
    low, high = report["cold_over_warm_range"]
    log(f"cold / warm tok/s: median {report['cold_over_warm_median']} of "
        f"{len(report['rounds'])} rounds, {low}-{high} (issue 74: >= 0.8)")  # fmt: skip
    reg = report.get("register")
    if reg and "rss_per_cold_adapter" in reg:
        log(f"RSS per registered-but-cold adapter: {reg['rss_per_cold_adapter'] / 1024:.1f} KiB; "
            f"disk per adapter {reg['disk_per_adapter'] / 1e6:.2f} MB")  # fmt: skip
    log(f"at {args.adapters}: {report['at_scale']}")
    write_json("bench_adapters", {"args": {k: v for k, v in vars(args).items()}, **report})
    _plot(report)


def _plot(report: dict) -> None:
    """Each round's cold and warm tok/s; the median round's first-use TTFT p50 / p99."""
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    colors = {"cold": "tab:blue", "warm": "tab:gray"}
    for i, rnd in enumerate(report["rounds"]):
        for j, run in enumerate(("cold", "warm")):
            label = run if i == 0 else None
            ax1.bar(i * 3 + j, rnd[run]["tok_s"], color=colors[run], label=label)
    ax1.set_xticks([i * 3 + 0.5 for i in range(len(report["rounds"]))])
    ax1.set_xticklabels([f"round {i + 1}" for i in range(len(report["rounds"]))])
    ax1.set_ylabel("delivered tok/s")
    ax1.set_title(f"cold / warm: median {report['cold_over_warm_median']}")
    ax1.legend()
    for r in ("cold", "warm"):
        q = report[r]["first_use_ttft_ms"]
        if q.get("n"):
            ax2.bar([f"{r}\np50", f"{r}\np99"], [q["p50"], q["p99"]], color=colors[r])
    ax2.set_ylabel("first request of an adapter: TTFT ms (median round)")
    save_plot("bench_adapters", fig)


if __name__ == "__main__":
    main()
