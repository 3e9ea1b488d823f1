"""The command-line flags several benchmarks share. Each helper adds one flag (or a run of
flags that always come together) with the type and default the scripts agree on; where a
script's default or help differs it passes its own, so every script's --help, defaults and
`args` in its JSON stay what they were."""

from __future__ import annotations

import argparse

SERVING_DTYPES = ["auto", "float32", "bfloat16"]


def parser(doc: str | None) -> argparse.ArgumentParser:
    """A parser whose --help prints the script's docstring as written."""
    return argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def add_requests(ap: argparse.ArgumentParser, default: int = 32) -> None:
    ap.add_argument("--requests", type=int, default=default)


def add_max_tokens(ap: argparse.ArgumentParser, default: int = 64) -> None:
    ap.add_argument("--max-tokens", type=int, default=default)


def add_adapters(ap: argparse.ArgumentParser, default: int = 8) -> None:
    ap.add_argument("--adapters", type=int, default=default)


def add_rank(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--rank", type=int, default=16)


def add_threads(ap: argparse.ArgumentParser, help: str | None = None) -> None:
    ap.add_argument("--threads", type=int, default=2, help=help)


def add_rounds(ap: argparse.ArgumentParser, default: int = 3, help: str | None = None) -> None:
    ap.add_argument("--rounds", type=int, default=default, help=help)


def add_decode_steps(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--decode-steps", type=int, default=15)


def add_engine_workload(ap: argparse.ArgumentParser, rounds_help: str | None = None) -> None:
    """--requests 32, --max-tokens 64, --rank 16, --threads 2, --decode-steps 15, --rounds 3:
    bench_generate's workload and step timing (bench_dtype runs the same)."""
    add_requests(ap)
    add_max_tokens(ap)
    add_rank(ap)
    add_threads(ap)
    add_decode_steps(ap)
    add_rounds(ap, help=rounds_help)


def add_dtype(ap: argparse.ArgumentParser, help: str | None = None) -> None:
    """--dtype auto|float32|bfloat16 (auto: punica-x's default on this CPU)."""
    ap.add_argument("--dtype", default="auto", choices=SERVING_DTYPES, help=help)


def add_seed(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--seed", type=int, default=0)


def add_model(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=None)


def add_output_lengths(
    ap: argparse.ArgumentParser, sigma_help: str | None = None, max_help: str | None = None
) -> None:
    """--output-sigma 1.2 and --output-max 512: heavy-tailed output lengths
    (punica_x.workloads.output_lengths)."""
    ap.add_argument("--output-sigma", type=float, default=1.2, help=sigma_help)
    ap.add_argument("--output-max", type=int, default=512, help=max_help)


def add_tenant_load(
    ap: argparse.ArgumentParser, flood_help: str | None = None, light_help: str | None = None
) -> None:
    """--flood 160 (tenant A's requests) and --light 6 (tenant B's)."""
    ap.add_argument("--flood", type=int, default=160, help=flood_help)
    ap.add_argument("--light", type=int, default=6, help=light_help)


def add_shape_model(ap: argparse.ArgumentParser) -> None:
    """--model (default SmolLM2-135M; a key of common.shapes.SHAPES, a random-weight model of
    that shape, or a path) and --tokenizer (a random model's tokenizer folder, for machines
    without the default model); check_shape_model refuses a tokenizer without a shape."""
    from common.shapes import SHAPES

    ap.add_argument(
        "--model",
        default=None,
        help=f"default SmolLM2-135M; a shape ({', '.join(SHAPES)}) or a path",
    )
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder of a --model shape")


def check_shape_model(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    from common.shapes import SHAPES

    if args.tokenizer and args.model not in SHAPES:
        ap.error("--tokenizer needs --model naming a shape")


def batch_sizes(ap: argparse.ArgumentParser, text: str) -> list[int]:
    """--batches' request counts: integers in 1..4096 separated by commas (ap.error, exit 2,
    naming the flag otherwise)."""
    try:
        sizes = [int(b) for b in text.split(",")]
    except ValueError:
        ap.error(f"--batches wants positive integers separated by commas, got {text!r}")
    if not all(0 < b <= 4096 for b in sizes):
        ap.error(f"--batches wants integers in 1..4096, got {text!r}")
    return sizes
