"""`punica-x` command line: `serve` runs the HTTP server; `admin tenant ...` talks to it;
`prepare` builds the kernels and converts the default model ahead of the first start.

    punica-x prepare [--isa native|avx2|avx512|avx512_bf16] [--all-isas] [--no-model]
    punica-x serve [--model PATH] [--dtype auto|float32|bfloat16|float16] [--host 127.0.0.1]
                   [--port 8000] [--data-dir DIR]
    punica-x admin tenant create NAME [--max-concurrent N] [--tokens-per-minute N] [--weight W]
    punica-x admin tenant weight NAME W
    punica-x admin tenant list
    punica-x admin tenant revoke NAME
    punica-x admin status
    punica-x admin scale up [--count K]
    punica-x admin scale down [--runner ID | --count K]

The admin commands read the admin token from the data dir (or $PUNICA_X_ADMIN_TOKEN) and
call the running server at --url.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

DEFAULT_DATA_DIR = os.environ.get("PUNICA_X_DATA", "data")


def serve(args) -> int:
    import uvicorn

    from frontend.app import create_app
    from frontend.config import ServerConfig
    from frontend.store import StoreError

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    engine = engine_config(args)
    limits = parse_limits(args.limit or [])
    if limits is None:
        return 2
    if args.runner_backend is None:
        args.runner_backend = "ray" if args.ray_address else "thread"
    if args.ray_address and args.runner_backend != "ray":
        print("punica-x: --ray-address needs --runner-backend ray", file=sys.stderr)
        return 2
    try:
        config = ServerConfig(
            host=args.host,
            port=args.port,
            data_dir=Path(args.data_dir),
            engine=engine,
            limits=limits,
            runners=args.runners,
            runner_backend=args.runner_backend,
            ray_address=args.ray_address,
            autoscale=args.autoscale,
            distkv=not args.no_distkv,
            fair_share=not args.no_fair_share,
            restart_runners=not args.no_runner_restart,
        )
    except ValueError as exc:
        print(f"punica-x: {exc}", file=sys.stderr)
        return 2
    try:
        app = create_app(config)
    except StoreError as exc:
        print(f"punica-x: cannot start: {exc}", file=sys.stderr)
        return 1
    _greet(app.state.server, args)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        access_log=False,
        log_level="warning",
        ws_max_size=config.limits.max_ws_frame_bytes,
    )
    return 0


def _greet(state, args) -> None:
    url = f"http://{args.host}:{args.port}/"
    print(f"punica-x: web chat at {url}", flush=True)
    note = "created" if state.admin_token_created else "stored"
    print(f"punica-x: admin token {note} in {state.admin_token_path} (mode 0600)", flush=True)
    print(
        f"punica-x: create a tenant with: punica-x admin tenant create NAME --url {url} "
        f"--data-dir {args.data_dir}",
        flush=True,
    )


def parse_limits(items: list[str]):
    """Limits with `--limit NAME=N` overrides, or None (the reason printed) if one is bad."""
    from frontend.config import Limits

    limits = Limits()
    for item in items:
        name, _, value = item.partition("=")
        if name not in Limits.__dataclass_fields__ or not value.isdigit():
            fields = sorted(Limits.__dataclass_fields__)
            print(f"--limit wants NAME=INTEGER, NAME one of {fields}", file=sys.stderr)
            return None
        limits = replace(limits, **{name: int(value)})
    return limits


def engine_config(args):
    """The runners' EngineConfig from `serve`'s arguments (a Ray runner gets it whole)."""
    from punica_x.config import EngineConfig, ModelConfig

    engine = EngineConfig(model=ModelConfig(model=args.model, dtype=args.dtype))
    if args.max_batch_size is not None:
        engine = replace(engine, batch=replace(engine.batch, max_batch_size=args.max_batch_size))
    engine = replace(engine, batch=replace(engine.batch, policy=args.policy))
    if args.kv_cache_bytes is not None:
        engine = replace(engine, cache=replace(engine.cache, kv_cache_bytes=args.kv_cache_bytes))
    return engine


def admin(args) -> int:
    from frontend.auth import read_admin_token

    token = read_admin_token(Path(args.data_dir))
    if not token:
        print(
            f"no admin token: set PUNICA_X_ADMIN_TOKEN or point --data-dir at the server's data "
            f"dir ({args.data_dir})",
            file=sys.stderr,
        )
        return 2
    base = args.url.rstrip("/")
    if args.object == "status":
        return _status(base, token)
    if args.object == "scale":
        return _scale(args, base, token)
    if args.action == "create":
        body = {
            "name": args.name,
            "max_concurrent": args.max_concurrent,
            "tokens_per_minute": args.tokens_per_minute,
            "weight": args.weight,
        }
        status, data = _call("POST", f"{base}/admin/tenants", token, body)
        if status == 201:
            print(data["api_key"])
            print(
                f"tenant {data['name']} created; the key above is shown only once", file=sys.stderr
            )
            return 0
    elif args.action == "list":
        status, data = _call("GET", f"{base}/admin/tenants", token)
        if status == 200:
            for t in data["data"]:
                state = "revoked" if t["revoked"] else "active"
                print(f"{t['name']}\t{state}\tweight {t['weight']:g}")
            return 0
    elif args.action == "weight":
        url = f"{base}/admin/tenants/{args.name}"
        status, data = _call("PATCH", url, token, {"weight": args.weight})
        if status == 200:
            print(f"tenant {args.name}: weight {data['weight']:g}")
            return 0
    else:
        status, data = _call("DELETE", f"{base}/admin/tenants/{args.name}", token)
        if status == 200:
            print(f"tenant {args.name} revoked")
            return 0
    print(f"error {status}: {json.dumps(data)}", file=sys.stderr)
    return 1


def _status(base: str, token: str) -> int:
    status, data = _call("GET", f"{base}/admin/runners", token)
    if status != 200:
        print(f"error {status}: {json.dumps(data)}", file=sys.stderr)
        return 1
    print(_runner_table(data))
    return 0


def _runner_table(data: dict) -> str:
    head = (
        "ID",
        "BACKEND",
        "NODE",
        "STATE",
        "RUNNING",
        "WAITING",
        "KV USED/FREE",
        "LENT/BORROWED",
        "ADAPTERS",
    )
    rows = [head]
    for r in data["runners"]:
        rows.append(
            (
                r["id"],
                r["backend"],
                str(r["node"] or "-"),
                r["state"],
                str(r["running"]),
                str(r["waiting"]),
                f"{r['kv_blocks_used']}/{r['kv_blocks_free']}",
                f"{r.get('kv_blocks_lent', 0)}/{r.get('kv_blocks_borrowed', 0)}",
                str(r["resident_adapters"]),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    advice = data["advice"]
    detail = f" ({data['advice_reason']})" if data.get("advice_reason") else ""
    lines.append(f"queued at the scheduler: {data['queued']}; advice: {advice}{detail}")
    return "\n".join(lines)


def _scale(args, base: str, token: str) -> int:
    """Both directions wait for the change to finish (the server answers when it is done)."""
    if args.direction == "up":
        status, data = _call(
            "POST", f"{base}/admin/runners", token, {"count": args.count}, timeout=900
        )
        done, verb = status == 201, "added"
    elif args.runner is not None:
        status, data = _call("DELETE", f"{base}/admin/runners/{args.runner}", token, timeout=900)
        done, verb = status == 200, "drained"
    else:
        url = f"{base}/admin/runners?count={args.count}"
        status, data = _call("DELETE", url, token, timeout=900)
        done, verb = status == 200, "drained"
    if not done:
        message = data.get("error", {})
        message = message.get("message", message) if isinstance(message, dict) else message
        print(f"punica-x: scale {args.direction} failed ({status}): {message}", file=sys.stderr)
        return 1
    print(f"{verb}: {', '.join(data[verb])}")
    print(_runner_table(data))
    return 0


def _call(
    method: str, url: str, token: str, body: dict | None = None, timeout: float = 30
) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        url,
        data=data,
        method=method,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")
    except urllib.error.URLError as err:
        return 0, {"error": f"cannot reach {url}: {err.reason}"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["prepare"]:
        from punica_x.prepare import main as prepare

        return prepare(argv[1:])
    args = build_parser().parse_args(argv)
    return serve(args) if args.command == "serve" else admin(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="punica-x", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("prepare", help="build the kernels and convert the model (punica-x prepare -h)")
    _serve_parser(sub)
    _admin_parser(sub)
    return parser


def _serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="run the HTTP server (REST, OpenAI API, web chat)")
    s.add_argument(
        "--model", default=None, help="HF directory or .gguf (default: SmolLM2-135M-Instruct)"
    )
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    s.add_argument("--max-batch-size", type=int, default=None, help="requests per batch (32)")
    s.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="the serving dtype (model weights, KV cache, adapters). auto (default): bfloat16 "
        "on CPUs with AVX512-BF16 or AMX-BF16, float32 on other CPUs, bfloat16 (else float16) "
        "on CUDA",
    )
    s.add_argument(
        "--kv-cache-bytes",
        type=int,
        default=None,
        help="each runner's paged KV cache in bytes (default 2 GiB; vLLM CPU's "
        "VLLM_CPU_KVCACHE_SPACE, its GPU memory share on a GPU)",
    )
    s.add_argument(
        "--policy",
        default="fcfs",
        choices=["fcfs", "mlfq"],
        help="who each runner serves first: fcfs (arrival order, default) or mlfq (skip-join "
        "MLFQ: short requests stop waiting behind long ones; preempted KV swapped to host)",
    )
    s.add_argument(
        "--limit",
        action="append",
        metavar="NAME=N",
        help="override a limit of frontend.config.Limits, e.g. max_queue=64 (repeatable)",
    )
    _cluster_args(s)


def _cluster_args(s) -> None:
    """serve's options about the runners: how many, which backend, what they share."""
    s.add_argument(
        "--runners", type=int, default=1, help="runners to start (admin scale changes it; 1)"
    )
    s.add_argument(
        "--runner-backend",
        default=None,
        choices=["thread", "ray"],
        help="thread (default): runners inside the server process, sharing the model weights; "
        "ray: each runner a Ray actor in its own process (default with --ray-address)",
    )
    s.add_argument(
        "--autoscale",
        default=None,
        metavar="MIN:MAX",
        help="start and drain runners on the scaling advice, keeping MIN..MAX (dead ones replaced)",
    )
    s.add_argument(
        "--no-distkv",
        action="store_true",
        help="no DistKV: a prompt longer than one runner's KV cache is refused (by default "
        "thread runners lend each other KV blocks for it)",
    )
    s.add_argument(
        "--no-fair-share",
        action="store_true",
        help="serve waiting requests first come, first served (by default tenants share the "
        "runners by weighted service: scheduler/fairness.py)",
    )
    s.add_argument(
        "--no-runner-restart",
        action="store_true",
        help="leave a dead runner dead (by default it is replaced, with backoff)",
    )
    s.add_argument(
        "--ray-address",
        default=None,
        help="join this Ray cluster (e.g. auto, or HOST:6379) instead of starting a local Ray",
    )


def _admin_parser(sub) -> None:
    a = sub.add_parser("admin", help="administer a running server")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default="http://127.0.0.1:8000", help="the running server")
    common.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help="where the admin token is")
    what = a.add_subparsers(dest="object", required=True)
    t = what.add_parser("tenant", help="tenants and their API keys")
    actions = t.add_subparsers(dest="action", required=True)
    create = actions.add_parser(
        "create", parents=[common], help="create a tenant, print its API key"
    )
    create.add_argument("name")
    create.add_argument("--max-concurrent", type=int, default=None)
    create.add_argument("--tokens-per-minute", type=int, default=None)
    create.add_argument(
        "--weight", type=float, default=1.0, help="its share of the runners while tenants wait"
    )
    weight = actions.add_parser(
        "weight", parents=[common], help="set a tenant's fair-share weight (default 1)"
    )
    weight.add_argument("name")
    weight.add_argument("weight", type=float)
    actions.add_parser("list", parents=[common], help="list tenants")
    revoke = actions.add_parser("revoke", parents=[common], help="revoke a tenant's keys")
    revoke.add_argument("name")
    what.add_parser("status", parents=[common], help="runners, their load and the advice")
    scale = what.add_parser("scale", help="add or drain runners (waits until done)")
    direction = scale.add_subparsers(dest="direction", required=True)
    up = direction.add_parser("up", parents=[common], help="start runners")
    up.add_argument("--count", type=int, default=1)
    down = direction.add_parser(
        "down", parents=[common], help="drain runners (their requests move) and stop them"
    )
    pick = down.add_mutually_exclusive_group()
    pick.add_argument("--runner", default=None, help="the runner to drain (id)")
    pick.add_argument("--count", type=int, default=1, help="drain the N least loaded")


if __name__ == "__main__":
    sys.exit(main())
