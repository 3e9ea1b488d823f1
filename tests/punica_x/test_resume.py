"""Migration by recomputation at the engine level: a request taken from one engine after k
steps and resumed on another gives exactly the tokens, text, logprobs and finish of a run
that never moved (greedy, seeded sampling, penalties, stop strings, JSON schemas)."""

from __future__ import annotations

import json

import pytest
from helpers import RESUME_CASES, tiny_llm

from punica_x import SamplingParams
from punica_x.core import FinishReason, Resume

PROMPT = "hello world, the migration"


@pytest.fixture(scope="module")
def engines(tiny_model_dir, tiny_adapters):
    pair = []
    for seed in (0, 5):  # different engine seeds: seeded requests must not depend on them
        llm = tiny_llm(tiny_model_dir, seed=seed)
        llm.load_adapter("r8", str(tiny_adapters["r8"]))
        pair.append(llm.engine)
    return pair


def run(engine, sp, adapter="r8", resume=None, steps=None):
    """Generate on `engine` (at most `steps` steps) -> (outputs, request)."""
    outs = []
    req = engine.add_request(PROMPT, sp, adapter, on_output=outs.append, resume=resume)
    n = 0
    while not req.finished and (steps is None or n < steps):
        engine.step()
        n += 1
    return outs, req


def migrated(engines, sp, k, adapter="r8", with_kv=False):
    first, second = engines
    before, req = run(first, sp, adapter, steps=k)
    assert not req.finished
    resume = first.take(req.request_id, with_kv)
    assert resume is not None and list(resume.output_token_ids) == req.output_token_ids
    assert first.take(req.request_id) is None  # gone: nothing left to take
    assert not first.requests and not first.batcher.running
    after, _ = run(second, sp, adapter, resume=resume)
    return before, after


def streamed(outs):
    return [t for o in outs for t in o.new_token_ids], "".join(o.new_text for o in outs)


@pytest.mark.parametrize("case", sorted(RESUME_CASES))
@pytest.mark.parametrize("k", [1, 6])
def test_resumed_request_continues_exactly(engines, case, k):
    sp = SamplingParams(max_tokens=14, ignore_eos=True, **RESUME_CASES[case])
    reference, _ = run(engines[0], sp)
    before, after = migrated(engines, sp, k)
    assert streamed(before + after) == streamed(reference)
    last, ref = after[-1], reference[-1]
    assert last.token_ids == ref.token_ids and last.text == ref.text
    assert last.finish_reason is FinishReason.LENGTH
    if sp.logprobs is not None:
        got = [lp for o in before + after for lp in o.new_logprobs]
        want = [lp for o in reference for lp in o.new_logprobs]
        assert [lp.token_id for lp in got] == [lp.token_id for lp in want] == ref.token_ids
        for a, b in zip(got + last.logprobs, want + ref.logprobs):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert len(last.prompt_logprobs) == len(last.prompt_token_ids)


@pytest.mark.parametrize("case", ["greedy", "seeded", "logprobs"])
def test_live_kv_copy_continues_exactly_without_recomputing(engines, case):
    sp = SamplingParams(max_tokens=14, ignore_eos=True, **RESUME_CASES[case])
    reference, _ = run(engines[0], sp)
    first, second = engines
    before, req = run(first, sp, "r8", steps=5)
    resume = first.take(req.request_id, with_kv=True)
    n = len(req.prompt_token_ids) + 5 - 1  # the last sampled token is not computed yet
    assert resume.kv is not None and resume.kv.num_tokens == n
    assert not first.cache.allocator.num_used  # the source's blocks are free
    moved = second.add_request(PROMPT, sp, "r8", resume=resume)
    assert moved.num_computed_tokens == n  # nothing to recompute but the newest token
    computed = []
    second.step()
    computed.append(moved.num_computed_tokens)
    while not moved.finished:
        second.step()
    assert computed == [n + 1]
    assert moved.output_token_ids == reference[-1].token_ids
    assert [t for o in before for t in o.new_token_ids] == moved.output_token_ids[:5]


def test_stop_string_across_the_move(engines):
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    full, _ = run(engines[0], greedy)
    text = full[-1].text
    cut = len(text) * 2 // 3
    stop = text[cut : cut + 3]
    assert text.find(stop) == cut, "pick a stop string that occurs first at `cut`"
    sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=(stop,))
    reference, _ = run(engines[0], sp)
    for k in (2, 8):
        before, after = migrated(engines, sp, k)
        assert streamed(before + after) == streamed(reference)
        assert after[-1].finish_reason is FinishReason.STOP and after[-1].stop_reason == stop


def test_json_schema_resumes_inside_the_document(engines):
    schema = json.dumps(
        {"type": "array", "items": {"enum": ["alpha", "beta"]}, "minItems": 3, "maxItems": 5}
    )
    sp = SamplingParams(max_tokens=40, temperature=1.0, seed=3, json_schema=schema)
    reference, _ = run(engines[0], sp)
    assert len(reference[-1].token_ids) > 4
    before, after = migrated(engines, sp, 3)
    assert streamed(before + after) == streamed(reference)
    json.loads(after[-1].text)


def test_resume_refuses_what_cannot_continue(engines):
    sp = SamplingParams(max_tokens=3, temperature=0)
    with pytest.raises(ValueError, match="no tokens left"):
        engines[1].add_request(PROMPT, sp, None, resume=Resume((1, 2, 3)))
    with pytest.raises(ValueError, match="vocabulary"):
        engines[1].add_request(PROMPT, SamplingParams(max_tokens=9), None, resume=Resume((-1,)))
    assert not engines[1].requests
