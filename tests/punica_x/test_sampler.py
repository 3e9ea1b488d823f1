"""Sampling: greedy, temperature, top-k, top-p, seeds."""

import pytest
import torch

from punica_x.core import SamplingParams
from punica_x.runtime import Request
from punica_x.sampling.sampler import Sampler


def req(seed=None, **kw):
    return Request(prompt_token_ids=[1], sampling=SamplingParams(seed=seed, **kw))


LOGITS = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))


def draws(n, **kw):
    s = Sampler(seed=5)
    return [s(LOGITS, [req(**kw)])[0] for _ in range(n)]


def test_greedy_and_top_k_one_take_the_argmax():
    s = Sampler()
    logits = torch.randn(6, 50)
    assert s(logits, [req(temperature=0) for _ in range(6)]) == logits.argmax(-1).tolist()
    assert s(logits, [req(top_k=1) for _ in range(6)]) == logits.argmax(-1).tolist()


def test_temperature_one_follows_the_distribution():
    counts = torch.bincount(torch.tensor(draws(4000)), minlength=4).float() / 4000
    torch.testing.assert_close(counts, torch.tensor([0.4, 0.3, 0.2, 0.1]), atol=0.03, rtol=0)


def test_top_k_and_top_p_filter():
    assert set(draws(300, top_k=2)) == {0, 1}
    assert set(draws(300, top_p=0.5)) == {0, 1}  # 0.4 < 0.5 keeps token 1; 0.7 >= 0.5 drops 2
    assert set(draws(300, top_p=0.3)) == {0}
    low = torch.bincount(torch.tensor(draws(4000, temperature=0.25)), minlength=4).float() / 4000
    sharp = torch.tensor([0.4, 0.3, 0.2, 0.1]) ** 4  # p^(1/T)
    torch.testing.assert_close(low, sharp / sharp.sum(), atol=0.03, rtol=0)


def test_seeded_requests_are_reproducible_in_any_batch():
    s = Sampler(seed=1)
    logits = torch.randn(3, 100)
    a = [s(logits[i : i + 1], [req(seed=42)])[0] for i in range(3)]
    rs = [req(seed=42), req(seed=42), req(seed=42)]
    b = s(logits, rs)
    assert a == b


def test_a_seeded_draw_depends_only_on_seed_and_position():
    """What migration relies on: a fresh sampler (another runner) continues a seeded request
    exactly, given only the tokens generated so far."""
    logits = torch.randn(1, 100)
    r = req(seed=42)
    first = Sampler(seed=1)
    drawn = []
    for _ in range(12):
        drawn.append(first(logits, [r])[0])
        r.output_token_ids.append(drawn[-1])
    assert len(set(drawn)) > 3  # a new draw each step, not the same one repeated
    moved = req(seed=42)
    moved.output_token_ids = drawn[:7]
    assert Sampler(seed=9)(logits, [moved])[0] == drawn[7]


def test_seeded_draws_follow_the_distribution():
    rs = [req(seed=s) for s in range(3000)]
    tokens = Sampler()(LOGITS.expand(3000, 4), rs)
    counts = torch.bincount(torch.tensor(tokens), minlength=4).float() / 3000
    torch.testing.assert_close(counts, torch.tensor([0.4, 0.3, 0.2, 0.1]), atol=0.035, rtol=0)


def reference_process(logits: torch.Tensor, r: Request) -> torch.Tensor:
    """One request, the textbook way (a Python loop per token)."""
    sp, out = r.sampling, logits.clone()
    for t, b in sp.logit_bias:
        out[t] += b
    for t in set(r.prompt_token_ids) | set(r.output_token_ids):
        out[t] = out[t] / sp.repetition_penalty if out[t] > 0 else out[t] * sp.repetition_penalty
    for t in set(r.output_token_ids):
        out[t] -= sp.frequency_penalty * r.output_token_ids.count(t) + sp.presence_penalty
    return out


def test_bias_and_penalties_match_a_reference_per_request():
    from punica_x.sampling.sampler import process_logits

    g = torch.Generator().manual_seed(0)
    vocab = 40
    requests = []
    for i in range(6):
        ids = torch.randint(0, vocab, (12,), generator=g).tolist()
        sp = SamplingParams(
            presence_penalty=[0, 0.5, -1, 0, 2, 0][i],
            frequency_penalty=[0, 0.3, 0, 1.5, -0.5, 0][i],
            repetition_penalty=[1, 1.3, 0.8, 1, 2.0, 1][i],
            logit_bias=[(), ((3, 5.0), (7, -100.0)), (), ((0, 1.5),), (), ()][i],
        )
        requests.append(Request(prompt_token_ids=ids[:5], sampling=sp, output_token_ids=ids[5:]))
    logits = torch.randn(6, vocab, generator=g)
    got = process_logits(logits, requests)
    want = torch.stack([reference_process(logits[i], r) for i, r in enumerate(requests)])
    torch.testing.assert_close(got, want)
    untouched = logits[5:]  # a request with no bias or penalty: no copy, no work
    assert process_logits(untouched, requests[5:]) is untouched


def test_logit_bias_steers_greedy_and_min_p_filters():
    s = Sampler()
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    assert s(logits, [req(temperature=0, logit_bias=((3, 100.0),))]) == [3]
    assert s(logits, [req(temperature=0, logit_bias=((0, -100.0),))]) == [1]
    # min_p 0.6: keep tokens with p >= 0.6 * 0.4 = 0.24 -> tokens 0 and 1
    assert set(draws(300, min_p=0.6)) == {0, 1}
    assert set(draws(300, min_p=1.0)) == {0}


# -- numerical safety -------------------------------------------------------------------------


def test_temperatures_below_the_epsilon_are_greedy():
    """1e-40 and 5e-324 would overflow the logits (5e-324 is 0 in float32) and make
    torch.multinomial raise: they are greedy, as vLLM's _SAMPLING_EPS (1e-5)."""
    logits = torch.randn(6, 50)
    for t in (1e-40, 5e-324, 9.9e-6):
        assert SamplingParams(temperature=t).greedy
        rs = [req(temperature=t, seed=s) for s in range(6)]
        assert Sampler()(logits, rs) == logits.argmax(-1).tolist()
    assert not SamplingParams(temperature=1e-5).greedy


def test_non_finite_rows_fall_back_to_their_finite_argmax_and_leave_the_rest_alone():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 30, generator=g)
    logits[1, [4, 9]] = float("nan")  # sampled row with NaNs
    logits[2, 7] = float("inf")  # sampled row with +inf: softmax is NaN
    logits[3, 11] = float("nan")  # greedy row: a plain argmax would pick the NaN
    rs = [
        req(seed=11),
        req(temperature=1.0),
        req(temperature=0.7, top_p=0.9),
        req(temperature=0),
        req(seed=12, top_k=5),
        req(temperature=0),
    ]

    def finite_argmax(row):
        return int(torch.where(torch.isfinite(row), row, float("-inf")).argmax())

    tokens = Sampler(seed=1)(logits, rs)
    assert tokens[1:4] == [finite_argmax(logits[i]) for i in (1, 2, 3)]
    assert tokens[5] == int(logits[5].argmax())
    for i in (0, 4):  # seeded rows draw as they would alone
        assert tokens[i] == Sampler(seed=9)(logits[i : i + 1], [rs[i]])[0]


def test_a_row_that_overflows_in_its_penalties_takes_its_argmax():
    """A tiny repetition_penalty makes the positive logits of seen tokens +inf."""
    from punica_x.sampling.sampler import process_logits

    logits = torch.tensor([[5.0, 1.0, 4.0, -2.0]])
    r = Request(prompt_token_ids=[0], sampling=SamplingParams(repetition_penalty=1e-38))
    processed = process_logits(logits, [r])
    assert processed[0, 0] == float("inf")
    assert Sampler()(logits, [r]) == [2]  # the best finite logit


def test_a_row_with_no_finite_logit_raises_no_token_allowed():
    from punica_x.sampling.sampler import NoTokenAllowed

    logits = torch.randn(2, 10)
    logits[1] = float("-inf")
    for sp in (dict(temperature=0), dict(temperature=1.0, seed=1)):
        with pytest.raises(NoTokenAllowed, match="no token is allowed"):
            Sampler()(logits, [req(), req(**sp)])
    logits[1] = float("nan")
    with pytest.raises(NoTokenAllowed):
        Sampler()(logits, [req(), req(temperature=1.0)])


# -- seeds ------------------------------------------------------------------------------------


def test_any_integer_seed_draws_reproducibly():
    from punica_x.sampling.sampler import step_seed

    logits = torch.randn(1, 200)
    seeds = (-1, -(2**63), 2**63, 2**64 - 1, 2**70, 0, 2**32, 12345)
    for seed in seeds:
        for step in (0, 1, 10**6):
            value = step_seed(seed, step)
            assert 0 <= value < 2**32  # all that torch's CPU generator keeps of a seed
            torch.Generator().manual_seed(value)  # accepted

    def run(seed):
        r, out = req(seed=seed, temperature=1.0), []
        sampler = Sampler(seed=seed % 97)  # the engine seed plays no part
        for _ in range(16):
            out.append(sampler(logits, [r])[0])
            r.output_token_ids.append(out[-1])
        return out

    runs = {seed: run(seed) for seed in seeds}
    assert all(run(seed) == runs[seed] for seed in seeds)
    assert runs[-1] == runs[2**64 - 1] and runs[2**70] == runs[0]  # modulo 2**64
    # seeds equal modulo 2**32 are different seeds (torch's generator alone would not tell)
    assert runs[2**63] != runs[0] and runs[2**32] != runs[0] and runs[12345] != runs[0]


def test_non_integer_seeds_are_refused():
    for seed in (1.0, 3.5, True, "3", float("nan")):
        with pytest.raises(ValueError, match="seed"):
            SamplingParams(seed=seed)


# -- SamplingParams as the engine's contract --------------------------------------------------


@pytest.mark.parametrize(
    "field", ["temperature", "top_p", "presence_penalty", "frequency_penalty", "min_p"]
)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), True, "0.5"])
def test_float_fields_must_be_finite_numbers(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_non_finite_penalties_and_biases_are_refused():
    for value in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="repetition_penalty"):
            SamplingParams(repetition_penalty=value)
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias={3: value})


@pytest.mark.parametrize("field", ["max_tokens", "top_k", "logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [2.0, True, "2"])
def test_int_fields_must_be_integers(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_fields_keep_their_ranges_and_canonical_types():
    sp = SamplingParams(temperature=1, top_k=-1, stop_token_ids=[3], logit_bias={2: 1})
    assert isinstance(sp.temperature, float) and sp.stop_token_ids == (3,)
    assert sp.logit_bias == ((2, 1.0),)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=(3.0,))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-0.1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)


# -- min_tokens -------------------------------------------------------------------------------


def test_min_tokens_is_bounded_by_max_tokens():
    assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4
    for value in (-1, 5):
        with pytest.raises(ValueError, match="min_tokens"):
            SamplingParams(max_tokens=4, min_tokens=value)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=1.0)


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    from punica_x.sampling.sampler import process_logits

    eos = (2, 9)
    logits = torch.zeros(4, 12)
    rs = [
        Request([1], SamplingParams(min_tokens=3, stop_token_ids=(5, 40, -1))),
        Request([1], SamplingParams(min_tokens=3, ignore_eos=True, stop_token_ids=(5,))),
        Request([1], SamplingParams(min_tokens=2), output_token_ids=[7, 7]),  # reached
        Request([1], SamplingParams()),
    ]
    out = process_logits(logits, rs, eos)
    masked = [set(torch.nonzero(row == float("-inf"))[:, 0].tolist()) for row in out]
    assert masked == [{2, 5, 9}, {5}, set(), set()]  # out-of-vocab ids are ignored
    # greedy included: eos at the top is not taken
    biased = Request([1], SamplingParams(temperature=0, min_tokens=1, logit_bias={2: 100}))
    assert Sampler(eos_token_ids=eos)(torch.zeros(1, 12), [biased]) != [2]
    biased.output_token_ids.append(0)
    assert Sampler(eos_token_ids=eos)(torch.zeros(1, 12), [biased]) == [2]


# -- the plain fast path ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=1.0),
        dict(logit_bias={3: 0.0}),
        dict(min_tokens=1),
        dict(json_schema='{"type": "object"}'),
        dict(logprobs=0),
        dict(repetition_penalty=1.1),
        dict(frequency_penalty=0.5),
        dict(presence_penalty=-0.5),
    ],
)
def test_plain_is_greedy_with_nothing_before_or_after_the_argmax(kw):
    assert SamplingParams(temperature=0).plain and SamplingParams(top_k=1).plain
    assert req(temperature=0).plain
    kw = {"temperature": 0, **kw}
    assert not SamplingParams(**kw).plain and not req(**kw).plain


def test_plain_requests_are_sampled_as_the_general_path_samples_them():
    from punica_x.engine.step_sampling import sample_step

    g = torch.Generator().manual_seed(4)
    logits = torch.randn(8, 40, generator=g)
    logits[2, 5] = float("nan")  # the general path takes the finite argmax
    logits[6] = float("-inf")  # no token allowed: that request alone fails
    rs = [req(temperature=0) for _ in range(8)]
    assert all(r.plain for r in rs)
    assert Sampler.plain(logits) is None  # a non-finite maximum: not the fast path's
    failed = {}
    tokens, logprobs = sample_step(Sampler(), logits, rs, (), failed)
    finite = torch.where(torch.isfinite(logits), logits, float("-inf"))
    assert tokens[:6] + tokens[7:] == [int(finite[i].argmax()) for i in (0, 1, 2, 3, 4, 5, 7)]
    assert tokens[6] is None and "no token is allowed" in failed[rs[6]]
    assert logprobs == [None] * 8
    ok = torch.randn(8, 40, generator=g)
    assert Sampler.plain(ok) == ok.argmax(-1).tolist() == sample_step(Sampler(), ok, rs, (), {})[0]


def test_a_matcher_on_a_plain_request_takes_the_general_path():
    """The fast path reads Request.plain (its SamplingParams) and that it has no matcher: a
    matcher set on the request (as the engine does for json_schema) is asked for its mask,
    here one that raises, so the request fails alone (the fast path would not ask it)."""
    from punica_x.engine.step_sampling import sample_step

    class Exploding:
        def __getattr__(self, name):
            raise RuntimeError("matcher asked")

    logits = torch.randn(2, 40)
    rs = [req(temperature=0), req(temperature=0)]
    rs[1].matcher = Exploding()
    failed = {}
    tokens, _ = sample_step(Sampler(), logits, rs, (), failed)
    assert tokens == [int(logits[0].argmax()), None]
    assert "matcher asked" in failed[rs[1]]
