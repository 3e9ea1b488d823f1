"""bench_generate --device cuda: one runner on one GPU, end to end.

A random-weight model of a real shape (default llama-3-8b, common/shapes.py), rank-r
adapters on all 7 projections written straight in PEFT's format (random; what a GPU reads
per step depends on the shapes only), bfloat16. For each --gpu-requests count (32 and 128):
tokens/s of a whole generation and the median decode step (every request decoding) for the
backbone and the Distinct / Uniform / Skewed / Identical workloads, with the LoRA overhead
of each = its step / the backbone's step - 1, with the decode steps replayed from CUDA
graphs (engine/cuda_graphs.py) and again eagerly (eager_ms, eager_overhead), interleaved in
each round. Beside them in the same run: HF transformers
(bfloat16 on the same GPU, sdpa attention) generating the same prompts without adapters,
and HF + PEFT with a mixed-adapter batch (adapter_names=) on --hf-workloads at the smallest
request count. Then the first token of an adapter nobody has loaded yet: registration (read,
validated, placed) plus the first request's first token, on an idle engine.
--batch-invariant on: the same with the batch-invariant mode's kernels (ops.invariance: the
Triton GEMM, norms and attention, eager decode steps), its own JSON; its cost is its step
time over the default run's.

The HF columns are common/gpu_hf.py's, the kernel time in a step common/gpu_kernels.py's."""

from __future__ import annotations

import gc
import json
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path

import torch

from common.engine_timing import decode_step_time, run_ours, warm_up
from common.gpu_hf import hf_columns
from common.gpu_kernels import step_kernel_ms
from common.report import describe_machine, print_table, pyplot, save_plot, write_json
from common.report import log as _log
from common.scratch import scratch_dir
from common.shapes import SHAPES, model_path
from common.workload import TARGETS, make_prompts, workload_names
from punica_x import LLM, SamplingParams
from punica_x.config import GiB, dtype_name

COLUMNS = [
    "requests",
    "workload",
    "adapters",
    "tok_s",
    "step_ms",
    "lora_overhead",
    "eager_ms",
    "eager_overhead",
    "kernel_ms",
    "gpu_busy",
    "hf_tok_s",
    "x_hf",
]


def add_gpu_args(ap) -> None:
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument(
        "--gpu-requests", default=None, help="with --device cuda: request counts (32,128)"
    )
    ap.add_argument(
        "--attention-backend",
        default=None,
        help="with --device cuda: flashinfer (the default where it has a kernel) or torch",
    )
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder of a --model shape")
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="the --device cuda run's whole path on the CPU, at the sizes given (for "
        "scripts/gpu_check.sh --dry-run): same phases, JSON and table, no GPU figures",
    )


def check_gpu_args(ap, args):
    """args, after refusing (ap.error: exit 2, naming the flag) GPU flags without --device
    cuda (--tokenizer serves a CPU run of a --model shape too) and request counts that are
    not positive integers. --dry-run takes the GPU flags on the CPU (and only there), and
    --hf-workloads none leaves HF out."""
    if args.dry_run and args.device != "cpu":
        ap.error("--dry-run runs the GPU benchmark's path on the CPU: it needs --device cpu")
    if args.device != "cuda" and not args.dry_run:
        flags = ["gpu_requests", "attention_backend"]
        if getattr(args, "model", None) not in SHAPES:  # a random model's tokenizer folder
            flags.append("tokenizer")
        given = [f for f in flags if getattr(args, f)]
        if given:
            ap.error(f"--{given[0].replace('_', '-')} needs --device cuda")
        return args
    try:
        given = args.gpu_requests if args.gpu_requests is not None else "32,128"
        counts = [int(c) for c in given.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        ap.error(f"--gpu-requests must be positive integers, got {args.gpu_requests!r}")
    return args


def write_random_adapters(model_dir: Path, n: int, rank: int, root: Path) -> list[Path]:
    """n PEFT adapters (rank `rank`, alpha = rank, all 7 projections, bfloat16 random:
    A ~ U(-1/sqrt(in), 1/sqrt(in)), B ~ N(0, 0.01)) saved as root/a0 .. root/a{n-1}, without
    building a PEFT model (minutes on an 8B model; this takes a second per adapter)."""
    from peft import LoraConfig
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes = {
        name: (mod.in_features, mod.out_features)
        for name, mod in model.named_modules()
        if name.rsplit(".", 1)[-1] in TARGETS
    }
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(dev).manual_seed(1000)
    paths = []
    for i in range(n):
        tensors = {}
        for name, (fan_in, fan_out) in shapes.items():
            a = torch.empty(rank, fan_in, device=dev, dtype=torch.bfloat16)
            a.uniform_(-(fan_in**-0.5), fan_in**-0.5, generator=gen)
            b = torch.empty(fan_out, rank, device=dev, dtype=torch.bfloat16)
            b.normal_(0.0, 0.01, generator=gen)
            tensors[f"base_model.model.{name}.lora_A.weight"] = a.cpu()
            tensors[f"base_model.model.{name}.lora_B.weight"] = b.cpu()
        path = root / f"a{i}"
        LoraConfig(r=rank, lora_alpha=rank, target_modules=TARGETS).save_pretrained(path)
        save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
        paths.append(path)
    return paths


def main(args) -> None:
    """The whole GPU run: see the module's docstring. Each phase prints its figures as it
    ends; the JSON is written after each request count and again at the end, and a run
    stopped by SIGTERM (e.g. timeout) writes the rows it has, partial ones too."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    print(describe_machine(), flush=True)
    counts = [int(c) for c in (args.gpu_requests or "32,128").split(",")]
    tmp = scratch_dir("bench-generate-cuda-")
    try:
        _run(args, counts, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # an 8B model's 129 adapters: 10.8 GB


def _run(args, counts: list[int], tmp: Path) -> None:
    llm, summary = _load(args, counts)
    engine = llm.engine
    paths = write_random_adapters(engine.loaded.model_dir, max(counts) + 1, args.rank, tmp)
    for i, p in enumerate(paths[:-1]):
        llm.load_adapter(f"a{i}", str(p))
    _log(f"{len(paths)} adapters written, {len(paths) - 1} registered")
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    rows: list[dict] = []
    try:
        for n in counts:
            _rows_for(llm, n, sp, args, rows)
            _save(args, rows, summary)
    except SystemExit:  # SIGTERM (a timeout): the rows measured so far, partial ones too
        if rows:
            _save(args, rows, summary)
        raise
    if engine.graphs is not None:
        summary["cuda_graphs"] = vars(engine.graphs.stats) | {"shapes": len(engine.graphs.graphs)}
    summary["new_adapter"] = _new_adapter_ttft(llm, paths[-1])
    _log(f"a new adapter: {summary['new_adapter']}")
    _save(args, rows, summary)
    model_dir, prompts = engine.loaded.model_dir, make_prompts(llm.tokenizer, max(counts))
    del llm, engine  # HF needs the memory our engine planned for itself
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if args.hf_workloads != "none":  # none: HF left out (gpu_check's device-time budget)
        summary |= hf_columns(rows, model_dir, paths, prompts, counts, args)
    _report(args, rows, summary)
    _save(args, rows, summary)


def _load(args, counts) -> tuple[LLM, dict]:
    """The engine on the model (built first if a shape), and the summary's first fields."""
    started = time.perf_counter()
    model = model_path(_model_name(args), args.tokenizer)
    _log(f"model at {model} ({time.perf_counter() - started:.0f} s)")
    t0 = time.perf_counter()
    llm = LLM(
        model=model,
        device=args.device,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        batch_invariant=args.batch_invariant,
        max_batch_size=max(counts),
        max_batched_tokens=max(2048, 64 * max(counts)),
        **(
            {"kv_fraction": 0.5, "host_bytes": 64 * GiB}
            if args.device == "cuda"
            else {"kv_cache_bytes": 64 << 20}  # a --dry-run on the CPU: small and fixed
        ),
    )
    engine = llm.engine
    summary = {
        "model": f"{_model_name(args)} (random weights)",
        "dtype": dtype_name(engine.dtype),
        "attention": engine.planner.attention.name,
        "sgmv": engine.sgmv.name,
        "batch_invariant": engine.invariance.reason,
        "load_s": time.perf_counter() - t0,
        "kv_blocks": engine.cache.kv.shape[0],
    }
    _log(f"engine: {summary}")
    return llm, summary


def _model_name(args) -> str:
    """--model, else the 8B shape on a GPU and SmolLM2's on a --dry-run."""
    return args.model or ("smollm2-135m" if args.dry_run else "llama-3-8b")


def _rows_for(llm: LLM, n: int, sp, args, out: list[dict]) -> None:
    """n requests' rows, appended to `out` as soon as their throughput is in (a run stopped
    later keeps them) and filled in as the step times and the profile come."""
    prompts = make_prompts(llm.tokenizer, n)
    names = {"backbone": [None] * n, **workload_names(n)}
    warm_up(llm, prompts)
    rows = []
    for w, a in names.items():
        tok_s = run_ours(llm, prompts, a, sp)
        adapters = len({x for x in a if x is not None})
        rows.append({"requests": n, "workload": w, "adapters": adapters, "tok_s": tok_s})
    out += rows
    _log(f"{n} requests, tok/s: { {r['workload']: r['tok_s'] for r in rows} }")
    graphs = llm.engine.graphs
    modes = ("graphs", "eager") if graphs is not None else ("eager",)
    steps: dict[tuple[str, str], list[float]] = {(m, w): [] for m in modes for w in names}
    for _ in range(args.rounds):  # interleaved: the GPU's clocks move over a run
        for mode in modes:
            if graphs is not None:
                graphs.enabled = mode == "graphs"
            for w, a in names.items():
                steps[mode, w].append(decode_step_time(llm, prompts, a, sp, args.decode_steps))
    if graphs is not None:
        graphs.enabled = True
    step = {k: statistics.median(s) for k, s in steps.items()}
    for row, w in zip(rows, names):
        row["step_ms"] = step[modes[0], w] * 1e3
        row["lora_overhead"] = step[modes[0], w] / step[modes[0], "backbone"] - 1
        if graphs is not None:  # the same steps with every launch from the host
            row["eager_ms"] = step["eager", w] * 1e3
            row["eager_overhead"] = step["eager", w] / step["eager", "backbone"] - 1
    for row, a in zip(rows, names.values()):
        kernel_ms = step_kernel_ms(llm, prompts, a, sp)
        row["kernel_ms"] = kernel_ms
        if isinstance(kernel_ms, float):
            row["gpu_busy"] = kernel_ms / row["step_ms"]
        _log(json.dumps(row))


def _new_adapter_ttft(llm: LLM, path: Path) -> dict:
    """Seconds from registering an adapter nobody loaded to its first request's first
    token, the engine otherwise idle: {"register_s", "first_token_s", "total_s"}."""
    engine = llm.engine
    t0 = time.perf_counter()
    llm.load_adapter("fresh", str(path))
    t1 = time.perf_counter()
    prompt = make_prompts(llm.tokenizer, 1)[0]
    req = engine.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True), "fresh")
    while not req.output_token_ids:
        engine.step()
    t2 = time.perf_counter()
    while engine.requests:
        engine.step()
    return {"register_s": t1 - t0, "first_token_s": t2 - t1, "total_s": t2 - t0}


def _report(args, rows, summary) -> None:
    print(
        f"\n{summary['model']}, {summary['dtype']}, rank {args.rank} on all 7 projections, "
        f"{args.max_tokens} tokens a request, attention {summary['attention']}, "
        f"SGMV {summary['sgmv']}"
    )
    print_table(rows, COLUMNS, "Generated tokens/s, decode step ms, LoRA overhead vs backbone")
    for row in rows:
        if row["workload"] == "distinct":
            print(
                f"distinct at {row['requests']} requests: LoRA overhead "
                f"{row['lora_overhead']:.1%} of the backbone step (target <= 15%)"
            )
    fresh = summary["new_adapter"]
    print(
        f"a new adapter's first token: {fresh['total_s'] * 1e3:.0f} ms "
        f"(registration {fresh['register_s'] * 1e3:.0f} ms, first token "
        f"{fresh['first_token_s'] * 1e3:.0f} ms)"
    )
    print(json.dumps(summary))


def _save(args, rows, summary) -> None:
    """JSON and PNG in benchmarks/results/cuda/ (again at each call: the latest wins)."""
    name = "bench_generate_cuda_" + Path(_model_name(args)).name.replace(".", "_")
    if args.batch_invariant != "auto":  # the mode's own file beside the default run's
        name += f"_invariant_{args.batch_invariant}"
    path = write_json(name, {"args": vars(args), "summary": summary, "rows": rows}, "cuda")
    _plot(rows, summary, name)
    _log(f"wrote {path} and {path.with_suffix('.png')}")


def _plot(rows, summary, name: str) -> None:
    plt = pyplot()
    counts = sorted({r["requests"] for r in rows})
    fig, axes = plt.subplots(1, len(counts), figsize=(6 * len(counts), 4), squeeze=False)
    for ax, n in zip(axes[0], counts):
        mine = [r for r in rows if r["requests"] == n]
        labels = [r["workload"] for r in mine]
        xs = range(len(labels))
        ax.bar([x - 0.2 for x in xs], [r["tok_s"] for r in mine], 0.4, label="punica-x")
        hf = [r.get("hf_tok_s", 0) for r in mine]
        ax.bar([x + 0.2 for x in xs], hf, 0.4, label="HF (+ PEFT mixed batch)")
        ax.set_xticks(list(xs), labels)
        ax.set_title(f"{n} requests")
        ax.set_ylabel("generated tokens / s")
        ax.legend()
    fig.suptitle(f"{summary['model']}, {summary['dtype']}, rank-16 LoRA ({_gpu_name()})")
    save_plot(name, fig, "cuda")


def _gpu_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
