"""The skip-join MLFQ policy (punica_x/batching/mlfq.py) and the step-time model it is derived from:
pure functions, checked with explicit times."""

from __future__ import annotations

import random

import pytest

from punica_x.batching import mlfq
from punica_x.batching.step_time import StepTimeModel

LEVELS = mlfq.Levels(q1_s=0.1, count=4, starve_s=5.0)  # quanta 0.1, 0.2, 0.4, 0.8


def test_levels_derive_covers_the_longest_iteration():
    for min_s, max_s in [(0.03, 1.3), (0.01, 0.01), (0.02, 0.0400001), (0.05, 10.0)]:
        levels = mlfq.Levels.derive(min_s, max_s, starve_s=3.0)
        assert levels.q1_s == min_s and levels.starve_s == 3.0
        assert levels.count >= 2
        assert levels.quantum(levels.count - 1) >= max_s
        if levels.count > 2:
            assert levels.quantum(levels.count - 2) < max_s  # no level more than needed
    assert [LEVELS.quantum(i) for i in range(4)] == pytest.approx([0.1, 0.2, 0.4, 0.8])


@pytest.mark.parametrize(
    "prefill_s, level", [(0.001, 0), (0.1, 0), (0.1001, 1), (0.3, 2), (0.8, 3), (50.0, 3)]
)
def test_skip_join_picks_the_highest_level_whose_quantum_covers_the_prefill(prefill_s, level):
    assert mlfq.join_level(LEVELS, prefill_s) == level
    p = mlfq.join(LEVELS, prefill_s, arrival=7, now=12.0)
    assert (p.level, p.arrival, p.charged_s, p.last_served_s) == (level, 7, 0.0, 12.0)


def test_charge_demotes_when_the_quantum_is_used_up_and_the_last_level_keeps():
    p = mlfq.join(LEVELS, 0.01, 0, now=0.0)
    mlfq.charge(p, LEVELS, 0.06, now=1.0)
    assert (p.level, p.charged_s, p.last_served_s) == (0, pytest.approx(0.06), 1.0)
    mlfq.charge(p, LEVELS, 0.06, now=2.0)  # 0.12 >= 0.1
    assert (p.level, p.charged_s, p.demotions) == (1, 0.0, 1)
    for _ in range(3):
        mlfq.charge(p, LEVELS, 0.15, now=3.0)
    assert p.level == 2  # 0.45 in level 1 once it passed 0.2: then 0.15 of level 2's 0.4
    for _ in range(100):
        mlfq.charge(p, LEVELS, 1.0, now=4.0)
    assert p.level == 3 and p.demotions == 3


def test_a_request_unserved_past_the_starvation_limit_returns_to_the_top():
    p = mlfq.Priority(level=3, arrival=0, charged_s=0.5, last_served_s=10.0)
    assert not mlfq.promote_if_starved(p, LEVELS, now=15.0)  # exactly the limit: not yet
    assert p.level == 3
    assert mlfq.promote_if_starved(p, LEVELS, now=15.01)
    assert (p.level, p.charged_s, p.last_served_s, p.promotions) == (0, 0.0, 15.01, 1)
    top = mlfq.Priority(level=0, arrival=1, last_served_s=0.0)
    assert not mlfq.promote_if_starved(top, LEVELS, now=100.0)


def test_order_is_level_then_arrival():
    rng = random.Random(0)
    ps = [mlfq.Priority(rng.randrange(4), i) for i in range(30)]
    rng.shuffle(ps)
    ordered = sorted(ps, key=mlfq.order_key)
    assert [(p.level, p.arrival) for p in ordered] == sorted((p.level, p.arrival) for p in ps)


def test_levels_refuse_nonsense():
    for bad in [(0.0, 3, 1.0), (0.1, 0, 1.0), (0.1, 3, 0.0)]:
        with pytest.raises(ValueError):
            mlfq.Levels(*bad)


def test_step_time_model_fits_a_line_and_holds_its_prior_until_data():
    m = StepTimeModel(prior_a=0.02, prior_b=5e-4)
    assert m.predict(100) == pytest.approx(0.07)
    rng = random.Random(1)
    for _ in range(200):
        tokens = rng.randint(1, 2048)
        m.observe(tokens, 0.03 + 2e-4 * tokens + rng.uniform(-1e-3, 1e-3))
    assert m.a == pytest.approx(0.03, abs=2e-3)
    assert m.b == pytest.approx(2e-4, rel=0.02)
    one = StepTimeModel()
    one.observe(32, 0.1)  # one token count only: the mean is met, the slope kept sane
    assert one.predict(32) == pytest.approx(0.1)
    assert one.predict(1) > 0


def test_step_time_model_follows_its_window():
    """The fit covers the last `window` steps only (running sums as the window slides): after
    the machine changes, the old steps stop counting."""
    m = StepTimeModel(window=32)
    rng = random.Random(2)
    for _ in range(100):
        tokens = rng.randint(1, 512)
        m.observe(tokens, 0.05 + 1e-3 * tokens)
    for _ in range(45):  # a faster machine: after 32 of these, only they are in the fit
        tokens = rng.randint(1, 512)
        m.observe(tokens, 0.01 + 1e-4 * tokens + rng.uniform(-1e-5, 1e-5))
    assert m.a == pytest.approx(0.01, abs=1e-4)
    assert m.b == pytest.approx(1e-4, rel=0.01)
