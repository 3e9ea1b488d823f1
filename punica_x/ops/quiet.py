"""Whether the machine is quiet enough to time kernels: how busy other processes keep the
CPUs this process may run on.

A timing taken while another process computes on the same cores is not just noisier but
biased: kernels that split their work over threads wait for the slowest thread, so two
kernels' ratio moves (the batch-invariant order's cost on a 2-core AMX Xeon: 7-10% idle,
30-40% beside two busy loops). Decisions that time kernels once and keep the result
(models/invariant_choice.py) take their figures when others_busy() is at most QUIET_BUSY."""

from __future__ import annotations

import os
import time

QUIET_BUSY = 0.25  # at most this share of our CPUs busy with other processes' work
PROC_STAT = "/proc/stat"


def others_busy(window_s: float = 0.25) -> float | None:
    """The share (0..1) of the time of the CPUs in this process's affinity that other
    processes kept busy over the next window_s seconds (this process's own CPU time taken
    out); None where /proc/stat cannot be read (not Linux)."""
    cpus = _affinity()
    before, own_before = _busy_ticks(cpus), _own_ticks()
    if before is None:
        return None
    time.sleep(window_s)
    after, own_after = _busy_ticks(cpus), _own_ticks()
    if after is None:
        return None
    total = after[1] - before[1]
    busy = (after[0] - before[0]) - (own_after - own_before)
    return min(1.0, max(0.0, busy / total)) if total > 0 else None


def is_quiet(busy: float | None) -> bool:
    return busy is None or busy <= QUIET_BUSY


def wait_for_quiet(patience_s: float, window_s: float = 0.25) -> float | None:
    """others_busy(), sampled until it is quiet or patience_s has passed; the last sample."""
    deadline = time.monotonic() + patience_s
    while True:
        busy = others_busy(window_s)
        if is_quiet(busy) or time.monotonic() >= deadline:
            return busy


def _affinity() -> set[int] | None:
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return None


def _busy_ticks(cpus: set[int] | None) -> tuple[int, int] | None:
    """(busy, total) clock ticks so far summed over `cpus` (None: all), from /proc/stat."""
    try:
        with open(PROC_STAT) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    busy = total = 0
    for line in lines:
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu":
            continue
        if cpus is not None and int(name[3:]) not in cpus:
            continue
        ticks = [int(v) for v in fields[:8]]  # user nice system idle iowait irq softirq steal
        total += sum(ticks)
        busy += sum(ticks) - ticks[3] - ticks[4]
    return (busy, total) if total else None


def _own_ticks() -> float:
    t = os.times()
    return (t.user + t.system) * os.sysconf("SC_CLK_TCK")
