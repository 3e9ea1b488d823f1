"""Set-up work done ahead of the first start: compile the kernels this machine uses and
convert the default model, so no request path (a server's start, a test) ever waits on a
compiler. scripts/bootstrap.sh runs it; `punica-x prepare` is the same command.

    python -m punica_x.prepare [--isa native|avx2|avx512|avx512_bf16] [--all-isas] [--no-model]
                               [--model PATH] [--quantization auto|none|int8|int4]
                               [--remeasure-invariance]

Prints one line per kernel (built, with its time, or already built) and one for the model.
--remeasure-invariance forgets what `--batch-invariant auto` decided on this machine and kernel
build (models/invariant_choice.py) and measures it again for the model, on a quiet machine.
Kernels build in parallel processes, one per extension; the build directories' locks make
a concurrent start wait for a build instead of duplicating or corrupting it.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

import torch

from punica_x.config import ModelConfig
from punica_x.ops import isa as isa_mod
from punica_x.ops._build import CPU_KINDS, is_built, load_extension


def kernel_jobs(isa: str | None, all_isas: bool) -> list[tuple[str, str]]:
    """(kind, isa) pairs this machine needs: the CPU kernels for the chosen level (every
    runnable tuned level with all_isas) and the CUDA SGMV kernels where CUDA works."""
    if all_isas:
        levels = [lvl for lvl in isa_mod.runnable_levels() if lvl != "generic"]
    else:
        levels = [isa_mod.resolve(isa)]
    jobs = [(kind, lvl) for lvl in levels for kind in CPU_KINDS]
    if torch.cuda.is_available():
        jobs.append(("sgmv_cuda", levels[0]))
    return jobs


def _build_one(kind: str, isa: str) -> float:
    start = time.perf_counter()
    load_extension(kind, isa)
    return time.perf_counter() - start


def build_kernels(jobs: list[tuple[str, str]], workers: int) -> None:
    todo = [(k, i) for k, i in jobs if not is_built(k, i)]
    for kind, isa in jobs:
        if (kind, isa) not in todo:
            print(f"prepare: kernel {kind} ({isa}) already built", flush=True)
    if not todo:
        return
    print(f"prepare: building {len(todo)} kernels on {workers} processes ...", flush=True)
    spawn = multiprocessing.get_context("spawn")  # fresh interpreters, no forked torch state
    with ProcessPoolExecutor(max_workers=workers, mp_context=spawn) as pool:
        futures = {pool.submit(_build_one, k, i): (k, i) for k, i in todo}
        for future in as_completed(futures):
            kind, isa = futures[future]
            print(f"prepare: kernel {kind} ({isa}) built in {future.result():.0f} s", flush=True)


def prepare_model(model: str | None, quantization: str) -> None:
    """The model's directory as a runner with `quantization` reads it on this machine (a GGUF
    file's metadata directory where it is read natively, its float copy where it is
    dequantized), made now and cached."""
    from punica_x.models.loader import resolve_model_dir

    start = time.perf_counter()
    served = ModelConfig(model=model, quantization=quantization).served_quantization()
    path = resolve_model_dir(model, served)
    took = time.perf_counter() - start
    print(f"prepare: model ({served}) ready at {path} ({took:.0f} s)", flush=True)


def remeasure_invariance(model: str | None, quantization: str) -> None:
    """Forget every kept batch-invariant decision of this machine and kernel build, then
    load the model (batch_invariant auto) so that its decision is measured and kept now."""
    from punica_x.models.invariant_choice import forget_decisions
    from punica_x.models.loader import load_model

    gone = forget_decisions()
    print(f"prepare: batch invariance: {len(gone)} kept decisions forgotten", flush=True)
    loaded = load_model(ModelConfig(model=model, quantization=quantization))
    print(f"prepare: batch invariance: {loaded.invariance.reason}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="punica-x prepare", description=__doc__.split("\n\n")[0])
    ap.add_argument("--isa", choices=isa_mod.CHOICES, default=None)
    ap.add_argument("--all-isas", action="store_true", help="every level this CPU runs")
    ap.add_argument("--no-model", action="store_true", help="skip the default model")
    ap.add_argument("--model", default=None, help="a model to convert instead of the default")
    ap.add_argument(
        "--quantization",
        choices=ModelConfig.QUANTIZATION,
        default=ModelConfig.quantization,
        help="the serve option the model is prepared for (none: its dequantized copy)",
    )
    ap.add_argument(
        "--remeasure-invariance",
        action="store_true",
        help="measure again what --batch-invariant auto decides for the model on this machine",
    )
    ap.add_argument("--workers", type=int, default=max(1, min(4, torch.get_num_threads())))
    args = ap.parse_args(argv)
    levels = ", ".join(isa_mod.runnable_levels())
    target = isa_mod.resolve(args.isa)
    print(f"prepare: CPU {isa_mod.cpu_model()} runs {levels}; kernels for {target}", flush=True)
    if isa_mod.tuned() or args.isa:
        build_kernels(kernel_jobs(args.isa, args.all_isas), args.workers)
    else:
        print("prepare: no x86 AVX2/AVX-512 here: the PyTorch paths are the default, no kernels")
    if not args.no_model:
        prepare_model(args.model, args.quantization)
    if args.remeasure_invariance:
        remeasure_invariance(args.model, args.quantization)
    return 0


if __name__ == "__main__":
    sys.exit(main())
