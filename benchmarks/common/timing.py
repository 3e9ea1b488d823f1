"""Timing: seconds per call of a callable (warm-up, repeats, median), the machine's memory-copy
and read bandwidth, and percentiles of latency samples."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Timing:
    median: float
    p10: float
    p90: float
    repeats: int


def measure(
    fn: Callable[[], object],
    warmup: int = 3,
    repeats: int = 20,
    between: Callable[[], object] | None = None,
) -> Timing:
    """Seconds per call of fn (median over repeats). `between` runs untimed before each call."""
    for _ in range(warmup):
        if between:
            between()
        fn()
    times = []
    for _ in range(repeats):
        if between:
            between()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return Timing(
        statistics.median(times), times[len(times) // 10], times[(len(times) * 9) // 10], repeats
    )


def copy_bandwidth(
    nbytes: int = 512 << 20, repeats: int = 10, device: torch.device | str = "cpu"
) -> float:
    """Bytes per second moved by a large tensor copy, counting the read and the write."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if src.is_cuda else (lambda: None)
    t = measure(lambda: (dst.copy_(src), sync()), warmup=2, repeats=repeats)
    return 2 * nbytes / t.median


def read_bandwidth(
    nbytes: int = 512 << 20, repeats: int = 10, device: torch.device | str = "cpu"
) -> float:
    """Bytes per second read by a reduction (a sum) over a large float32 tensor: the floor
    of a kernel that only reads its weights, steadier than a copy's figure (a copy's writes
    swing with the machine's write-allocate traffic; 30-56 GB/s within one run seen on one
    VM)."""
    src = torch.ones(nbytes // 4, device=device)
    sync = torch.cuda.synchronize if src.is_cuda else (lambda: None)
    t = measure(lambda: (src.sum(), sync()), warmup=2, repeats=repeats)
    return nbytes / t.median


def percentile(values: list[float], q: float) -> float:
    """The q-quantile of the samples (the one at index q * n of the sorted list); nan if none."""
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def latency_ms(ttft: list[float], itl: list[float]) -> dict[str, float]:
    """Streams' latencies in ms: {ttft_p50_ms, ttft_p99_ms, itl_p50_ms, itl_p99_ms} of times to
    first token and inter-token gaps in seconds."""
    return {
        f"{name}_{label}_ms": percentile(values, q) * 1e3
        for name, values in (("ttft", ttft), ("itl", itl))
        for label, q in (("p50", 0.5), ("p99", 0.99))
    }
