"""The batch-invariant mode's decision (punica_x/ops/invariance.py, pure), its config field
against hostile values, and what an engine chooses and says."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import tiny_llm

from punica_x.config import ModelConfig
from punica_x.ops import isa as isa_mod
from punica_x.ops.invariance import (
    CUDA_AUTO,
    MAX_COST,
    Invariance,
    decide,
    invariant_backend,
    relative_cost,
    with_engine_backends,
)
from punica_x.ops.sgmv import ORDER_DIFFERS, order_timings


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
        ("mps", True, {}, "no batch-invariant kernels on mps yet"),
        ("cuda", False, {}, "the Triton kernels do not run this model here"),
        ("cuda", True, {"attention": "flashinfer"}, "'flashinfer' named, not .* 'triton'"),
        ("cuda", True, {"SGMV": "torch_ref", "dense": "triton"}, "'torch_ref' named, not .*"),
        ("cuda", True, {"dense": "torch"}, "dense backend 'torch' named"),
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
    assert not auto.on and re.search(says, auto.reason) and auto.cost is None


def test_on_cuda_the_mode_is_opt_in_and_names_its_kernels():
    named = {"dense": "triton", "fused": None, "attention": "triton", "SGMV": "cuda"}
    assert decide("on", "cuda", True, named, never) == Invariance(True, "batch_invariant=on")
    auto = decide("auto", "cuda", True, {}, never)  # not measured there: off, saying so
    assert auto == Invariance(False, CUDA_AUTO) and "opt-in" in auto.reason
    assert invariant_backend("cuda", "dense") == "triton" == invariant_backend("cuda", "fused")
    assert invariant_backend("cuda", "attention") == "triton"
    assert invariant_backend("cuda", "SGMV") == "cuda" and invariant_backend("cpu", "SGMV") == "cpu"
    on = Invariance(True, "batch_invariant=on")
    assert with_engine_backends(on, "on", {"attention": "triton", "SGMV": "cuda"}, "cuda") is on
    with pytest.raises(ValueError, match="attention backend 'flashinfer' named"):
        with_engine_backends(on, "on", {"attention": "flashinfer"}, "cuda")
    with pytest.raises(ValueError, match="SGMV backend 'cpu' named, not .* 'cuda'"):
        with_engine_backends(on, "on", {"SGMV": "cpu"}, "cuda")


@pytest.mark.parametrize(("cost", "on"), [(0.0, True), (MAX_COST, True), (0.051, False)])
@pytest.mark.parametrize("part", ["dense projections", "LoRA"])
def test_auto_is_on_up_to_the_measured_cost_of_its_costliest_part(cost, on, part):
    parts = {"dense projections": 0.01, "LoRA": 0.0, part: cost}
    choice = decide("auto", "cpu", True, {}, lambda: parts)
    assert choice.on is (on or parts[part] < 0.01) and choice.cost == max(parts.values())
    assert f"{part} {100 * cost:.1f}%" in choice.reason
    assert choice.reason.startswith(f"auto: {'on' if choice.on else 'off'}, its measured cost is")


def test_auto_with_nothing_to_time_is_on_and_says_so():
    choice = decide("auto", "cpu", True, {}, dict)
    assert choice.on and choice.cost == 0.0 and "nothing to time" in choice.reason


def test_relative_cost_weighs_each_shape_by_its_count():
    # shape A: cpu fastest; shape B (4 of them): onednn 10% faster than cpu
    timings = [(1, {"cpu": 2.0, "onednn": 3.0}), (4, {"cpu": 1.1, "onednn": 1.0})]
    assert relative_cost(timings) == pytest.approx((2.0 + 4.4) / (2.0 + 4.0) - 1)
    assert relative_cost([(3, {"cpu": 1.0})]) == 0.0  # a lone candidate
    assert relative_cost([(2, {})]) == 0.0  # no timing (timing off, a lone candidate)
    assert relative_cost([]) == 0.0  # nothing timed (SGMV where both orders are one)
    # the SGMV orders: fixed ("cpu") 20% slower than the kernels' own on one shape
    assert relative_cost([(2, {"cpu": 1.2, "cpu_any_order": 1.0})]) == pytest.approx(0.2)


def test_engine_backends_named_turn_auto_off_and_refuse_on():
    on = Invariance(True, "auto: on, ...", 0.01)
    assert with_engine_backends(on, "auto", {"attention": "cpu", "SGMV": None}) is on
    off = with_engine_backends(on, "auto", {"attention": "torch"})
    assert not off.on and "attention backend 'torch' named" in off.reason and off.cost == 0.01
    with pytest.raises(ValueError, match="SGMV backend 'torch_ref' named"):
        with_engine_backends(Invariance(True, "batch_invariant=on"), "on", {"SGMV": "torch_ref"})
    # auto off by its measured cost: the backend named is the reason, whatever the timing
    costly = Invariance(False, "auto: off, its measured cost is 10.5% ...", 0.105)
    named = with_engine_backends(costly, "auto", {"attention": "torch"})
    assert "attention backend 'torch' named" in named.reason and named.cost == 0.105
    assert with_engine_backends(costly, "auto", {"attention": None}) is costly
    # off at load (the device, the dtype, CUDA's opt-in): that reason stays
    cuda = Invariance(False, CUDA_AUTO)
    assert with_engine_backends(cuda, "auto", {"attention": "flashinfer"}, "cuda") is cuda


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_sgmv_orders_are_timed_per_lora_shape_where_they_differ(dtype):
    shapes = {"q_proj": (64, 64), "o_proj": (64, 64), "gate_proj": (64, 96)}
    timed = order_timings(shapes, dtype, force=True)
    assert [count for count, _ in timed] == [2, 1]
    for _, times in timed:
        assert set(times) == {"cpu", "cpu_any_order"} and min(times.values()) > 0
    differs = isa_mod.resolve() in ORDER_DIFFERS  # elsewhere both orders are one
    assert bool(order_timings(shapes, dtype)) is differs


def test_auto_says_what_each_part_costs(tiny_model_dir):
    reason = tiny_llm(tiny_model_dir).engine.describe().batch_invariant_reason
    assert reason.startswith("auto: ") and "dense projections " in reason and "LoRA " in reason
