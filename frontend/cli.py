"""`punica-x` command line: `serve` runs the HTTP server; `admin tenant ...` talks to it;
`prepare` builds the kernels and converts the default model ahead of the first start.

    punica-x prepare [--isa native|avx2|avx512|avx512_bf16] [--all-isas] [--no-model]
    punica-x serve [--model PATH] [--quantization auto|none|int8|int4]
                   [--quant-activations int16|int8|float] [--dtype auto|float32|...]
                   [--lora-dtype auto|bfloat16|...] [--attention-workers N]
                   [--batch-invariant auto|on|off]
                   [--host 127.0.0.1] [--port 8000] [--data-dir DIR]
    punica-x admin tenant create NAME [--max-concurrent N] [--tokens-per-minute N] [--weight W]
    punica-x admin tenant weight NAME W
    punica-x admin tenant list
    punica-x admin tenant revoke NAME
    punica-x admin status
    punica-x admin scale up [--count K]
    punica-x admin scale down [--runner ID | --count K]

The admin commands read the admin token from the data dir (or $PUNICA_X_ADMIN_TOKEN) and
call the running server at --url.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import replace
from pathlib import Path

from frontend.cli_admin import admin, admin_parser

DEFAULT_DATA_DIR = os.environ.get("PUNICA_X_DATA", "data")
# ModelConfig.QUANTIZATION, spelled here so that --help needs no torch (a test keeps them equal)
QUANTIZATION_CHOICES = ("auto", "none", "int8", "int4")


def serve(args) -> int:
    import uvicorn

    from frontend.http.app import create_app
    from frontend.tenancy.store import StoreError

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    limits = parse_limits(args.limit or [])
    if limits is None:
        return 2
    try:
        config = server_config(args, limits)
    except ValueError as exc:  # a flag's value, or a combination, the config refuses
        print(f"punica-x: {exc}", file=sys.stderr)
        return 2
    try:
        app = create_app(config)
    except StoreError as exc:
        print(f"punica-x: cannot start: {exc}", file=sys.stderr)
        return 1
    state = app.state.server
    _greet(state, args)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            access_log=False,
            log_level="warning",
            ws_max_size=config.limits.max_ws_frame_bytes,
        )
    )
    state.stop_server = lambda: setattr(server, "should_exit", True)
    server.run()
    if state.load_error is not None:  # as vLLM: a server that cannot build its model exits
        print(
            f"punica-x: cannot start: building the model failed: {state.load_error}",
            file=sys.stderr,
        )
        return 1
    return 0


def server_config(args, limits):
    """serve's ServerConfig from its arguments; ValueError naming a bad flag or combination."""
    from frontend.config import ServerConfig, distkv_off
    from punica_x.api import quiet_wait_s

    engine = engine_config(args)
    quiet_wait_s()  # the environment's value, refused here rather than at the model's load
    if args.runner_backend is None:
        args.runner_backend = "ray" if args.ray_address else "thread"
    if args.ray_address and args.runner_backend != "ray":
        raise ValueError("--ray-address needs --runner-backend ray")
    devices = runner_devices(args)
    if (why_no_distkv := distkv_off(engine)) is not None and not args.no_distkv:
        logging.getLogger("punica_x.server").info("DistKV is off: %s", why_no_distkv)
    return ServerConfig(
        host=args.host,
        port=args.port,
        data_dir=Path(args.data_dir),
        engine=engine,
        limits=limits,
        runners=args.runners or max(1, len(devices)),
        runner_backend=args.runner_backend,
        devices=devices,
        ray_address=args.ray_address,
        autoscale=args.autoscale,
        distkv=not args.no_distkv and why_no_distkv is None,
        fair_share=not args.no_fair_share,
        restart_runners=not args.no_runner_restart,
    )


def _greet(state, args) -> None:
    url = f"http://{args.host}:{args.port}/"
    print(f"punica-x: web chat at {url}", flush=True)
    note = "created" if state.admin_token_created else "stored"
    print(f"punica-x: admin token {note} in {state.admin_token_path} (mode 0600)", flush=True)
    print(
        f"punica-x: create a tenant with: punica-x admin tenant create NAME --url {url} "
        f"--data-dir {args.data_dir}",
        flush=True,
    )


def parse_limits(items: list[str]):
    """Limits with `--limit NAME=N` overrides, or None (the reason printed) if one is bad."""
    from frontend.config import Limits

    limits = Limits()
    for item in items:
        name, _, value = item.partition("=")
        if name not in Limits.__dataclass_fields__ or not value.isdigit():
            fields = sorted(Limits.__dataclass_fields__)
            print(f"--limit wants NAME=INTEGER, NAME one of {fields}", file=sys.stderr)
            return None
        limits = replace(limits, **{name: int(value)})
    return limits


def runner_devices(args) -> tuple[str, ...]:
    """The thread runners' devices from --devices (scheduler/runners/devices.py); () for Ray runners
    (Ray gives each one GPU), where --devices is refused. ValueError naming the problem."""
    if args.runner_backend == "ray":
        if args.devices is not None:
            raise ValueError("--devices is for thread runners (Ray gives each runner one GPU)")
        return ()
    import torch

    from scheduler.runners.devices import parse_devices

    return parse_devices(args.devices, torch.cuda.device_count())


def engine_config(args):
    """The runners' EngineConfig from `serve`'s arguments (a Ray runner gets it whole)."""
    from punica_x.api import EngineConfig, MemoryConfig, ModelConfig

    model = ModelConfig(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        quantization=args.quantization,
        quant_activations=args.quant_activations,
        batch_invariant=args.batch_invariant,
        simulated_step_ms=args.simulated_step_ms,
    )
    memory = MemoryConfig(utilization=args.memory_utilization)
    if args.kv_fraction is not None:
        memory = replace(memory, kv_fraction=args.kv_fraction)
    engine = EngineConfig(model=model, memory=memory, cuda_graphs=not args.no_cuda_graphs)
    engine = replace(engine, lora=replace(engine.lora, lora_dtype=args.lora_dtype))
    if args.max_batch_size is not None:
        engine = replace(engine, batch=replace(engine.batch, max_batch_size=args.max_batch_size))
    engine = replace(engine, batch=replace(engine.batch, policy=args.policy))
    if args.kv_cache_bytes is not None:
        engine = replace(engine, cache=replace(engine.cache, kv_cache_bytes=args.kv_cache_bytes))
    if args.no_prefix_caching:
        engine = replace(engine, cache=replace(engine.cache, prefix_caching=False))
    engine = replace(engine, attention_workers=args.attention_workers, overlap=args.overlap)
    return replace(engine, stream_interval=args.stream_interval)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["prepare"]:
        from punica_x.api import prepare_main as prepare

        return prepare(argv[1:])
    args = build_parser().parse_args(argv)
    return serve(args) if args.command == "serve" else admin(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="punica-x", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("prepare", help="build the kernels and convert the model (punica-x prepare -h)")
    _serve_parser(sub)
    admin_parser(sub, DEFAULT_DATA_DIR)
    return parser


def _serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="run the HTTP server (REST, OpenAI API, web chat)")
    s.add_argument(
        "--model", default=None, help="HF directory or .gguf (default: SmolLM2-135M-Instruct)"
    )
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    s.add_argument("--max-batch-size", type=int, default=None, help="requests per batch (32)")
    _quant_args(s)
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


if __name__ == "__main__":
    sys.exit(main())
