"""Do AMX tiles make LoRA decode steps cheaper? (issue 29: Identical <= 1.1x the backbone on AMX)

One process, one engine: decode steps (every request decoding, the median of --decode-steps)
of the backbone and of the Identical / Uniform / Distinct workloads, each LoRA workload with
the SGMV vector kernels and with the AMX tiles path (csrc/sgmv/amx.h, switched per arm
through the kernel's sgmv_amx binding: what PUNICA_X_SGMV_AMX=1 turns on), the arms in a
shuffled order in each of --rounds rounds so that the machine's drift evens out. Reports
each arm over the backbone and tiles over vectors, paired by round (median and range), and
how many greedy tokens the two paths agree on (32 requests x --max-tokens; float32 rounding
may flip near ties, most on a random-weight model). Needs a CPU with AMX-BF16; --emulated
runs the tiles' scalar emulation instead (slow; a smoke test of the script, writes nothing).

    python benchmarks/bench_amx_tiles.py [--model smollm2-135m --tokenizer DIR] [--rounds 6]
"""

from __future__ import annotations

import random
import statistics
import sys

import torch
from common.args import (
    add_decode_steps,
    add_max_tokens,
    add_rounds,
    add_shape_model,
    add_threads,
    check_shape_model,
    parser,
)
from common.engine_timing import decode_step_time, paired_ratio, warm_up
from common.report import describe_machine, print_table, pyplot, save_plot, write_json
from common.scratch import scratch_dir
from common.shapes import SHAPES, model_path
from common.workload import load_adapters, make_adapters, make_prompts, workload_names

from punica_x import LLM, SamplingParams
from punica_x.ops.sgmv import cpu_backend

OFF, HARDWARE, EMULATED = 0, 1, 2
WORKLOADS = ("identical", "uniform", "distinct")


def parse_args():
    ap = parser(__doc__)
    add_threads(ap)
    add_rounds(ap, default=6)
    add_decode_steps(ap)
    add_max_tokens(ap, default=32)
    add_shape_model(ap)
    ap.add_argument("--min-rows", type=int, default=8, help="segments of this many rows take tiles")
    ap.add_argument("--emulated", action="store_true", help="scalar tiles (no AMX needed; slow)")
    args = ap.parse_args()
    for name in ("threads", "rounds", "decode_steps", "max_tokens", "min_rows"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    check_shape_model(ap, args)
    module = cpu_backend().module
    if not args.emulated and not module.amx_available():
        ap.error(
            "this CPU (or its OS, or this kernel build) has no AMX-BF16 tiles; "
            "--emulated runs them in scalar code"
        )
    return args, module


def greedy_agreement(llm, module, mode, prompts, names, max_tokens) -> dict:
    """Requests (of len(prompts)) whose greedy tokens are equal with vectors and with tiles."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    agree = {}
    for w in ("identical", "uniform"):
        tokens = {}
        for m in (OFF, mode):
            module.sgmv_amx(m, 0)
            tokens[m] = [o.token_ids for o in llm.generate(prompts, names[w], sp)]
        agree[w] = sum(a == b for a, b in zip(tokens[OFF], tokens[mode]))
    return agree


def step_rounds(llm, module, mode, prompts, names, args) -> dict[tuple[str, int], list[float]]:
    sp = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    arms = [("backbone", OFF)] + [(w, m) for w in WORKLOADS for m in (OFF, mode)]
    times: dict[tuple[str, int], list[float]] = {arm: [] for arm in arms}
    rng = random.Random(0)
    for _ in range(args.rounds):
        order = arms[:]
        rng.shuffle(order)
        for w, m in order:
            module.sgmv_amx(m, 0)
            adapters = [None] * len(prompts) if w == "backbone" else names[w]
            times[w, m].append(decode_step_time(llm, prompts, adapters, sp, args.decode_steps))
    module.sgmv_amx(OFF, 0)
    return times


def rows_of(times, mode, agree) -> list[dict]:
    back = times["backbone", OFF]
    rows = []
    for w in WORKLOADS:
        vec, tiles = times[w, OFF], times[w, mode]
        r_vec, r_tiles, r_gain = (
            paired_ratio(vec, back),
            paired_ratio(tiles, back),
            paired_ratio(tiles, vec),
        )
        rows.append(
            {
                "workload": w,
                "backbone_ms": statistics.median(back) * 1e3,
                "vectors_ms": statistics.median(vec) * 1e3,
                "tiles_ms": statistics.median(tiles) * 1e3,
                "vectors_x_backbone": r_vec["median"],
                "tiles_x_backbone": r_tiles["median"],
                "tiles_x_vectors": r_gain["median"],
                "tiles_x_vectors_range": f"{r_gain['min']:.3f}-{r_gain['max']:.3f}",
                "greedy_equal": agree.get(w, ""),
            }
        )
    return rows


def main() -> None:
    args, module = parse_args()
    torch.set_num_threads(args.threads)
    print(describe_machine(), flush=True)
    mode = EMULATED if args.emulated else HARDWARE
    before = module.sgmv_amx(OFF, args.min_rows)
    # the float weights: the question is the bf16 GEMMs' tiles, not a GGUF file's blocks
    llm = LLM(dtype="bfloat16", model=model_path(args.model, args.tokenizer), quantization="none")
    n = 32
    prompts = make_prompts(llm.tokenizer, n)
    tmp = scratch_dir("bench-amx-")
    load_adapters(llm, make_adapters(llm.engine.loaded.model_dir, n, 16, tmp))
    names = workload_names(n)
    warm_up(llm, prompts)
    try:
        agree = greedy_agreement(llm, module, mode, prompts, names, args.max_tokens)
        times = step_rounds(llm, module, mode, prompts, names, args)
    finally:
        module.sgmv_amx(*before)
    rows = rows_of(times, mode, agree)
    print_table(
        rows,
        list(rows[0]),
        title=f"bfloat16, {n} requests, {args.threads} threads, tiles from {args.min_rows} rows",
    )
    if args.emulated:
        print("(--emulated: scalar tiles, nothing written)")
        return
    name = "bench_amx_tiles" + (f"_{args.model.replace('.', '_')}" if args.model in SHAPES else "")
    path = write_json(
        name,
        {
            "args": vars(args),
            "rows": rows,
            "step_s_rounds": {f"{w}/{m}": t for (w, m), t in times.items()},
        },
        group="amx",
    )
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.bar([r["workload"] for r in rows], [r["tiles_x_vectors"] for r in rows], color="tab:blue")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_ylabel("step with tiles / with vectors")
    print(f"wrote {path} and {save_plot(name, fig, group='amx')}")


if __name__ == "__main__":
    sys.exit(main())
