"""A scheduler over runners in processes of their own (Ray actors, engine processes) with
one runner's process SIGKILLed while it streams: the engine config and the reference tokens
both suites compare with, and the kill at a random point."""

from __future__ import annotations

import asyncio
import os
import random
import signal

from helpers import consume, tiny_llm

from punica_x import SamplingParams
from punica_x.config import BatchConfig, CacheConfig, EngineConfig, ModelConfig
from punica_x.core import FinishReason
from punica_x.request import EngineRequest

SP = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=48, temperature=1.0, seed=11, ignore_eos=True)


def cluster_config(model_dir) -> EngineConfig:
    """The tiny model, 64 KV blocks and 3 requests a runner (a 4th goes to another one)."""
    return EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float32"),
        cache=CacheConfig(num_blocks=64),
        batch=BatchConfig(max_batch_size=3),
    )


def cluster_reference(model_dir, adapters, label: str):
    """(6 prompts, {(seed, adapter): their tokens}) from the in-process engine, greedy and
    seeded, with and without adapter r8."""
    llm = tiny_llm(model_dir)
    llm.load_adapter("r8", str(adapters["r8"]))
    prompts = [llm.tokenizer.encode(f"{label} request {i} wants tokens") for i in range(6)]
    out = {}
    for sp in (SP, SEEDED):
        for adapter in (None, "r8"):
            results = llm.generate(prompts, [adapter] * len(prompts), sp)
            out[sp.seed, adapter] = [r.token_ids for r in results]
    return prompts, out


async def replaced(cluster, runner_id: str, timeout: float = 120.0) -> str | None:
    """The state of the runner started in place of runner_id, once it is no longer starting
    (None: there is none)."""
    for _ in range(int(timeout / 0.1)):
        slot = next((s for s in cluster.slots if s.replaces == runner_id), None)
        if slot is None or slot.state != "starting":
            return slot and slot.state
        await asyncio.sleep(0.1)
    return "starting"


def sigkill_at_a_random_point(cluster, reference, trial: int) -> None:
    """4 requests (greedy and seeded, adapters drawn) on 2 active runners; the first one's
    runner process is SIGKILLed after a random number of its tokens. Every request ends with
    the reference's tokens, the runner is dead and a new one replaces it."""
    prompts, ref = reference
    rng = random.Random(100 + trial)
    after = rng.randint(1, 40)  # tokens streamed before the kill

    async def main():
        while len([s for s in cluster.slots if s.state == "active"]) < 2:
            await cluster.add_runners(1)
        sps = [SP if i % 2 == 0 else SEEDED for i in range(4)]
        adapters = [rng.choice([None, "r8"]) for _ in range(4)]
        streams = [
            await cluster.open(EngineRequest(prompts[i], sps[i], adapters[i], f"k{trial}-{i}"))
            for i in range(4)
        ]
        victim = streams[0].slot
        head = await consume(streams[0], until=after)
        os.kill(victim.handle.info.pid, signal.SIGKILL)
        rest = await asyncio.gather(*(consume(s) for s in streams))
        for _ in range(100):  # the runner may have sent every token before the kill landed:
            cluster.check_runners()  # then its death shows at its next poll, not in a stream
            if victim.state == "dead":
                break
            await asyncio.sleep(0.1)
        state = victim.state
        replacement = await replaced(cluster, victim.runner_id)
        await cluster.drain(victim.runner_id)  # forget the dead one
        return sps, adapters, head, rest, state, replacement

    restarts = cluster.restarts
    sps, adapters, head, rest, state, replacement = asyncio.run(main())
    assert state == "dead"
    assert replacement == "active" and cluster.restarts == restarts + 1  # (a new process)
    rest[0] = (head[0] + rest[0][0], rest[0][1])
    for i, (tokens, last) in enumerate(rest):
        assert last.finish_reason is FinishReason.LENGTH, last.error
        assert tokens == last.token_ids == ref[sps[i].seed, adapters[i]][i], i
