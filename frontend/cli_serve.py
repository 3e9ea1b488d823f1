"""The flags of `punica-x serve` (frontend/cli.py turns them into the server's config)."""

from __future__ import annotations

import argparse
import math

# ModelConfig.QUANTIZATION, spelled here so that --help needs no torch (a test keeps them equal)
QUANTIZATION_CHOICES = ("auto", "none", "int8", "int4")


def serve_parser(sub, default_data_dir: str) -> None:
    s = sub.add_parser("serve", help="run the HTTP server (REST, OpenAI API, web chat)")
    s.add_argument(
        "--model", default=None, help="HF directory or .gguf (default: SmolLM2-135M-Instruct)"
    )
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--data-dir", default=default_data_dir)
    s.add_argument("--max-batch-size", type=int, default=None, help="requests per batch (32)")
    _quant_args(s)
    _source_args(s)
    s.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="the serving dtype (model weights, KV cache, adapters). auto (default): bfloat16 "
        "on CPUs with AVX512-BF16 or AMX-BF16, float32 on other CPUs, bfloat16 (else float16) "
        "on CUDA",
    )
    s.add_argument(
        "--kv-cache-bytes",
        type=int,
        default=None,
        help="each runner's paged KV cache in bytes (default 2 GiB; vLLM CPU's "
        "VLLM_CPU_KVCACHE_SPACE, its GPU memory share on a GPU)",
    )
    _memory_args(s)
    s.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="prefill every prompt whole (by default a prompt's prefix whose KV a runner "
        "computed for the same model or adapter version and tenant is reused: docs/prefix.md)",
    )
    s.add_argument(
        "--policy",
        default="fcfs",
        choices=["fcfs", "mlfq"],
        help="who each runner serves first: fcfs (arrival order, default) or mlfq (skip-join "
        "MLFQ: short requests stop waiting behind long ones; preempted KV swapped to host)",
    )
    _host_path_args(s)
    s.add_argument(
        "--limit",
        action="append",
        metavar="NAME=N",
        help="override a limit of frontend.config.Limits, e.g. max_queue=64 (repeatable)",
    )
    _cluster_args(s)


def _host_path_args(s) -> None:
    """serve's options about each runner's host path (punica_x/engine/overlap.py)."""
    s.add_argument(
        "--overlap",
        choices=["auto", "on", "off"],
        default="auto",
        help="overlapped scheduling: each runner plans step N+1 and streams step N's tokens "
        "while the device runs (docs/api.md). auto (default): on with the simulated device, "
        "off on real devices until measured there (PUNICA_X_OVERLAP=on|off changes auto)",
    )
    s.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        metavar="N",
        help="send each stream's tokens every N tokens, the first and the last at once "
        "(vLLM's --stream-interval); 1 (default): every token. Larger N costs the server less "
        "per token at many streams",
    )
    s.add_argument(
        "--simulated-step-ms",
        type=float,
        default=None,
        help="benchmarks only: runners call a simulated device instead of the model, each "
        "step holding this many ms without the interpreter lock (bench_host.py measures the "
        "host path with it); its tokens are a hash of the input, not the model's",
    )


def _quant_args(s) -> None:
    """What a runner does with quantized weights (docs/api.md#quantized-gguf-weights)."""
    s.add_argument(
        "--quantization",
        choices=QUANTIZATION_CHOICES,
        default="auto",
        help="auto (default): serve a GGUF file's Q4_0 / Q4_1 / Q8_0 tensors (and GPTQ / AWQ "
        "projections) in their own blocks on the CPU (llama-architecture files; dequantized on "
        "a GPU, with a warning); none: dequantize the file to the serving dtype (the exact "
        "reference); int8 / int4: also quantize float weights on load (Q8_0 / Q4_1 "
        "projections; CPU only)",
    )
    s.add_argument(
        "--quant-activations",
        choices=["int16", "int8", "float"],
        default="int16",
        help="how x meets weights served in blocks: each block of 32 values is rounded to "
        "integers for integer dot products. int16 (default): within float32 noise of float; "
        "int8: llama.cpp's arithmetic, the fastest, coarser; float: x exact",
    )
    s.add_argument(
        "--batch-invariant",
        choices=["auto", "on", "off"],
        default="auto",
        help="the same request gives the same tokens and logprobs bit for bit whatever else "
        "runs (batching, prefix-cache hits, chunked prefill, preemption, migration): every "
        "kernel in one reduction order per row. auto (default): on where its measured decode "
        "cost is at most 5%% on this CPU (said at start; off on a GPU until measured there); "
        "on: refused where it cannot hold (an untuned CPU, float16 on a CPU, CUDA without "
        "Triton); off: the fastest kernel per shape",
    )
    s.add_argument(
        "--lora-dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="what the adapters' weights are stored and read in. auto (default): the serving "
        "dtype; bfloat16 under a float32 model on the CPU: half the bytes an adapter holds and "
        "a step of distinct adapters reads (activations stay float32); other pairs are refused",
    )
    s.add_argument(
        "--max-loras",
        type=int,
        default=None,
        metavar="N",
        help="vLLM's flag: each runner's device adapter pool holds N adapters of the maximum "
        "rank on every projection (a byte budget, logged at start; lower-rank adapters fit "
        "more). Default: the memory plan's share",
    )
    s.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        metavar="M",
        help="vLLM's flag: each runner's host adapter cache holds M such adapters (default 4 GiB)",
    )


def _memory_args(s) -> None:
    """serve's options about each runner's memory (punica_x/engine/memory.py)."""
    s.add_argument(
        "--attention-workers",
        type=int,
        default=0,
        help="Lamina: each runner becomes a model worker (weights, adapters, no KV) whose "
        "attention and KV cache run on this many attention worker processes, each holding a "
        "slice of every request's KV heads (the count must divide the model's KV heads); "
        "0 (default): runners keep their own KV. DistKV is off with attention workers",
    )
    s.add_argument(
        "--memory-utilization",
        type=float,
        default=None,
        help="each runner's share of its device's memory (0 < x <= 1): the KV cache and the "
        "adapter pool are sized from what the weights and one profiling step leave of it "
        "(vLLM's gpu_memory_utilization; default 0.9 on a GPU; on a CPU the fixed "
        "--kv-cache-bytes unless this is given)",
    )
    s.add_argument(
        "--kv-fraction",
        type=float,
        default=None,
        help="with memory planning, the share of the spare memory that goes to the KV cache "
        "(0 < x < 1, default 0.8); the rest holds adapters",
    )
    s.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="the longest context served (default: the model's own, capped by what the KV "
        "cache holds when memory is planned)",
    )


def _cluster_args(s) -> None:
    """serve's options about the runners: how many, which backend, what they share."""
    s.add_argument(
        "--runners",
        type=int,
        default=None,
        help="runners to start (admin scale changes it; default: one per --devices entry)",
    )
    s.add_argument(
        "--devices",
        default=None,
        help="thread and process runners' devices, runner i on the i-th (round robin): auto "
        "(default: every visible GPU, else the CPU), cpu, or cuda:0,cuda:1,...",
    )
    s.add_argument(
        "--runner-backend",
        default=None,
        choices=["thread", "process", "ray"],
        help="thread (default): runners inside the server process, sharing the model weights; "
        "process: each runner's engine in a process of its own on this machine (HTTP and "
        "streaming keep the server's interpreter to themselves; no DistKV); "
        "ray: each runner a Ray actor in its own process (default with --ray-address)",
    )
    s.add_argument(
        "--autoscale",
        default=None,
        metavar="MIN:MAX",
        help="start and drain runners on the scaling advice, keeping MIN..MAX (dead ones replaced)",
    )
    s.add_argument(
        "--no-cuda-graphs",
        action="store_true",
        help="run every decode step eagerly on a GPU (by default decode steps replay CUDA "
        "graphs captured at start, with the torch attention backend)",
    )
    s.add_argument(
        "--no-distkv",
        action="store_true",
        help="no DistKV: a prompt longer than one runner's KV cache is refused (by default "
        "thread runners lend each other KV blocks for it)",
    )
    s.add_argument(
        "--no-fair-share",
        action="store_true",
        help="serve waiting requests first come, first served (by default tenants share the "
        "runners by weighted service: scheduler/policy/fairness.py)",
    )
    s.add_argument(
        "--no-runner-restart",
        action="store_true",
        help="leave a dead runner dead (by default it is replaced, with backoff)",
    )
    s.add_argument(
        "--ray-address",
        default=None,
        help="join this Ray cluster (e.g. auto, or HOST:6379) instead of starting a local Ray",
    )


def _source_args(s) -> None:
    s.add_argument(
        "--lora-source-root",
        default=None,
        metavar="DIR|s3://BUCKET/PREFIX",
        help="turn on vLLM's dynamic LoRA API (POST /v1/load_lora_adapter, "
        "/v1/unload_lora_adapter) and loading on first use: tenant T loads adapters from "
        "DIR/T/ (or under s3://BUCKET/PREFIX/T/, through s3fs and the AWS environment) only "
        "(docs/api.md)",
    )
    s.add_argument(
        "--lora-source-timeout-s",
        type=_timeout_s,
        default=15.0,
        metavar="S",
        help="an object store that does not connect or answer a read within S seconds fails "
        "the load with 504 source_timeout (default 15; 0.1-300)",
    )


def _timeout_s(value: str) -> float:
    """--lora-source-timeout-s: a finite number of seconds in 0.1..300."""
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"want seconds, got {value!r}") from None
    if not math.isfinite(seconds) or not 0.1 <= seconds <= 300:
        raise argparse.ArgumentTypeError(f"want 0.1-300 seconds, got {value!r}")
    return seconds
