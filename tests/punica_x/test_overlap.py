"""Overlapped scheduling (engine/overlap.py): step N+1 planned while step N runs, its in-flight
inputs filled on the device. Every feature gives the tokens, text, finish reasons and logprobs
of synchronous steps, token for token; a finished request's wasted row is never emitted; aborts,
preemptions and migration hold; steps that need the host are synchronous."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest
from helpers import tiny_llm

from punica_x import SamplingParams
from punica_x.config import EngineConfig
from punica_x.core import FinishReason
from punica_x.engine import overlap
from punica_x.sampling.structured import canonical_schema

PROMPTS = [
    "the quick brown fox",
    "hello world",
    "paged attention keeps",
    "a multi tenant lora",
    "numbers 0123",
    "the lazy dog",
]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SCHEMA = {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3}


def features(tokenizer) -> list[SamplingParams]:
    """One request per feature, all in one batch."""
    text = tokenizer.decode(tokenizer.encode("the quick brown fox jumps")[-1:])
    return [
        GREEDY,
        replace(GREEDY, max_tokens=1),
        replace(GREEDY, max_tokens=3, logprobs=2),
        replace(GREEDY, temperature=0.9, top_p=0.9, top_k=20, seed=7),
        replace(GREEDY, temperature=1.0, seed=11, repetition_penalty=1.3, presence_penalty=0.5),
        replace(GREEDY, stop=(text, "o"), ignore_eos=False),
        replace(GREEDY, stop_token_ids=(20, 30, 40), min_tokens=3, ignore_eos=False),
        replace(GREEDY, logit_bias={5: 3.0}, frequency_penalty=0.4),
        replace(GREEDY, max_tokens=40, json_schema=canonical_schema(SCHEMA)),
        replace(GREEDY, max_tokens=7, temperature=0.7, min_p=0.05, seed=3),
    ]


def run(llm, prompts, adapters, params):
    """Every request in one go (continuous batching), each one's streamed outputs kept."""
    engine = llm.engine
    streams = {}
    for i, (p, a, sp) in enumerate(zip(prompts, adapters, params)):
        streams[f"q{i}"] = []
        engine.add_request(p, sp, a, request_id=f"q{i}", on_output=streams[f"q{i}"].append)
    while engine.has_unfinished():
        engine.step()
    engine.drain()
    return streams


def summary(stream):
    last = stream[-1]
    flat = [(e.token_id, e.logprob, e.top) for e in last.logprobs or []]
    return (last.token_ids, last.text, last.finish_reason, last.stop_reason, last.error, flat)


@pytest.fixture(scope="module")
def engines(tiny_model_dir, tiny_adapters):
    out = {}
    for mode in ("off", "on"):
        llm = tiny_llm(tiny_model_dir, overlap=mode, max_batch_size=8)
        for name in ("r4", "r8", "r16"):
            llm.load_adapter(name, str(tiny_adapters[name]))
        out[mode] = llm
    assert out["off"].engine.overlap is None and out["on"].engine.overlap is not None
    return out


def test_every_feature_gives_the_synchronous_tokens(engines):
    tok = engines["on"].tokenizer
    params = features(tok)
    n = len(params) * 2  # more requests than the batch: some join mid-way
    prompts = [PROMPTS[i % len(PROMPTS)] + f" {i}" for i in range(n)]
    adapters = [[None, "r4", "r8", "r16"][i % 4] for i in range(n)]
    params = params * 2
    results = {m: run(engines[m], prompts, adapters, params) for m in ("off", "on")}
    on = engines["on"].engine.overlap
    assert on.steps > 20  # the steps did overlap
    for rid, stream in results["off"].items():
        other = results["on"][rid]
        assert summary(other) == summary(stream), rid
        # a finished request's wasted row is never emitted: one final output, at the end
        assert [o.finished for o in other] == [False] * (len(other) - 1) + [True]
        assert "".join(o.new_text for o in other) == other[-1].text
        assert [t for o in other for t in o.new_token_ids] == other[-1].token_ids
    assert json.loads(results["on"]["q8"][-1].text)  # the JSON one parsed
    for mode in ("off", "on"):
        e = engines[mode].engine
        assert not e.requests and e.cache.allocator.num_free == e.cache.allocator.num_blocks
        assert not e.in_flight()


def test_prompt_logprobs_make_steps_synchronous_until_scored(engines):
    engine = engines["on"].engine
    part = engine.overlap
    sp = replace(GREEDY, prompt_logprobs=2, logprobs=1)
    outs = []
    engine.add_request(PROMPTS[1], sp, request_id="p", on_output=outs.append)
    assert not part.usable()
    steps = part.steps
    engine.step()  # the prompt's step: synchronous, its logprobs recorded
    assert part.steps == steps and outs and outs[0].prompt_logprobs is not None
    assert part.usable()  # then the request overlaps like any other
    while engine.has_unfinished():
        engine.step()
    assert part.steps > steps
    ref = engines["off"].generate([PROMPTS[1]], sampling=sp)[0]
    assert outs[-1].prompt_logprobs == ref.prompt_logprobs
    assert (outs[-1].token_ids, outs[-1].logprobs) == (ref.token_ids, ref.logprobs)


def test_an_abort_mid_flight_frees_everything_and_leaves_the_others_alone(engines):
    ref = {m: run(engines[m], PROMPTS, [None, "r8"] * 3, [GREEDY] * 6) for m in ("off", "on")}
    llm = engines["on"]
    engine = llm.engine
    streams = {f"q{i}": [] for i in range(6)}
    for i, p in enumerate(PROMPTS):
        rid = f"q{i}"
        engine.add_request(p, GREEDY, [None, "r8"][i % 2], rid, on_output=streams[rid].append)
    for _ in range(4):
        engine.step()
    assert engine.in_flight()
    out = engine.abort("q1")
    assert out.finished and out.finish_reason is FinishReason.ABORT
    while engine.has_unfinished():
        engine.step()
    engine.drain()
    assert streams["q1"][-1] is not None and streams["q1"][-1].finish_reason is FinishReason.ABORT
    assert sum(o.finished for o in streams["q1"]) == 1  # nothing after the abort's output
    aborted = [t for o in streams["q1"] for t in o.new_token_ids]
    assert aborted == ref["off"]["q1"][-1].token_ids[: len(aborted)]
    for rid in ("q0", "q2", "q3", "q4", "q5"):
        assert summary(streams[rid]) == summary(ref["off"][rid]) == summary(ref["on"][rid])
    assert engine.cache.allocator.num_free == engine.cache.allocator.num_blocks


def test_preemption_for_kv_gives_the_same_tokens(tiny_model_dir):
    """A cache of 10 blocks of 4 tokens for 4 requests of 5 + 12 tokens: the newest are
    preempted (their KV freed while their last token may be in flight) and recompute."""
    outs = {}
    for mode in ("off", "on"):
        llm = tiny_llm(tiny_model_dir, overlap=mode, num_blocks=10, block_size=4)
        outs[mode] = llm.generate(PROMPTS[:4], sampling=GREEDY)
        assert llm.engine.batcher.num_preemptions > 0
        llm.engine.shutdown()
    assert [o.token_ids for o in outs["on"]] == [o.token_ids for o in outs["off"]]
    assert [o.text for o in outs["on"]] == [o.text for o in outs["off"]]


def test_a_request_taken_mid_flight_resumes_elsewhere_with_the_same_tokens(engines):
    src, dst = engines["on"].engine, engines["off"].engine
    sp = replace(GREEDY, max_tokens=16)
    whole = engines["off"].generate([PROMPTS[2]], sampling=sp)[0]
    seen = []
    src.add_request(PROMPTS[2], sp, request_id="m", on_output=seen.append)
    for _ in range(6):
        src.step()
    assert src.in_flight()
    resume = src.take("m")  # completes the in-flight step first
    assert not src.in_flight() and "m" not in src.requests
    emitted = [t for o in seen for t in o.new_token_ids]
    assert list(resume.output_token_ids) == emitted and len(emitted) >= 4
    rest = []
    dst.add_request(PROMPTS[2], sp, request_id="m2", resume=resume, on_output=rest.append)
    while dst.has_unfinished():
        dst.step()
    assert emitted + [t for o in rest for t in o.new_token_ids] == whole.token_ids


def test_a_request_too_big_for_the_cache_keeps_its_last_token(tiny_model_dir):
    """It runs out of cache with a token in flight: it ends when that token arrives, with the
    tokens and error of synchronous steps."""
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    outs = {}
    for mode in ("off", "on"):
        llm = tiny_llm(tiny_model_dir, overlap=mode, num_blocks=6, block_size=4)
        outs[mode] = llm.generate(["the quick brown fox"], sampling=sp)[0]
        llm.engine.shutdown()
    assert outs["on"].finish_reason is FinishReason.LENGTH and "even alone" in outs["on"].error
    assert (outs["on"].token_ids, outs["on"].error) == (outs["off"].token_ids, outs["off"].error)


def test_engines_that_swap_or_borrow_run_synchronous_steps(tiny_model_dir):
    llm = tiny_llm(tiny_model_dir, overlap="on", policy="mlfq")
    assert not llm.engine.overlap.usable()
    out = llm.generate([PROMPTS[0]], sampling=GREEDY)[0]
    assert llm.engine.overlap.steps == 0 and len(out.token_ids) == GREEDY.max_tokens
    llm.engine.shutdown()


def test_a_failing_forward_surfaces_and_leaves_nothing_in_flight(tiny_model_dir, monkeypatch):
    llm = tiny_llm(tiny_model_dir, overlap="on")
    engine = llm.engine
    engine.add_request(PROMPTS[0], GREEDY, request_id="f")
    engine.step()
    engine.step()

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.model, "forward", broken)
    with pytest.raises(RuntimeError, match="device lost"):
        for _ in range(3):
            engine.step()
    assert not engine.in_flight()
    assert [o.finish_reason for o in engine.fail_all("device lost")] == [FinishReason.ERROR]
    monkeypatch.undo()
    out = llm.generate([PROMPTS[1]], sampling=GREEDY)[0]  # the engine serves on
    assert len(out.token_ids) == GREEDY.max_tokens
    engine.shutdown()


@pytest.mark.parametrize("bad", ["maybe", "ON", "", None, True, 1])
def test_bad_overlap_settings_are_refused(bad):
    with pytest.raises(ValueError, match="overlap"):
        EngineConfig(overlap=bad)


def test_the_auto_decision(monkeypatch):
    monkeypatch.delenv("PUNICA_X_OVERLAP", raising=False)
    assert overlap.decide("auto", simulated=True)[0] is True
    assert overlap.decide("auto", simulated=False)[0] is False
    assert overlap.decide("on", simulated=False)[0] is True
    assert overlap.decide("off", simulated=True)[0] is False
    monkeypatch.setenv("PUNICA_X_OVERLAP", "on")
    assert overlap.decide("auto", simulated=False) == (True, "auto: on (PUNICA_X_OVERLAP)")
    assert overlap.decide("off", simulated=False)[0] is False  # an explicit setting wins
    for bad in ("yes", "1", "maybe"):
        monkeypatch.setenv("PUNICA_X_OVERLAP", bad)
        with pytest.raises(ValueError, match="PUNICA_X_OVERLAP"):
            overlap.decide("auto", simulated=False)
    assert os.environ["PUNICA_X_OVERLAP"] == "maybe"
