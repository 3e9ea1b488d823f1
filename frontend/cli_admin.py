"""`punica-x admin ...`: the admin commands, a client of the running server's /admin API.
They read the admin token from the data dir (or $PUNICA_X_ADMIN_TOKEN)."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

ADAPTER_PAGE = 1000  # adapters per request of `admin tenant adapters`


def admin(args) -> int:
    from frontend.tenancy.auth import read_admin_token

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
    return _tenant(args, base, token)


def _tenant(args, base: str, token: str) -> int:
    """`admin tenant create | list | weight | share | source | adapters | revoke`."""
    if args.action == "create":
        body = {
            "name": args.name,
            "max_concurrent": args.max_concurrent,
            "tokens_per_minute": args.tokens_per_minute,
            "weight": args.weight,
            "share_prefix_cache": args.share_prefix_cache,
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
                shares = "shares prefix cache" if t["share_prefix_cache"] else "own prefix cache"
                source = t.get("lora_source") or "server root"
                print(f"{t['name']}\t{state}\tweight {t['weight']:g}\t{shares}\t{source}")
            return 0
    elif args.action == "adapters":
        return _adapters(base, token, args.name)
    elif args.action == "weight":
        url = f"{base}/admin/tenants/{args.name}"
        status, data = _call("PATCH", url, token, {"weight": args.weight})
        if status == 200:
            print(f"tenant {args.name}: weight {data['weight']:g}")
            return 0
    elif args.action == "source":
        url = f"{base}/admin/tenants/{args.name}"
        status, data = _call("PATCH", url, token, {"lora_source": args.uri or ""})
        if status == 200:
            print(f"tenant {args.name}: adapters from {data['lora_source'] or 'the server root'}")
            return 0
    elif args.action == "share":
        url = f"{base}/admin/tenants/{args.name}"
        status, data = _call("PATCH", url, token, {"share_prefix_cache": args.state == "on"})
        if status == 200:
            print(f"tenant {args.name}: share_prefix_cache {data['share_prefix_cache']}")
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


def _worker_rows(r: dict) -> list[tuple[str, ...]]:
    """A model worker's attention workers, one row each under it: its pid in the backend
    column, its role with the KV heads it holds ("attention[0:1]"), and the runner's KV
    blocks (it holds a slice of each)."""
    kv = f"{r['kv_blocks_used']}/{r['kv_blocks_free']}"
    return [
        (
            f"  {r['id']}/attention-{w['index']}",
            f"pid={w['pid']}",
            str(w["node"] or "-"),
            r["state"],
            f"attention[{w['kv_heads'][0]}:{w['kv_heads'][1]}]",
            "-",
            "-",
            kv,
            "-",
            "-",
            "-",
            "-",
        )
        for w in r.get("attention_workers", ())
    ]


def _runner_table(data: dict) -> str:
    head = (
        "ID",
        "BACKEND",
        "NODE",
        "STATE",
        "ROLE",
        "RUNNING",
        "WAITING",
        "KV USED/FREE",
        "LENT/BORROWED",
        "PREFIX HITS",
        "ADAPTERS",
        "INVARIANT",
    )
    rows = [head]
    model = data.get("model") or {}
    title = f"model: {model.get('name')} (family {model.get('family')}, {model.get('dtype')})"
    if model.get("weight_format"):
        mb = (model.get("weight_bytes") or 0) / 1e6
        title += f"; weights {model['weight_format']}, {mb:.1f} MB"
    for r in data["runners"]:
        rows.append(
            (
                r["id"],
                r["backend"],
                str(r["node"] or "-"),
                r["state"],
                r.get("role", "runner"),
                str(r["running"]),
                str(r["waiting"]),
                f"{r['kv_blocks_used']}/{r['kv_blocks_free']}",
                f"{r.get('kv_blocks_lent', 0)}/{r.get('kv_blocks_borrowed', 0)}",
                _hit_rate(r.get("prefix_cache_hits", 0), r.get("prefix_cache_queries", 0)),
                str(r["resident_adapters"]),
                {True: "on", False: "off"}.get(r.get("batch_invariant"), "-"),
            )
        )
        rows += _worker_rows(r)
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = [title]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines += _invariance_lines(data["runners"])
    advice = data["advice"]
    detail = f" ({data['advice_reason']})" if data.get("advice_reason") else ""
    lines.append(f"queued at the scheduler: {data['queued']}; advice: {advice}{detail}")
    hits = sum(r.get("prefix_cache_hits", 0) for r in data["runners"])
    queries = sum(r.get("prefix_cache_queries", 0) for r in data["runners"])
    lines.append(
        f"prefix cache: {_hit_rate(hits, queries)} of {queries} prompt tokens looked up were cached"
    )
    return "\n".join(lines)


def _invariance_lines(runners: list[dict]) -> list[str]:
    """A line per batch-invariance decision among the runners: which runners, and why."""
    by_reason: dict[str, list[str]] = {}
    for r in runners:
        if r.get("batch_invariant_reason"):
            by_reason.setdefault(r["batch_invariant_reason"], []).append(r["id"])
    return [f"batch invariance of {', '.join(ids)}: {why}" for why, ids in by_reason.items()]


def _hit_rate(hits: int, queries: int) -> str:
    """Prefix cache hits as a share of the tokens looked up ("-" before any lookup)."""
    return f"{100 * hits / queries:.1f}%" if queries else "-"


def _adapters(base: str, token: str, tenant: str) -> int:
    """`admin tenant adapters NAME`: every adapter of the tenant, one line each, read a page
    of ADAPTER_PAGE at a time (a tenant may hold 10,000)."""
    after, lines = "", 0
    while True:
        query = f"limit={ADAPTER_PAGE}" + (f"&after={after}" if after else "")
        status, data = _call("GET", f"{base}/admin/tenants/{tenant}/adapters?{query}", token)
        if status != 200:
            print(f"error {status}: {json.dumps(data)}", file=sys.stderr)
            return 1
        for a in data["data"]:
            pinned = "pinned" if a["pinned"] else "-"
            print(f"{a['name']}\tv{a['version']}\trank {a['rank']}\t{a['size_bytes']} B\t"
                  f"{pinned}\t{a['source'] or 'upload'}")  # fmt: skip
            lines += 1
        if not data["has_more"]:
            print(f"{lines} adapters", file=sys.stderr)
            return 0
        after = data["last_id"]


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


def admin_parser(sub, default_data_dir: str) -> None:
    a = sub.add_parser("admin", help="administer a running server")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default="http://127.0.0.1:8000", help="the running server")
    common.add_argument("--data-dir", default=default_data_dir, help="where the admin token is")
    what = a.add_subparsers(dest="object", required=True)
    _tenant_parser(what, common)
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


def _tenant_parser(what, common) -> None:
    """`admin tenant ...`'s actions."""
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
    create.add_argument(
        "--share-prefix-cache",
        action="store_true",
        help="its base-model requests share prefix-cached KV with other tenants that allow it",
    )
    share = actions.add_parser(
        "share",
        parents=[common],
        help="let a tenant's base-model requests share prefix-cached KV with other tenants "
        "that allow it (on), or keep them to its own (off, the default)",
    )
    share.add_argument("name")
    share.add_argument("state", choices=["on", "off"])
    source = actions.add_parser(
        "source",
        parents=[common],
        help="load a tenant's adapters by path from an object-store URI of its own "
        "(s3://BUCKET/PREFIX); without one, from the server's --lora-source-root again",
    )
    source.add_argument("name")
    source.add_argument("uri", nargs="?", default=None)
    actions.add_parser("list", parents=[common], help="list tenants")
    listing = actions.add_parser(
        "adapters", parents=[common], help="list a tenant's adapters (version, rank, source)"
    )
    listing.add_argument("name")
    revoke = actions.add_parser("revoke", parents=[common], help="revoke a tenant's keys")
    revoke.add_argument("name")
