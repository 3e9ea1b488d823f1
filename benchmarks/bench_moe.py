"""How fast does one runner serve 32 multi-LoRA requests on a mixture-of-experts base, with
LoRA on the experts, and how close is its decode step to the bytes of the experts it routes to?

A random-weight model of a real MoE's shape (default olmoe-1b-7b-2l: OLMoE-1B-7B's layers,
2 of its 16; benchmarks/common/shapes.py), --requests requests of --max-tokens greedy tokens
(eos ignored), rank --rank adapters on q/k/v/o, both expert stacks and the router (PEFT's
target_parameters: each expert its own rank-r LoRA). Workloads: Distinct (every request its
own adapter), Identical (one adapter for all) and Backbone (no adapter).

Per workload: punica-x's tok/s; its decode step (all requests decoding, median of
--decode-steps, over --rounds interleaved rounds) against the step's floor, the larger of
- reading: the bytes a step cannot avoid reading (the dense weights and LM head, the experts
  the batch's tokens were routed to, counted in that workload's measured steps, and the LoRA
  of every (adapter, expert) pair and every adapter's attention) over the machine's read
  bandwidth, and
- computing: 2 x rows x the parameters each row multiplies (dense, its k experts, its
  adapter's LoRA) over a float GEMM's throughput on this machine (torch.mm, 256 x 2048 x
  2048: what its library reaches with these cores),
both measured in every round.
Beside it: the bytes of every expert (what a step reading all of them would pay), and HF
transformers + PEFT on Backbone and Identical (PEFT serves no mixed-adapter batch on
target_parameters adapters: "does not support mixed adapter batches yet", recorded as such;
one adapter at a time for Distinct would be 32 sequential runs, left out).

    python benchmarks/bench_moe.py [--model olmoe-1b-7b-2l] [--requests 32] [--max-tokens 32]
"""

from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path

import torch
from common.args import add_dtype, add_engine_workload, parser
from common.engine_timing import decode_step_time, interleaved_rounds, run_ours, warm_up
from common.hf_baselines import HFBaselines
from common.report import describe_machine, print_table, pyplot, save_plot, write_json
from common.scratch import scratch_dir
from common.shapes import SHAPES, model_path
from common.timing import read_bandwidth
from common.workload import make_adapters, make_prompts

from punica_x import LLM, SamplingParams
from punica_x.dtypes import dtype_name
from punica_x.engine.memory import weights_bytes
from punica_x.layers.linear import Dense
from punica_x.models import moe

WORKLOADS = ("distinct", "identical", "backbone")


def parse_args():
    ap = parser(__doc__)
    add_engine_workload(ap)
    add_dtype(ap)
    ap.add_argument("--model", default="olmoe-1b-7b-2l", help=f"a shape ({', '.join(SHAPES)})")
    ap.add_argument(
        "--lora-gib",
        type=int,
        default=8,
        help="the adapter pool, device and host (rank-16 LoRA on OLMoE's 64 experts is ~47 MB "
        "a layer in float32: the 1 GiB default holds 10 of 32 two-layer adapters, and a "
        "Distinct batch then runs 10 requests a step)",
    )
    ap.add_argument(
        "--quantization",
        default="none",
        choices=["none", "int8", "int4"],
        help="punica-x's on-load quantization (int4: every expert and attention projection "
        "in Q4_1 blocks, the head in Q8_0, the router float); HF stays float32",
    )
    ap.set_defaults(max_tokens=32, decode_steps=8)
    return ap.parse_args()


class ActiveExperts:
    """Counts, for every MoE layer call of a full decode step (T * k pairs), the experts with
    rows, per workload (set `workload` before its steps), by wrapping moe.group_by_expert."""

    def __init__(self, rows: int, top_k: int) -> None:
        self.pairs, self.calls, self.workload = rows * top_k, {}, ""
        self.original = moe.group_by_expert

    def __enter__(self) -> ActiveExperts:
        def counted(experts, num_experts):
            out = self.original(experts, num_experts)
            if experts.numel() == self.pairs:
                active = sum(1 for n in out[1] if n)
                self.calls.setdefault(self.workload, []).append(active)
            return out

        moe.group_by_expert = counted
        return self

    def __exit__(self, *exc) -> None:
        moe.group_by_expert = self.original


def names_of(n: int) -> dict[str, list]:
    return {
        "distinct": [f"a{i}" for i in range(n)],
        "identical": ["a0"] * n,
        "backbone": [None] * n,
    }


def byte_counts(llm: LLM, rank: int) -> dict:
    """The model's weight bytes split: every expert's, the rest (the embedding table, read by
    rows only, left out), one expert's, one adapter's attention LoRA, one (adapter, expert)
    pair's LoRA (gate|up and down) and one adapter's router LoRA."""
    model, d = llm.engine.model, llm.engine.model.dims
    blocks = [layer.mlp for layer in model.layers if isinstance(layer.mlp, moe.MoeBlock)]
    experts = sum(weights_bytes(m) for b in blocks for m in (b.experts_gate_up, b.experts_down))
    one = experts // (len(blocks) * d.moe.num_experts)
    embed = weights_bytes(model.embed_tokens)
    size = torch.tensor([], dtype=llm.engine.dtype).element_size()
    h, i = d.hidden_size, d.moe.expert_size
    q, kv = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
    attention = rank * ((h + q) * 2 + (h + kv) * 2) * d.num_layers * size
    pair = rank * ((h + 2 * i) + (i + h)) * size
    router = rank * (h + d.moe.num_experts) * len(blocks) * size
    dense = weights_bytes(model) - experts - embed
    params = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, Dense))
    expert_params = 3 * h * i  # gate, up and down of one expert
    return dict(
        experts=experts,
        dense=dense,
        # elements each row multiplies outside the experts (quantized weights hold fewer bytes)
        dense_params=params - expert_params * d.moe.num_experts * len(blocks),
        expert_params=expert_params,
        expert=one,
        attention=attention,
        pair=pair,
        router=router,
        sparse_layers=len(blocks),
    )


def floor_bytes(counts: dict, workload: str, active: float, n: int, top_k: int) -> float:
    """The bytes a decode step of `workload` must read (module doc); active: the mean experts
    with rows per sparse layer."""
    total = counts["dense"] + active * counts["expert"] * counts["sparse_layers"]
    if workload == "backbone":
        return total
    adapters = n if workload == "distinct" else 1
    pairs = n * top_k if workload == "distinct" else active  # (adapter, expert) per layer
    lora = pairs * counts["pair"] * counts["sparse_layers"]
    return total + lora + adapters * (counts["attention"] + counts["router"])


def floor_flops(counts: dict, workload: str, n: int, top_k: int, size: int) -> float:
    """2 x rows x the parameters each row of a decode step multiplies (module doc)."""
    per_row = counts["dense_params"] + top_k * counts["expert_params"] * counts["sparse_layers"]
    if workload != "backbone":  # the LoRA's bytes are in the serving dtype
        lora = top_k * counts["pair"] * counts["sparse_layers"]
        per_row += (lora + counts["attention"] + counts["router"]) / size
    return 2.0 * n * per_row


def gemm_flops() -> float:
    """FLOP/s of a float32 torch.mm of 256 x 2048 by 2048 x 2048 (median of 5)."""
    a, b = torch.randn(256, 2048), torch.randn(2048, 2048)
    torch.mm(a, b)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t0)
    return 2 * 256 * 2048 * 2048 / statistics.median(times)


def ours(args, llm: LLM, prompts, names, sp) -> tuple[list[dict], dict]:
    tps = {w: run_ours(llm, prompts, names[w], sp) for w in WORKLOADS}
    reads, flops = [], []
    k = llm.engine.model.dims.moe.top_k

    def between(_round: int) -> None:
        reads.append(read_bandwidth(256 << 20, repeats=5))
        flops.append(gemm_flops())

    def step_time(workload: str) -> float:
        seen.workload = workload
        return decode_step_time(llm, prompts, names[workload], sp, args.decode_steps)

    with ActiveExperts(args.requests, k) as seen:
        per_round = interleaved_rounds({w: w for w in WORKLOADS}, args.rounds, step_time, between)
    counts = byte_counts(llm, args.rank)
    size = torch.tensor([], dtype=llm.engine.dtype).element_size()
    missing = [w for w in WORKLOADS if w not in seen.calls]
    if missing:  # no step ran every request: the figures would describe a smaller batch
        raise SystemExit(f"no decode step of {missing} held all {args.requests} requests")
    rows = [
        ours_row(
            w,
            tps[w],
            per_round[w],
            statistics.mean(seen.calls[w]),
            counts,
            reads,
            flops,
            (args.requests, k, size),
        )
        for w in WORKLOADS
    ]
    active = statistics.mean(c for calls in seen.calls.values() for c in calls)
    summary = {
        "active_experts_per_layer": active,
        "num_experts": llm.engine.model.dims.moe.num_experts,
        "all_experts_gb": counts["experts"] / 1e9,
        "active_experts_gb": active * counts["expert"] * counts["sparse_layers"] / 1e9,
        "read_gb_s": statistics.median(reads) / 1e9,
        "gemm_gflop_s": statistics.median(flops) / 1e9,
        "bytes": counts,
        "step_ms_rounds": {w: [t * 1e3 for t in per_round[w]] for w in WORKLOADS},
    }
    return rows, summary


def ours_row(w, tps, steps, active, counts, reads, flops, shape) -> dict:
    """One workload's row: tok/s, step, the read and compute floors (each round's), and the
    step over the larger floor, paired by round."""
    n, k, size = shape
    nbytes = floor_bytes(counts, w, active, n, k)
    work = floor_flops(counts, w, n, k, size)
    floors = [max(nbytes / bw, work / f) for bw, f in zip(reads, flops)]
    ratios = [t / f for t, f in zip(steps, floors)]
    return {
        "workload": w,
        "ours_tok_s": tps,
        "active_experts": active,
        "step_ms": statistics.median(steps) * 1e3,
        "read_floor_ms": statistics.median(nbytes / bw for bw in reads) * 1e3,
        "compute_floor_ms": statistics.median(work / f for f in flops) * 1e3,
        "floor_gb": nbytes / 1e9,
        "step_over_floor": statistics.median(ratios),
        "step_over_floor_min": min(ratios),
        "step_over_floor_max": max(ratios),
    }


def hf_columns(rows, model_dir, adapter, prompts, names, n_tokens) -> dict:
    """HF + PEFT on Backbone and Identical (one adapter), and PEFT's answer to a mixed batch."""
    hf = HFBaselines(model_dir, [adapter])
    hf.backbone(prompts[:2], 2)  # warm-up
    got = {"backbone": hf.backbone(prompts, n_tokens)}
    got["identical"] = hf.one_at_a_time(prompts, names["identical"], n_tokens)
    try:
        hf.mixed(prompts[:2], ["a0", "a0"], 2)
        mixed = "served"
    except ValueError as exc:
        mixed = str(exc)
    for row in rows:
        if row["workload"] in got:
            row["hf_tok_s"] = got[row["workload"]]
            row["x_hf"] = row["ours_tok_s"] / row["hf_tok_s"]
    return {"hf_mixed_batch": mixed}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    print(describe_machine(), flush=True)
    model = model_path(args.model)
    pool = args.lora_gib << 30  # every adapter resident: a Distinct batch holds all of them
    llm = LLM(
        dtype=args.dtype,
        model=model,
        quantization=args.quantization,
        device_bytes=pool,
        host_bytes=pool,
    )
    dtype = dtype_name(llm.engine.dtype)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    prompts = make_prompts(llm.tokenizer, args.requests)
    paths = make_adapters(
        llm.engine.loaded.model_dir, args.requests, args.rank, scratch_dir("bench-moe-")
    )
    for i, path in enumerate(paths):
        llm.load_adapter(f"a{i}", str(path))
    names = names_of(args.requests)
    warm_up(llm, prompts)
    rows, summary = ours(args, llm, prompts, names, sp)
    model_dir = llm.engine.loaded.model_dir
    del llm
    gc.collect()
    summary.update(hf_columns(rows, model_dir, paths[0], prompts, names, args.max_tokens))
    summary.update(
        model=f"{args.model} (random weights)",
        dtype=dtype,
        requests=args.requests,
        max_tokens=args.max_tokens,
        rank=args.rank,
        quantization=args.quantization,
    )
    report(args, rows, summary)


def report(args, rows, summary) -> None:
    cols = ["workload", "ours_tok_s", "hf_tok_s", "x_hf", "active_experts", "step_ms"]
    cols += ["read_floor_ms", "compute_floor_ms", "step_over_floor"]
    title = (
        f"{summary['model']}, {summary['dtype']}"
        + (f" {args.quantization}" if args.quantization != "none" else "")
        + f", {args.requests} requests x "
        f"{args.max_tokens} tokens, rank-{args.rank} LoRA on attention + experts + router; "
        f"{summary['active_experts_per_layer']:.1f} of {summary['num_experts']} experts active "
        f"per layer ({summary['active_experts_gb']:.2f} of {summary['all_experts_gb']:.2f} GB "
        f"of experts a step); read {summary['read_gb_s']:.1f} GB/s, torch.mm "
        f"{summary['gemm_gflop_s']:.0f} GFLOP/s"
    )
    print_table(rows, cols, title)
    print(f"HF + PEFT, a mixed-adapter batch: {summary['hf_mixed_batch']}")
    shape = Path(args.model).name.replace(".", "_").replace("-", "_")  # a shape or a folder
    name = f"bench_moe_{shape}_{summary['dtype']}"
    if args.quantization != "none":
        name += f"_{args.quantization}"
    write_json(name, {"rows": rows, "summary": summary})
    plot(name, rows, title)


def plot(name: str, rows: list[dict], title: str) -> None:
    """tok/s beside HF + PEFT's, and each decode step over its floor."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    labels = [r["workload"] for r in rows]
    left.bar([x - 0.2 for x in range(3)], [r["ours_tok_s"] for r in rows], 0.4, label="punica-x")
    left.bar(
        [x + 0.2 for x in range(3)], [r.get("hf_tok_s", 0) for r in rows], 0.4, label="HF + PEFT"
    )
    left.set_xticks(range(3), labels)
    left.set_ylabel("tokens/s")
    left.legend()
    right.bar(labels, [r["step_over_floor"] for r in rows])
    right.set_ylabel("decode step / its floor (read or compute)")
    right.axhline(1.0, color="grey", linewidth=0.8)
    fig.suptitle(title[:120] + ("..." if len(title) > 120 else ""), fontsize=8)
    save_plot(name, fig)


if __name__ == "__main__":
    main()
