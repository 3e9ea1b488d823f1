"""On a GPU, does the host make the device wait? (issue 72: scripts/gpu_check.sh's `host` step)

The 8B shape (random weights, bfloat16; --model), --adapters rank-16 adapters round robin over
the requests (bench_host's workload), greedy, for each batch B of --batches: B requests, every
one decoding, and per decode step:
- step_ms: the median step as the engine serves by default (CUDA graphs, synchronous steps:
  overlap is off on a real device until measured), and overlap_ms: the same with overlapped
  scheduling on (engine/overlap.py: the host plans step N+1 and postprocesses N while the
  device replays N+1's graph; 2026-11-29's eager steps with overlap, 44-61 ms a step at every
  batch, were launch-bound and are no longer measured);
- graph_kernel_ms (common/gpu_kernels: torch.profiler over the steps as served, graphs
  replayed) and gpu_busy = graph_kernel_ms / step_ms; kernel_ms, the same over eager steps
  (every kernel launched by name: what the graph holds, unless the graph's fixed shapes
  cost more, as a block-table width bucket does for the torch attention);
- floor_ms, the step's byte floor: (the weights' bytes + the bytes of the batch's distinct
  adapters + the KV the step reads: B x context x KV bytes a token) / the device's copy
  bandwidth (common/timing.copy_bandwidth: a large copy, read and write counted), and
  step_over_floor;
then the torch profiler's top host (CPU) costs of one step at the largest B, graphs on.
Issue 72's targets: gpu_busy >= 90% at 32, 128 and 256; step <= 1.5 x floor there, one stream
<= 1.3 x.

--dry-run: the same path on the CPU at the sizes given (a tiny shape), for scripts/gpu_check.sh
--dry-run and the suite: no GPU figure means anything then.

    python benchmarks/bench_host_cuda.py [--device cuda] [--model llama-3-8b]
        [--batches 1,32,128,256] [--adapters 8] [--max-tokens 64] [--steps 16] [--dry-run]
"""

from __future__ import annotations

import signal
import statistics
import sys
import time

import torch
from common.args import add_adapters, add_max_tokens, batch_sizes, parser
from common.engine_timing import decode_step_time, start_decoding, stop_all, warm_up
from common.gpu_generate import write_random_adapters
from common.gpu_kernels import step_kernel_ms
from common.report import describe_machine, log, print_table, write_json
from common.scratch import scratch_dir
from common.shapes import model_path
from common.timing import copy_bandwidth
from common.workload import make_prompts

from punica_x import LLM, SamplingParams
from punica_x.config import GiB

COLUMNS = [
    "batch",
    "step_ms",
    "overlap_ms",
    "graph_kernel_ms",
    "kernel_ms",
    "gpu_busy",
    "floor_ms",
    "step_over_floor",
    "weights_GB",
    "adapters_MB",
    "kv_MB",
]


def parse_args():
    """The flags; bad values exit 2 naming the flag."""
    ap = parser(__doc__)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--model", default=None, help="a shape (default llama-3-8b) or a folder")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder of a --model shape")
    ap.add_argument("--batches", default="1,32,128,256")
    ap.add_argument("--attention-backend", default=None, help="default: the engine's choice")
    ap.add_argument("--steps", type=int, default=16, help="decode steps timed per figure")
    ap.add_argument("--dry-run", action="store_true", help="the path on the CPU, toy sizes")
    add_max_tokens(ap, default=64)
    add_adapters(ap, default=8)
    ap.add_argument("--name", default="bench_host_cuda")
    args = ap.parse_args()
    args.batch_sizes = batch_sizes(ap, args.batches)
    if not 1 <= args.steps <= 1000 or not 1 <= args.max_tokens <= 4096:
        ap.error("--steps wants 1..1000 and --max-tokens 1..4096")
    if not 1 <= args.adapters <= 64:
        ap.error(f"--adapters wants 1..64, got {args.adapters}")
    if args.dry_run != (args.device == "cpu"):
        ap.error("--dry-run and --device cpu go together (the GPU path on the CPU)")
    if args.steps + 8 > args.max_tokens:
        ap.error("--max-tokens must leave room for the warm-up and --steps decode steps")
    return args


def build(args, overlap: str) -> LLM:
    """The engine on --model with room for the largest batch, CUDA graphs as by default."""
    model = model_path(
        args.model or ("smollm2-135m" if args.dry_run else "llama-3-8b"), args.tokenizer
    )
    biggest = max(args.batch_sizes)
    memory = (
        {"kv_fraction": 0.5, "host_bytes": 8 * GiB}
        if args.device == "cuda"
        else {"kv_cache_bytes": 256 << 20}
    )
    return LLM(
        model=model,
        device=args.device,
        dtype="bfloat16" if args.device == "cuda" else "float32",
        overlap=overlap,
        max_batch_size=biggest,
        max_batched_tokens=max(2048, 64 * biggest),
        max_lora_rank=16,
        **({"attention_backend": args.attention_backend} if args.attention_backend else {}),
        **memory,
    )


def step_bytes(llm: LLM, batch: int, adapters: list, context: int) -> dict:
    """What one decode step of `batch` requests must read: the weights, each distinct adapter
    of the batch once, and every request's KV over `context` tokens."""
    info = llm.engine.describe()
    picked = {f"a{i % len(adapters)}" for i in range(batch)}
    return {
        "weights": info.model.weight_bytes,
        "adapters": sum(adapters[int(a[1:])].nbytes for a in picked),
        "kv": batch * context * info.kv_bytes_per_token,
    }


def top_host_costs(llm: LLM, prompts, names, sp, top: int = 12) -> list[dict]:
    """The torch profiler's largest self CPU times over 4 steps of the batch (graphs as the
    engine has them): where a step's host time goes."""
    from torch.profiler import ProfilerActivity, profile

    engine = start_decoding(llm, prompts, names, sp)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(4):
                engine.step()
        events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
        return [
            {
                "op": e.key[:80],
                "self_cpu_ms_per_step": e.self_cpu_time_total / 4e3,
                "calls": e.count,
            }
            for e in events
        ]
    finally:
        stop_all(llm)


def measure(args, llm: LLM, adapters: list, bandwidth: float) -> list[dict]:
    """A row per batch size (module docstring), appended as each is measured."""
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    rows = []
    for batch in args.batch_sizes:
        prompts = make_prompts(llm.tokenizer, batch)
        names = [f"a{i % len(adapters)}" for i in range(batch)]
        step = decode_step_time(llm, prompts, names, sp, args.steps)
        kernel = step_kernel_ms(llm, prompts, names, sp)
        graph_kernel = step_kernel_ms(llm, prompts, names, sp, eager=False)
        context = statistics.mean(len(llm.tokenizer.encode(p)) for p in prompts) + args.steps
        need = step_bytes(llm, batch, adapters, int(context))
        floor = sum(need.values()) / bandwidth
        row = {
            "batch": batch,
            "step_ms": step * 1e3,
            "graph_kernel_ms": graph_kernel,
            "kernel_ms": kernel,
            "gpu_busy": graph_kernel / (step * 1e3) if isinstance(graph_kernel, float) else None,
            "floor_ms": floor * 1e3,
            "step_over_floor": step / floor,
            "weights_GB": need["weights"] / 1e9,
            "adapters_MB": need["adapters"] / 1e6,
            "kv_MB": need["kv"] / 1e6,
        }
        rows.append(row)
        log(f"{row}")
    return rows


def overlapped(args, adapters_paths, rows: list[dict]) -> None:
    """overlap_ms of every row: a second engine, graphs on, overlap on."""
    llm = build(args, "on")
    for i, p in enumerate(adapters_paths):
        llm.load_adapter(f"a{i}", str(p))
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    warm_up(llm, make_prompts(llm.tokenizer, 4))
    for row in rows:
        prompts = make_prompts(llm.tokenizer, row["batch"])
        names = [f"a{i % len(adapters_paths)}" for i in range(row["batch"])]
        row["overlap_ms"] = decode_step_time(llm, prompts, names, sp, args.steps) * 1e3
    llm.engine.shutdown()


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    print(describe_machine(), flush=True)
    started = time.perf_counter()
    bandwidth = copy_bandwidth(device=args.device)
    llm = build(args, "auto")
    paths = write_random_adapters(
        llm.engine.loaded.model_dir, args.adapters, 16, scratch_dir("bh-cuda-")
    )
    adapters = [llm.load_adapter(f"a{i}", str(p)) for i, p in enumerate(paths)]
    warm_up(llm, make_prompts(llm.tokenizer, 4))
    summary = {"copy_GB_s": bandwidth / 1e9, "graphs": llm.engine.graphs is not None}
    rows: list[dict] = []
    try:
        rows += measure(args, llm, adapters, bandwidth)
        biggest = max(args.batch_sizes)
        prompts = make_prompts(llm.tokenizer, biggest)
        names = [f"a{i % len(adapters)}" for i in range(biggest)]
        sp = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
        summary["top_host_costs"] = top_host_costs(llm, prompts, names, sp)
        llm.engine.shutdown()
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        overlapped(args, paths, rows)
    finally:  # a timeout (SIGTERM) keeps what was measured
        summary["seconds"] = time.perf_counter() - started
        group = "cuda" if args.device == "cuda" else None  # GPU figures in results/cuda
        write_json(args.name, {"args": vars(args), "summary": summary, "rows": rows}, group)
    title = (
        f"decode step vs its byte floor ({args.adapters} rank-16 adapters, copy "
        f"{bandwidth / 1e9:.0f} GB/s)"
    )
    print_table(rows, COLUMNS, title)
    print_table(summary["top_host_costs"], ["op", "self_cpu_ms_per_step", "calls"], "host costs")


if __name__ == "__main__":
    main()
