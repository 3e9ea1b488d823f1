"""Sampling: greedy, temperature, top-k, top-p, seeds."""

import torch

from punica_x.core import Request, SamplingParams
from punica_x.sampler import Sampler


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
    from punica_x.sampler import process_logits

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
