"""Does a large Python heap in the process slow punica-x's steps? (issue 29, the collector)

Each configuration runs in a fresh process of its own: a heap is built first, then punica-x
starts (LLM(), --adapters rank-16 adapters on all 7 projections loaded) and generates
--max-tokens tokens for --requests prompts, greedy, on the Distinct and Identical workloads
(median tok/s of --rounds runs), counting the collector's passes and their time. Heaps:

- none: a fresh process;
- objects: --heap-objects small Python objects (dicts holding lists) kept alive;
- hf_peft: HF transformers' model with the same adapters loaded through PEFT, run once
  (issue 29 measured 3.7x slower Distinct after this on an AMX Xeon).

each with the start-up freeze (punica_x/heap.py, the default) and without it
(PUNICA_X_GC_FREEZE=0). Target: Distinct with a heap within 5% of the fresh process.

    python benchmarks/bench_heap.py [--heap-objects 1000000] [--requests 32] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from common.args import (
    add_adapters,
    add_dtype,
    add_max_tokens,
    add_requests,
    add_rounds,
    add_threads,
    parser,
)

HEAPS = ("none", "objects", "hf_peft")
WORKLOADS = ("distinct", "identical")


def child(args) -> dict:
    """One configuration, in this process: build the heap, start punica-x, measure."""
    import gc
    import statistics

    import torch
    from common.engine_timing import run_ours, warm_up
    from common.hf_baselines import HFBaselines
    from common.scratch import scratch_dir
    from common.workload import load_adapters, make_adapters, make_prompts, workload_names
    from transformers import AutoTokenizer

    from punica_x import LLM, SamplingParams
    from punica_x.models.loader import resolve_model_dir

    torch.set_num_threads(args.threads)
    n = args.requests
    model_dir = resolve_model_dir(None)
    paths = make_adapters(model_dir, args.adapters, 16, scratch_dir("heap-"))
    prompts = make_prompts(AutoTokenizer.from_pretrained(model_dir), n)
    names = workload_names(n, WORKLOADS)
    kept = None
    if args.heap == "objects":
        kept = [{"i": i, "v": [i]} for i in range(args.heap_objects // 3)]  # 3 tracked each
    elif args.heap == "hf_peft":
        kept = HFBaselines(model_dir, paths)
        kept.mixed(prompts, names["distinct"], 4)
    passes, spent, started = [0, 0, 0], [0.0], [0.0]

    def on_gc(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            passes[info["generation"]] += 1
            spent[0] += time.perf_counter() - started[0]

    llm = LLM(dtype=args.dtype, quantization="none")  # the float weights HF's baseline runs
    load_adapters(llm, paths)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    warm_up(llm, prompts)
    gc.callbacks.append(on_gc)
    result = {"tracked": len(gc.get_objects()), "frozen": gc.get_freeze_count()}
    for w in WORKLOADS:
        passes[:], spent[0] = [0, 0, 0], 0.0
        tps = [run_ours(llm, prompts, names[w], sp) for _ in range(args.rounds)]
        result[w] = {"tok_s": statistics.median(tps), "gc_passes": list(passes), "gc_s": spent[0]}
    del kept
    return result


def run_config(args, heap: str, freeze: bool) -> dict:
    env = {**os.environ, "PUNICA_X_GC_FREEZE": "1" if freeze else "0"}
    cmd = [sys.executable, __file__, "--child", heap, *child_flags(args)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{heap} freeze={freeze} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def child_flags(args) -> list[str]:
    return [
        f"--heap-objects={args.heap_objects}",
        f"--requests={args.requests}",
        f"--max-tokens={args.max_tokens}",
        f"--adapters={args.adapters}",
        f"--rounds={args.rounds}",
        f"--threads={args.threads}",
        f"--dtype={args.dtype}",
    ]


def parse() -> argparse.Namespace:
    ap = parser(__doc__)
    ap.add_argument("--heap-objects", type=int, default=1_000_000)
    add_requests(ap)
    add_max_tokens(ap, 32)
    add_adapters(ap, 32)
    add_rounds(ap)
    add_threads(ap)
    add_dtype(ap)
    ap.add_argument("--heaps", default=",".join(HEAPS))
    ap.add_argument("--child", choices=HEAPS, help=argparse.SUPPRESS)
    return ap.parse_args()


def main() -> None:
    args = parse()
    if args.child:
        args.heap = args.child
        print(json.dumps(child(args)))
        return
    from common.report import describe_machine, print_table, write_json

    print(describe_machine(), flush=True)
    rows = []
    for heap in args.heaps.split(","):
        for freeze in (False, True):
            r = run_config(args, heap, freeze)
            row = {"heap": heap, "freeze": freeze, "tracked": r["tracked"], "frozen": r["frozen"]}
            for w in WORKLOADS:
                row[f"{w}_tok_s"] = r[w]["tok_s"]
                row[f"{w}_gc_passes"] = "/".join(map(str, r[w]["gc_passes"]))
                row[f"{w}_gc_ms"] = r[w]["gc_s"] * 1e3
            rows.append(row)
            print(f"  {heap} freeze={freeze}: {row}", flush=True)
    fresh = {r["freeze"]: r["distinct_tok_s"] for r in rows if r["heap"] == "none"}
    for row in rows:  # Distinct with the heap over Distinct in a fresh process (same freeze)
        row["distinct_vs_fresh"] = row["distinct_tok_s"] / fresh.get(row["freeze"], float("nan"))
    columns = list(rows[0])
    print_table(rows, columns, "tok/s with a heap in the process (gc passes: gen0/gen1/gen2)")
    path = write_json("bench_heap", {"args": vars(args), "rows": rows})
    plot(rows)
    print(f"wrote {path}")


def plot(rows: list[dict]) -> None:
    from common.report import pyplot, save_plot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    labels = [f"{r['heap']}\n{'freeze' if r['freeze'] else 'no freeze'}" for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["distinct_tok_s"] for r in rows], 0.4, label="Distinct")
    ax.bar([x + 0.2 for x in xs], [r["identical_tok_s"] for r in rows], 0.4, label="Identical")
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("tok/s")
    ax.set_title("punica-x with a large Python heap in its process")
    ax.legend()
    save_plot("bench_heap", fig)


if __name__ == "__main__":
    main()
