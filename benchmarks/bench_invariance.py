"""What does the batch-invariant mode cost (ModelConfig.batch_invariant: ops/invariance.py),
per workload, in decode and in prefill, and what does `auto` decide on this CPU?

Two engines in one process, the mode on and off, same model, dtype and adapters
(bench_generate's: rank-16 LoRA on all 7 projections, one per request). Decode: the median
step once all --requests requests decode (common.engine_timing.decode_step_time), for
Distinct (every request its own adapter), Identical (one adapter) and Backbone (none): the
two engines' steps alternate (on, off, on, ... for --decode-steps pairs), so both see the same
machine. Prefill: the time to compute --prefill-tokens prompt tokens of one request on the
base model (one chunk: where flash attention takes it with the mode off), and the prefill of
the --requests prompts of Distinct together (their first token), on and off back to back.
Every workload is measured in each of --rounds rounds, which engine goes first alternating by
round; each cost is the ratio on / off within a round (median, min, max over rounds), so the
machine's drift (tens of percent over minutes on these VMs) cancels.
A third engine with batch_invariant=auto reports what auto chose and its measured cost.

Default: the default server's model and weights (SmolLM2-135M's own Q4_1 blocks,
--quantization auto) in bfloat16, where the mode matters (in float32 a last-bit difference
rarely flips a token); --quantization none serves the float weights.

    python benchmarks/bench_invariance.py [--dtype bfloat16] [--quantization auto]
                                          [--prefill-tokens 1024] [--rounds 5]
"""

from __future__ import annotations

import statistics

import torch
from common.args import add_dtype, add_engine_workload, parser
from common.engine_timing import warm_up
from common.invariance_pairs import (
    MODES,
    cost,
    invariance_rounds,
    paired_decode,
    paired_prefill,
)
from common.report import describe_machine, print_table, pyplot, save_plot, write_json
from common.scratch import scratch_dir
from common.workload import load_adapters, make_adapters, make_prompts, workload_names

from punica_x import LLM, SamplingParams
from punica_x.dtypes import dtype_name

DECODE = ("distinct", "identical", "backbone")
PREFILL = ("prefill_long", "prefill_batch")


def parse_args():
    ap = parser(__doc__)
    add_engine_workload(ap, rounds_help="interleaved rounds (on and off in each)")
    add_dtype(ap, help="the serving dtype of both engines")
    ap.add_argument("--quantization", default="auto", choices=["auto", "none"])
    ap.add_argument("--prefill-tokens", type=int, default=1024)
    ap.set_defaults(dtype="bfloat16", rounds=5, decode_steps=30)
    args = ap.parse_args()
    args.max_tokens = max(args.max_tokens, args.decode_steps + 4)  # all decode while timed
    return args


def serve(args, mode: str) -> LLM:
    return LLM(dtype=args.dtype, quantization=args.quantization, batch_invariant=mode)


def long_prompt(llm: LLM, tokens: int) -> list[int]:
    text = " ".join(["You are a careful assistant who answers briefly and precisely."] * 200)
    return llm.tokenizer(text).input_ids[:tokens]


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    print(describe_machine(), flush=True)
    n = args.requests
    auto = serve(args, "auto").engine.describe()
    engines = {mode: serve(args, mode) for mode in MODES}
    model_dir = engines["on"].engine.loaded.model_dir
    paths = make_adapters(model_dir, n, args.rank, scratch_dir("bench-invariance-"))
    for llm in engines.values():
        load_adapters(llm, paths)
    prompts = make_prompts(engines["on"].tokenizer, n)
    names = {**workload_names(n), "backbone": [None] * n}
    long = [long_prompt(engines["on"], args.prefill_tokens)]
    for llm in engines.values():
        warm_up(llm, prompts)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    work = {
        **{w: lambda order, w=w: paired_decode(
               engines, order, prompts, names[w], sp, args.decode_steps)
           for w in DECODE},
        "prefill_long": lambda order: paired_prefill(engines, order, long, [None]),
        "prefill_batch": lambda order: paired_prefill(engines, order, prompts, names["distinct"]),
    }  # fmt: skip
    per_round = invariance_rounds(work, args.rounds)
    rows = [row(w, per_round) for w in work]
    summary = {
        "dtype": dtype_name(engines["on"].engine.dtype),
        "weights": engines["on"].engine.describe().model.weight_format,
        "auto": auto.batch_invariant,
        "auto_reason": auto.batch_invariant_reason,
        "requests": n,
        "prefill_tokens": len(long[0]),
    }
    report(args, rows, summary, per_round)


def row(workload: str, per_round: dict) -> dict:
    on, off = per_round[(workload, "on")], per_round[(workload, "off")]
    ratio = cost(per_round, workload)
    return {
        "workload": workload,
        "off_ms": statistics.median(off) * 1e3,
        "on_ms": statistics.median(on) * 1e3,
        "on_over_off": ratio["median"],
        "min": ratio["min"],
        "max": ratio["max"],
    }


def report(args, rows, summary, per_round) -> None:
    title = (
        f"batch_invariant on vs off, {summary['dtype']} ({summary['weights']} weights), "
        f"{summary['requests']} requests, prefill {summary['prefill_tokens']} tokens; "
        f"auto here: {summary['auto_reason']}"
    )
    cols = ["workload", "off_ms", "on_ms", "on_over_off", "min", "max"]
    print_table(rows, cols, title)
    name = f"bench_invariance_{summary['dtype']}_q{args.quantization}"
    rounds = {f"{w}/{m}": [t * 1e3 for t in v] for (w, m), v in per_round.items()}
    path = write_json(
        name, {"args": vars(args), "summary": summary, "rows": rows, "rounds_ms": rounds}
    )
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar([r["workload"] for r in rows], [r["on_over_off"] for r in rows])
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.axhline(1.05, color="red", linewidth=0.8, linestyle="--")
    ax.set_ylabel("time on / off (median of paired rounds)")
    fig.suptitle(title[:150], fontsize=7)
    save_plot(name, fig)
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
