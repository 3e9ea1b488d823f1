"""Memory planning: the KV cache and the adapter pool sized from what the device has left
(vLLM's gpu_memory_utilization convention), instead of fixed byte counts.

After the weights are loaded, the engine runs one profiling step at its largest size (a
prompt of max_batched_tokens tokens that asks for every prompt logprob: the most rows, and
a logits matrix of that many rows) on a KV cache just large enough for it, and measures the
step's peak memory above what was in use before it. Then (plan_memory, a pure function):

    budget  = utilization x the device's total memory (this engine's share, as vLLM's
              gpu_memory_utilization: two engines on one device take 0.45 each)
    spare   = budget - the weights - the profiling step's peak - host reservations (CPU:
              the swap pool and the adapters' host cache live in the same RAM)
    spare   = at most what is free now minus the step's peak and the reservations (memory
              another process or engine holds is not ours to plan)
    KV      = kv_fraction x spare  -> num_blocks = KV // bytes per block
    adapters = the rest of spare (the device slots' byte budget); with max_loras the
              adapters' budget is what those slots cost and KV the rest of spare
    max_model_len = min(the model's limit, num_blocks x block_size)

and the engine rebuilds its KV cache and adapter pool at those sizes, logging the plan. A
plan with no room (spare <= 0, or not one block) raises MemoryPlanError naming the figures.

Probes (injectable, so the planner is tested on any machine): CudaProbe reads
torch.cuda.mem_get_info and the allocator's peak; CpuProbe reads the cgroup's limit and
usage where one is set, else /proc/meminfo (MemTotal, MemAvailable), and samples this
process's resident set during the profiling step for its peak."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch


class MemoryPlanError(ValueError):
    """The device has no room for a KV cache after the weights and one step."""


@dataclass(frozen=True)
class MemorySnapshot:
    """total_bytes: the device's (or the cgroup's) memory; free_bytes: free now (what this
    and other processes hold is not)."""

    total_bytes: int
    free_bytes: int


class MemoryProbe(Protocol):
    def snapshot(self) -> MemorySnapshot:
        """The device's memory now."""

    def peak_during(self, fn: Callable[[], None]) -> int:
        """Run fn; the most bytes it had in use at once above what was in use before it."""


@dataclass(frozen=True)
class MemoryPlan:
    """What plan_memory decided, in bytes unless named otherwise."""

    total_bytes: int
    budget_bytes: int
    free_bytes: int
    weights_bytes: int
    step_peak_bytes: int
    host_reserved_bytes: int
    kv_bytes: int
    adapter_bytes: int
    num_blocks: int
    max_model_len: int

    def describe(self) -> str:
        gib = 1 << 30
        return (
            f"memory plan: {self.budget_bytes / gib:.2f} GiB of {self.total_bytes / gib:.2f} "
            f"GiB ({self.free_bytes / gib:.2f} free); weights {self.weights_bytes / gib:.2f}, "
            "one step's peak "
            f"{self.step_peak_bytes / gib:.2f}, host reservations "
            f"{self.host_reserved_bytes / gib:.2f}; KV cache {self.kv_bytes / gib:.2f} GiB "
            f"({self.num_blocks} blocks), adapters {self.adapter_bytes / gib:.2f} GiB; "
            f"max_model_len {self.max_model_len}"
        )


def plan_memory(
    snapshot: MemorySnapshot,
    weights_bytes: int,
    step_peak_bytes: int,
    utilization: float,
    kv_fraction: float,
    bytes_per_block: int,
    block_size: int,
    model_max_len: int,
    host_reserved_bytes: int = 0,
    adapter_bytes: int | None = None,
) -> MemoryPlan:
    """The plan described in the module docstring (pure: numbers in, numbers out).
    adapter_bytes: the adapters' budget as given (LoraConfig.max_loras), the KV cache then
    taking the rest of spare instead of kv_fraction of it."""
    budget = int(utilization * snapshot.total_bytes)
    needs = step_peak_bytes + host_reserved_bytes
    share = budget - weights_bytes - needs
    free = snapshot.free_bytes - needs
    spare = min(share, free)
    gib = 1 << 30
    if spare <= 0:
        why = (
            f"{utilization:g} of {snapshot.total_bytes / gib:.2f} GiB is {budget / gib:.2f} GiB, "
            f"of which the weights take {weights_bytes / gib:.2f} GiB"
            if share <= free
            else f"only {snapshot.free_bytes / gib:.2f} GiB are free (other processes or "
            "engines hold the rest)"
        )
        raise MemoryPlanError(
            f"no memory left for a KV cache: {why}, one step needs "
            f"{step_peak_bytes / gib:.2f} GiB and the host reservations "
            f"{host_reserved_bytes / gib:.2f} GiB (change the memory utilization, or lower "
            "max_batched_tokens or the reservations)"
        )
    kv_bytes = int(spare * kv_fraction) if adapter_bytes is None else spare - adapter_bytes
    num_blocks = kv_bytes // bytes_per_block
    if num_blocks < 1:
        share = (
            f"spare {spare} bytes x kv_fraction {kv_fraction:g}"
            if adapter_bytes is None
            else f"spare {spare} bytes less the {adapter_bytes} max_loras stands for"
        )
        raise MemoryPlanError(
            f"{max(0, kv_bytes)} bytes of KV cache hold no {bytes_per_block}-byte block ({share})"
        )
    return MemoryPlan(
        total_bytes=snapshot.total_bytes,
        budget_bytes=budget,
        free_bytes=snapshot.free_bytes,
        weights_bytes=weights_bytes,
        step_peak_bytes=step_peak_bytes,
        host_reserved_bytes=host_reserved_bytes,
        kv_bytes=num_blocks * bytes_per_block,
        adapter_bytes=spare - kv_bytes,
        num_blocks=num_blocks,
        max_model_len=min(model_max_len, num_blocks * block_size),
    )


class CudaProbe:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def snapshot(self) -> MemorySnapshot:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # cached but unused blocks are free for the plan
        free, total = torch.cuda.mem_get_info(self.device)
        return MemorySnapshot(total, free)

    def peak_during(self, fn: Callable[[], None]) -> int:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        fn()
        torch.cuda.synchronize(self.device)
        return max(0, torch.cuda.max_memory_allocated(self.device) - before)


CGROUP = Path("/sys/fs/cgroup")


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def _meminfo(path: Path = Path("/proc/meminfo")) -> dict[str, int]:
    """/proc/meminfo's fields in bytes."""
    out = {}
    for line in path.read_text().splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[name] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class CpuProbe:
    """Host RAM: the cgroup v2 limit and what it leaves where a limit is set (a container),
    else /proc/meminfo's MemTotal and MemAvailable (whichever leaves less free)."""

    def __init__(self, cgroup: Path = CGROUP, meminfo: Path = Path("/proc/meminfo")) -> None:
        self.cgroup, self.meminfo = cgroup, meminfo

    def snapshot(self) -> MemorySnapshot:
        info = _meminfo(self.meminfo)
        total, free = info["MemTotal"], info["MemAvailable"]
        limit = _read_int(self.cgroup / "memory.max")
        current = _read_int(self.cgroup / "memory.current")
        if limit is not None and current is not None and limit < total:
            total, free = limit, min(free, max(0, limit - current))
        return MemorySnapshot(total, free)

    def peak_during(self, fn: Callable[[], None], interval_s: float = 0.001) -> int:
        before = peak = _rss_bytes()
        done = threading.Event()

        def sample() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, _rss_bytes())
                time.sleep(interval_s)

        sampler = threading.Thread(target=sample, name="punica-x-memory-probe", daemon=True)
        sampler.start()
        try:
            fn()
        finally:
            done.set()
            sampler.join()
        return max(0, max(peak, _rss_bytes()) - before)


def probe_for(device: torch.device) -> MemoryProbe:
    return CudaProbe(device) if device.type == "cuda" else CpuProbe()


def weights_bytes(model: torch.nn.Module) -> int:
    """The bytes of the model's parameters and buffers (RoPE tables)."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def profiling_prompt(config, max_model_len: int, vocab_size: int) -> list[int]:
    """The profiling step's prompt: max_batched_tokens tokens (one step prefills it all),
    fewer where the context is shorter."""
    n = max(1, min(config.batch.max_batched_tokens, max_model_len - 1))
    return [1 + i % (vocab_size - 1) for i in range(n)]


def profiling_config(config, max_model_len: int):
    """The config to profile with: a KV cache just large enough for the profiling prompt
    (and no swap pool), the adapter pool unchanged."""
    n = len(profiling_prompt(config, max_model_len, 2))
    blocks = -(-(n + 1) // config.cache.block_size) + 1
    cache = dataclasses.replace(config.cache, num_blocks=blocks, swap_blocks=0)
    return dataclasses.replace(config, cache=cache)


def planned_config(config, plan: MemoryPlan):
    """`config` with the plan's KV blocks and adapter budget."""
    cache = dataclasses.replace(config.cache, num_blocks=plan.num_blocks)
    lora = dataclasses.replace(config.lora, device_bytes=max(1, plan.adapter_bytes))
    return dataclasses.replace(config, cache=cache, lora=lora)


def host_reserved_bytes(config, bytes_per_block: int, device: torch.device) -> int:
    """What else an engine on a CPU takes from the same RAM: the MLFQ swap pool and the
    adapters' host cache (on a GPU they live in host memory, not the device's)."""
    if device.type != "cpu":
        return 0
    swap = 0
    if config.batch.policy == "mlfq":
        c = config.cache
        swap = c.swap_bytes if c.swap_blocks is None else c.swap_blocks * bytes_per_block
    return swap + config.lora.host_bytes


def plan_engine(engine, utilization: float, probe: MemoryProbe) -> MemoryPlan:
    """One profiling step of `engine` (built on profiling_config) at its largest size, then
    the plan from what the device has left (the module docstring)."""
    from punica_x.core import SamplingParams

    config = engine.config
    ids = profiling_prompt(config, engine.max_model_len, engine.model.dims.vocab_size)
    sampling = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)

    def profile() -> None:
        engine.add_request(ids, sampling, request_id="memory-profile")
        while engine.requests:
            engine.step()

    peak = probe.peak_during(profile)
    bytes_per_block = engine.cache.spec.bytes_per_block
    return plan_memory(
        probe.snapshot(),
        weights_bytes(engine.model),
        peak,
        utilization,
        config.memory.kv_fraction,
        bytes_per_block,
        config.cache.block_size,
        engine.max_model_len,
        host_reserved_bytes(config, bytes_per_block, engine.device),
        config.lora.device_bytes if config.lora.max_loras else None,
    )
