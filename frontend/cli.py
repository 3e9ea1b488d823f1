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
from frontend.cli_serve import serve_parser

DEFAULT_DATA_DIR = os.environ.get("PUNICA_X_DATA", "data")


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
        lora_source_root=lora_source_root(args.lora_source_root),
        lora_source_timeout_s=args.lora_source_timeout_s,
    )


def lora_source_root(value: str | None) -> Path | str | None:
    """--lora-source-root as an existing directory, or an object store's URI (checked, its
    client installed; the store is not contacted at start); ValueError naming the flag."""
    if value is None:
        return None
    if "://" in value:
        from frontend.tenancy.object_sources import check_installed, parse_root

        parse_root(value)
        check_installed()
        return value
    root = Path(value)
    if not root.is_dir():
        raise ValueError(f"--lora-source-root {value!r} is not a directory")
    return root.resolve()


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
    lora = replace(engine.lora, lora_dtype=args.lora_dtype, max_loras=args.max_loras)
    engine = replace(engine, lora=replace(lora, max_cpu_loras=args.max_cpu_loras))
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
    serve_parser(sub, DEFAULT_DATA_DIR)
    admin_parser(sub, DEFAULT_DATA_DIR)
    return parser


if __name__ == "__main__":
    sys.exit(main())
