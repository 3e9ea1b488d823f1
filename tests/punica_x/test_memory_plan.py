"""Memory planning (punica_x/engine/memory.py): the pure plan, the CPU probe over fake
/proc and cgroup files, and an engine sized by an injected probe (the profiling step runs,
the KV cache and adapter pool take the plan's sizes, max_model_len is capped, and the engine
still generates what a fixed-size engine does)."""

from __future__ import annotations

import dataclasses
import mmap
import time

import pytest
from helpers import tiny_llm

from punica_x import SamplingParams
from punica_x.config import CacheConfig, EngineConfig, GiB, MemoryConfig, ModelConfig
from punica_x.engine import Engine
from punica_x.engine.memory import (
    CpuProbe,
    MemoryPlanError,
    MemorySnapshot,
    plan_memory,
    profiling_config,
)

MiB = 1 << 20


def plan(total=80 * GiB, free=70 * GiB, weights=16 * GiB, peak=2 * GiB, **kw):
    args = dict(
        utilization=0.9,
        kv_fraction=0.8,
        bytes_per_block=2 * MiB,
        block_size=16,
        model_max_len=131072,
    )
    args.update(kw)
    return plan_memory(MemorySnapshot(total, free), weights, peak, **args)


def test_the_plan_splits_what_the_weights_and_a_step_leave():
    p = plan()
    spare = int(0.9 * 80 * GiB) - 16 * GiB - 2 * GiB  # 54 GiB
    assert p.num_blocks == int(spare * 0.8) // (2 * MiB)
    assert p.kv_bytes == p.num_blocks * 2 * MiB
    assert p.adapter_bytes == spare - int(spare * 0.8)
    assert p.max_model_len == 131072  # 22118 blocks x 16 tokens hold more than the model's


def test_the_context_is_capped_by_what_the_cache_holds():
    p = plan(total=24 * GiB, free=24 * GiB, weights=16 * GiB, peak=1 * GiB)
    assert p.max_model_len == p.num_blocks * 16 < 131072


def test_free_memory_bounds_the_plan():
    """Another process holds 40 of 80 GiB: the plan fits in what is free, not in 0.9 x 80."""
    p = plan(free=40 * GiB, weights=16 * GiB)
    assert p.kv_bytes + p.adapter_bytes <= 40 * GiB - 2 * GiB
    assert p.num_blocks == int((38 * GiB) * 0.8) // (2 * MiB)


def test_host_reservations_come_off_the_top():
    assert plan(host_reserved_bytes=10 * GiB).num_blocks < plan().num_blocks


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(weights=75 * GiB), "the weights take 75.00 GiB"),
        (dict(free=1 * GiB), "only 1.00 GiB are free"),
        (dict(peak=80 * GiB), "one step needs 80.00 GiB"),
        (dict(bytes_per_block=100 * GiB), "hold no"),
    ],
)
def test_no_room_is_an_error_naming_the_figures(kw, match):
    with pytest.raises(MemoryPlanError, match=match):
        plan(**kw)


@pytest.mark.parametrize("bad", [0, -0.1, 1.01, float("nan"), float("inf"), True, "0.9"])
def test_bad_utilization_is_refused(bad):
    with pytest.raises(ValueError, match="utilization"):
        MemoryConfig(utilization=bad)


@pytest.mark.parametrize("bad", [0, 1, 1.5, -1, float("nan"), None, False])
def test_bad_kv_fraction_is_refused(bad):
    with pytest.raises(ValueError, match="kv_fraction"):
        MemoryConfig(kv_fraction=bad)


def test_planning_is_on_by_default_on_cuda_only():
    import torch

    assert MemoryConfig().effective_utilization(torch.device("cuda")) == 0.9
    # a cache size given (tests, --kv-cache-bytes) is kept unless planning is asked for
    assert MemoryConfig().effective_utilization(torch.device("cuda"), sized=True) is None
    assert MemoryConfig(utilization=0.5).effective_utilization(torch.device("cuda"), True) == 0.5
    assert not CacheConfig().sized and CacheConfig(kv_cache_bytes=1 << 20).sized
    assert CacheConfig(num_blocks=4).sized
    assert MemoryConfig().effective_utilization(torch.device("cpu")) is None
    assert MemoryConfig(utilization=0.3).effective_utilization(torch.device("cpu")) == 0.3


def test_cpu_probe_reads_meminfo_and_a_cgroup_limit(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(
        "MemTotal:       25165824 kB\nMemFree:  100 kB\nMemAvailable:   20971520 kB\n"
    )
    cgroup = tmp_path / "cg"
    cgroup.mkdir()
    assert CpuProbe(cgroup, meminfo).snapshot() == MemorySnapshot(24 * GiB, 20 * GiB)
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text(f"{GiB}\n")
    assert CpuProbe(cgroup, meminfo).snapshot() == MemorySnapshot(24 * GiB, 20 * GiB)
    (cgroup / "memory.max").write_text(f"{8 * GiB}\n")  # a container of 8 GiB, 1 in use
    assert CpuProbe(cgroup, meminfo).snapshot() == MemorySnapshot(8 * GiB, 7 * GiB)


def test_cpu_probe_sees_a_step_peak():
    probe = CpuProbe()

    def allocate():  # a step holds its activations a while (torch ops release the GIL)
        # fresh anonymous pages (an allocator could hand back memory already resident in a
        # long-lived process: a test suite's), every page touched
        block = mmap.mmap(-1, 64 * MiB)
        for offset in range(0, 64 * MiB, mmap.PAGESIZE):
            block[offset] = 1
        time.sleep(0.05)
        block.close()

    assert probe.peak_during(allocate) >= 32 * MiB


class FakeProbe:
    """A device of `total` bytes with `free` free; records the profiling step it ran."""

    def __init__(self, total: int, free: int, peak: int) -> None:
        self.total, self.free, self.peak = total, free, peak
        self.profiled: list[int] = []

    def snapshot(self) -> MemorySnapshot:
        return MemorySnapshot(self.total, self.free)

    def peak_during(self, fn) -> int:
        from punica_x.engine import engine as engine_mod

        before = engine_mod.Engine.step
        steps = []

        def counting(self_):
            steps.append(len(self_.requests))
            return before(self_)

        engine_mod.Engine.step = counting
        try:
            fn()
        finally:
            engine_mod.Engine.step = before
        self.profiled.append(len(steps))
        return self.peak


def test_an_engine_takes_the_plans_sizes(tiny_model_dir):
    base = tiny_llm(tiny_model_dir)
    config = dataclasses.replace(
        base.engine.config,
        memory=MemoryConfig(utilization=0.5, kv_fraction=0.75),
        model=ModelConfig(model=str(tiny_model_dir), dtype="float32"),
        lora=dataclasses.replace(base.engine.config.lora, host_bytes=2 * MiB),
    )
    probe = FakeProbe(total=64 * MiB, free=60 * MiB, peak=4 * MiB)
    engine = Engine(config, probe=probe)
    assert probe.profiled == [1]  # one step prefilled the whole profiling prompt
    plan = engine.memory_plan
    weights = plan.weights_bytes
    spare = 32 * MiB - weights - 4 * MiB - 2 * MiB  # the adapters' host cache: same RAM
    assert 0 < weights < 8 * MiB
    assert (
        engine.cache.allocator.num_blocks
        == plan.num_blocks
        == int(spare * 0.75) // (engine.cache.spec.bytes_per_block)
    )
    assert engine.config.lora.device_bytes == plan.adapter_bytes
    assert engine.max_model_len == min(base.engine.max_model_len, plan.num_blocks * 16)
    assert not engine.requests and engine.cache.allocator.num_free == plan.num_blocks


def test_a_planned_engine_generates_as_a_fixed_one(tiny_model_dir, tiny_adapters):
    fixed = tiny_llm(tiny_model_dir)
    planned = tiny_llm(tiny_model_dir, utilization=0.05, kv_fraction=0.1, host_bytes=64 * MiB)
    assert planned.engine.memory_plan is not None and fixed.engine.memory_plan is None
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for llm in (fixed, planned):
        llm.load_adapter("a", str(tiny_adapters["r16"]))
    prompts, adapters = ["hello world", "the quick brown fox"], [None, "a"]
    want = [o.token_ids for o in fixed.generate(prompts, adapters, sp)]
    assert [o.token_ids for o in planned.generate(prompts, adapters, sp)] == want


def test_the_profiling_cache_fits_one_profiling_prompt():
    config = EngineConfig()
    small = profiling_config(config, 8192)
    assert small.cache.num_blocks * small.cache.block_size >= config.batch.max_batched_tokens + 1
    assert profiling_config(config, 100).cache.num_blocks <= 8


def test_max_loras_fixes_the_adapters_budget_and_kv_takes_the_rest():
    fixed = plan(adapter_bytes=3 * GiB)
    spare = int(0.9 * 80 * GiB) - 16 * GiB - 2 * GiB
    assert fixed.adapter_bytes == 3 * GiB
    assert fixed.num_blocks == (spare - 3 * GiB) // (2 * MiB)
    with pytest.raises(MemoryPlanError, match="max_loras"):
        plan(adapter_bytes=spare)  # nothing left for one block


def test_an_engine_plans_with_the_bytes_max_loras_stands_for(tiny_model_dir, caplog):
    from punica_x.engine.build import lora_target
    from punica_x.lora.slots import slot_bytes

    base = tiny_llm(tiny_model_dir)
    lora = dataclasses.replace(base.engine.config.lora, host_bytes=2 * MiB, max_loras=3)
    config = dataclasses.replace(
        base.engine.config,
        memory=MemoryConfig(utilization=0.5, kv_fraction=0.75),
        model=ModelConfig(model=str(tiny_model_dir), dtype="float32"),
        lora=lora,
    )
    with caplog.at_level("INFO", logger="punica_x.lora"):
        engine = Engine(config, probe=FakeProbe(total=64 * MiB, free=60 * MiB, peak=4 * MiB))
    target = lora_target(engine.model.dims, engine.model.edge_digests)
    each = slot_bytes(target, lora.max_lora_rank, 4)
    assert engine.memory_plan.adapter_bytes == engine.adapters.config.device_bytes == 3 * each
    spare = 32 * MiB - engine.memory_plan.weights_bytes - 4 * MiB - 2 * MiB
    per_block = engine.cache.spec.bytes_per_block
    assert engine.cache.allocator.num_blocks == (spare - 3 * each) // per_block
    assert "max_loras: 3 adapters of rank" in caplog.text
