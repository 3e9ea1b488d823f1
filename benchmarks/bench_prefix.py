"""Does prefix caching pay on a multi-turn chat workload? punica-x with its prefix cache on
and off, and vLLM CPU's OpenAI server (its prefix caching on, as by default), through the
same streaming chat client in one run.

Workload: --adapters rank-16 adapters (all 7 projections), each with its own system prompt
of about --system-tokens tokens; --conversations conversations, each on one adapter (round
robin), of --turns turns: every turn resends the system prompt and the whole conversation
so far (the replies as the server gave them) plus a new question of ~25 tokens, and asks
for --output-len tokens (ignore_eos). Conversations start at Poisson times at --rate per
second, for each of --rates; a conversation's next turn is sent --think-s after its
previous reply ended. The same seed gives every server the same questions and start times;
every (server, rate) run starts a fresh server, so no run finds another's cache.

    python benchmarks/bench_prefix.py [--rates 0.1,0.2] [--conversations 16] [--turns 4]

Per server: TTFT p50 / p99 over all turns (and over turns after the first), output tokens/s
over the run (completion tokens / time from the first request to the last reply), the
punica-x runner's prefix cache hit rate. Targets (issue 31): cache on vs off TTFT p50 >= 3x
better and output tokens/s >= 1.3x; TTFT p50 below vLLM's.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from pathlib import Path

import httpx
from common import peers
from common.args import add_adapters, add_dtype, add_rank, add_seed, add_threads, parser
from common.report import describe_machine, machine, print_table, pyplot, save_plot, write_json
from common.scratch import scratch_dir
from common.server import bench_server, free_port
from common.workload import TOPICS, make_adapters

WORDS = [
    *("policy", "answer", "customer", "order", "refund", "account", "shipping", "warranty"),
    *("support", "product", "service", "billing", "invoice", "delivery", "return", "exchange"),
    *("manager", "ticket", "priority", "escalate", "friendly", "concise", "polite", "accurate"),
    *("verify", "identity", "language", "summary", "context", "example"),
]


def add_args(ap) -> None:
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument(
        "--rates", default="0.1,0.2", help="conversations started per second, comma separated"
    )
    ap.add_argument("--think-s", type=float, default=0.5, help="pause before the next turn")
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--servers", default="punica-x,punica-x-off,vllm")
    add_adapters(ap)
    add_rank(ap)
    add_threads(ap, help="cores vLLM's OpenMP threads bind")
    add_seed(ap)
    add_dtype(ap, help="both servers' dtype (auto: punica-x's default on this CPU, vLLM the same)")


# -- the workload ------------------------------------------------------------------------------
def system_prompt(tokenizer, adapter: int, tokens: int) -> str:
    """About `tokens` tokens of instructions, different for each adapter."""
    rng = random.Random(1000 + adapter)
    text = f"You are the assistant of shop number {adapter}. Rules follow.\n"
    while len(tokenizer(text).input_ids) < tokens:
        words = " ".join(rng.choice(WORDS) for _ in range(12))
        text += f"Rule {rng.randrange(10**4)}: {words}.\n"
    return text


def conversations(args, tokenizer, rate: float) -> list[dict]:
    """Each conversation: its adapter index, start time and questions."""
    rng = random.Random(args.seed)
    systems = [system_prompt(tokenizer, a, args.system_tokens) for a in range(args.adapters)]
    t, convs = 0.0, []
    for c in range(args.conversations):
        t += rng.expovariate(rate)
        questions = [
            f"Question {k + 1}: tell me about {rng.choice(TOPICS)} and "
            f"{' '.join(rng.choice(WORDS) for _ in range(8))}."
            for k in range(args.turns)
        ]
        adapter = c % args.adapters
        convs.append({"adapter": adapter, "start": t, "system": systems[adapter], "qs": questions})
    return convs


# -- the client --------------------------------------------------------------------------------
async def turn(client: httpx.AsyncClient, model: str, messages: list, args) -> dict:
    """One streamed chat turn: TTFT, completion tokens, the reply text."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": args.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent, first, text, tokens = time.monotonic(), None, [], 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta", {}).get("content")
                if delta:
                    first = first or time.monotonic()
                    text.append(delta)
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return {"ttft": (first or time.monotonic()) - sent, "tokens": tokens, "text": "".join(text)}


async def conversation(client, conv: dict, names: list[str], args, t0: float) -> list[dict]:
    await asyncio.sleep(max(0.0, t0 + conv["start"] - time.monotonic()))
    messages = [{"role": "system", "content": conv["system"]}]
    out = []
    for k, q in enumerate(conv["qs"]):
        messages.append({"role": "user", "content": q})
        result = await turn(client, names[conv["adapter"]], messages, args)
        out.append({**result, "turn": k})
        messages.append({"role": "assistant", "content": result["text"]})
        await asyncio.sleep(args.think_s)
    return out


async def drive(url: str, key: str | None, names: list[str], convs: list[dict], args) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    limits = httpx.Limits(max_connections=256)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=1800, limits=limits) as c:
        t0 = time.monotonic()
        per = await asyncio.gather(*(conversation(c, cv, names, args, t0) for cv in convs))
        end = time.monotonic() - args.think_s
    turns = [t for conv in per for t in conv]
    return summarize(turns, end - t0)


def summarize(turns: list[dict], seconds: float) -> dict:
    ttft = sorted(t["ttft"] * 1e3 for t in turns)
    later = sorted(t["ttft"] * 1e3 for t in turns if t["turn"] > 0)
    return {
        "turns": len(turns),
        "ttft_p50_ms": percentile(ttft, 50),
        "ttft_p99_ms": percentile(ttft, 99),
        "ttft_mean_ms": statistics.fmean(ttft),
        "later_ttft_p50_ms": percentile(later, 50) if later else None,
        "out_tok_s": sum(t["tokens"] for t in turns) / seconds,
        "seconds": seconds,
    }


def percentile(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


# -- the servers -------------------------------------------------------------------------------
def punica_run(args, paths, tmp: Path, convs, on: bool) -> dict:
    name = "punica-x" if on else "punica-x-off"
    extra = ("--quantization", "none")  # the float weights vLLM serves
    extra += () if args.dtype == "auto" else ("--dtype", args.dtype)
    extra += () if on else ("--no-prefix-caching",)
    with bench_server(tmp, paths, extra) as (_, url, key, _model):
        names = [f"a{i}" for i in range(len(paths))]
        warm_up(url, key, names[0])
        row = asyncio.run(drive(url, key, names, convs, args))
        row["hit_rate"] = hit_rate(url, tmp / "data")
    return {"server": name, **row}


def vllm_run(args, paths, tmp: Path, convs, model_dir: Path) -> dict:
    port = free_port()
    adapters = {f"a{i}": p for i, p in enumerate(paths)}
    log = tmp / "vllm-server.log"
    proc = peers.start_server(
        model_dir, "base", adapters, args.rank, port, args.threads, log, args.served_dtype
    )
    try:
        url = f"http://127.0.0.1:{port}"
        warm_up(url, None, "a0")
        row = asyncio.run(drive(url, None, list(adapters), convs, args))
    finally:
        proc.terminate()
        proc.wait(60)
    return {"server": "vllm", **row, "hit_rate": None}


def warm_up(url: str, key: str | None, model: str) -> None:
    """One short chat, so first-request costs (compilation, adapter load) are not measured;
    it shares no prefix with the workload beyond the chat template's first tokens."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=900)


def hit_rate(url: str, data_dir: Path) -> float | None:
    token = (data_dir / "admin_token").read_text().strip()
    rows = httpx.get(url + "/admin/runners", headers={"Authorization": f"Bearer {token}"})
    runners = rows.json()["runners"]
    queries = sum(r["prefix_cache_queries"] for r in runners)
    return sum(r["prefix_cache_hits"] for r in runners) / queries if queries else None


def run(args) -> None:
    print(describe_machine(), flush=True)
    from transformers import AutoTokenizer

    from punica_x.config import ModelConfig, dtype_name
    from punica_x.models.loader import describe_model

    meta = describe_model(ModelConfig(quantization="none"))  # vLLM serves this float copy
    args.served_dtype = dtype_name(ModelConfig(dtype=args.dtype).torch_dtype())
    tokenizer = AutoTokenizer.from_pretrained(meta.model_dir)
    tmp = scratch_dir("bench-prefix-")
    paths = make_adapters(meta.model_dir, args.adapters, args.rank, tmp / "adapters")
    rows = []
    for rate in [float(r) for r in args.rates.split(",")]:
        convs = conversations(args, tokenizer, rate)
        for server in args.servers.split(","):
            run_dir = tmp / f"{server}-{rate:g}"
            run_dir.mkdir()
            if server == "vllm":
                row = vllm_run(args, paths, run_dir, convs, meta.model_dir)
            else:
                row = punica_run(args, paths, run_dir, convs, on=server == "punica-x")
            rows.append({"rate": rate, **row})
            print(f"  {rows[-1]}", flush=True)
    report(args, rows)


def report(args, rows: list[dict]) -> None:
    print(
        f"SmolLM2-135M {args.served_dtype}, {args.conversations} conversations x {args.turns} "
        f"turns, {args.adapters} rank-{args.rank} adapters each with a ~{args.system_tokens}"
        f"-token system prompt, {args.output_len} tokens a reply, Poisson conversation starts"
    )
    columns = ["rate", "server", "turns", "ttft_p50_ms", "ttft_p99_ms", "later_ttft_p50_ms"]
    print_table(rows, columns + ["out_tok_s", "hit_rate"], "multi-turn chat, streamed")
    ratios = [r for r in (rate_ratios(rows, rate) for rate in rates(rows)) if len(r) > 1]
    if ratios:
        title = "targets: off/on TTFT p50 >= 3, on/off tok/s >= 1.3, vLLM/on TTFT p50 > 1"
        print_table(ratios, list(ratios[0]), title)
    name = "bench_prefix" + ("" if args.served_dtype == "float32" else f"_{args.served_dtype}")
    payload = {"args": vars(args), "machine": machine(), "rows": rows, "ratios": ratios}
    path = write_json(name, payload)
    plot(rows, name)
    print(f"wrote {path} and {path.with_suffix('.png')}")


def rates(rows: list[dict]) -> list[float]:
    return sorted({r["rate"] for r in rows})


def rate_ratios(rows: list[dict], rate: float) -> dict:
    by = {r["server"]: r for r in rows if r["rate"] == rate}
    on, off, peer = by.get("punica-x"), by.get("punica-x-off"), by.get("vllm")
    ratios: dict = {"rate": rate}
    if on and off:
        ratios["ttft_p50_off_over_on"] = off["ttft_p50_ms"] / on["ttft_p50_ms"]
        ratios["out_tok_s_on_over_off"] = on["out_tok_s"] / off["out_tok_s"]
    if on and peer:
        ratios["ttft_p50_vllm_over_on"] = peer["ttft_p50_ms"] / on["ttft_p50_ms"]
        ratios["out_tok_s_on_over_vllm"] = on["out_tok_s"] / peer["out_tok_s"]
    return ratios


def plot(rows: list[dict], name: str) -> None:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for server in sorted({r["server"] for r in rows}):
        mine = sorted((r for r in rows if r["server"] == server), key=lambda r: r["rate"])
        x = [r["rate"] for r in mine]
        a.plot(x, [r["ttft_p50_ms"] / 1e3 for r in mine], "-o", label=f"{server} p50")
        a.plot(x, [r["ttft_p99_ms"] / 1e3 for r in mine], "--", label=f"{server} p99")
        b.plot(x, [r["out_tok_s"] for r in mine], "-o", label=server)
    a.set_ylabel("time to first token (s)")
    a.set_yscale("log")
    b.set_ylabel("output tokens/s")
    for ax in (a, b):
        ax.set_xlabel("conversations started per second")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(describe_machine(), fontsize=8)
    save_plot(name, fig)


def main() -> None:
    ap = parser(__doc__)
    add_args(ap)
    run(ap.parse_args())


if __name__ == "__main__":
    main()
