"""Fair share in the scheduler (one thread runner, batch 4, tiny model): while tenant A floods
the runner and the queue, tenant B's requests are served next and take a batch slot from A
(A's newest request moves back to the queue and resumes later), not after A's backlog; every
request, the moved ones included, produces the tokens of an undisturbed run. Without fair
share, B waits behind A's whole backlog. Order, not time, is asserted."""

from __future__ import annotations

import asyncio

import pytest
from helpers import tiny_llm

from punica_x import SamplingParams
from punica_x.config import BatchConfig, CacheConfig, EngineConfig, ModelConfig
from punica_x.core import FinishReason
from punica_x.models.loader import load_model
from punica_x.request import EngineRequest
from scheduler.cluster import Scheduler
from scheduler.runners.local import LocalRunner

FLOOD = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
LIGHT = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
A_TEXTS = [f"tenant a request {i} floods the runner" for i in range(12)]
B_TEXTS = ["tenant b asks one thing", "tenant b asks another thing"]


@pytest.fixture(scope="module")
def shared(tiny_model_dir):
    return load_model(ModelConfig(model=str(tiny_model_dir), dtype="float32"))


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    llm = tiny_llm(tiny_model_dir)
    a = [llm.tokenizer.encode(t) for t in A_TEXTS]
    b = [llm.tokenizer.encode(t) for t in B_TEXTS]
    ref_a = [r.token_ids for r in llm.generate(a, None, FLOOD)]
    ref_b = [r.token_ids for r in llm.generate(b, None, LIGHT)]
    return a, b, ref_a, ref_b


def one_runner(shared, fair_share: bool, policy: str = "fcfs") -> Scheduler:
    """One runner of 4 batch slots; under MLFQ it holds no more than those 4 (the rest waits
    at the scheduler, in the fair order) and orders what it holds itself."""
    batch = BatchConfig(max_batch_size=4, policy=policy)
    if policy == "mlfq":
        batch = BatchConfig(max_batch_size=4, policy=policy, mlfq_working_set=4)
    config = EngineConfig(
        model=ModelConfig(model="unused", dtype="float32"),
        cache=CacheConfig(num_blocks=256),
        batch=batch,
    )
    return Scheduler([LocalRunner(config, "runner-0", shared=shared)], fair_share=fair_share)


def flood_then_light(shared, reference, fair_share: bool, policy: str = "fcfs"):
    """A opens 12 requests (4 run, 8 wait); once A's first tokens arrive, B opens 2. Returns
    each request's tokens and, for B, how many of A's requests had produced no token yet
    when B's first token came."""
    a, b, _, _ = reference
    first_token: dict[str, int] = {}  # request -> the order of its first token
    order = iter(range(1000))

    async def read(stream):
        tokens, last = [], None
        async for out in stream:
            if out.new_token_ids and stream.request_id not in first_token:
                first_token[stream.request_id] = next(order)
            tokens += out.new_token_ids
            last = out
        assert last.finish_reason is FinishReason.LENGTH, last.error
        return tokens

    async def main():
        sched = one_runner(shared, fair_share, policy)
        flood = [
            await sched.open(EngineRequest(p, FLOOD, None, f"a{i}"), tenant="a")
            for i, p in enumerate(a)
        ]
        readers = [asyncio.ensure_future(read(s)) for s in flood]
        while len(first_token) < 4:  # A's first 4 are running; 8 wait at the scheduler
            await asyncio.sleep(0.005)
        assert sched.queued == 8
        light = [
            await sched.open(EngineRequest(p, LIGHT, None, f"b{i}"), tenant="b")
            for i, p in enumerate(b)
        ]
        b_tokens = await asyncio.gather(*(read(s) for s in light))
        a_tokens = await asyncio.gather(*readers)
        moves = sum(n for (reason, _), n in sched.migrations.items() if reason == "fair_share")
        rows = {r.tenant: r for r in sched.tenant_rows()}
        sched.shutdown()
        return a_tokens, b_tokens, moves, rows

    a_tokens, b_tokens, moves, rows = asyncio.run(main())
    b_first = min(first_token["b0"], first_token["b1"])
    a_not_started = sum(1 for i in range(len(a)) if first_token[f"a{i}"] > b_first)
    return a_tokens, b_tokens, moves, rows, a_not_started


@pytest.mark.parametrize("policy", ["fcfs", "mlfq"])
def test_a_flood_does_not_delay_another_tenant(shared, reference, policy):
    """Fair share composes with the runner's own order (FCFS or skip-join MLFQ)."""
    _, _, ref_a, ref_b = reference
    flood = flood_then_light(shared, reference, True, policy)
    a_tokens, b_tokens, moves, rows, a_not_started = flood
    assert b_tokens == ref_b and a_tokens == ref_a  # the moved requests resumed exactly
    assert a_not_started == 8  # B ran before any of A's backlog
    assert moves >= 2  # B took its share (2 of 4 slots) from A's newest requests
    assert rows["a"].served_tokens > rows["b"].served_tokens > 0
    assert rows["a"].waiting == rows["b"].waiting == 0


def test_without_fair_share_b_waits_behind_the_backlog(shared, reference):
    _, _, ref_a, ref_b = reference
    a_tokens, b_tokens, moves, _, a_not_started = flood_then_light(shared, reference, False)
    assert b_tokens == ref_b and a_tokens == ref_a
    assert moves == 0 and a_not_started <= 2  # B started with A's last requests
