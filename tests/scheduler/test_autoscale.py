"""--autoscale MIN:MAX over thread runners: a queue at the scheduler starts a runner that
takes the waiting request; an idle extra runner is drained back to MIN; a dead runner is
replaced; MIN:MAX is parsed strictly."""

from __future__ import annotations

import asyncio

import pytest

from punica_x import SamplingParams
from punica_x.config import BatchConfig, CacheConfig, EngineConfig, ModelConfig
from punica_x.core import FinishReason
from punica_x.models.loader import load_model
from punica_x.request import EngineRequest
from scheduler.autoscale import AutoscaleConfig, Autoscaler
from scheduler.cluster import Scheduler
from scheduler.runners.local import LocalRunner

SP = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)  # the tiny model holds 512


@pytest.fixture(scope="module")
def factory(tiny_model_dir):
    shared = load_model(ModelConfig(model=str(tiny_model_dir), dtype="float32"))
    config = EngineConfig(
        model=ModelConfig(model="unused", dtype="float32"),
        cache=CacheConfig(num_blocks=64),
        batch=BatchConfig(max_batch_size=1),
    )
    return lambda rid: LocalRunner(config, rid, shared=shared)


async def drain_all(streams):
    outs = []
    for s in streams:
        last = None
        async for out in s:
            last = out
        outs.append(last)
    return outs


def test_queue_scales_up_and_idle_scales_down(factory):
    async def main():
        sched = Scheduler([factory("runner-0")], factory, idle_after=0.3)
        scaler = Autoscaler(sched, AutoscaleConfig(1, 2, interval=0.02))
        task = asyncio.create_task(scaler.run())
        # `a` holds runner-0's one batch slot until `b` is done, however fast this machine
        # decodes (30 tokens of the tiny model could finish before a new runner starts)
        a = await sched.open(EngineRequest([5, 6, 7], LONG, None, "a"))
        b = await sched.open(EngineRequest([8, 9, 10], SP, None, "b"))
        assert b.slot is None  # queued: runner-0's batch is full
        outs = await drain_all([b])
        await a.aclose()
        grown = [s.runner_id for s in sched.slots]
        for _ in range(200):  # wait for the idle runner to be drained (0.3 s idle)
            if len(sched.slots) == 1:
                break
            await asyncio.sleep(0.02)
        task.cancel()
        sched.shutdown()
        return outs, b.runners_seen, grown, [s.runner_id for s in sched.slots], scaler.actions

    outs, placed, grown, left, actions = asyncio.run(main())
    assert all(o.finish_reason is FinishReason.LENGTH for o in outs)
    assert placed == ["runner-1"] and grown == ["runner-0", "runner-1"]
    assert len(left) == 1 and actions[0] == "add runner-1" and actions[1].startswith("drain ")


def test_a_dead_runner_is_replaced(factory):
    async def main():  # (the scheduler does not replace it itself: restart=None)
        sched = Scheduler([factory("runner-0"), factory("runner-1")], factory, restart=None)
        scaler = Autoscaler(sched, AutoscaleConfig(2, 3, interval=0.02))
        sched.slots[0].handle.async_engine.on_step_error = "stop"

        def boom():
            raise RuntimeError("dead engine")

        sched.slots[0].handle.engine.step = boom
        stream = await sched.open(EngineRequest([1, 2, 3], SP, None, "x"))
        last = (await drain_all([stream]))[0]
        await scaler.tick()
        rows = sched.runners()
        sched.shutdown()
        return last, rows, scaler.actions

    last, rows, actions = asyncio.run(main())
    assert last.finish_reason is FinishReason.LENGTH
    assert [(r.id, r.state) for r in rows] == [("runner-1", "active"), ("runner-2", "active")]
    assert actions == ["add runner-2"]


def test_a_runner_the_scheduler_replaces_is_not_replaced_twice(factory):
    """The scheduler replaces a dead runner itself (by default): its replacement counts as
    live while it starts, so the autoscaler starts no second one."""

    async def main():
        sched = Scheduler([factory("runner-0"), factory("runner-1")], factory)
        scaler = Autoscaler(sched, AutoscaleConfig(2, 3, interval=0.02))

        def boom():
            raise RuntimeError("dead engine")

        sched.slots[0].handle.engine.step = boom
        stream = await sched.open(EngineRequest([1, 2, 3], SP, None, "x"))
        last = (await drain_all([stream]))[0]
        await scaler.tick()  # at once: the replacement may still be starting
        for _ in range(500):
            if sched.restarts:
                break
            await asyncio.sleep(0.01)
        await scaler.tick()
        rows = sched.runners()
        sched.shutdown()
        return last, rows, scaler.actions, sched.restarts

    last, rows, actions, restarts = asyncio.run(main())
    assert last.finish_reason is FinishReason.LENGTH
    assert [(r.id, r.state) for r in rows] == [("runner-1", "active"), ("runner-2", "active")]
    assert actions == [] and restarts == 1


def test_parse():
    assert AutoscaleConfig.parse("1:4") == AutoscaleConfig(1, 4)
    for bad in ("4", "0:2", "3:2", "a:b"):
        with pytest.raises(ValueError):
            AutoscaleConfig.parse(bad)


class StubScheduler:
    """The parts of Scheduler the autoscaler calls: advice given from a script."""

    def __init__(self, runners: int, advice: list) -> None:
        from types import SimpleNamespace

        self.slots = [SimpleNamespace(runner_id=f"r{i}", state="active") for i in range(runners)]
        self.script = list(advice)
        self.drained: list[str] = []

    def check_runners(self) -> None:
        pass

    def advice(self):
        from scheduler.policy.placement import Advice

        return self.script.pop(0) if self.script else Advice("none")

    async def drain(self, runner_id: str) -> str:
        self.drained.append(runner_id)
        self.slots = [s for s in self.slots if s.runner_id != runner_id]
        return runner_id


def test_consolidation_drains_repeat_within_a_tick_and_idle_drains_do_not():
    from scheduler.policy.placement import Advice

    fits = [Advice("scale_down", f"r{i}", "fits", consolidate=True) for i in (5, 4, 3)]
    s = StubScheduler(6, [*fits, Advice("none")])
    asyncio.run(Autoscaler(s, AutoscaleConfig(1, 6)).tick())
    assert s.drained == ["r5", "r4", "r3"]
    s = StubScheduler(6, fits)  # MIN stops it
    asyncio.run(Autoscaler(s, AutoscaleConfig(4, 6)).tick())
    assert s.drained == ["r5", "r4"]
    idle = [Advice("scale_down", f"r{i}", "idle") for i in (5, 4)]
    s = StubScheduler(6, idle)
    asyncio.run(Autoscaler(s, AutoscaleConfig(1, 6)).tick())
    assert s.drained == ["r5"]
    s = StubScheduler(6, [idle[0], *fits[1:]])  # an idle drain first, then consolidation
    asyncio.run(Autoscaler(s, AutoscaleConfig(1, 6)).tick())
    assert s.drained == ["r5", "r4", "r3"]
