"""Streaming through AsyncEngine: concurrent streams, early exit aborts, refusals raise."""

from __future__ import annotations

import asyncio

import pytest
from helpers import tiny_llm

from punica_x import SamplingParams
from punica_x.core import FinishReason, RequestOutput, TokenLogprob
from punica_x.engine.async_engine import AsyncEngine
from punica_x.lora.pool import UnknownAdapterError
from punica_x.request import EngineRequest

SP = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tiny_adapters):
    llm = tiny_llm(tiny_model_dir)
    llm.load_adapter("r8", str(tiny_adapters["r8"]))
    expected = {a: llm.generate(["hello world"], [a], SP)[0].token_ids for a in ("r8", None)}
    engine = AsyncEngine(llm.engine)
    yield engine, expected
    engine.shutdown()


async def collect(engine, adapter, sp=SP):
    outs = [out async for out in engine.generate("hello world", sp, adapter)]
    return outs


def test_concurrent_streams_match_offline(setup):
    engine, expected = setup

    async def main():
        return await asyncio.gather(
            collect(engine, "r8"), collect(engine, None), collect(engine, "r8")
        )

    results = asyncio.run(main())
    for outs, adapter in zip(results, ["r8", None, "r8"]):
        assert [t for o in outs for t in o.new_token_ids] == expected[adapter]
        assert outs[-1].finished and outs[-1].finish_reason is FinishReason.LENGTH
        # streamed, not batched: an output per step, or a few joined when the reader lagged
        assert 1 < len(outs) <= SP.max_tokens


def test_leaving_the_stream_aborts_and_frees_kv(setup):
    engine, _ = setup
    core = engine.engine
    free = core.cache.allocator.num_free

    async def main():
        stream = engine.generate(
            "hello world", SamplingParams(max_tokens=500, ignore_eos=True), "r8"
        )
        request, generated = None, 0
        async for out in stream:
            # the only request in flight
            request = request or await engine.call(lambda: next(iter(core.requests.values())))
            generated += len(out.new_token_ids)  # outputs carry deltas
            if generated >= 3:
                break
        await stream.aclose()
        for _ in range(200):  # the abort lands between steps
            if not await engine.call(core.has_unfinished):
                break
            await asyncio.sleep(0.01)
        return request, await engine.call(lambda: core.cache.allocator.num_free)

    request, now_free = asyncio.run(main())
    # aborted, not finished: 500 tokens would take far longer than the polling above
    assert request.finish_reason is FinishReason.ABORT
    assert len(request.output_token_ids) < 100
    assert now_free == free
    assert not core.requests


def test_refusals_raise_before_the_first_item(setup):
    engine, _ = setup

    async def main():
        with pytest.raises(UnknownAdapterError):
            await collect(engine, "missing")
        with pytest.raises(ValueError, match="prompt is empty"):
            async for _ in engine.generate([], SP):
                pass

    asyncio.run(main())


def test_hold_keeps_the_engine_thread_between_steps_until_released(setup):
    """hold() returns once the engine thread waits in it: a command sent meanwhile runs only
    after release(); a second hold() while the first is held times out with a clear error,
    and the engine steps on afterwards."""
    import threading

    engine, expected = setup
    release = engine.hold(timeout=5.0)
    ran = threading.Event()
    engine.submit(ran.set)
    assert not ran.wait(0.3), "a command ran while the engine was held"
    with pytest.raises(TimeoutError, match="not held within 0.2 s"):
        engine.hold(timeout=0.2)  # (its own command runs and returns at once, later)
    release()
    assert ran.wait(5.0)
    outs = asyncio.run(collect(engine, None))
    assert [t for o in outs for t in o.new_token_ids] == expected[None]


def test_a_reader_that_fell_behind_gets_the_queued_steps_joined(setup):
    """Outputs queued while the reader was away come as one, equal to the step by step
    ones joined: the tokens, the text, the logprobs; the finish from the last."""
    engine, expected = setup
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)

    async def main():
        steps = await collect(engine, "r8", sp)
        stream = await engine.open(
            EngineRequest(engine.engine.tokenizer.encode("hello world"), sp, "r8", "slow")
        )
        while stream._outputs.qsize() < 4:
            await asyncio.sleep(0.001)
        joined = [out async for out in stream]
        return steps, joined

    steps, joined = asyncio.run(main())
    assert len(joined) < len(steps)
    assert len(joined[0].new_token_ids) >= 4
    for outs in (steps, joined):
        assert [t for o in outs for t in o.new_token_ids] == expected["r8"]
        assert "".join(o.new_text for o in outs) == outs[-1].text
        assert [lp for o in outs for lp in o.new_logprobs] == outs[-1].logprobs
        assert outs[-1].finished and outs[-1].finish_reason is FinishReason.LENGTH
    assert joined[-1].token_ids == steps[-1].token_ids


def test_then_joins_deltas_and_keeps_the_later_finish():
    a = RequestOutput("r", [1], [], "", [5], "he", False, prompt_logprobs=[None])
    b = RequestOutput("r", [1], [5, 6], "hey", [6], "y", True, FinishReason.STOP, stop_reason=6)
    both = a.then(b)
    assert both.new_token_ids == [5, 6] and both.new_text == "hey"
    assert both.finished and both.finish_reason is FinishReason.STOP and both.stop_reason == 6
    assert both.prompt_logprobs == [None] and both.new_logprobs is None
    assert both.token_ids == [5, 6] and both.text == "hey" and both.prompt_token_ids == [1]
    middle = RequestOutput("r", [], [], "", [7], "!", False)
    assert a.then(middle).prompt_token_ids == [1]  # the first output's prompt is kept


def test_then_keeps_every_other_field_of_the_later_output():
    import dataclasses

    joined = {"prompt_token_ids", "new_token_ids", "new_text", "new_logprobs", "prompt_logprobs"}
    lp = TokenLogprob(6, -0.5, ())
    later = RequestOutput(
        "r", [], [5, 6], "hey", [6], "y", True, FinishReason.ERROR, "s", "boom", [lp], [lp], None
    )
    later = dataclasses.replace(later, retryable=True)
    both = RequestOutput("r", [1], [], "", [5], "he", False, new_logprobs=[lp]).then(later)
    for f in dataclasses.fields(RequestOutput):
        if f.name not in joined:
            assert getattr(both, f.name) == getattr(later, f.name), f.name
    assert both.new_logprobs == [lp, lp] and both.prompt_token_ids == [1]
