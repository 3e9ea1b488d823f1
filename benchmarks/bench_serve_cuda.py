"""Does `punica-x serve` run end to end on a GPU with a real-sized model, and what do its
users see?

Starts `punica-x serve` with one runner on cuda:0 (default: a random-weight model of
Llama-3-8B's shape, common/shapes.py) on 127.0.0.1 and, over HTTP only, measures:

- server_ready_s: process start to GET /ready answering 200 (weights loaded, memory
  planned, the runner's warm-up done); upload_s: a tenant and --adapters rank-r adapters
  (all 7 projections, random, PEFT's format) uploaded through POST /v1/adapters;
- backbone_tok_s / distinct_tok_s: generated tokens/s of --requests greedy completions
  (EOS ignored, --max-tokens each) from --clients closed-loop connections, every request on
  the base model, then request i on adapter a{i % adapters}; lora_x = distinct / backbone;
- a new adapter's first token: new_upload_s (its upload), new_first_token_s (a streamed
  request on it, from sending to the first SSE event that carries a token: its text or, for
  random weights whose ids the tokenizer decodes to nothing, its logprob), new_total_s;
- the server's own account: the punica_x_ graph / memory / KV series of GET /metrics and
  its log's memory plan and graph lines.

JSON (written after every phase, and on SIGTERM) and a PNG of the tok/s go to
benchmarks/results/cuda/ (results/<isa>/ with --device cpu, the CPU smoke run).

    python benchmarks/bench_serve_cuda.py [--model llama-3-8b] [--adapters 8] [--requests 64]
        [--clients 32] [--max-tokens 32] [--timeout-s 300]
    python benchmarks/bench_serve_cuda.py --device cpu --model DIR --adapters 2 --requests 4
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from common.args import add_adapters, add_max_tokens, add_rank, add_requests, parser
from common.gpu_generate import write_random_adapters
from common.http_load import tokens_per_second
from common.report import describe_machine, print_table, pyplot, save_plot, write_json
from common.report import log as _log
from common.scratch import scratch_dir
from common.server import free_port, setup_tenant, wait_ready
from common.shapes import SHAPES, model_path
from common.workload import make_prompts

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = [
    "server_ready_s",
    "upload_s",
    "backbone_tok_s",
    "distinct_tok_s",
    "lora_x",
    "new_upload_s",
    "new_first_token_s",
    "new_total_s",
]
LOG_MARKERS = ("memory plan", "plan:", "graph")
# access lines left out of a failure's log tail: successes, and the readiness polls
ACCESS = re.compile(r"\b(GET|POST|DELETE|PUT) /\S* 2\d\d |GET /ready ")


def parse_args():
    ap = parser(__doc__)
    ap.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    ap.add_argument(
        "--model",
        default="llama-3-8b",
        help=f"a shape ({', '.join(SHAPES)}: random weights) or a model folder",
    )
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder of a --model shape")
    add_adapters(ap)
    add_rank(ap)
    add_requests(ap, 64)
    ap.add_argument("--clients", type=int, default=32)
    add_max_tokens(ap, 32)
    ap.add_argument(
        "--timeout-s", type=float, default=300, help="seconds the server may take to be ready"
    )
    args = ap.parse_args()
    for flag in ("adapters", "rank", "requests", "clients", "max_tokens", "timeout_s"):
        if getattr(args, flag) <= 0:
            ap.error(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    if args.tokenizer and args.model not in SHAPES:
        ap.error("--tokenizer needs --model naming a shape")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            ap.error("--device cuda: no CUDA device is visible (--device cpu for a smoke run)")
    return args


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    print(describe_machine(), flush=True)
    summary: dict = {"model": args.model, "device": args.device}
    tmp = scratch_dir("bench-serve-cuda-")
    try:
        _run(args, summary, tmp)
    except BaseException as exc:
        stopped = isinstance(exc, SystemExit) and exc.code == 124
        summary["error"] = "SIGTERM" if stopped else f"{type(exc).__name__}: {exc}"
        _log(f"stopped: {summary['error']}")
        _server_log_tail(tmp / "server.log")
        raise
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the cleanup below runs to its end
        _save(args, summary)
        if summary.get("_server") is not None:
            _stop(summary["_server"])
        shutil.rmtree(tmp, ignore_errors=True)  # an 8B model's adapters: ~0.8 GB


def _run(args, summary: dict, tmp: Path) -> None:
    """Every phase, in order, each adding its figures to summary; the server process goes
    in summary["_server"] as soon as it runs, so that main stops it whatever happens."""
    t0 = time.perf_counter()
    model_dir = Path(model_path(args.model, args.tokenizer))
    _log(f"model at {model_dir} ({time.perf_counter() - t0:.0f} s)")
    paths = write_random_adapters(model_dir, args.adapters + 1, args.rank, tmp / "adapters")
    _free_cuda_cache()
    _log(f"{len(paths)} rank-{args.rank} adapters written")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    server = _start(args, model_dir, tmp / "data", port)
    summary["_server"] = server
    wait_ready(server, url + "/ready", args.timeout_s, tmp / "server.log")
    summary["server_ready_s"] = time.perf_counter() - t0
    _log(f"server ready in {summary['server_ready_s']:.1f} s (pid {server.pid})")
    _save(args, summary)

    t0 = time.perf_counter()
    key, model_id = setup_tenant(url, tmp / "data", paths[:-1])
    summary["upload_s"] = time.perf_counter() - t0
    summary["base_model_id"] = model_id
    _log(f"tenant and {args.adapters} adapters uploaded in {summary['upload_s']:.1f} s")

    warm = make_prompts(tokenizer, 2, warm_up=True)
    tokens_per_second(url, key, [(model_id, warm[0], {}), ("a0", warm[1], {})], 2, 4)
    _log("warmed up (2 requests: the base model and a0)")

    prompts = make_prompts(tokenizer, args.requests)
    loads = {
        "backbone": [(model_id, p, {}) for p in prompts],
        "distinct": [(f"a{i % args.adapters}", p, {}) for i, p in enumerate(prompts)],
    }
    for name, jobs in loads.items():
        tps = tokens_per_second(url, key, jobs, args.clients, args.max_tokens)
        summary[f"{name}_tok_s"] = tps
        _log(f"{name}: {tps:.1f} tok/s ({args.requests} requests, {args.clients} clients)")
        _save(args, summary)
    summary["lora_x"] = summary["distinct_tok_s"] / summary["backbone_tok_s"]

    summary |= _new_adapter(url, key, paths[-1], f"a{args.adapters}", prompts[0])
    _log(
        f"a new adapter: upload {summary['new_upload_s'] * 1e3:.0f} ms, first token "
        f"{summary['new_first_token_s'] * 1e3:.0f} ms ({summary['new_first_event']}), "
        f"total {summary['new_total_s'] * 1e3:.0f} ms"
    )
    _save(args, summary)

    summary["metrics"] = _metrics(url, tmp / "data")
    _log(f"/metrics: {len(summary['metrics'])} graph / memory / KV series")
    summary["server_log"] = _log_lines(tmp / "server.log")
    for line in summary["server_log"]:
        print(f"  server: {line}", flush=True)
    _report(args, summary)


def _start(args, model_dir: Path, data_dir: Path, port: int) -> subprocess.Popen:
    """`punica-x serve` as common.server.start_server runs it, but with the process handed
    back before it is ready (a SIGTERM during a long load must still stop it) and our
    --timeout-s for the wait."""
    extra = ["--model", str(model_dir), "--runners", "1"]
    if args.device == "cuda":
        extra += ["--devices", "cuda:0"]
    else:  # `auto` would take a GPU where there is one
        extra += ["--devices", "cpu", "--kv-cache-bytes", str(64 << 20)]
    log = (data_dir.parent / "server.log").open("w")
    return subprocess.Popen(
        [sys.executable, "-m", "frontend.cli", "serve", "--port", str(port)]
        + ["--data-dir", str(data_dir), *extra],
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env=dict(os.environ),
    )


def _stop(server: subprocess.Popen) -> None:
    """terminate, wait, kill: the server is gone when this returns."""
    if server.poll() is None:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(30)
            _log("the server ignored SIGTERM for 30 s: killed")
    _log(f"server stopped (exit {server.returncode})")


def _new_adapter(url: str, key: str, path: Path, name: str, prompt: str) -> dict:
    """Upload an adapter nobody has loaded, then at once a streamed request on it."""
    auth = {"Authorization": f"Bearer {key}"}
    files = {
        f: (f, (path / f).read_bytes())
        for f in ("adapter_config.json", "adapter_model.safetensors")
    }
    t0 = time.perf_counter()
    r = httpx.post(
        url + "/v1/adapters", data={"name": name}, files=files, headers=auth, timeout=120
    )
    r.raise_for_status()
    t1 = time.perf_counter()
    first, kind = asyncio.run(_first_token(url, auth, name, prompt))
    t2 = time.perf_counter()
    return {
        "new_upload_s": t1 - t0,
        "new_first_token_s": first - t1,
        "new_total_s": t2 - t0,
        "new_first_event": kind,
    }


async def _first_token(url: str, auth: dict, model: str, prompt: str) -> tuple[float, str]:
    """perf_counter at the first SSE event carrying a token ("text", or "logprobs" where the
    token decodes to nothing) and which; the stream is read to its end."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "logprobs": 0,  # an event for every token, also one whose text is empty
    }
    first, kind = None, ""
    async with (
        httpx.AsyncClient(base_url=url, headers=auth, timeout=300) as c,
        c.stream("POST", "/v1/completions", json=body) as r,
    ):
        r.raise_for_status()
        async for line in r.aiter_lines():
            if first is not None or not line.startswith("data: {"):
                continue
            choice = (json.loads(line[6:]).get("choices") or [{}])[0]
            if choice.get("text") or choice.get("logprobs"):
                first, kind = time.perf_counter(), "text" if choice["text"] else "logprobs"
    if first is None:
        raise RuntimeError(f"the stream on {model} ended without a token")
    return first, kind


def _metrics(url: str, data_dir: Path) -> dict[str, float]:
    """The punica_x_ series of GET /metrics (admin) naming graph, memory or kv_: series (name
    and labels) -> value."""
    token = (data_dir / "admin_token").read_text().strip()
    r = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=30)
    r.raise_for_status()
    out = {}
    for line in r.text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        name = series.split("{", 1)[0]
        if name.startswith("punica_x_") and any(w in name for w in ("graph", "memory", "kv_")):
            with contextlib.suppress(ValueError):
                out[series] = float(value)
    return out


def _log_lines(log: Path, most: int = 20) -> list[str]:
    if not log.exists():
        return []
    lines = log.read_text(errors="replace").splitlines()
    return [ln.strip() for ln in lines if any(m in ln for m in LOG_MARKERS)][:most]


def _server_log_tail(log: Path, lines: int = 40) -> None:
    """The server log's last lines but its access lines (GET/POST ... 2xx, GET /ready) on
    stderr: the scratch folder holding it is removed."""
    if log.exists():
        text = log.read_text(errors="replace").splitlines()
        tail = [ln for ln in text if not ACCESS.search(ln)][-lines:]
        print(f"--- {log} (last {len(tail)} lines) ---", file=sys.stderr)
        print("\n".join(tail), file=sys.stderr, flush=True)


def _free_cuda_cache() -> None:
    """The adapters were drawn on the GPU: give its cached blocks back before the server
    plans its memory."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _name(args) -> str:
    return "bench_serve_cuda_" + Path(args.model).name.replace(".", "_")


def _save(args, summary: dict) -> None:
    """The JSON as it stands (again at each call: the latest wins)."""
    clean = {k: v for k, v in summary.items() if not k.startswith("_")}
    group = "cuda" if args.device == "cuda" else None
    write_json(_name(args), {"args": vars(args), "summary": clean}, group)


def _report(args, summary: dict) -> None:
    title = (
        f"punica-x serve, {args.model} on {args.device}: {args.requests} requests, "
        f"{args.clients} clients, {args.max_tokens} tokens each, {args.adapters} rank-"
        f"{args.rank} adapters"
    )
    print_table([summary], COLUMNS, title)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 4))
    ax.bar(["backbone", "distinct"], [summary["backbone_tok_s"], summary["distinct_tok_s"]])
    ax.set_ylabel("generated tokens / s")
    ax.set_title(f"punica-x serve, {args.model} ({args.device})", fontsize=9)
    group = "cuda" if args.device == "cuda" else None
    path = save_plot(_name(args), fig, group)
    _log(f"wrote {path.with_suffix('.json')} and {path}")


if __name__ == "__main__":
    main()
