"""Does a fault ever lose a request, truncate it without an error, or change its tokens?

A fault campaign against `punica-x serve --runner-backend ray --runners 2 --batch-invariant
on` (greedy tokens do not depend on what else runs, so every request has one right answer: its
fault-free text), in two phases of --minutes each (11: each fault kind 3 times or more), a fresh
server each:

- lamina: every runner a Lamina model worker with 3 attention workers, MLFQ scheduling (KV
  swapped to the host); faults: model_worker, attention_worker, sigstop, disk_full,
  slow_client;
- distkv: plain runners (fcfs: DistKV does not run beside MLFQ's swapping) with a tight KV
  cache (--kv-cache-bytes) and a few long prompts, so that runners lend each other blocks;
  faults: runner, distkv_lender, sigstop, disk_full, slow_client.

Each phase first answers every request of its pool once with no fault (the references), then
--streams clients (3 tenants with 2 adapters each and the base model, prompts sharing each
tenant's system prompt: prefix hits; 3 of 4 streamed) send requests from the pool in a
closed loop while a fault is injected every 20-40 s (--gap; common/fault_kinds.py: the kind
least injected so far, ties drawn). Every request ends as ok, failed (a visible error),
refused (admission), or lost / broken / truncated / wrong (common/fault_clients.py). Per
fault: what it hit and its recovery time (until a new request is answered 200). The seed is
printed: a run replays its draws.

    python benchmarks/bench_faults.py [--minutes 11] [--streams 64] [--seed 0]
                                      [--phases lamina,distkv] [--max-tokens 32] [--gap 20,40]
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import shutil
import statistics
import subprocess
import time
from pathlib import Path

import httpx
from common.args import add_seed, parser
from common.fault_clients import BAD, Spec, complete, judge
from common.fault_kinds import KINDS, Campaign
from common.report import describe_machine, print_table, pyplot, save_plot, write_json
from common.scratch import scratch_dir
from common.server import free_port, start_server

PHASES = {
    "lamina": (("--attention-workers", "3", "--policy", "mlfq"),
               ("model_worker", "attention_worker", "sigstop", "disk_full", "slow_client")),
    "distkv": (("--kv-cache-bytes", str(128 << 20)),
               ("runner", "distkv_lender", "sigstop", "disk_full", "slow_client")),
}  # fmt: skip
COMMON = ("--runner-backend", "ray", "--runners", "2", "--batch-invariant", "on",
          "--limit", "max_queue=1024")  # fmt: skip
TENANTS = 3
SYSTEM = "You are assistant {t} of a shop that sells {topic}. Answer in one short paragraph. "
TOPICS = ("bicycles", "teapots", "garden tools")


def pool(models: list[list[str]], max_tokens: int, long_prompts: bool) -> list[Spec]:
    """Per tenant: 8 questions x its models, the tenant's system prompt first (prefix hits);
    with long_prompts, 3 more of tenant 0 of ~6,500 tokens, more KV than a runner holds
    (--kv-cache-bytes: ~5,700 tokens), sent by one client, one at a time."""
    specs = []
    for t in range(TENANTS):
        system = SYSTEM.format(t=t, topic=TOPICS[t])
        for q in range(8):
            for m, model in enumerate(models[t]):
                prompt = system + f"Question {q}: what should I know about item {q + m}?"
                specs.append(Spec(t, model, prompt, max_tokens, (q + m) % 4 != 3))
    if long_prompts:
        system = SYSTEM.format(t=0, topic=TOPICS[0])
        for q in range(3):
            text = system + " ".join(f"note {i} on item {q}." for i in range(650))
            specs.append(Spec(0, models[0][q % 2], text, max_tokens, True, long=True))
    return specs


def setup(url: str, data_dir: Path, adapters: list[Path]) -> tuple[str, list[str], list]:
    """The admin token, a key per tenant and each tenant's models (2 adapters, the base)."""
    admin = (data_dir / "admin_token").read_text().strip()
    keys, models = [], []
    with httpx.Client(base_url=url, timeout=120) as h:
        base = h.get("/v1/models", headers={"Authorization": f"Bearer {admin}"})
        for t in range(TENANTS):
            r = h.post("/admin/tenants", json={"name": f"tenant{t}", "max_concurrent": 1000},
                       headers={"Authorization": f"Bearer {admin}"})  # fmt: skip
            key = r.json()["api_key"]
            auth = {"Authorization": f"Bearer {key}"}
            names = []
            for a in range(2):
                path = adapters[(2 * t + a) % len(adapters)]
                files = {f: (f, (path / f).read_bytes())
                         for f in ("adapter_config.json", "adapter_model.safetensors")}  # fmt: skip
                h.post("/v1/adapters", data={"name": f"t{t}a{a}"}, files=files,
                       headers=auth).raise_for_status()  # fmt: skip
                names.append(f"t{t}a{a}")
            model_id = h.get("/v1/models", headers=auth).json()["data"][0]["id"]
            keys.append(key)
            models.append([*names, model_id])
    del base
    return admin, keys, models


async def references(url: str, keys: list[str], specs: list[Spec]) -> list[str]:
    """Every spec's text with no fault (64 at a time); a request that fails here stops the
    run (the server is broken before any fault)."""
    sem = asyncio.Semaphore(64)
    async with httpx.AsyncClient(base_url=url, timeout=600) as h:

        async def one(i, spec):
            async with sem:
                rec = await complete(h, keys[spec.tenant], spec, i)
            if rec.status != 200 or rec.error:
                raise RuntimeError(f"reference {i} failed: {rec.status} {rec.error}")
            return rec.text

        short = await asyncio.gather(*(one(i, s) for i, s in enumerate(specs) if not s.long))
        long = [await one(i, s) for i, s in enumerate(specs) if s.long]  # one at a time
        return short + long


async def recovery(c: Campaign, since: float) -> float:
    """Seconds from `since` until a new base-model request is answered 200."""
    spec = Spec(0, c.models[0][-1], "Are you there?", 4, False)
    async with httpx.AsyncClient(base_url=c.url, timeout=60) as h:
        while True:
            rec = await complete(h, c.keys[0], spec, -1)
            if rec.status == 200 and rec.error is None:
                return time.monotonic() - since
            await asyncio.sleep(0.5)


async def inject(c: Campaign, kinds: tuple[str, ...], counts: dict, faults: list, t0: float):
    """One fault: the kind least injected so far (ties drawn) that finds something to hit."""
    order = sorted(kinds, key=lambda k: (counts[k], c.rng.random()))
    for kind in order:
        at = time.monotonic()
        hit = await KINDS[kind](c)
        if hit is None:
            continue
        counts[kind] += 1
        took = await recovery(c, at)
        faults.append({"kind": kind, "at_s": round(at - t0, 1), "hit": hit,
                       "recovery_s": round(took, 2)})  # fmt: skip
        print(f"  {at - t0:6.1f} s {kind}: {hit}; serving again after {took:.1f} s", flush=True)
        return


async def campaign(c: Campaign, specs, refs, kinds, args) -> tuple[list, list]:
    records, faults, counts = [], [], dict.fromkeys(kinds, 0)
    t0 = time.monotonic()
    stop_at = t0 + 60 * args.minutes
    limits = httpx.Limits(max_connections=args.streams + 8)
    async with httpx.AsyncClient(base_url=c.url, timeout=None, limits=limits) as h:

        async def client(n: int):
            rng = random.Random(args.seed * 1000 + n)
            longs = [i for i, s in enumerate(specs) if s.long]
            mine = [i for i, s in enumerate(specs) if s.tenant == n % TENANTS and not s.long]
            mine = longs if longs and n == 0 else mine  # the one client of long prompts
            while time.monotonic() < stop_at:
                i = rng.choice(mine)
                rec = await complete(h, c.keys[specs[i].tenant], specs[i], i)
                rec.outcome = judge(rec, refs[i])
                if rec.outcome != "ok":
                    rec.reference = refs[i]
                rec.started, rec.ended = rec.started - t0, rec.ended - t0
                records.append(rec)
                if rec.outcome == "refused":
                    await asyncio.sleep(1.0)

        async def faulter():
            while True:
                await asyncio.sleep(c.rng.uniform(*args.gap))
                if time.monotonic() > stop_at - 15:
                    return
                await inject(c, kinds, counts, faults, t0)

        tasks = [asyncio.create_task(client(n)) for n in range(args.streams)]
        injector = asyncio.create_task(faulter())
        await asyncio.gather(*tasks)
        injector.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await injector
    return records, faults


@contextlib.contextmanager
def data_folder(root: Path):
    """The server's data folder on a tmpfs of its own (256 MiB), so disk_full can fill it;
    a plain folder (disk_full left out) where mounting is not allowed."""
    folder = root / "data"
    folder.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(folder)],
                             capture_output=True, check=False).returncode == 0  # fmt: skip
    try:
        yield folder, mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(folder)], check=False)


def run_phase(name: str, args, adapters: list[Path], root: Path) -> dict:
    extra, kinds = PHASES[name]
    with data_folder(root / name) as (data, tmpfs):
        port = free_port()
        server = start_server(data, port, (*COMMON, *extra))
        try:
            url = f"http://127.0.0.1:{port}"
            admin, keys, models = setup(url, data, adapters)
            specs = pool(models, args.max_tokens, long_prompts=name == "distkv")
            refs = asyncio.run(references(url, keys, specs))
            rng = random.Random(args.seed)
            c = Campaign(url, admin, keys, models, data, adapters[0], tmpfs, rng)
            records, faults = asyncio.run(campaign(c, specs, refs, kinds, args))
        finally:
            server.terminate()
            server.wait(60)
            if args.logs:
                Path(args.logs).mkdir(parents=True, exist_ok=True)
                shutil.copy(root / name / "server.log", Path(args.logs) / f"{name}.log")
    return {"phase": name, "tmpfs": tmpfs, "kinds": kinds, "pool": len(specs),
            "records": [compact(r) for r in records], "faults": faults}  # fmt: skip


def compact(rec) -> dict:
    """A request as the JSON keeps it: what the plot and the counts need, and for one that
    did not end ok, what its client saw."""
    out = {"spec": rec.spec, "started": round(rec.started, 2), "ended": round(rec.ended, 2),
           "outcome": rec.outcome}  # fmt: skip
    if rec.outcome != "ok":
        out.update(status=rec.status, error=rec.error, text=rec.text, reference=rec.reference)
        if rec.events:
            out["chunks"] = rec.events
    return out


def outcome_rows(phases: list[dict]) -> list[dict]:
    rows = []
    for p in phases:
        recs = p["records"]
        row = {"phase": p["phase"], "requests": len(recs)}
        for o in ("ok", "failed", "refused", *BAD):
            row[o] = sum(r["outcome"] == o for r in recs)
        rows.append(row)
    return rows


def fault_rows(phases: list[dict]) -> list[dict]:
    rows = []
    for p in phases:
        for kind in p["kinds"]:
            times = [f["recovery_s"] for f in p["faults"] if f["kind"] == kind]
            rows.append({"phase": p["phase"], "fault": kind, "injected": len(times),
                         "recovery_median_s": statistics.median(times) if times else None,
                         "recovery_max_s": max(times) if times else None})  # fmt: skip
    return rows


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--minutes", type=float, default=11.0, help="minutes of faults per phase")
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--phases", default="lamina,distkv")
    ap.add_argument("--logs", default=None, help="a folder to keep the servers' logs in")
    ap.add_argument("--gap", default="20,40", help="seconds between faults: min,max")
    add_seed(ap)
    args = ap.parse_args()
    names = args.phases.split(",")
    try:
        args.gap = tuple(float(g) for g in args.gap.split(","))
    except ValueError:
        args.gap = ()
    if len(args.gap) != 2 or not 0 < args.gap[0] <= args.gap[1] < 3600:
        ap.error("--gap: min,max seconds, 0 < min <= max")
    if args.minutes <= 0 or args.streams < 1 or args.max_tokens < 1:
        ap.error("--minutes, --streams and --max-tokens must be positive")
    if any(n not in PHASES for n in names):
        ap.error(f"--phases: choose from {', '.join(PHASES)}")
    print(describe_machine(), f"seed {args.seed}", flush=True)
    root = scratch_dir("bench-faults-")
    adapters = make_pool_adapters(root)
    phases = []
    for name in names:
        print(f"phase {name}: {args.minutes:g} min, {args.streams} streams", flush=True)
        phases.append(run_phase(name, args, adapters, root))
    outcomes, faults = outcome_rows(phases), fault_rows(phases)
    title = "requests by outcome (lost, broken, truncated, wrong: 0)"
    print_table(outcomes, list(outcomes[0]), title)
    print_table(faults, list(faults[0]), "faults injected and the time until serving again")
    summary = {o: sum(r[o] for r in outcomes) for o in BAD}
    write_json("bench_faults", {"args": vars(args), "summary": summary, "outcomes": outcomes,
                                "faults": faults, "phases": phases})  # fmt: skip
    plot(phases)
    print("lost / broken / truncated / wrong:", summary, flush=True)


def make_pool_adapters(root: Path) -> list[Path]:
    from common.workload import make_adapters

    from punica_x.config import ModelConfig
    from punica_x.models.loader import describe_model

    meta = describe_model(ModelConfig())  # the default model, without loading its weights
    return make_adapters(meta.model_dir, 6, 8, root / "adapters")


def plot(phases: list[dict]) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(len(phases), 1, figsize=(10, 2.6 * len(phases)), squeeze=False)
    colors = {"ok": "tab:green", "failed": "tab:orange", "refused": "tab:gray",
              "lost": "tab:red", "broken": "tab:purple", "truncated": "tab:red",
              "wrong": "black"}  # fmt: skip
    for ax, p in zip(axes[:, 0], phases):
        recs = p["records"]
        for outcome, color in colors.items():
            mine = [r for r in recs if r["outcome"] == outcome]
            ax.scatter([r["ended"] for r in mine], [r["ended"] - r["started"] for r in mine],
                       s=4, c=color, label=f"{outcome} ({len(mine)})")  # fmt: skip
        for f in p["faults"]:
            ax.axvline(f["at_s"], color="tab:blue", linewidth=0.8, alpha=0.6)
            ax.text(f["at_s"], ax.get_ylim()[1] * 0.95, f["kind"], rotation=90, fontsize=6,
                    va="top")  # fmt: skip
        ax.set_ylabel("latency s")
        ax.set_title(f"phase {p['phase']}: requests by end time; faults (blue)", fontsize=9)
        ax.legend(fontsize=6, loc="upper right", ncol=3)
    axes[-1, 0].set_xlabel("seconds into the campaign")
    fig.tight_layout()
    save_plot("bench_faults", fig)


if __name__ == "__main__":
    main()
