"""The benchmarks' round design: configurations interleaved in each round (the order reversed
every other round), and ratios paired by round so that a machine whose speed drifts during
the run does not move them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from common.engine_timing import (  # noqa: E402
    decode_step_time,
    interleaved_rounds,
    paired_ratio,
    unique_salts,
)


def test_rounds_interleave_the_configs_and_reverse_their_order():
    calls = []
    rounds = interleaved_rounds(
        {"a": 1, "b": 2, "c": 3},
        3,
        lambda value: calls.append(value) or value * 10,
        between=lambda r: calls.append(f"round {r}"),
    )
    assert calls == ["round 0", 1, 2, 3, "round 1", 3, 2, 1, "round 2", 1, 2, 3]
    assert rounds == {"a": [10, 10, 10], "b": [20, 20, 20], "c": [30, 30, 30]}


def test_a_ratio_paired_by_round_ignores_the_machine_drifting():
    # the machine slows down 2x over the run; b always costs 1.08x a
    speed = [1.0, 1.3, 1.6, 2.0, 1.2]
    a = [s * 10 for s in speed]
    b = [s * 10.8 for s in speed]
    paired = paired_ratio(b, a)
    assert paired["median"] == pytest.approx(1.08)
    assert paired["min"] == pytest.approx(1.08) and paired["max"] == pytest.approx(1.08)
    # values that were not measured side by side give ratios all over the place
    shuffled = [a[3], a[0], a[1], a[2], a[4]]
    unpaired = paired_ratio(b, shuffled)
    assert unpaired["min"] < 0.6 and unpaired["max"] > 1.4


def test_paired_ratio_reports_the_spread_of_the_rounds():
    paired = paired_ratio([11.0, 12.0, 10.5], [10.0, 10.0, 10.0])
    assert paired == pytest.approx({"median": 1.1, "min": 1.05, "max": 1.2})


@pytest.mark.parametrize("num, den", [([], []), ([1.0], [1.0, 2.0])])
def test_paired_ratio_refuses_rounds_that_do_not_pair(num, den):
    with pytest.raises(ValueError, match="one value of each per round"):
        paired_ratio(num, den)


class _Engine:
    """Records add_request; every request is decoding at once (the wait loop ends)."""

    def __init__(self):
        self.added, self.requests, self.steps = [], {}, 0

    def add_request(self, prompt, sampling, adapter, **kwargs):
        self.added.append((prompt, adapter, kwargs))

    def step(self):
        self.steps += 1

    def abort(self, rid):
        del self.requests[rid]


def test_decode_step_time_gives_every_request_its_own_cache_salt():
    # the same prompt on the base model four times: unsalted, the four would share KV blocks
    # that requests of four distinct adapters cannot, and the backbone's step would be cheaper
    llm = type("LLM", (), {"engine": _Engine()})()
    decode_step_time(llm, ["p"] * 4, [None] * 4, object(), steps=3)
    salts = [kwargs["cache_salt"] for _, _, kwargs in llm.engine.added]
    assert len(set(salts)) == 4 and all(salts)
    assert llm.engine.steps == 3


def test_unique_salts_are_stable_across_batches():
    assert unique_salts("decode-step", 3) == ["decode-step-0", "decode-step-1", "decode-step-2"]
    assert unique_salts("x", 0) == []
