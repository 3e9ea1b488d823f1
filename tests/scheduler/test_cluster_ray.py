"""The scheduler over 2 Ray runners (actors in their own processes; one local Ray per test
session, no dashboard): adapters shipped as bytes, placement, drain between processes, and
SIGKILL of a runner process at random points (5 in the default suite; 20 more in the `long`
run, `make test-long`): every request completes with the greedy and seeded tokens of a run
nobody killed, and the killed runner is replaced by a new process that serves the adapter."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal

import pytest
from cluster_kills import (
    SEEDED,
    SP,
    cluster_config,
    cluster_reference,
    replaced,
    sigkill_at_a_random_point,
)
from helpers import consume, ray_scheduler, tiny_llm

from punica_x import SamplingParams
from punica_x.config import BatchConfig, CacheConfig, EngineConfig, ModelConfig
from punica_x.core import FinishReason
from punica_x.request import EngineRequest

ray = pytest.importorskip("ray")

from scheduler.cluster import Scheduler  # noqa: E402
from scheduler.runners.ray_runner import RayRunner  # noqa: E402


@pytest.fixture(scope="module")
def config(tiny_model_dir):
    return cluster_config(tiny_model_dir)


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tiny_adapters):
    return cluster_reference(tiny_model_dir, tiny_adapters, "ray")


@pytest.fixture(scope="module")
def cluster(local_ray, config, tiny_adapters, tmp_path_factory):
    """Two actors; the adapter is registered from a copy deleted right after, so the actors
    can only be serving the bytes they were sent."""

    sched = ray_scheduler(config)
    copy = tmp_path_factory.mktemp("shipped") / "r8"
    shutil.copytree(tiny_adapters["r8"], copy)

    async def register():
        await sched.register_adapter("r8", copy)

    asyncio.run(register())
    shutil.rmtree(copy)
    yield sched
    sched.shutdown()


def test_runners_are_processes_and_place_by_consolidation(cluster, reference):
    prompts, ref = reference
    rows = cluster.runners()
    assert [r.backend for r in rows] == ["ray", "ray"]
    assert len({r.pid for r in rows} | {os.getpid()}) == 3

    async def main():
        streams = [
            await cluster.open(EngineRequest(prompts[i], SP, "r8", f"p{i}")) for i in range(4)
        ]
        placed = [s.slot.runner_id for s in streams]
        return placed, await asyncio.gather(*(consume(s) for s in streams))

    placed, results = asyncio.run(main())
    assert placed == ["runner-0", "runner-0", "runner-0", "runner-1"]
    for i, (tokens, last) in enumerate(results):
        assert last.finish_reason is FinishReason.LENGTH, last.error
        assert tokens == last.token_ids == ref[None, "r8"][i]


def test_ray_runners_report_their_serving_dtype(cluster, config):
    """The actors' dtype reaches the scheduler's ModelInfo (what the frontend reports)."""
    from punica_x.config import dtype_name

    assert cluster.info.model.dtype == dtype_name(config.model.torch_dtype())
    assert {s.handle.info.model.dtype for s in cluster.slots} == {cluster.info.model.dtype}


def test_drain_moves_streams_between_processes(cluster, reference):
    prompts, ref = reference

    async def main():
        await cluster.add_runners(1)
        sps = [SP, SEEDED, SP]
        streams = [
            await cluster.open(EngineRequest(prompts[i], sps[i], "r8", f"d{i}")) for i in range(3)
        ]
        source = streams[0].slot.runner_id
        heads = [await consume(s, until=5) for s in streams]
        await cluster.drain(source)
        tails = await asyncio.gather(*(consume(s) for s in streams))
        return sps, heads, tails, source

    sps, heads, tails, source = asyncio.run(main())
    assert source not in [r.id for r in cluster.runners()]
    for i, (head, tail) in enumerate(zip(heads, tails)):
        assert tail[1].finish_reason is FinishReason.LENGTH, tail[1].error
        assert head[0] + tail[0] == tail[1].token_ids == ref[sps[i].seed, "r8"][i]


@pytest.mark.parametrize("trial", range(5))
def test_sigkill_of_a_runner_process_loses_no_request(cluster, reference, trial):
    sigkill_at_a_random_point(cluster, reference, trial)


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("trial", range(100, 120))
def test_sigkill_twenty_more_points(cluster, reference, trial):
    sigkill_at_a_random_point(cluster, reference, trial)


def test_kv_shortage_moves_the_newest_request_to_the_other_process(
    local_ray, tiny_model_dir, reference
):
    """runner-0 (6 blocks: 96 tokens) holds both requests when placed, not as they grow: its
    preemption notice crosses the process boundary and the newest moves to runner-1. Each
    request grows to all 6 blocks, so the two overlap on runner-0 however late the second
    open lands (with 40 tokens each, a second open delayed by a loaded machine came after
    the first had grown past the point where both fit, and nothing was preempted)."""
    from punica_x.models.loader import describe_model

    prompts, _ = reference
    config = EngineConfig(
        model=ModelConfig(model=str(tiny_model_dir), dtype="float32"),
        cache=CacheConfig(num_blocks=6),
        batch=BatchConfig(max_batch_size=4),
    )
    longest = 6 * config.cache.block_size - max(len(p) for p in prompts[:2])
    sp = SamplingParams(max_tokens=longest, temperature=0, ignore_eos=True)
    expected = tiny_llm(tiny_model_dir).generate(prompts[:2], None, sp)

    async def main():
        runners = [RayRunner(config, f"runner-{i}") for i in range(2)]
        sched = Scheduler(runners, tokenizer=describe_model(config.model).tokenizer)
        # a warm runner first: a fresh cache's first steps (kernel timings) could hold the
        # actor so long that "new" lands after "old" holds every block: it then waits for
        # "old" to end instead of being preempted (a fresh clone's make test saw it once)
        warm = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        await consume(await sched.open(EngineRequest(prompts[2], warm, None, "warm")))
        a = await sched.open(EngineRequest(prompts[0], sp, None, "old"))
        b = await sched.open(EngineRequest(prompts[1], sp, None, "new"))
        results = await asyncio.gather(consume(a), consume(b))
        sched.shutdown()
        return results, (a.runners_seen, b.runners_seen), sched.migrations

    results, seen, migrations = asyncio.run(main())
    assert seen == (["runner-0"], ["runner-0", "runner-1"])
    assert migrations[("kv_pressure", "recompute")] + migrations[("kv_pressure", "copy")] == 1
    for (tokens, last), want in zip(results, expected):
        assert last.finish_reason is FinishReason.LENGTH, last.error
        assert tokens == last.token_ids == want.token_ids


@pytest.mark.parametrize("transport", ["socket", "ray"])
def test_distkv_between_processes_serves_a_request_no_runner_holds(
    local_ray, tiny_model_dir, transport
):
    """Three actors of 6 blocks (96 tokens) each: a 190-token request is placed on one,
    borrows blocks on the other two processes (micro-attention there, per layer, over each
    data plane), and its greedy tokens equal one engine with room for all of it. Then
    killing a process that lends to another one mid-decode makes it recompute, with the
    same tokens."""
    from punica_x.models.loader import describe_model

    prompt = [(i * 7) % 200 + 3 for i in range(150)]
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    # 175 tokens: 11 blocks, which the two runners left after the kill still hold (6 + 5)
    sp2 = SamplingParams(max_tokens=25, temperature=0, ignore_eos=True)
    ref = tiny_llm(tiny_model_dir)
    want, want2 = (ref.generate([prompt], None, s)[0].token_ids for s in (sp, sp2))
    config = EngineConfig(
        model=ModelConfig(model=str(tiny_model_dir), dtype="float32"),
        cache=CacheConfig(num_blocks=6),
        batch=BatchConfig(max_batch_size=4, max_batched_tokens=64),
    )

    def lender(runners):
        """A runner process lending blocks now (asked directly: polls may come too late)."""
        counts = ray.get([r.actor.kv_counts.remote() for r in runners])
        return next((r for r, c in zip(runners, counts) if c["lent"] > 0), None)

    async def main():
        runners = [RayRunner(config, f"runner-{i}") for i in range(3)]
        sched = Scheduler(
            runners,
            tokenizer=describe_model(config.model).tokenizer,
            distkv_transport=transport,
        )
        try:
            first = await consume(await sched.open(EngineRequest(prompt, sp, None, "long")))
            counts = ray.get([r.actor.kv_counts.remote() for r in runners])
            assert sum(c["calls"] for c in counts) > 0, counts  # creditors ran micro-attention
            frames = sum(c["frames"] for c in counts)
            assert frames > 0 if transport == "socket" else frames == 0, counts
            stream = await sched.open(EngineRequest(prompt, sp2, None, "long-2"))
            tokens, victim, last = [], None, None
            async for out in stream:
                tokens += out.new_token_ids
                last = out
                if victim is None and len(tokens) >= 2:
                    victim = lender(runners)
                    if victim is not None:
                        os.kill(victim.info.pid, signal.SIGKILL)
            return first, tokens, last, victim
        finally:
            sched.shutdown()

    (tokens, last), tokens2, last2, victim = asyncio.run(main())
    assert last.finish_reason is FinishReason.LENGTH, last.error
    assert tokens == last.token_ids == want
    assert victim is not None, "no runner was seen lending"
    assert last2.finish_reason is FinishReason.LENGTH, last2.error
    assert tokens2 == last2.token_ids == want2


def test_dgfm_swaps_a_debt_cycle_home_between_processes(local_ray, tiny_model_dir):
    """Runner processes of 26 (A), 14 (B) and 8 (C) blocks, as the thread-runner DGFM test:
    w0 (27 blocks) on A takes the 10 blocks A's short request leaves and borrows the rest on
    B (and C); the short one leaves, and w1 (15 blocks) on B borrows A's freed blocks: a
    2-cycle.
    DGFM, with both held between steps, copies the KV across, brings each side's blocks home,
    cuts the debts by the blocks moved, and both requests finish with one big engine's
    tokens. w0 lives 40 decode steps: on a loaded machine it may finish before w1 has
    borrowed, and then no cycle ever forms; that attempt is run again on fresh runners (3
    at most), the cycle's absence each time failing the test."""
    from scheduler.distkv.ray_group import RayKVGroup

    w0 = [(i * 5) % 200 + 3 for i in range(430)]  # 27 blocks: more than A has
    w1 = [(i * 11) % 200 + 3 for i in range(230)]  # 15 blocks: more than B has
    short = [(i * 3) % 200 + 3 for i in range(250)]  # 16 blocks
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    ref = tiny_llm(tiny_model_dir)
    want = [o.token_ids for o in ref.generate([w0, w1], None, sp)]

    def runner(rid: str, blocks: int) -> RayRunner:
        return RayRunner(
            EngineConfig(
                model=ModelConfig(model=str(tiny_model_dir), dtype="float32"),
                cache=CacheConfig(num_blocks=blocks),
                # the blocks as counted above: a borrower takes every free local one
                batch=BatchConfig(max_batch_size=4, borrow_headroom=0),
            ),
            rid,
        )

    async def main():
        runners = [runner("A", 26), runner("B", 14), runner("C", 8)]
        a, b, _ = runners
        group = RayKVGroup(transport="socket")
        try:
            for r in runners:
                await asyncio.to_thread(group.join, r)
            streams = [
                await a.open(
                    EngineRequest(short, SamplingParams(max_tokens=60, ignore_eos=True), None, "s")
                ),
                await a.open(EngineRequest(w0, sp, None, "w0")),  # while s holds 10 of A's blocks
            ]
            debts = {}
            for _ in range(500):  # w0 has borrowed on B
                debts = await asyncio.to_thread(group.debts)
                if debts.get(("A", "B"), 0) >= 4:
                    break
                await asyncio.sleep(0.01)
            await streams[0].aclose()  # s leaves: its blocks on A are free
            for _ in range(500):
                beats = ray.get([r.actor.kv_heartbeat.remote() for r in runners])
                if beats[0].free_blocks >= 12:
                    break
                await asyncio.sleep(0.01)
            ray.get(group.gmanager.heartbeats.remote(beats))  # not the periodic ones: w0 is short
            streams[0] = await b.open(EngineRequest(w1, sp, None, "w1"))  # it borrows them
            for _ in range(500):
                debts = await asyncio.to_thread(group.debts)
                if debts.get(("B", "A"), 0) >= 4:
                    break
                await asyncio.sleep(0.01)
            if debts.get(("A", "B"), 0) < 4 or debts.get(("B", "A"), 0) < 4:
                return debts, None  # w0 finished before w1 borrowed: no cycle this time
            swaps = await asyncio.to_thread(group.defragment_blocking, {"A", "B", "C"}, 4)
            after = await asyncio.to_thread(group.debts)
            outs = await asyncio.gather(*(consume(s) for s in streams[::-1]))
            for _ in range(100):  # the loans' returns reach the ledger actor asynchronously
                final = await asyncio.to_thread(group.debts)
                if not final:
                    break
                await asyncio.sleep(0.05)
            return debts, (swaps, after, outs, final)
        finally:
            for r in runners:
                r.shutdown()

    seen = []
    for _ in range(3):
        debts, run = asyncio.run(main())
        seen.append(debts)
        if run is not None:
            break
    assert run is not None, f"no A<->B debt cycle formed in 3 attempts: {seen}"
    swaps, after, outs, final = run
    assert len(swaps) == 1 and set(swaps[0].cycle) == {"A", "B"}, (debts, swaps)
    moved = swaps[0].blocks
    assert moved >= 4, swaps
    for edge in (("A", "B"), ("B", "A")):  # (requests may have grown onto peers since)
        assert after.get(edge, 0) <= debts[edge] - moved + 2, (debts, after)
    for (tokens, last), expected in zip(outs, want):
        assert last.finish_reason is FinishReason.LENGTH, last.error
        assert tokens == last.token_ids == expected
    assert final == {}


def test_a_poison_request_fails_alone_across_the_process_boundary(
    local_ray, config, reference, monkeypatch
):
    """One runner process whose model raises in any step holding a poison token: whether
    each request was in the failed step crosses the process boundary with its RunnerLost,
    so the poison request ends alone with the quarantine error after two failed steps (two
    replacement processes), and the others finish with the undisturbed tokens."""
    import scheduler.runners.ray_runner as ray_runner
    from punica_x.models.loader import describe_model
    from scheduler.cluster import RestartPolicy

    prompts, ref = reference
    used = {t for p in prompts[:2] for t in p} | {t for r in ref[None, None][:2] for t in r}
    token = next(t for t in range(3, 300) if t not in used)
    poison = prompts[2][:3] + [token] + prompts[2][3:]

    class PoisonedActor(ray_runner.RunnerActor):  # (pickled by value into the actor)
        def __init__(self, config, runner_id):
            super().__init__(config, runner_id)
            model = self.engine.model

            def forward(batch, *args, **kwargs):
                if token in batch.input_ids.tolist():
                    raise RuntimeError("injected kernel fault")
                return model(batch, *args, **kwargs)

            self.engine.model = type("Poisoned", (), {"__call__": staticmethod(forward)})()
            self.engine.model.dims = model.dims

    monkeypatch.setattr(ray_runner, "RunnerActor", PoisonedActor)

    def factory(rid):
        return RayRunner(config, rid)

    async def main():
        sched = Scheduler(
            [factory("runner-0")],
            factory,
            tokenizer=describe_model(config.model).tokenizer,
            restart=RestartPolicy(backoff_s=0.05),
        )
        try:
            streams = [
                await sched.open(EngineRequest(p, SP, None, f"p{i}"))
                for i, p in enumerate(prompts[:2])
            ]
            streams.append(await sched.open(EngineRequest(poison, SP, None, "poison")))
            results = await asyncio.gather(*(consume(s) for s in streams))
            return results, sched.restarts, sched.quarantined
        finally:
            sched.shutdown()

    results, restarts, quarantined = asyncio.run(main())
    for i, (tokens, last) in enumerate(results[:2]):
        assert last.finish_reason is FinishReason.LENGTH, last.error
        assert tokens == last.token_ids == ref[None, None][i]
    last = results[2][1]
    assert last.finish_reason is FinishReason.ERROR
    assert last.error.startswith("this request was in 2 engine steps that failed"), last.error
    assert "injected kernel fault" in last.error
    assert restarts == 2 and quarantined == 1


@pytest.mark.slow
@pytest.mark.long
def test_sigkill_in_the_batch_invariant_mode_continues_bit_for_bit(local_ray, tmp_path):
    """The default model in bfloat16, batch_invariant=on: the runner process holding four
    streams (base and adapter rows) is SIGKILLed mid-stream; each stream, resumed on another
    process by recomputation from what its client had, ends with the tokens and logprob bits
    of the same request run alone by an LLM nobody killed. The prompts carry a ~1,000-token
    system prompt: recomputed, a stream's prompt and tokens so far are one chunk past the
    flash attention threshold, where the mode keeps the paged kernel. (With the mode off,
    the streams' logprobs differ from the alone runs here.)"""
    from helpers import CHAT_QUESTIONS, hf_default_model, make_peft_adapter

    from punica_x import LLM

    mode = "on"
    adapter = make_peft_adapter(hf_default_model(), tmp_path / "r8", 8, ["q_proj", "v_proj"], 3)
    model = ModelConfig(model=None, dtype="bfloat16", batch_invariant=mode)
    config = EngineConfig(model=model, cache=CacheConfig(num_blocks=400))
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=2)
    llm = LLM(dtype="bfloat16", batch_invariant=mode)
    llm.load_adapter("r8", str(adapter))
    system = " ".join(["You are a careful assistant who answers briefly and precisely."] * 95)

    def chat(question: str) -> list[int]:
        turns = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        text = llm.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        return llm.tokenizer.encode(text)

    prompts = [chat(q) for q in CHAT_QUESTIONS[:4]]
    adapters = [None, "r8", "r8", None]

    def bits(outs):
        return [t for o in outs for t in o.new_token_ids], [
            (lp.logprob, lp.top) for o in outs for lp in o.new_logprobs
        ]

    alone = []
    for p, a in zip(prompts, adapters):
        out = llm.generate([p], [a], sp)[0]
        alone.append((out.token_ids, [(lp.logprob, lp.top) for lp in out.logprobs]))
    sched = ray_scheduler(config)

    async def main():
        await sched.register_adapter("r8", adapter)
        pairs = enumerate(zip(prompts, adapters))
        reqs = [EngineRequest(p, sp, a, f"inv-{i}") for i, (p, a) in pairs]
        streams = [await sched.open(r) for r in reqs]
        victim = streams[0].slot
        outs = [[] for _ in streams]
        async for out in streams[0]:
            outs[0].append(out)
            if sum(len(o.new_token_ids) for o in outs[0]) >= 9:
                break
        os.kill(victim.handle.info.pid, signal.SIGKILL)

        async def rest(i):
            outs[i] += [out async for out in streams[i]]

        await asyncio.gather(*(rest(i) for i in range(len(streams))))
        for _ in range(100):
            sched.check_runners()
            if victim.state == "dead":
                break
            await asyncio.sleep(0.1)
        state = victim.state
        await replaced(sched, victim.runner_id)  # the loop stays until the new process is up
        return outs, state

    try:
        outs, state = asyncio.run(main())
    finally:
        sched.shutdown()
    assert state == "dead"
    for i, got in enumerate(outs):
        assert bits(got) == alone[i], i
