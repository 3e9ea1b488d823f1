"""Does one tenant's flood delay another tenant? (issue 28's fair-share target)

Starts `punica-x serve` (default model, one runner, defaults) twice, side by side: with fair
share (the default: a virtual token counter per tenant orders the scheduler's queue, and a
tenant below its share of the batch slots takes one from the tenant furthest above it) and
with `--no-fair-share` (first come, first served: today's order before the change). On each:

1. alone: tenant B sends `--light` concurrent streaming requests, `--rounds` times after a
   warm-up round; their median time to first token (TTFT) is the reference;
2. flood: tenant A opens `--flood` concurrent streams (`--max-tokens` tokens each, ignoring
   eos); once they fill the batch and the queue, B sends the same `--light` requests again.

Target: B's median TTFT during the flood at most 5x B's alone, every B request served.

    python benchmarks/bench_fairness.py [--flood 160] [--light 6] [--max-tokens 64]
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from common.args import add_max_tokens, add_rounds, add_tenant_load, parser
from common.report import describe_machine, print_table, pyplot, save_plot, write_json
from common.server import free_port, start_server

PROMPT = "Write a short note about the weather in a city you like."


async def stream_one(http: httpx.AsyncClient, key: str, model: str, max_tokens: int) -> dict:
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    start = time.perf_counter()
    ttft, tokens, status = None, 0, None
    async with http.stream(
        "POST", "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    ) as r:
        status = r.status_code
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"text":""' not in line:
                ttft = ttft if ttft is not None else time.perf_counter() - start
                tokens += 1
    return {"status": status, "ttft": ttft, "tokens": tokens, "end": time.perf_counter() - start}


async def queued(http: httpx.AsyncClient, admin: str) -> int:
    r = await http.get("/admin/runners", headers={"Authorization": f"Bearer {admin}"})
    return r.json()["queued"]


async def scenario(url: str, admin: str, keys: dict, model: str, args) -> dict:
    limits = httpx.Limits(max_connections=args.flood + args.light + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:

        def light():
            return [stream_one(http, keys["b"], model, args.max_tokens) for _ in range(args.light)]

        await asyncio.gather(*light())  # warm-up, not counted
        alone = []
        for _ in range(args.rounds):
            alone += await asyncio.gather(*light())
        flood = [
            asyncio.create_task(stream_one(http, keys["a"], model, args.max_tokens))
            for _ in range(args.flood)
        ]
        deadline = time.monotonic() + 120
        while await queued(http, admin) < args.flood // 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        backlog = await queued(http, admin)
        during = await asyncio.gather(*light())
        flood_results = await asyncio.gather(*flood)
    return {"alone": alone, "during": during, "flood": flood_results, "backlog": backlog}


def summarize(name: str, res: dict) -> dict:
    def med(rows):
        values = [r["ttft"] for r in rows if r["ttft"] is not None]
        return statistics.median(values) if values else float("nan")

    alone, during = med(res["alone"]), med(res["during"])
    return {
        "server": name,
        "b_ttft_alone_ms": round(alone * 1e3, 1),
        "b_ttft_flood_ms": round(during * 1e3, 1),
        "ratio": round(during / alone, 2),
        "b_served": sum(r["status"] == 200 and r["tokens"] > 0 for r in res["during"]),
        "a_served": sum(r["status"] == 200 and r["tokens"] > 0 for r in res["flood"]),
        "a_queued_when_b_came": res["backlog"],
    }


def tenants(url: str, data_dir: Path) -> tuple[str, dict]:
    admin = (data_dir / "admin_token").read_text().strip()
    auth = {"Authorization": f"Bearer {admin}"}
    keys = {
        t: httpx.post(url + "/admin/tenants", json={"name": t}, headers=auth).json()["api_key"]
        for t in ("a", "b")
    }
    return admin, keys


def run(extra: tuple[str, ...], args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        data, port = Path(tmp) / "data", free_port()
        server = start_server(data, port, extra)
        url = f"http://127.0.0.1:{port}"
        try:
            admin, keys = tenants(url, data)
            model = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {keys['a']}"})
            model_id = model.json()["data"][0]["id"]
            return asyncio.run(scenario(url, admin, keys, model_id, args))
        finally:
            server.terminate()
            server.wait(30)


def main() -> None:
    ap = parser(__doc__)
    add_tenant_load(ap)
    add_max_tokens(ap)
    add_rounds(ap, help="rounds of B alone (after a warm-up)")
    ap.add_argument("--serve-args", default="", help="extra `punica-x serve` arguments")
    args = ap.parse_args()
    extra = tuple(args.serve_args.split())
    rows = []
    for name, flags in (("fcfs (--no-fair-share)", ("--no-fair-share",)), ("fair share", ())):
        rows.append(summarize(name, run(extra + flags, args)))
    machine = describe_machine()
    columns = list(rows[0])
    print_table(rows, columns, f"bench_fairness on {machine}")
    write_json("bench_fairness", {"machine": machine, "args": vars(args), "rows": rows})
    plot(rows)


def plot(rows: list[dict]) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = [r["server"] for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [r["b_ttft_alone_ms"] for r in rows], 0.4, label="B alone")
    ax.bar([i + 0.2 for i in x], [r["b_ttft_flood_ms"] for r in rows], 0.4, label="B in A's flood")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("B's median TTFT (ms)")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title("One tenant's flood and another's first token")
    save_plot("bench_fairness", fig)


if __name__ == "__main__":
    main()
