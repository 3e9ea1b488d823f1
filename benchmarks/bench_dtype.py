"""What does serving in bfloat16 give over float32 on this CPU? (issue 14)

Two engines in one process, float32 and bfloat16, same SmolLM2 model, same 32 prompts and
rank-16 adapters on all 7 projections (bench_generate's workload). Decode step times (all
requests decoding) are measured interleaved over --rounds rounds (the machine's speed drifts;
the median over rounds of each round's median), then end-to-end tok/s of 32 x --max-tokens
greedy tokens. bf16 halves the bytes of weights, KV and adapters; on a CPU without
AVX512-BF16 the kernels compute in float32 after widening, so what it gives there is the
memory traffic it saves minus the widening it costs.

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

DTYPES = ("float32", "bfloat16")


def main() -> None:
    ap = parser(__doc__)
    add_engine_workload(ap)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(describe_machine(), flush=True)
    n = args.requests
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    llms = {d: LLM(dtype=d, quantization="none") for d in DTYPES}  # the float weights
    auto = dtype_name(ModelConfig().torch_dtype())
    first = llms["float32"]
    prompts = make_prompts(first.tokenizer, n)
    tmp = scratch_dir("bench-dtype-")
    paths = make_adapters(first.engine.loaded.model_dir, n, args.rank, tmp)
    for llm in llms.values():
        load_adapters(llm, paths)
    configs = {"backbone": [None] * n, **workload_names(n)}
    for llm in llms.values():
        warm_up(llm, prompts)
    step = step_times(args, llms, prompts, configs, sp)
    tps = {(d, c): run_ours(llms[d], prompts, a, sp) for c, a in configs.items() for d in DTYPES}
    rows = []
    for c in configs:
        rows.append(
            {
                "workload": c,
                "fp32_tok_s": tps[("float32", c)],
                "bf16_tok_s": tps[("bfloat16", c)],
                "x_tok_s": tps[("bfloat16", c)] / tps[("float32", c)],
                "fp32_step_ms": step[("float32", c)],
                "bf16_step_ms": step[("bfloat16", c)],
                "x_step": step[("float32", c)] / step[("bfloat16", c)],
            }
        )
    print(
        f"SmolLM2-135M, {n} requests x {args.max_tokens} tokens, rank {args.rank} on all 7 "
        f"projections, {args.threads} threads; dtype=auto here serves {auto}"
    )
    print_table(
        rows,
        [
            "workload",
            "fp32_tok_s",
            "bf16_tok_s",
            "x_tok_s",
            "fp32_step_ms",
            "bf16_step_ms",
            "x_step",
        ],
        "bfloat16 over float32 (x > 1: bf16 faster)",
    )
    path = write_json("bench_dtype", {"args": vars(args), "auto_dtype": auto, "rows": rows})
    plot(rows)
    print(f"wrote {path} and {path.with_suffix('.png')}")


def step_times(args, llms: dict, prompts, configs: dict, sp) -> dict:
    """Median decode step ms per (dtype, config), interleaved over --rounds rounds."""
    per_round = {(d, c): [] for d in DTYPES for c in configs}
    for _ in range(args.rounds):
        for c, adapters in configs.items():
            for d, llm in llms.items():
                per_round[(d, c)].append(
                    decode_step_time(llm, prompts, adapters, sp, args.decode_steps)
                )
    return {k: statistics.median(v) * 1e3 for k, v in per_round.items()}


def plot(rows) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = [r["workload"] for r in rows]
    for i, (key, label) in enumerate((("fp32_tok_s", "float32"), ("bf16_tok_s", "bfloat16"))):
        ax.bar(
            [x + (i - 0.5) * 0.4 for x in range(len(rows))],
            [r[key] for r in rows],
            0.4,
            label=label,
        )
    ax.set_xticks(range(len(rows)), labels)
    ax.set_ylabel("generated tokens / s")
    m = machine()
    ax.set_title(f"punica-x, float32 vs bfloat16 ({m['cpu']}, {m['isa']})")
    ax.legend()
    save_plot("bench_dtype", fig)


if __name__ == "__main__":
    main()
