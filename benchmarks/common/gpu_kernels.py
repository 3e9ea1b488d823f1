"""bench_generate --device cuda's kernel time: the milliseconds of CUDA kernels in a decode
step (torch.profiler, every request decoding, launched eagerly), with the kernels that took
the most GPU time logged; over the step's wall time it is the GPU's busy share."""

from __future__ import annotations

import torch

from common.report import log
from punica_x import LLM


def step_kernel_ms(
    llm: LLM, prompts, adapters, sp, steps: int = 4, eager: bool = True
) -> float | str:
    """Milliseconds of CUDA kernels in a decode step (torch.profiler, mean over `steps`
    steps, every request decoding, launched eagerly, or as the engine's CUDA graphs replay
    them with eager=False; the top kernels logged). Over the
    step's unprofiled wall time (gpu_busy): near 1, the step is the GPU's; far below, the
    host's launches and Python are the step (what CUDA graphs cut). The profiler's error
    text where it cannot say (a diagnostic, never a reason to stop the run)."""
    if not torch.cuda.is_available():
        return "no CUDA"
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    if eager and engine.graphs is not None:  # the same kernels, each one launched by name
        engine.graphs.enabled = False
    for p, a in zip(prompts, adapters):
        engine.add_request(p, sp, a)
    while any(not r.output_token_ids for r in engine.requests.values()):
        engine.step()
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        busy_us = sum(e.time_range.elapsed_us() for e in kernels)  # kernels and copies
        _log_top_kernels(kernels, steps)
        return busy_us / 1e3 / steps
    except Exception as exc:  # noqa: BLE001 - reported in the table instead
        return f"profiler: {exc}"
    finally:
        for rid in list(engine.requests):
            engine.abort(rid)
        if engine.graphs is not None:
            engine.graphs.enabled = True


def _log_top_kernels(kernels, steps: int, top: int = 8) -> None:
    """The kernels that took the most GPU time per step, with their calls per step."""
    by: dict[str, list[float]] = {}
    for e in kernels:
        by.setdefault(e.name[:90], []).append(e.time_range.elapsed_us())
    ranked = sorted(by.items(), key=lambda kv: -sum(kv[1]))[:top]
    for name, times in ranked:
        log(f"  {sum(times) / steps / 1e3:7.3f} ms/step {len(times) / steps:6.1f} calls  {name}")
