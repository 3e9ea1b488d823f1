"""Lamina under Ray (scheduler/lamina/ray_workers.py): each model worker (a Ray runner) has
its attention workers as Ray actors of their own. SIGKILL of a model worker's process
mid-stream: its requests continue on another runner from the KV its attention workers still
hold (nothing recomputed but the last token sent), with the greedy tokens of a run nobody
killed; SIGKILL of an attention worker: it is replaced and its model worker's requests
recompute, with the same tokens. Both within 10 s of the death."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from helpers import consume, ray_scheduler, tiny_llm

from punica_x import SamplingParams
from punica_x.config import BatchConfig, CacheConfig, EngineConfig, ModelConfig
from punica_x.core import FinishReason
from punica_x.request import EngineRequest

pytest.importorskip("ray")


SP = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
MODES = ("copy", "recompute")


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tiny_adapters):
    llm = tiny_llm(tiny_model_dir)
    llm.load_adapter("r8", str(tiny_adapters["r8"]))
    prompts = [llm.tokenizer.encode(f"lamina request {i} wants tokens") for i in range(4)]
    adapters = [None, "r8", "r8", None]
    return prompts, adapters, [r.token_ids for r in llm.generate(prompts, adapters, SP)]


@pytest.fixture(scope="module")
def cluster(local_ray, tiny_model_dir, tiny_adapters):

    config = EngineConfig(
        model=ModelConfig(model=str(tiny_model_dir), dtype="float32"),
        cache=CacheConfig(num_blocks=64),
        batch=BatchConfig(max_batch_size=4),
        attention_workers=2,
    )

    # distkv off: the KV lives on the attention workers, which lend none
    sched = ray_scheduler(config, distkv=False)
    asyncio.run(sched.register_adapter("r8", tiny_adapters["r8"]))
    yield sched
    sched.shutdown()


def active(cluster) -> list:
    return [s for s in cluster.slots if s.state == "active"]


async def open_all(cluster, prompts, adapters, tag: str) -> list:
    assert len(active(cluster)) == 2
    streams = []
    for i, (p, a) in enumerate(zip(prompts, adapters)):
        streams.append(await cluster.open(EngineRequest(p, SP, a, f"{tag}-{i}")))
    return streams


def assert_rescued(cluster, before: dict, moved: int, heads, tails, want) -> None:
    """Every request ended with the reference tokens; the `moved` ones of the killed model
    worker continued from a KV copy (the rescue), none recomputed."""
    for (head, _), (tail, last), ref in zip(heads, tails, want):
        assert last.finish_reason is FinishReason.LENGTH, last.error
        assert head + tail == ref
    after = cluster.mover.migrations
    assert after["failure", "copy"] - before.get(("failure", "copy"), 0) == moved > 0
    assert after["failure", "recompute"] == before.get(("failure", "recompute"), 0)


def test_attention_workers_are_actors_of_their_own(cluster, reference):
    prompts, adapters, want = reference
    rows = cluster.runners()
    model_pids = {r.pid for r in rows}
    workers = [w for r in rows for w in r.attention_workers]
    assert [r.role for r in rows] == ["model", "model"] and len(workers) == 4
    assert not {w["pid"] for w in workers} & (model_pids | {os.getpid()})

    async def main():
        streams = await open_all(cluster, prompts, adapters, "plain")
        return await asyncio.gather(*(consume(s) for s in streams))

    for (tokens, last), ref in zip(asyncio.run(main()), want):
        assert last.finish_reason is FinishReason.LENGTH, last.error
        assert tokens == ref


def test_sigkill_of_a_model_worker_continues_from_its_kv(cluster, reference):
    prompts, adapters, want = reference
    before = dict(cluster.mover.migrations)

    async def main():
        streams = await open_all(cluster, prompts, adapters, "model-kill")
        victim = streams[0].slot
        on_victim = [s for s in streams if s.slot is victim]
        heads = [await consume(s, until=8) for s in streams]
        os.kill(victim.handle.info.pid, signal.SIGKILL)
        killed = time.monotonic()
        tails = await asyncio.gather(*(consume(s) for s in streams))
        took = time.monotonic() - killed
        for _ in range(1200):  # its replacement starts on this loop: wait for it here
            if len(active(cluster)) == 2:
                break
            await asyncio.sleep(0.1)
        return heads, tails, took, len(on_victim)

    heads, tails, took, moved = asyncio.run(main())
    assert_rescued(cluster, before, moved, heads, tails, want)
    assert took < 10.0
    assert [s.rescue for s in cluster.slots if s.state == "dead"] == [None]  # workers let go


def test_sigkill_of_an_attention_worker_recomputes_its_requests(cluster, reference):
    prompts, adapters, want = reference

    async def main():
        streams = await open_all(cluster, prompts, adapters, "worker-kill")
        slot = streams[0].slot
        losses = slot.handle.stats().attention_worker_losses
        heads = [await consume(s, until=8) for s in streams]
        pid = slot.handle.stats().attention_workers[1][1]
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        tails = await asyncio.gather(*(consume(s) for s in streams))
        took = time.monotonic() - killed
        for _ in range(50):  # the runner's stats reach the scheduler with its next poll
            if slot.handle.stats().attention_worker_losses > losses:
                break
            await asyncio.sleep(0.1)
        return heads, tails, took, slot.handle.stats().attention_worker_losses - losses

    heads, tails, took, lost = asyncio.run(main())
    for (head, _), (tail, last), ref in zip(heads, tails, want):
        assert last.finish_reason is FinishReason.LENGTH, last.error
        assert head + tail == ref
    assert lost == 1 and took < 10.0


def test_a_model_worker_killed_after_its_attention_worker_was_replaced_is_rescued(
    cluster, reference
):
    """Two faults in a row on one runner (issue 73's finding: the second one failed every
    request): an attention worker is SIGKILLed and replaced, its requests recompute and
    finish; then, with new requests running, the model worker's process is SIGKILLed: they
    continue from the KV its attention workers hold (the replaced one's too), with the
    greedy tokens of a run nobody killed."""
    prompts, adapters, want = reference
    before = dict(cluster.mover.migrations)

    async def main():
        streams = await open_all(cluster, prompts, adapters, "pair-worker")
        slot = streams[0].slot
        losses = slot.handle.stats().attention_worker_losses
        early = [await consume(s, until=8) for s in streams]
        os.kill(slot.handle.stats().attention_workers[0][1], signal.SIGKILL)
        first = [
            (early[i], out) for i, out in enumerate(await asyncio.gather(*map(consume, streams)))
        ]
        for _ in range(100):
            if slot.handle.stats().attention_worker_losses > losses:
                break
            await asyncio.sleep(0.1)
        streams = await open_all(cluster, prompts, adapters, "pair-model")
        on_victim = [s for s in streams if s.slot is slot]
        heads = [await consume(s, until=8) for s in streams]
        os.kill(slot.handle.info.pid, signal.SIGKILL)
        tails = await asyncio.gather(*(consume(s) for s in streams))
        for _ in range(1200):
            if len(active(cluster)) == 2:
                break
            await asyncio.sleep(0.1)
        return first, heads, tails, len(on_victim)

    first, heads, tails, moved = asyncio.run(main())
    for ((head, _), (tail, last)), ref in zip(first, want):  # recomputed on the new worker
        assert last.finish_reason is FinishReason.LENGTH, last.error
        assert head + tail == ref
    assert_rescued(cluster, before, moved, heads, tails, want)


async def kill_model_worker(cluster, slot) -> None:
    """SIGKILL of `slot`'s model worker process (its replacement starts meanwhile)."""
    os.kill(slot.handle.info.pid, signal.SIGKILL)


async def until_two_active(cluster) -> None:
    for _ in range(1200):  # a killed runner's replacement starts on this loop
        if len(active(cluster)) == 2:
            return
        await asyncio.sleep(0.1)


@pytest.mark.parametrize("first", ["model_worker", "live_copy"])
def test_a_rescue_holds_after_an_earlier_fault_on_the_runner(cluster, reference, first):
    """Two faults in a row: first a model worker's death (its requests go on elsewhere from
    its KV) or a live copy (drain in copy mode), then the model worker now holding the
    requests is SIGKILLed: they continue from the KV its attention workers hold, every
    request with the greedy tokens of a run nobody disturbed."""
    prompts, adapters, want = reference

    async def main():
        await until_two_active(cluster)
        streams = await open_all(cluster, prompts, adapters, f"then-{first}")
        heads = [await consume(s, until=6) for s in streams]
        victim = streams[0].slot
        if first == "model_worker":
            await kill_model_worker(cluster, victim)
        else:
            for s in [s for s in streams if s.slot is victim]:
                assert await cluster.mover.migrate(s, "drain", mode="copy")
        mids = [await consume(s, until=6) for s in streams]  # all on the other runner now
        holder = streams[0].slot
        assert holder is not None and holder is not victim
        before = dict(cluster.mover.migrations)
        on_holder = sum(s.slot is holder for s in streams)
        await kill_model_worker(cluster, holder)
        tails = await asyncio.gather(*(consume(s) for s in streams))
        await until_two_active(cluster)
        after = cluster.mover.migrations
        moved = {m: after["failure", m] - before.get(("failure", m), 0) for m in MODES}
        return heads, mids, tails, moved, on_holder

    heads, mids, tails, moved, on_holder = asyncio.run(main())
    for (head, _), (mid, _), (tail, last), ref in zip(heads, mids, tails, want):
        assert last.finish_reason is FinishReason.LENGTH, last.error
        assert head + mid + tail == ref
    # every request on the holder moved once; a request the holder had not stepped yet when it
    # died (a loaded machine: its tokens so far came from the victim) has no KV on the holder's
    # workers and recomputes, the others go on from that KV
    assert moved["copy"] + moved["recompute"] == on_holder > 0, moved
    assert moved["copy"] > 0, moved
