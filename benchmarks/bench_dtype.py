"""What does serving in bfloat16 give over float32 on this CPU? (issue 14)

Engines in one process, float32 and bfloat16, same SmolLM2 model, same 32 prompts and
rank-16 adapters on all 7 projections (bench_generate's workload). Decode step times (all
requests decoding) are measured interleaved over --rounds rounds (the machine's speed drifts;
the median over rounds of each round's median), then end-to-end tok/s of 32 x --max-tokens
greedy tokens. bf16 halves the bytes of weights, KV and adapters; on a CPU without
AVX512-BF16 the kernels compute in float32 after widening, so what it gives there is the
memory traffic it saves minus the widening it costs. A third engine serves float32 with the
adapters alone in bfloat16 (--lora-dtype bfloat16, fp32_lora16): what halving the adapters'
bytes gives where the model stays float32 (issue 47).

    python benchmarks/bench_dtype.py [--rounds 3] [--max-tokens 64]
"""

from __future__ import annotations

import statistics

import torch
from common.args import add_engine_workload, parser
from common.engine_timing import decode_step_time, run_ours, warm_up
from common.report import describe_machine, machine, print_table, pyplot, save_plot, write_json
from common.scratch import scratch_dir
from common.workload import load_adapters, make_adapters, make_prompts, workload_names

from punica_x import LLM, SamplingParams
from punica_x.config import ModelConfig, dtype_name

# engine label -> LLM options: float32, float32 with adapters stored in bfloat16
# (--lora-dtype bfloat16: half the adapter bytes, activations float32), bfloat16
VARIANTS = {
    "fp32": {"dtype": "float32"},
    "fp32_lora16": {"dtype": "float32", "lora_dtype": "bfloat16"},
    "bf16": {"dtype": "bfloat16"},
}


def main() -> None:
    ap = parser(__doc__)
    add_engine_workload(ap)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(describe_machine(), flush=True)
    n = args.requests
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    llms = {v: LLM(quantization="none", **o) for v, o in VARIANTS.items()}  # the float weights
    auto = dtype_name(ModelConfig().torch_dtype())
    first = llms["fp32"]
    prompts = make_prompts(first.tokenizer, n)
    tmp = scratch_dir("bench-dtype-")
    paths = make_adapters(first.engine.loaded.model_dir, n, args.rank, tmp)
    for llm in llms.values():
        load_adapters(llm, paths)
    configs = {"backbone": [None] * n, **workload_names(n)}
    for llm in llms.values():
        warm_up(llm, prompts)
    step = step_times(args, llms, prompts, configs, sp)
    tps = {(v, c): run_ours(llms[v], prompts, a, sp) for c, a in configs.items() for v in VARIANTS}
    rows = [row(c, tps, step) for c in configs]
    print(
        f"SmolLM2-135M, {n} requests x {args.max_tokens} tokens, rank {args.rank} on all 7 "
        f"projections, {args.threads} threads; dtype=auto here serves {auto}; fp32_lora16: "
        f"float32 with the adapters in bfloat16 (--lora-dtype bfloat16)"
    )
    print_table(rows, list(rows[0]), "over float32 (x > 1: faster than float32)")
    path = write_json("bench_dtype", {"args": vars(args), "auto_dtype": auto, "rows": rows})
    plot(rows)
    print(f"wrote {path} and {path.with_suffix('.png')}")


def row(config: str, tps: dict, step: dict) -> dict:
    """One workload's tok/s and decode step ms per variant, and each over float32's."""
    out: dict = {"workload": config}
    for v in VARIANTS:
        out[f"{v}_tok_s"] = tps[(v, config)]
    for v in VARIANTS:
        out[f"{v}_step_ms"] = step[(v, config)]
    for v in list(VARIANTS)[1:]:
        out[f"x_tok_s_{v}"] = tps[(v, config)] / tps[("fp32", config)]
        out[f"x_step_{v}"] = step[("fp32", config)] / step[(v, config)]
    return out


def step_times(args, llms: dict, prompts, configs: dict, sp) -> dict:
    """Median decode step ms per (variant, config), interleaved over --rounds rounds."""
    per_round = {(v, c): [] for v in VARIANTS for c in configs}
    for _ in range(args.rounds):
        for c, adapters in configs.items():
            for v, llm in llms.items():
                per_round[(v, c)].append(
                    decode_step_time(llm, prompts, adapters, sp, args.decode_steps)
                )
    return {k: statistics.median(v) * 1e3 for k, v in per_round.items()}


def plot(rows) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [r["workload"] for r in rows]
    width = 0.8 / len(VARIANTS)
    for i, v in enumerate(VARIANTS):
        ax.bar(
            [x + (i - (len(VARIANTS) - 1) / 2) * width for x in range(len(rows))],
            [r[f"{v}_tok_s"] for r in rows],
            width,
            label=v,
        )
    ax.set_xticks(range(len(rows)), labels)
    ax.set_ylabel("generated tokens / s")
    m = machine()
    ax.set_title(f"punica-x, float32 vs bfloat16 ({m['cpu']}, {m['isa']})")
    ax.legend()
    save_plot("bench_dtype", fig)


if __name__ == "__main__":
    main()
