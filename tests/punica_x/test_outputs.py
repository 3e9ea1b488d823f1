"""Outputs carry deltas (core.RequestOutput): every output has what the step added, the
totals are on the final output only, and prompt logprobs come once the prompt is computed
and again at the end; the deltas add up to the totals."""

from __future__ import annotations

import pytest
from helpers import tiny_llm

from punica_x import SamplingParams


def test_outputs_carry_deltas_and_the_final_one_the_totals(tiny_model_dir):
    llm = tiny_llm(tiny_model_dir)
    engine = llm.engine
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    sp_prompt = SamplingParams(
        max_tokens=9, temperature=0.8, seed=5, ignore_eos=True, logprobs=1, prompt_logprobs=1
    )
    plain = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)
    a = engine.add_request("the quick brown fox jumps", sp)
    b = engine.add_request("hello world, once more", sp_prompt)
    c = engine.add_request("plain request", plain)
    seen = {r.request_id: [] for r in (a, b, c)}
    prompts = dict(
        zip(seen, ("the quick brown fox jumps", "hello world, once more", "plain request"))
    )
    while engine.has_unfinished():
        for out in engine.step():
            seen[out.request_id].append(out)
    for req, params in ((a, sp), (b, sp_prompt), (c, plain)):
        outs = seen[req.request_id]
        final, steps = outs[-1], outs[:-1]
        assert final.finished and not any(o.finished for o in steps)
        assert len(final.token_ids) == params.max_tokens
        for o in steps:  # no totals before the end
            assert o.token_ids == [] and o.text == ""
            assert o.logprobs == ([] if params.logprobs is not None else None)
        assert sum((o.new_token_ids for o in outs), []) == final.token_ids
        assert "".join(o.new_text for o in outs) == final.text
        # the prompt on the first output and the final one only (not resent every token)
        prompt = engine.tokenizer.encode(prompts[req.request_id])
        assert outs[0].prompt_token_ids == final.prompt_token_ids == prompt
        assert all(o.prompt_token_ids == [] for o in steps[1:])
        if params.logprobs is None:
            assert all(o.new_logprobs is None for o in outs) and final.logprobs is None
        else:
            assert sum((o.new_logprobs for o in outs), []) == final.logprobs
            assert [e.token_id for e in final.logprobs] == final.token_ids
        with_prompt = [i for i, o in enumerate(outs) if o.prompt_logprobs is not None]
        if params.prompt_logprobs is None:
            assert with_prompt == []
        else:  # the first output (the prompt is computed before a token is sampled), and the end
            assert with_prompt == [0, len(outs) - 1]
            assert outs[0].prompt_logprobs == final.prompt_logprobs
            assert len(final.prompt_logprobs) == len(final.prompt_token_ids)


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_a_stream_interval_sends_the_first_token_then_every_n_joined(tiny_model_dir, overlap):
    """stream_interval=4: a request's callback gets its first token at once, then outputs of
    4 tokens (the deltas, logprobs and prompt logprobs of the steps joined), the end at once
    with the totals; step() still returns an output per token (and drain() an overlapped
    step's); a take hands over what was held first, so the caller has every token the moved
    request made here (overlapped: the one in flight too, which the take's drain brings)."""
    from dataclasses import replace

    from punica_x.engine.engine import Engine

    base = tiny_llm(tiny_model_dir).engine
    engine = Engine(replace(base.config, stream_interval=4, overlap=overlap), base.loaded)
    sp = SamplingParams(
        max_tokens=13, temperature=0, ignore_eos=True, logprobs=1, prompt_logprobs=1
    )
    got: dict[str, list] = {"a": [], "b": []}
    engine.add_request("the quick brown fox", sp, request_id="a", on_output=got["a"].append)
    engine.add_request("hello there", sp, request_id="b", on_output=got["b"].append)
    per_token = []
    while engine.has_unfinished():
        per_token += [o for o in engine.step() if o.request_id == "a"]
        if "b" in engine.requests and len(engine.requests["b"].output_token_ids) == 6:
            per_token += [o for o in engine.drain() if o.request_id == "a"]  # take's drain
            resume = engine.take("b")
    per_token += [o for o in engine.drain() if o.request_id == "a"]  # the last step's
    assert [len(o.new_token_ids) for o in got["a"]] == [1, 4, 4, 4]
    assert [len(o.new_token_ids) for o in per_token] == [1] * 13
    final = got["a"][-1]
    assert final.finished and final.token_ids == [t for o in per_token for t in o.new_token_ids]
    assert [t for o in got["a"] for t in o.new_token_ids] == final.token_ids
    assert "".join(o.new_text for o in got["a"]) == final.text
    assert [lp for o in got["a"] for lp in o.new_logprobs] == final.logprobs
    assert got["a"][0].prompt_logprobs == final.prompt_logprobs is not None
    assert got["a"][1].prompt_token_ids == [] and got["a"][0].prompt_token_ids
    # the 6th (and overlapped, the 7th that was in flight): held, then handed at the take
    assert [len(o.new_token_ids) for o in got["b"]] == [1, 4, 1 + (overlap == "on")]
    assert [t for o in got["b"] for t in o.new_token_ids] == list(resume.output_token_ids)
    assert not any(o.finished for o in got["b"])


def test_stream_interval_refuses_what_is_not_a_count():
    import pytest

    from punica_x.config import EngineConfig

    for bad in (0, -1, 4097, 2.0, True, "4", None):
        with pytest.raises(ValueError, match="stream_interval"):
            EngineConfig(stream_interval=bad)
