"""Lamina under Ray with the mlfq policy: a model worker whose batcher has swapped KV out to
its host pool (through its attention workers) and back is SIGKILLed: its requests continue
elsewhere (from the KV its attention workers hold, or recomputed where that KV was on the
dead process's host pool), each with the greedy tokens of a run nobody disturbed. Issue 73's
last pair of faults in a row on one runner: an MLFQ swap, then a rescue."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from helpers import consume, ray_scheduler, tiny_llm

from punica_x import SamplingParams
from punica_x.config import BatchConfig, CacheConfig, EngineConfig, ModelConfig
from punica_x.core import FinishReason
from punica_x.request import EngineRequest

pytest.importorskip("ray")

SP = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
N = 6


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    llm = tiny_llm(tiny_model_dir)
    prompts = [llm.tokenizer.encode(f"swapped request {i} wants tokens") for i in range(N)]
    return prompts, [r.token_ids for r in llm.generate(prompts, None, SP)]


@pytest.fixture(scope="module")
def cluster(local_ray, tiny_model_dir):
    config = EngineConfig(
        model=ModelConfig(model=str(tiny_model_dir), dtype="float32"),
        cache=CacheConfig(num_blocks=6, swap_blocks=64),
        batch=BatchConfig(max_batch_size=8, policy="mlfq"),
        attention_workers=2,
    )
    sched = ray_scheduler(config, distkv=False)
    yield sched
    sched.shutdown()


def test_a_model_worker_killed_after_mlfq_swaps_is_rescued(cluster, reference):
    prompts, want = reference

    async def main():
        streams = [
            await cluster.open(EngineRequest(p, SP, None, f"swap-{i}"))
            for i, p in enumerate(prompts)
        ]
        slots = {s.slot.runner_id: s.slot for s in streams}
        heads = [await consume(s, until=10) for s in streams]
        swapped = {rid: slot.handle.stats().swaps_out for rid, slot in slots.items()}
        # a reader that fell behind gets the queued outputs joined: on a loaded machine a head
        # may already hold its stream's end; the victim is a runner with requests still going
        going = {s.slot.runner_id for s, (_, last) in zip(streams, heads) if not last.finished}
        victim = slots[max(going or swapped, key=swapped.get)]
        os.kill(victim.handle.info.pid, signal.SIGKILL)
        tails = await asyncio.gather(*(consume(s) for s in streams))
        return heads, tails, swapped

    heads, tails, swapped = asyncio.run(main())
    print("swaps out before the kill:", swapped)
    assert max(swapped.values()) > 0  # the killed runner had swapped KV out and back
    for (head, head_last), (tail, last), ref in zip(heads, tails, want):
        last = last or head_last  # None: the head read to the end
        assert last.finish_reason is FinishReason.LENGTH, last.error
        assert head + tail == ref
    assert cluster.mover.migrations["failure", "copy"] > 0  # rescued from the workers' KV
