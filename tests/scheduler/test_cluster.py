"""The scheduler over 3 thread runners (tiny model): consolidating placement, moves under KV
pressure, drain, scale-up, runner failure at random steps; every moved request's greedy and
seeded output equals a run that never moved, with nothing missing or repeated in its stream."""

from __future__ import annotations

import asyncio
import random

import pytest
from helpers import tiny_llm

from punica_x import SamplingParams
from punica_x.config import BatchConfig, CacheConfig, EngineConfig, ModelConfig
from punica_x.core import FinishReason
from punica_x.models.loader import load_model
from punica_x.request import EngineRequest
from scheduler.cluster import ClusterError, NoRunner, Scheduler, SchedulerConfig
from scheduler.runners.local import LocalRunner

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=77, ignore_eos=True)
TEXTS = [f"request number {i} says hello to the cluster" for i in range(8)]


@pytest.fixture(scope="module")
def shared(tiny_model_dir):
    return load_model(ModelConfig(model=str(tiny_model_dir), dtype="float32"))


@pytest.fixture(scope="module")
def ref_llm(tiny_model_dir, tiny_adapters):
    """One engine with plenty of KV: what every moved request must reproduce."""
    llm = tiny_llm(tiny_model_dir)
    llm.load_adapter("r8", str(tiny_adapters["r8"]))
    return llm


@pytest.fixture(scope="module")
def reference(ref_llm):
    llm = ref_llm
    prompts = [llm.tokenizer.encode(t) for t in TEXTS]
    out = {}
    for sp in (GREEDY, SEEDED):
        for adapter in ("r8", None):
            results = llm.generate(prompts, [adapter] * len(prompts), sp)
            out[sp.seed, adapter] = [(r.token_ids, r.text) for r in results]
    return prompts, out


def make_cluster(shared, n=3, batch=2, num_blocks=64, grow=True):
    config = EngineConfig(
        model=ModelConfig(model="unused", dtype="float32"),
        cache=CacheConfig(num_blocks=num_blocks),
        batch=BatchConfig(max_batch_size=batch),
    )

    def factory(rid):
        return LocalRunner(config, rid, shared=shared)

    return Scheduler([factory(f"runner-{i}") for i in range(n)], factory if grow else None)


async def consume(stream, steps=None):
    """Read a stream (all of it, or `steps` outputs) -> (token ids, text, last output)."""
    tokens, text, last = [], "", None
    async for out in stream:
        tokens += out.new_token_ids
        text += out.new_text
        last = out
        if steps is not None and len(tokens) >= steps:
            break
    return tokens, text, last


def check(result, expected):
    tokens, text, last = result
    assert last.finish_reason is FinishReason.LENGTH, last.error
    assert (tokens, text) == expected
    assert last.token_ids == tokens  # the totals agree with the deltas: nothing repeated


async def with_adapter(sched, tiny_adapters):
    await sched.register_adapter("r8", tiny_adapters["r8"])


def test_the_request_reaches_the_engine_as_its_caller_made_it(shared, reference):
    """One EngineRequest from Scheduler.open through the runner to Engine.submit: the engine
    gets the caller's object itself (a moved request: the same with its Resume)."""
    prompts, _ = reference
    request = EngineRequest(prompts[0], GREEDY, None, "same", "salt")

    async def main():
        sched = make_cluster(shared, n=1)
        engine = sched.fleet.slots[0].handle.engine
        got = []
        submit = engine.submit
        engine.submit = lambda req, *rest: got.append(req) or submit(req, *rest)
        await consume(await sched.open(request))
        sched.shutdown()
        return got

    assert [r is request for r in asyncio.run(main())] == [True]


def test_placement_consolidates_then_spills(shared, reference, tiny_adapters):
    prompts, ref = reference

    async def main():
        sched = make_cluster(shared)
        await with_adapter(sched, tiny_adapters)
        streams = [
            await sched.open(EngineRequest(p, GREEDY, "r8", f"q{i}"))
            for i, p in enumerate(prompts[:5])
        ]
        placed = [s.slot.runner_id for s in streams]
        results = await asyncio.gather(*(consume(s) for s in streams))
        sched.shutdown()
        return placed, results

    placed, results = asyncio.run(main())
    assert placed == ["runner-0", "runner-0", "runner-1", "runner-1", "runner-2"]
    for i, result in enumerate(results):
        check(result, ref[None, "r8"][i])


def test_requests_queue_at_the_scheduler_when_every_runner_is_full(shared, reference):
    prompts, ref = reference

    async def main():
        sched = make_cluster(shared, n=2, batch=1)
        streams = [
            await sched.open(EngineRequest(p, GREEDY, None, f"q{i}"))
            for i, p in enumerate(prompts[:4])
        ]
        queued = [s.slot is None for s in streams]
        assert sched.stats().waiting >= 2 and sched.advice().action == "scale_up"
        results = await asyncio.gather(*(consume(s) for s in streams))
        sched.shutdown()
        return queued, results

    queued, results = asyncio.run(main())
    assert queued == [False, False, True, True]
    for i, result in enumerate(results):
        check(result, ref[None, None][i])


def test_kv_shortage_moves_the_newest_request_to_a_runner_with_room(shared, reference, ref_llm):
    """Two requests fit runner-0 when placed, but not as they grow: it preempts the newest,
    which moves to runner-1 instead of waiting for runner-0's memory."""
    prompts, ref = reference
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)

    async def main():
        sched = make_cluster(shared, n=2, batch=4, num_blocks=6)  # 96 tokens per runner
        a = await sched.open(EngineRequest(prompts[0], sp, None, "old"))
        b = await sched.open(EngineRequest(prompts[1], sp, None, "new"))
        assert a.slot.runner_id == b.slot.runner_id == "runner-0"
        results = await asyncio.gather(consume(a), consume(b))
        seen = (a.runners_seen, b.runners_seen)
        sched.shutdown()
        return results, seen, sched.migrations

    results, seen, migrations = asyncio.run(main())
    assert seen == (["runner-0"], ["runner-0", "runner-1"])
    assert migrations[("kv_pressure", "recompute")] + migrations[("kv_pressure", "copy")] == 1
    expected = ref_llm.generate(prompts[:2], None, sp)
    for result, want in zip(results, expected):
        check(result, (want.token_ids, want.text))


@pytest.mark.parametrize("mode", ["recompute", "copy"])
def test_drain_moves_every_request_and_refuses_the_last_runner(
    shared, reference, tiny_adapters, mode
):
    prompts, ref = reference

    async def main():
        sched = make_cluster(shared)
        await with_adapter(sched, tiny_adapters)
        sps = [GREEDY, SEEDED] * 2
        streams = [
            await sched.open(EngineRequest(prompts[i], sps[i], "r8", f"q{i}")) for i in range(4)
        ]
        heads = [await consume(s, steps=3) for s in streams]  # every request is mid-stream
        assert {s.slot.runner_id for s in streams} == {"runner-0", "runner-1"}
        moved = sum(s.slot.runner_id == "runner-0" for s in streams)
        assert await sched.drain("runner-0", mode=mode) == "runner-0"
        assert [r.id for r in sched.runners()] == ["runner-1", "runner-2"]
        tails = await asyncio.gather(*(consume(s) for s in streams))
        await sched.drain()  # the least loaded of the two
        with pytest.raises(ClusterError) as refused:
            await sched.drain()
        sched.shutdown()
        return sps, heads, tails, moved, refused.value, sched.migrations

    sps, heads, tails, moved, refused, migrations = asyncio.run(main())
    assert refused.status == 409 and refused.code == "last_runner"
    assert migrations[("drain", mode)] == moved == 2
    for i, (head, tail) in enumerate(zip(heads, tails)):
        joined = (head[0] + tail[0], head[1] + tail[1], tail[2])
        check(joined, ref[sps[i].seed, "r8"][i])


def test_a_kv_copy_the_target_refuses_recomputes_instead_of_failing(
    shared, reference, tiny_adapters, monkeypatch
):
    """A drain in copy mode whose target refuses the copy (as a copy with missing heads is
    refused: punica_x/engine/moves.py): the requests recompute there and finish with the
    undisturbed tokens, rather than ending with "could not be placed again"."""
    from punica_x.engine import moves

    prompts, ref = reference

    def refuse(cache, req, kv):
        raise ValueError("the KV copy has blocks of another shape")

    async def main():
        sched = make_cluster(shared)
        await with_adapter(sched, tiny_adapters)
        streams = [
            await sched.open(EngineRequest(prompts[i], GREEDY, "r8", f"q{i}")) for i in range(4)
        ]
        heads = [await consume(s, steps=3) for s in streams]
        monkeypatch.setattr(moves, "import_kv", refuse)
        await sched.drain("runner-0", mode="copy")
        tails = await asyncio.gather(*(consume(s) for s in streams))
        sched.shutdown()
        return heads, tails

    heads, tails = asyncio.run(main())
    for i, (head, tail) in enumerate(zip(heads, tails)):
        assert tail[2].finish_reason is not FinishReason.ERROR, tail[2].error
        check((head[0] + tail[0], head[1] + tail[1], tail[2]), ref[None, "r8"][i])


@pytest.mark.parametrize("trial", range(5))
def test_a_runner_failing_at_a_random_step_loses_no_request(shared, reference, trial):
    """runner-0's engine raises at a random step (as a crashed kernel would): its requests
    continue on the other runners from what their clients had; tokens equal an unfailed run;
    a new runner is started in its place."""
    prompts, ref = reference
    rng = random.Random(trial)
    fail_at = rng.randint(1, 20)  # runner-0 needs about 25 steps for its 3 requests

    async def main():
        sched = make_cluster(shared, n=3, batch=3)
        engine = sched.slots[0].handle.engine
        real_step, calls = engine.step, [0]

        def step():
            calls[0] += 1
            if calls[0] == fail_at:
                raise RuntimeError("injected kernel failure")
            return real_step()

        engine.step = step
        sps = [GREEDY if i % 2 == 0 else SEEDED for i in range(6)]
        streams = [
            await sched.open(EngineRequest(prompts[i], sps[i], None, f"q{i}")) for i in range(6)
        ]
        results = await asyncio.gather(*(consume(s) for s in streams))
        rows = sched.runners()
        sched.shutdown()
        return sps, results, rows

    sps, results, rows = asyncio.run(main())
    assert rows[0].state == "dead" and "injected kernel failure" in rows[0].error
    assert rows[-1].replaces == "runner-0"  # a new runner started in its place
    for i, result in enumerate(results):
        check(result, ref[sps[i].seed, None][i])


def test_no_runner_left_ends_streams_with_an_error_and_refuses_new_ones(shared, reference):
    prompts, _ = reference

    async def main():
        sched = make_cluster(shared, n=1, grow=False)
        engine = sched.slots[0].handle.engine

        def step():
            raise RuntimeError("boom")

        stream = await sched.open(EngineRequest(prompts[0], GREEDY, None, "q"))
        engine.step = step
        _, _, last = await consume(stream)
        with pytest.raises(NoRunner):
            await sched.open(EngineRequest(prompts[1], GREEDY, None, "q2"))
        assert not sched.ready() and not sched.accepting()  # /health answers 503
        sched.shutdown()
        return last

    last = asyncio.run(main())
    assert last.finish_reason is FinishReason.ERROR and "boom" in last.error
    assert last.retryable  # no runner could serve it: HTTP 503 with Retry-After


def test_a_scheduler_fault_while_moving_a_request_on_ends_it_visibly(shared, reference):
    """Should moving a dead runner's request on raise (a fault of the scheduler's own, as a
    fairness KeyError once did), the request ends with an error output instead of the
    exception reaching its reader (an HTTP handler: a broken stream, a bare 500)."""
    prompts, _ = reference

    async def main():
        sched = make_cluster(shared, n=2, grow=False)
        stream = await sched.open(EngineRequest(prompts[0], GREEDY, None, "q"))
        await consume(stream, steps=2)

        def boom(*args):
            raise KeyError("tenant1")

        def step():
            raise RuntimeError("the runner fails")

        sched.mover.lost = boom
        stream.slot.handle.engine.step = step
        _, _, last = await consume(stream)
        sched.shutdown()
        return last

    last = asyncio.run(main())
    assert last.finish_reason is FinishReason.ERROR and "KeyError" in last.error


def test_scale_up_adds_a_runner_that_takes_work_with_every_adapter(
    shared, reference, tiny_adapters
):
    prompts, ref = reference

    async def main():
        sched = make_cluster(shared, n=1, batch=1)
        await with_adapter(sched, tiny_adapters)
        first = await sched.open(EngineRequest(prompts[0], GREEDY, "r8", "q0"))
        assert await sched.add_runners(1) == ["runner-1"]
        second = await sched.open(EngineRequest(prompts[1], GREEDY, "r8", "q1"))
        placed = second.slot.runner_id
        results = await asyncio.gather(consume(first), consume(second))
        sched.shutdown()
        return placed, results

    placed, results = asyncio.run(main())
    assert placed == "runner-1"
    for i, result in enumerate(results):
        check(result, ref[None, "r8"][i])


@pytest.mark.parametrize("existing", [False, True])
def test_an_adapter_one_runner_refuses_is_rolled_back_on_the_others(
    shared, tiny_adapters, existing
):
    """Registration is all or nothing: runner-1 refuses; runner-0 and runner-2, which took
    the files at the same time, go back to what they held before: nothing (a new key), or
    the previous files under that key (an update), which keep serving."""

    async def main():
        sched = make_cluster(shared, n=3)
        if existing:
            await sched.register_adapter("a", tiny_adapters["r8"])
        refusing = sched.slots[1].handle

        async def refuse(*_args, **_kwargs):
            raise ValueError("runner-1 has no room for it")

        refusing.register_adapter = refuse
        with pytest.raises(ValueError, match="no room"):
            await sched.register_adapter("a", tiny_adapters["r16"])
        held = {
            s.runner_id: (s.handle.engine.adapters.info("a").rank if "a" in names else None)
            for s in sched.slots
            for names in [s.handle.engine.adapters.names()]
        }
        known = "a" in sched.adapters
        sched.shutdown()
        return held, known

    held, known = asyncio.run(main())
    if existing:
        assert held == {"runner-0": 8, "runner-1": 8, "runner-2": 8} and known
    else:
        assert held == {"runner-0": None, "runner-1": None, "runner-2": None} and not known


def test_from_config_builds_the_scheduler_the_options_describe(shared):
    """Scheduler.from_config and the keyword options are one construction: every field of
    the config reaches the scheduler (a field dropped on the way would fail here)."""
    config = SchedulerConfig(
        idle_after=7.5, distkv=False, lend_fraction=0.5, restart=None, fair_share=False
    )
    runner = make_cluster(shared, n=1).fleet.slots[0].handle  # (that scheduler is dropped)
    sched = Scheduler.from_config(config, [runner])
    try:
        assert sched.config == config
        assert sched.idle_after == 7.5
        assert sched.distkv is None and not sched.fair_share and sched.fleet.restart is None
    finally:
        sched.shutdown()
    with pytest.raises(TypeError):
        Scheduler([runner], no_such_option=1)


def test_one_version_id_on_every_runner(shared, tiny_adapters):
    """A registration has one version id on every runner: the caller's (the server passes
    the store's row id) or the scheduler's own; has_version asks the runners for it."""

    async def main():
        sched = make_cluster(shared, n=2)
        try:
            named = await sched.register_adapter("a", tiny_adapters["r8"], version=7)
            auto = await sched.register_adapter("b", tiny_adapters["r4"])
            pools = [s.handle.engine.adapters for s in sched.slots]
            versions = [(p.info("a").version, p.info("b").version) for p in pools]
            held = sched.has_version(7)
            await sched.unregister_adapter("a")
            return named, auto, versions, held, sched.has_version(7)
        finally:
            sched.shutdown()

    named, auto, versions, held, held_after = asyncio.run(main())
    assert named.version == 7 and versions == [(7, auto.version)] * 2
    assert held and not held_after  # no request held it: gone with the registration


def test_a_conversation_goes_back_to_the_runner_holding_its_prefix(shared, reference):
    """Cache-aware placement: turn 2 of a conversation goes to the runner that served turn
    1 (its prompt and answer are cached there) although another runner has the larger
    working set, and reuses the blocks there."""
    prompts, _ = reference
    system = prompts[0] * 4  # 4 copies of a prompt: several full blocks
    long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)

    async def main():
        sched = make_cluster(shared, n=2, batch=3)
        turn1 = await sched.open(EngineRequest(system, GREEDY, None, "turn1", cache_salt="me"))
        tokens, _, _ = await consume(turn1)
        longs = [
            await sched.open(EngineRequest(prompts[i + 1], long, None, f"long{i}"))
            for i in range(5)
        ]
        placed = [s.slot.runner_id for s in longs]
        for s in longs[:2]:
            await s.aclose()  # runner-0 holds 1 request, runner-1 holds 2
        engines = [slot.handle.async_engine for slot in sched.slots]
        releases = [e.hold() for e in engines]
        turn2_prompt = system + tokens + prompts[6]
        task = asyncio.create_task(
            sched.open(EngineRequest(turn2_prompt, GREEDY, None, "turn2", cache_salt="me"))
        )
        await asyncio.sleep(0.05)  # placed, waiting for the held engine to take it
        chosen = sched.slots[0].streams.get("turn2") is not None
        for release in releases:
            release()
        turn2 = await task
        await consume(turn2)
        for s in longs[2:]:
            await s.aclose()
        hits = engines[0].engine.batcher.prefix.stats.hits[""]
        sched.shutdown()
        return placed, chosen, hits, len(system + tokens)

    placed, chosen, hits, cached = asyncio.run(main())
    assert placed == ["runner-0"] * 3 + ["runner-1"] * 2
    assert chosen
    assert hits >= (cached - 1) // 16 * 16 - 16 and hits > 0


def test_a_pin_reaches_every_runner_and_later_ones(shared, tiny_adapters):
    """register_adapter(pinned=True) pins the key on every runner, a runner started later
    pins it too, pinned=False unpins it everywhere, and None keeps it as it was."""

    async def main():
        sched = make_cluster(shared, n=2)
        try:
            await sched.register_adapter("a", tiny_adapters["r8"], version=3, pinned=True)
            await sched.register_adapter("b", tiny_adapters["r4"])
            await sched.add_runners(1)
            pinned = [s.handle.engine.adapters.pinned() for s in sched.slots]
            await sched.register_adapter("a", tiny_adapters["r16"], version=4)  # a new version
            kept = [s.handle.engine.adapters.pinned() for s in sched.slots]
            await sched.register_adapter("a", tiny_adapters["r16"], version=4, pinned=False)
            after = [s.handle.engine.adapters.pinned() for s in sched.slots]
            return pinned, kept, after
        finally:
            sched.shutdown()

    pinned, kept, after = asyncio.run(main())
    assert pinned == [{"a"}] * 3 and kept == [{"a"}] * 3
    assert after == [frozenset()] * 3
