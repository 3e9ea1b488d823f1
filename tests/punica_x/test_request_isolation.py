"""One request's failure in a step (its logits processing, sampling, logprobs, grammar, text)
ends that request alone with ERROR; the others of the batch produce exactly the tokens of an
undisturbed run. Numerically hostile sampling inputs (tiny temperatures, NaN rows, odd seeds)
and min_tokens, on the tiny Llama."""

from __future__ import annotations

from dataclasses import replace

import pytest
from helpers import tiny_llm

import punica_x.engine.step_sampling as engine_mod  # where the step calls them
import punica_x.sampling.sampler as sampler_mod
from punica_x import SamplingParams
from punica_x.core import FinishReason

PROMPTS = ["the quick brown fox", "hello world", "paged attention keeps", "a multi tenant lora"]
ADAPTERS = [None, "r8", "r8", None]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
BAD = 1  # the request that fails (it runs on adapter r8, beside another r8 request)
EOS = 2  # the tiny Llama's


@pytest.fixture(scope="module")
def engine(tiny_model_dir, tiny_adapters):
    llm = tiny_llm(tiny_model_dir)
    llm.load_adapter("r8", str(tiny_adapters["r8"]))
    return llm.engine


def generate(engine, params, before_step=None, prompts=PROMPTS, adapters=ADAPTERS):
    """Run `prompts` in one batch to the end -> (final outputs, streamed outputs), per
    request. before_step(requests, step) runs before each step. Checks that every KV block
    and adapter reference is back."""
    free = engine.cache.allocator.num_free
    streams = [[] for _ in prompts]
    reqs = [
        engine.add_request(p, sp, a, on_output=s.append)
        for p, a, sp, s in zip(prompts, adapters, params, streams)
    ]
    step = 0
    while engine.has_unfinished():
        if before_step is not None:
            before_step(reqs, step)
        engine.step()
        step += 1
    assert not engine.requests and engine.cache.allocator.num_free == free
    assert all(r.adapter is None or r.adapter._version.refs == 0 for r in reqs)
    return [s[-1] for s in streams], streams


@pytest.fixture(scope="module")
def undisturbed(engine):
    params = [replace(GREEDY, logprobs=2, prompt_logprobs=1)] * len(PROMPTS)
    return generate(engine, params)[0]


def assert_others_undisturbed(outs, undisturbed, logprobs=False):
    """The others' tokens are exactly the undisturbed ones; their logprobs too, up to float
    noise (the batch without the failed request runs in other shapes)."""
    for i, (out, ref) in enumerate(zip(outs, undisturbed)):
        if i != BAD:
            assert out.finish_reason is FinishReason.LENGTH and out.error is None
            assert out.token_ids == ref.token_ids, i
            if logprobs:
                assert flat(out.logprobs) == pytest.approx(flat(ref.logprobs), abs=1e-5)
                assert flat(out.prompt_logprobs) == pytest.approx(
                    flat(ref.prompt_logprobs), abs=1e-5
                )


def flat(entries) -> list:
    """Token ids and logprobs (top alternatives included) of TokenLogprob entries, in order."""
    out = []
    for e in entries:
        if e is not None:
            out += [e.token_id, e.logprob] + [x for pair in e.top for x in pair]
    return out


def assert_failed(out, error: str, streamed):
    assert out.finished and out.finish_reason is FinishReason.ERROR
    assert error in out.error
    assert [t for o in streamed for t in o.new_token_ids] == out.token_ids


class ExplodingMatcher:
    """A JSON-schema matcher whose every method raises."""

    def __getattr__(self, name):
        raise RuntimeError(f"grammar exploded ({name})")


def test_a_request_whose_grammar_raises_ends_alone(engine, undisturbed):
    def sabotage(reqs, step):
        # 4 tokens generated (known: with overlapped steps a 5th may be on the device, and
        # its sampling is still to come): it holds KV blocks and its adapter
        if len(reqs[BAD].output_token_ids) == 4 and reqs[BAD].matcher is None:
            reqs[BAD].matcher = ExplodingMatcher()

    outs, streams = generate(engine, [GREEDY] * 4, sabotage)
    bad = outs[BAD]
    assert_failed(bad, "sampling failed: RuntimeError: grammar exploded", streams[BAD])
    assert bad.token_ids == undisturbed[BAD].token_ids[:4]
    assert_others_undisturbed(outs, undisturbed)


def test_a_request_whose_text_raises_ends_alone(engine, undisturbed, monkeypatch):
    update = engine.detokenizer.update
    bad_ids = set()

    def failing_update(request_id, token_ids, *args, **kwargs):
        if request_id in bad_ids and len(token_ids) == 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return update(request_id, token_ids, *args, **kwargs)

    monkeypatch.setattr(engine.detokenizer, "update", failing_update)
    outs, streams = generate(
        engine, [GREEDY] * 4, lambda reqs, _: bad_ids.add(reqs[BAD].request_id)
    )
    bad = outs[BAD]
    assert_failed(bad, "postprocessing failed: UnicodeDecodeError", streams[BAD])
    assert bad.token_ids == undisturbed[BAD].token_ids[:2]  # the failed token is taken back
    assert_others_undisturbed(outs, undisturbed)


@pytest.mark.parametrize("stage", ["sampled_logprobs", "record_prompt_logprobs"])
def test_a_request_whose_logprobs_raise_ends_alone(engine, undisturbed, monkeypatch, stage):
    original, bad = getattr(engine_mod, stage), []

    def failing(logits, requests, *args):
        requests_here = [r for r, _ in requests] if stage == "record_prompt_logprobs" else requests
        if bad and bad[0] in requests_here:
            raise IndexError("logprobs exploded")
        return original(logits, requests, *args)

    monkeypatch.setattr(engine_mod, stage, failing)
    params = [replace(GREEDY, logprobs=2, prompt_logprobs=1)] * 4
    outs, streams = generate(engine, params, lambda reqs, _: bad or bad.append(reqs[BAD]))
    name = "logprobs" if stage == "sampled_logprobs" else "prompt logprobs"
    assert_failed(outs[BAD], f"{name} failed: IndexError: logprobs exploded", streams[BAD])
    assert outs[BAD].token_ids == []
    assert_others_undisturbed(outs, undisturbed, logprobs=True)


def poison(monkeypatch, fill):
    """Make the processed logits of the BAD request's row `fill(row)` (in place on a copy).
    Only requests that are not SamplingParams.plain have their logits processed: a plain
    greedy one is sampled from the model's logits (step_sampling's fast path), whose
    non-finite rows test_sampler covers."""
    process, bad = sampler_mod.process_logits, []

    def poisoned(logits, requests, *args):
        out = process(logits, requests, *args)
        rows = [i for i, r in enumerate(requests) if bad and r is bad[0]]
        if rows:
            out = out.clone()
            fill(out[rows[0]])
        return out

    monkeypatch.setattr(sampler_mod, "process_logits", poisoned)
    return lambda reqs, _: bad or bad.append(reqs[BAD])


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_a_request_with_no_finite_logit_ends_alone(engine, undisturbed, monkeypatch, temperature):
    sabotage = poison(monkeypatch, lambda row: row.fill_(float("-inf")))
    params = [GREEDY] * 4
    # a logit bias of 0 changes no logit and makes the request's logits processed
    params[BAD] = replace(GREEDY, temperature=temperature, logit_bias={5: 0.0})
    outs, streams = generate(engine, params, sabotage)
    assert_failed(outs[BAD], "no token is allowed", streams[BAD])
    assert outs[BAD].token_ids == []
    assert_others_undisturbed(outs, undisturbed)


def test_nan_and_inf_logits_fall_back_to_the_finite_argmax(engine, undisturbed, monkeypatch):
    def fill(row):
        row.fill_(float("nan"))
        row[7], row[11], row[12] = float("inf"), 3.0, 1.0

    sabotage = poison(monkeypatch, fill)
    params = [GREEDY] * 4
    params[BAD] = replace(GREEDY, temperature=1.0, seed=3)
    outs, _ = generate(engine, params, sabotage)
    assert outs[BAD].finish_reason is FinishReason.LENGTH
    assert outs[BAD].token_ids == [11] * GREEDY.max_tokens
    assert_others_undisturbed(outs, undisturbed)


def test_a_seed_that_slipped_past_validation_fails_alone(engine, undisturbed):
    params = [GREEDY] * 4
    params[BAD] = replace(GREEDY, temperature=1.0, seed=5)
    object.__setattr__(params[BAD], "seed", 2.5)  # what a frozen dataclass cannot refuse
    outs, streams = generate(engine, params)
    assert_failed(outs[BAD], "sampling failed: TypeError", streams[BAD])
    assert_others_undisturbed(outs, undisturbed)


def test_a_failing_model_forward_still_fails_the_step(engine, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.model, "forward", broken)
    engine.add_request(PROMPTS[0], GREEDY)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
        engine.step()  # overlapped steps: a launch's failure surfaces when it is read
    assert not engine.in_flight()
    assert all(o.finish_reason is FinishReason.ERROR for o in engine.fail_all("device lost"))
    assert not engine.requests


@pytest.mark.parametrize("temperature", [1e-40, 5e-324])
def test_tiny_temperatures_are_greedy(engine, undisturbed, temperature):
    params = [replace(GREEDY, temperature=temperature, top_p=0.9)] * 4
    outs, _ = generate(engine, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in undisturbed]


# -- seeds ------------------------------------------------------------------------------------


def test_any_integer_seed_is_reproducible_in_any_batch(engine):
    def seeded(seed):
        return replace(GREEDY, temperature=1.0, seed=seed)

    seeds = (-1, 2**63, 2**64 - 1, 2**70, 0, 2**32)
    alone = {s: generate(engine, [seeded(s)], prompts=PROMPTS[:1])[0][0].token_ids for s in seeds}
    for s in seeds:
        params = [GREEDY, seeded(s), replace(GREEDY, temperature=0.8), seeded(s)]
        outs, _ = generate(engine, params, prompts=PROMPTS[:1] * 4, adapters=[None] * 4)
        assert outs[1].token_ids == outs[3].token_ids == alone[s]
    assert alone[-1] == alone[2**64 - 1] and alone[2**70] == alone[0]  # modulo 2**64
    assert alone[2**63] != alone[0] and alone[2**32] != alone[0]
    for bad in (1.0, True, "7"):
        with pytest.raises(ValueError, match="seed"):
            seeded(bad)


# -- min_tokens -------------------------------------------------------------------------------


def one(engine, sp, prompt=PROMPTS[0]):
    outs, streams = generate(engine, [sp], prompts=[prompt], adapters=[None])
    return outs[0], streams[0]


def test_min_tokens_holds_eos_back_then_lets_it_stop(engine):
    eager = SamplingParams(max_tokens=20, temperature=0, logit_bias={EOS: 100})
    assert EOS in engine.loaded.eos_token_ids
    assert one(engine, eager)[0].token_ids == [EOS]
    for temperature in (0, 1.0):
        out, _ = one(engine, replace(eager, min_tokens=5, temperature=temperature, seed=1))
        assert EOS not in out.token_ids[:5] and out.token_ids[5:] == [EOS]
        assert out.finish_reason is FinishReason.STOP
    out, _ = one(engine, replace(eager, min_tokens=5, ignore_eos=True, max_tokens=6))
    assert out.token_ids == [EOS] * 6  # ignore_eos: eos is an ordinary token


def test_min_tokens_holds_stop_token_ids_back(engine):
    token = 7
    sp = SamplingParams(max_tokens=20, temperature=0, logit_bias={token: 100})
    sp = replace(sp, stop_token_ids=(token,), min_tokens=4)
    out, _ = one(engine, sp)
    assert token not in out.token_ids[:4] and out.token_ids[4:] == [token]
    assert out.finish_reason is FinishReason.STOP and out.stop_reason == token


def test_min_tokens_holds_stop_strings_back(engine):
    """The model repeats "z" (biased to the top): the stop string "zz" is in the text from
    the second token on, but counts only where it ends after the text of the first
    min_tokens - 1 tokens."""
    (z,) = engine.tokenizer.encode("z")
    sp = SamplingParams(max_tokens=12, temperature=0, logit_bias={z: 100}, stop=("zz",))
    out, _ = one(engine, sp)
    assert out.token_ids == [z, z] and out.text == ""
    out, streamed = one(engine, replace(sp, min_tokens=4))
    assert out.token_ids == [z] * 4 and out.finish_reason is FinishReason.STOP
    assert out.stop_reason == "zz"
    assert out.text == "zz" == "".join(o.new_text for o in streamed)  # cut where it starts


def test_a_resumed_request_keeps_its_min_tokens(engine):
    sp = SamplingParams(max_tokens=20, temperature=1.0, seed=9, logit_bias={EOS: 100}, min_tokens=6)
    whole, _ = one(engine, sp)
    req = engine.add_request(PROMPTS[0], sp)
    for _ in range(3):
        engine.step()
    resume = engine.take(req.request_id)
    assert len(resume.output_token_ids) == 3
    moved, _ = one_resumed(engine, sp, resume)
    assert moved.token_ids == whole.token_ids and len(whole.token_ids) == 7
    assert moved.finish_reason is FinishReason.STOP


def one_resumed(engine, sp, resume):
    outs = []
    engine.add_request(PROMPTS[0], sp, on_output=outs.append, resume=resume)
    while engine.has_unfinished():
        engine.step()
    return outs[-1], outs
