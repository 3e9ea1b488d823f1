"""A runner fault is not an outage: a dead runner is replaced through the scheduler's factory
(with backoff, counted in Scheduler.restarts and /metrics), requests wait at the scheduler
while the only runner is replaced, and a poison request (one whose steps always raise) ends
alone with an error after two failed steps while its batch mates finish with the tokens of
an undisturbed run. Faults are injected in the engine's model forward: any step whose batch
holds the poison token raises, as a kernel that crashes on one request's input would."""

from __future__ import annotations

import asyncio
import pickle
import threading

import pytest
from helpers import tiny_llm

from frontend.http.metrics import Metrics
from punica_x import SamplingParams
from punica_x.config import BatchConfig, CacheConfig, EngineConfig, ModelConfig
from punica_x.core import FinishReason
from punica_x.engine.async_engine import RunnerLost
from punica_x.errors import ContextTooLong
from punica_x.lora.pool import UnknownAdapterError
from punica_x.models.loader import load_model
from punica_x.request import EngineRequest
from scheduler.cluster import NoRunner, RestartPolicy, Scheduler
from scheduler.runners.local import LocalRunner

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
TEXTS = [f"request number {i} says hello to the cluster" for i in range(6)]
FAST = RestartPolicy(backoff_s=0.05, max_backoff_s=0.2, stable_s=60.0)
FAULT = "injected kernel fault"


class Faults:
    """How many steps holding the poison token raise (None: every one), and how many did."""

    def __init__(self, token: int, budget: int | None = None) -> None:
        self.token, self.budget, self.raised = token, budget, 0
        self._lock = threading.Lock()

    def hit(self, input_ids) -> bool:
        if self.token not in input_ids.tolist():
            return False
        with self._lock:
            if self.budget is not None and self.raised >= self.budget:
                return False
            self.raised += 1
            return True


class Poisoned:
    """An engine's model whose forward raises when `faults` says so."""

    def __init__(self, model, faults: Faults) -> None:
        self._model, self._faults = model, faults

    def __call__(self, batch, *args, **kwargs):
        if self._faults.hit(batch.input_ids):
            raise RuntimeError(FAULT)
        return self._model(batch, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


@pytest.fixture(scope="module")
def shared(tiny_model_dir):
    return load_model(ModelConfig(model=str(tiny_model_dir), dtype="float32"))


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tiny_adapters):
    """Prompts, a poison token none of the normal prompts or outputs hold, a poison prompt,
    every prompt's greedy tokens from one undisturbed engine, and prompt 2's with the r8
    adapter."""
    llm = tiny_llm(tiny_model_dir)
    llm.load_adapter("r8", str(tiny_adapters["r8"]))
    prompts = [llm.tokenizer.encode(t) for t in TEXTS]
    normal = llm.generate(prompts, None, GREEDY)
    adapted = llm.generate(prompts[2:3], ["r8"], GREEDY)[0].token_ids
    used = {t for p in prompts for t in p} | {t for r in normal for t in r.token_ids}
    token = next(t for t in range(3, len(llm.tokenizer)) if t not in used)
    poison = prompts[0][:4] + [token] + prompts[0][4:]
    expected = [r.token_ids for r in normal] + [llm.generate([poison], None, GREEDY)[0].token_ids]
    return prompts + [poison], token, expected, adapted


def config(batch: int = 8) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model="unused", dtype="float32"),
        cache=CacheConfig(num_blocks=64),
        batch=BatchConfig(max_batch_size=batch),
    )


def poisoned_factory(shared, faults: Faults, gate: threading.Event | None = None, batch=8):
    """Runners whose model raises on the poison token; with `gate`, a runner started after
    the first waits for it (a slow replacement)."""
    built = []

    def factory(rid: str) -> LocalRunner:
        if gate is not None and built:
            assert gate.wait(60)
        runner = LocalRunner(config(batch), rid, shared=shared)
        runner.engine.model = Poisoned(runner.engine.model, faults)
        built.append(rid)
        return runner

    return factory


async def consume(stream):
    tokens, last = [], None
    async for out in stream:
        tokens += out.new_token_ids
        last = out
    return tokens, last


def finished(result, expected) -> None:
    tokens, last = result
    assert last.finish_reason is FinishReason.LENGTH, last.error
    assert tokens == last.token_ids == expected


def test_restart_policy_backs_off_doubling_up_to_its_cap():
    policy = RestartPolicy(backoff_s=1.0, max_backoff_s=30.0)
    assert [policy.delay(n) for n in range(8)] == [0, 1, 2, 4, 8, 16, 30, 30]


def test_a_poison_request_fails_alone_and_the_runner_comes_back(shared, reference):
    """One runner, five normal requests and a poison one opened together: the poison
    request's steps raise twice (its first step, then its retry, alone among suspects); the
    runner is replaced each time, the poison request ends with the quarantine error, every
    other request finishes with the undisturbed tokens, and the server takes new work."""
    prompts, token, expected, _ = reference
    faults = Faults(token)

    async def main():
        factory = poisoned_factory(shared, faults)
        sched = Scheduler([factory("runner-0")], factory, restart=FAST)
        streams = [
            await sched.open(EngineRequest(p, GREEDY, None, f"q{i}")) for i, p in enumerate(prompts)
        ]
        results = await asyncio.gather(*(consume(s) for s in streams))
        after = await consume(await sched.open(EngineRequest(prompts[1], GREEDY, None, "after")))
        metrics = Metrics(
            sched.stats, sched.runners, lambda: sched.migrations, lambda: sched.restarts
        )
        rows = sched.runners()
        sched.shutdown()
        return sched, results, after, rows, metrics.render().decode()

    sched, results, after, rows, text = asyncio.run(main())
    *normal, (tokens, last) = results
    for i, result in enumerate(normal):
        finished(result, expected[i])
    finished(after, expected[1])
    assert last.finish_reason is FinishReason.ERROR
    assert last.error.startswith(
        f"this request was in 2 engine steps that failed (last: engine step failed: "
        f"RuntimeError: {FAULT})"
    ), last.error
    assert last.error.endswith("it is not retried")
    assert not last.retryable  # sent again, it would fail the same way (HTTP 500, not 503)
    assert faults.raised == 2 and sched.restarts == 2 and sched.quarantined == 1
    assert [(r.id, r.state, r.replaces) for r in rows] == [
        ("runner-0", "dead", None),
        ("runner-1", "dead", "runner-0"),
        ("runner-2", "active", "runner-1"),
    ]
    assert FAULT in rows[0].error and FAULT in rows[1].error
    assert "punica_x_runner_restarts_total 2.0" in text


def test_a_fault_that_does_not_repeat_retries_the_request(shared, reference):
    """The step raises once only: the requests that were in it are retried on the
    replacement and every one, the poison one too, finishes with the undisturbed tokens."""
    prompts, token, expected, _ = reference
    faults = Faults(token, budget=1)

    async def main():
        factory = poisoned_factory(shared, faults)
        sched = Scheduler([factory("runner-0")], factory, restart=FAST)
        streams = [
            await sched.open(EngineRequest(p, GREEDY, None, f"q{i}")) for i, p in enumerate(prompts)
        ]
        results = await asyncio.gather(*(consume(s) for s in streams))
        sched.shutdown()
        return sched, results

    sched, results = asyncio.run(main())
    for result, want in zip(results, expected):
        finished(result, want)
    assert faults.raised == 1 and sched.restarts == 1 and sched.quarantined == 0


def test_requests_wait_while_the_only_runner_is_replaced(shared, reference, tiny_adapters):
    """While the replacement starts, the server is not ready (no runner takes work) but
    takes requests (refusing bad ones as a runner would): they wait at the scheduler, then
    run on the replacement, which has every adapter."""
    prompts, token, expected, adapted = reference
    gate = threading.Event()
    faults = Faults(token, budget=1)

    async def main():
        factory = poisoned_factory(shared, faults, gate)
        sched = Scheduler([factory("runner-0")], factory, restart=FAST)
        await sched.register_adapter("r8", tiny_adapters["r8"])
        poison = await sched.open(EngineRequest(prompts[-1], GREEDY, None, "poison"))
        for _ in range(500):  # the step raised, the replacement waits for the gate
            sched.check_runners()
            if sched.slots[0].state == "dead":
                break
            await asyncio.sleep(0.01)
        states = [s.state for s in sched.slots]
        ready, accepting = sched.ready(), sched.accepting()
        waiting = await sched.open(EngineRequest(prompts[2], GREEDY, "r8", "waiting"))
        queued = waiting.slot is None and sched.queued >= 1
        with pytest.raises(UnknownAdapterError):
            await sched.open(EngineRequest(prompts[2], GREEDY, "unknown", "refused"))
        with pytest.raises(ContextTooLong):
            await sched.open(EngineRequest(prompts[2] * 100, GREEDY, None, "too-long"))
        gate.set()
        results = await asyncio.gather(consume(poison), consume(waiting))
        sched.shutdown()
        return states, ready, accepting, queued, results, sched.restarts

    states, ready, accepting, queued, results, restarts = asyncio.run(main())
    assert states == ["dead", "starting"]
    assert not ready and accepting and queued
    finished(results[0], expected[-1])
    finished(results[1], adapted)
    assert restarts == 1


def test_a_scheduler_without_restart_keeps_a_dead_runner_dead(shared, reference):
    prompts, token, _, _ = reference
    faults = Faults(token)

    async def main():
        factory = poisoned_factory(shared, faults)
        sched = Scheduler([factory("runner-0")], factory, restart=None)
        _, last = await consume(
            await sched.open(EngineRequest(prompts[-1], GREEDY, None, "poison"))
        )
        with pytest.raises(NoRunner):
            await sched.open(EngineRequest(prompts[0], GREEDY, None, "q"))
        sched.shutdown()
        return last, [s.state for s in sched.slots], sched.restarts

    last, states, restarts = asyncio.run(main())
    assert last.finish_reason is FinishReason.ERROR and FAULT in last.error
    assert states == ["dead"] and restarts == 0


def test_runner_lost_names_the_requests_that_were_in_the_failed_step(shared, reference):
    """Batch of 2: the poison request and the next one run in the failing step, the two
    after them wait; only the first two streams end with in_failed_step. The flag survives
    pickling (Ray carries it)."""
    prompts, token, _, _ = reference
    runner = poisoned_factory(shared, Faults(token), batch=2)("runner-0")

    async def main():
        held, release = threading.Event(), threading.Event()

        def hold():
            held.set()
            release.wait(30)

        runner.async_engine.submit(hold)  # the four requests join between the same steps
        assert await asyncio.to_thread(held.wait, 30)
        order = [prompts[-1], *prompts[:3]]
        opening = asyncio.gather(
            *(runner.open(EngineRequest(p, GREEDY, None, f"r{i}")) for i, p in enumerate(order))
        )
        await asyncio.sleep(0.05)
        release.set()
        streams = await opening
        flags = []
        for stream in streams:
            with pytest.raises(RunnerLost) as lost:
                async for _ in stream:
                    pass
            flags.append(lost.value.in_failed_step)
        return flags, lost.value

    flags, lost = asyncio.run(main())
    runner.shutdown()
    assert flags == [True, True, False, False]
    again = pickle.loads(pickle.dumps(RunnerLost(str(lost), True)))
    assert again.in_failed_step and str(again) == str(lost) and FAULT in str(lost)
