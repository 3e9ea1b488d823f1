"""Does `--batch-invariant auto` decide the same at every start, idle and beside a load?

Each start is a fresh Python process loading the default model (LLM(), batch_invariant auto)
with its own cache folder (the built kernels and the converted model shared, the timings and
decisions its own), and prints the decision, its measured cost and where the figure came from.

- kept: one cache: a first start, then --starts idle starts, then --starts starts beside
  --load-procs busy loops (a 2-core load on a 2-core machine). What a user's machine does.
- fresh idle / fresh loaded: --starts first starts, each with an empty cache, idle and beside
  the load, with PUNICA_X_QUIET_WAIT=0: the figure a start takes where it cannot wait for a
  quiet machine, i.e. what every start decided from before the decision was kept.

    python benchmarks/bench_invariance_decision.py [--starts 5] [--load-procs 2] [--dtype auto]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common.args import add_dtype, parser
from common.report import describe_machine, print_table, pyplot, save_plot, write_json
from common.scratch import scratch_dir

COLUMNS = ["scenario", "start", "load", "decision", "cost_pct", "figure", "seconds"]
BUSY = "while True: pass"


def child(args) -> None:
    from punica_x import LLM

    started = time.perf_counter()
    llm = LLM(dtype=args.dtype)
    inv = llm.engine.invariance
    print(json.dumps({"on": inv.on, "cost": inv.cost, "reason": inv.reason,
                      "seconds": time.perf_counter() - started}))  # fmt: skip


def cache_folder(root: Path, name: str) -> Path:
    """A cache folder whose kernels and converted models are the real cache's."""
    from punica_x.env import cache_dir

    folder = root / name
    folder.mkdir()
    for shared in ("torch_extensions", "models"):
        (folder / shared).symlink_to(cache_dir(shared))
    return folder


def start(args, cache: Path, wait: str | None) -> dict:
    env = {**os.environ, "PUNICA_X_CACHE": str(cache)}
    if wait is not None:
        env["PUNICA_X_QUIET_WAIT"] = wait
    cmd = [sys.executable, __file__, "--child", f"--dtype={args.dtype}"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"the start failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


class Load:
    """--load-procs busy loops while in the `with` block."""

    def __init__(self, procs: int) -> None:
        self.procs, self.running = procs, []

    def __enter__(self):
        self.running = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(self.procs)]
        time.sleep(1.0)
        return self

    def __exit__(self, *exc) -> None:
        for p in self.running:
            p.kill()
            p.wait()


def row(scenario: str, i: int, load: bool, result: dict) -> dict:
    reason = result["reason"]
    figure = "provisional" if "provisional" in reason else "quiet"
    if "kept for this CPU" in reason:
        figure = f"kept ({figure})"
    return {"scenario": scenario, "start": i, "load": "2-core" if load else "idle",
            "decision": "on" if result["on"] else "off",
            "cost_pct": None if result["cost"] is None else round(100 * result["cost"], 1),
            "figure": figure, "seconds": round(result["seconds"], 1)}  # fmt: skip


def kept(args, root: Path) -> list[dict]:
    cache = cache_folder(root, "kept")
    rows = [row("kept", 0, False, start(args, cache, None))]
    rows += [row("kept", i, False, start(args, cache, None)) for i in range(1, args.starts + 1)]
    with Load(args.load_procs):
        for i in range(args.starts + 1, 2 * args.starts + 1):
            rows.append(row("kept", i, True, start(args, cache, None)))
    return rows


def fresh(args, root: Path, loaded: bool) -> list[dict]:
    name = "fresh loaded" if loaded else "fresh idle"
    rows = []
    for i in range(args.starts):
        cache = cache_folder(root, f"{name.replace(' ', '-')}-{i}")
        if loaded:
            with Load(args.load_procs):
                rows.append(row(name, i, True, start(args, cache, "0")))
        else:
            rows.append(row(name, i, False, start(args, cache, "0")))
    return rows


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--starts", type=int, default=5, help="starts per scenario")
    ap.add_argument("--load-procs", type=int, default=os.cpu_count() or 2)
    add_dtype(ap)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.starts < 1 or args.load_procs < 1:
        ap.error("--starts and --load-procs must be at least 1")
    if args.child:
        child(args)
        return
    print(describe_machine(), flush=True)
    root = scratch_dir("bench-invariance-decision-")
    rows = kept(args, root) + fresh(args, root, False) + fresh(args, root, True)
    decisions = {s: sorted({r["decision"] for r in rows if r["scenario"] == s}) for s in
                 ("kept", "fresh idle", "fresh loaded")}  # fmt: skip
    title = f"--batch-invariant auto at {len(rows)} starts of the default model ({args.dtype})"
    print_table(rows, COLUMNS, title)
    print("decisions per scenario:", decisions)
    write_json("bench_invariance_decision", {"args": vars(args), "decisions": decisions,
                                             "rows": rows})  # fmt: skip
    plot(rows, title)


def plot(rows: list[dict], title: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.8))
    for scenario, marker in (("kept", "o"), ("fresh idle", "s"), ("fresh loaded", "^")):
        mine = [r for r in rows if r["scenario"] == scenario]
        ax.scatter([r["start"] for r in mine], [r["cost_pct"] for r in mine], marker=marker,
                   label=scenario, c=["tab:red" if r["load"] != "idle" else "tab:blue"
                                      for r in mine])  # fmt: skip
    ax.axhline(5.0, color="gray", linestyle="--", linewidth=0.8, label="on up to 5%")
    ax.set_xlabel("start (red: beside a 2-core load)")
    ax.set_ylabel("measured cost % (the figure used)")
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    save_plot("bench_invariance_decision", fig)


if __name__ == "__main__":
    main()
