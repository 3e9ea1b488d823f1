"""The simulated device: a step of fixed wall time without the interpreter lock, tokens that are
a pure function of the input, and refusals of bad step times (models/simulated.py)."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch
from helpers import tiny_llm

from punica_x.config import ModelConfig
from punica_x.core import SamplingParams
from punica_x.models.simulated import FIRST_TOKEN, SimulatedForward, next_token
from punica_x.runtime import Batch


def _batch(ids: list[int], positions: list[int]) -> Batch:
    rows = torch.arange(len(ids))
    t = torch.tensor
    return Batch(t(ids), t(positions), attention=None, lora=None, sample_rows=rows)


def test_logits_pick_next_token_of_each_row():
    sim = SimulatedForward(1.0, vocab=1024, token_limit=300)
    logits = sim(_batch([5, 5, 250], [0, 7, 7]))
    assert logits.shape == (3, 1024) and logits.dtype == torch.float32
    picked = logits.argmax(dim=1)
    want = next_token(torch.tensor([5, 5, 250]), torch.tensor([0, 7, 7]), 300)
    assert picked.tolist() == want.tolist()
    assert all(FIRST_TOKEN <= t < 300 for t in picked.tolist())
    assert picked[0] != picked[1]  # the position counts, not only the token


def test_a_step_holds_its_time_without_the_interpreter_lock():
    """While the forward holds 300 ms, a Python thread runs on: a forward that held the lock
    (a busy wait, a C call that keeps it) would leave the counter near zero."""
    sim = SimulatedForward(300.0, vocab=64)
    count, stop = [0], threading.Event()

    def spin():
        while not stop.is_set():
            count[0] += 1

    thread = threading.Thread(target=spin)
    thread.start()
    time.sleep(0.05)
    before = count[0]
    t0 = time.perf_counter()
    sim(_batch([20], [3]))
    took = time.perf_counter() - t0
    during = count[0] - before
    stop.set()
    thread.join()
    assert 0.3 <= took < 1.0
    assert during > 100_000, during
    assert sim.calls == 1 and sim.waited_s >= 0.3
    sim.reset()
    assert sim.calls == 0 and sim.waited_s == 0.0


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, 60_001, True, "5"])
def test_bad_step_times_are_refused(bad):
    with pytest.raises(ValueError, match="simulated_step_ms"):
        ModelConfig(simulated_step_ms=bad)
    if not isinstance(bad, str | bool) and not bad > 0:
        with pytest.raises(ValueError, match="step_ms"):
            SimulatedForward(bad, vocab=64)


def test_a_vocabulary_without_ordinary_tokens_is_refused():
    with pytest.raises(ValueError, match="vocabulary"):
        SimulatedForward(1.0, vocab=1024, token_limit=FIRST_TOKEN)


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_an_engine_on_the_simulated_device_generates_its_chain(tiny_model_dir, overlap):
    """Greedy tokens follow next_token from the prompt's last token, alone or in a batch,
    and (synchronous steps) every step waited the device's time."""
    llm = tiny_llm(tiny_model_dir, simulated_step_ms=2.0, overlap=overlap)
    sim = llm.engine.forward
    assert isinstance(sim, SimulatedForward) and llm.engine.graphs is None
    prompts = [[5, 9, 30], [7, 8], [40, 41, 42, 43]]
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, sampling=sp)
    limit = sim.token_limit
    for prompt, out in zip(prompts, outs):
        last, pos, chain = prompt[-1], len(prompt) - 1, []
        for _ in range(6):
            last = int(next_token(torch.tensor([last]), torch.tensor([pos]), limit))
            chain.append(last)
            pos += 1
        assert out.token_ids == chain
    assert sim.calls >= 6
    if overlap == "off":
        assert sim.waited_s >= sim.calls * 0.002
