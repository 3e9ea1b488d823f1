"""Outputs carry deltas (core.RequestOutput): every output has what the step added, the
totals are on the final output only, and prompt logprobs come once the prompt is computed
and again at the end; the deltas add up to the totals."""

from __future__ import annotations

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
