"""The batch-invariant mode's decision (punica_x/ops/invariance.py, pure), its config field
against hostile values, and what an engine chooses and says."""

from __future__ import annotations

import pytest
from helpers import tiny_llm

from punica_x.config import ModelConfig
from punica_x.ops.invariance import (
    MAX_COST,
    Invariance,
    decide,
    dense_cost,
    with_engine_backends,
)


def never():
    raise AssertionError("cost measured where no measurement is needed")


@pytest.mark.parametrize("bad", ["ON", "yes", "", "true", 1, True, None, 0.5, ["on"], {"on": 1}])
def test_the_mode_refuses_anything_but_auto_on_off(bad):
    with pytest.raises(ValueError, match="batch_invariant must be one of auto, on, off"):
        ModelConfig(batch_invariant=bad)
    with pytest.raises(ValueError, match="batch_invariant must be one of"):
        decide(bad, "cpu", True, {}, never)


def test_off_and_on_need_no_measurement():
    assert decide("off", "cpu", True, {}, never) == Invariance(False, "batch_invariant=off")
    assert decide("on", "cpu", True, {"dense": "cpu", "fused": None}, never).on


@pytest.mark.parametrize(
    ("device", "kernels", "named", "says"),
    [
        ("cuda", True, {}, "no batch-invariant kernels on cuda yet"),
        ("cpu", False, {}, "compiled CPU kernels do not run this model"),
        ("cpu", True, {"dense": "onednn"}, "dense backend 'onednn' named"),
        ("cpu", True, {"fused": "torch", "dense": "cpu"}, "fused backend 'torch' named"),
    ],
)
def test_on_is_refused_where_it_cannot_hold_and_auto_says_why_it_is_off(
    device, kernels, named, says
):
    with pytest.raises(ValueError, match=f"batch_invariant=on cannot hold: .*{says}"):
        decide("on", device, kernels, named, never)
    auto = decide("auto", device, kernels, named, never)
    assert not auto.on and says in auto.reason and auto.cost is None


@pytest.mark.parametrize(("cost", "on"), [(0.0, True), (MAX_COST, True), (0.051, False)])
def test_auto_is_on_up_to_the_measured_cost(cost, on):
    choice = decide("auto", "cpu", True, {}, lambda: cost)
    assert choice.on is on and choice.cost == cost
    assert f"{100 * cost:.1f}%" in choice.reason and choice.reason.startswith(
        f"auto: {'on' if on else 'off'}"
    )


def test_dense_cost_weighs_each_shape_by_its_count():
    # shape A: cpu fastest; shape B (4 of them): onednn 10% faster than cpu
    timings = [(1, {"cpu": 2.0, "onednn": 3.0}), (4, {"cpu": 1.1, "onednn": 1.0})]
    assert dense_cost(timings) == pytest.approx((2.0 + 4.4) / (2.0 + 4.0) - 1)
    assert dense_cost([(3, {"cpu": 1.0})]) == 0.0  # a lone candidate
    assert dense_cost([(2, {})]) == 0.0  # no timing (timing off, a lone candidate)


def test_engine_backends_named_turn_auto_off_and_refuse_on():
    on = Invariance(True, "auto: on, ...", 0.01)
    assert with_engine_backends(on, "auto", {"attention": "cpu", "SGMV": None}) is on
    off = with_engine_backends(on, "auto", {"attention": "torch"})
    assert not off.on and "attention backend 'torch' named" in off.reason and off.cost == 0.01
    with pytest.raises(ValueError, match="SGMV backend 'torch_ref' named"):
        with_engine_backends(Invariance(True, "batch_invariant=on"), "on", {"SGMV": "torch_ref"})


def test_an_engine_says_what_it_chose(tiny_model_dir, monkeypatch):
    llm = tiny_llm(tiny_model_dir, batch_invariant="on")
    info = llm.engine.describe()
    assert info.batch_invariant and info.batch_invariant_reason == "batch_invariant=on"
    assert llm.engine.sgmv.fixed_order and not llm.engine.planner.attention.flash
    off = tiny_llm(tiny_model_dir, batch_invariant="off").engine
    assert not off.describe().batch_invariant and not off.sgmv.fixed_order
    torch_attention = tiny_llm(tiny_model_dir, attention_backend="torch").engine  # auto
    assert not torch_attention.invariance.on
    assert "attention backend 'torch' named" in torch_attention.describe().batch_invariant_reason
    with pytest.raises(ValueError, match="attention backend 'torch' named"):
        tiny_llm(tiny_model_dir, attention_backend="torch", batch_invariant="on")
    monkeypatch.setenv("PUNICA_X_DENSE_BACKEND", "torch")
    with pytest.raises(ValueError, match="dense backend 'torch' named"):
        tiny_llm(tiny_model_dir, batch_invariant="on")
