"""Lamina's roofline cost model (benchmarks/simulation/lamina.py) and its script
(benchmarks/sim_lamina.py): batch sizes from memory, monotone step times, pipelining that
never loses, equal-cost configs within the price margin, and clear refusals."""

from __future__ import annotations

import json
import sys

import pytest
from simulation.lamina import (
    DEVICES,
    MODELS,
    Case,
    Knobs,
    Lamina,
    Pool,
    equal_cost_rows,
    homogeneous_step,
    lamina_step,
)

H100, H20 = DEVICES["h100"], DEVICES["h20"]
L70, L8 = MODELS["llama3-70b"], MODELS["llama3-8b"]
PAPER_70B = Lamina(Pool(H100, 2), Pool(H20, 4))  # Table 5: DOP (2,4) against 4xH100


def test_shapes_have_the_published_sizes():
    assert L70.params == pytest.approx(70.55e9, rel=0.01)
    assert L8.params == pytest.approx(8.03e9, rel=0.01)
    assert L70.kv_bytes_per_token == 80 * 2 * 8 * 128 * 2  # 320 KiB a token
    assert L70.exchange_bytes_per_token == (64 + 8 + 8 + 64) * 128 * 2


def test_homogeneous_batch_shrinks_as_context_grows_and_reaches_zero():
    pool = Pool(H100, 4)
    batches = [homogeneous_step(Case(L70, ctx), pool).batch for ctx in (1024, 2048, 4096, 8192)]
    assert batches == sorted(batches, reverse=True) and len(set(batches)) == 4
    # (4 x 80 GB x 0.9 - 141.1 GB of weights) // (320 KiB x 8192) by hand
    assert batches[-1] == 54
    no_room = homogeneous_step(Case(L70, 1_000_000), pool)
    assert no_room.batch == 0 and no_room.tokens_per_s == 0.0


def test_weights_that_do_not_fit_are_refused():
    with pytest.raises(
        ValueError, match=r"llama3-70b \(141.1 GB of weights\) does not fit on 1xH100"
    ):
        homogeneous_step(Case(L70, 4096), Pool(H100, 1))
    with pytest.raises(ValueError, match="does not fit on 1xH100"):
        lamina_step(Case(L70, 4096), Lamina(Pool(H100, 1), Pool(H20, 8)))


def test_lamina_reaches_a_larger_batch_at_equal_cost_for_70b_at_8k():
    homog, lam = equal_cost_rows(L70, [8192], [4])
    assert (homog["config"], lam["config"]) == ("4xH100", "Lamina 2xH100+4xH20")
    assert lam["batch"] == 128 and homog["batch"] == 54  # 4 x 96 GB x 0.9 // 2.68 GB
    assert lam["batch_ratio"] == pytest.approx(128 / 54)
    assert lam["tokens_per_s"] > homog["tokens_per_s"]


@pytest.mark.parametrize("batches", [1, 2])
def test_step_time_grows_with_the_batch(batches):
    for ctx in (1024, 8192):
        case = Case(L70, ctx)
        homog = [homogeneous_step(case, Pool(H100, 4), b).step_s for b in range(1, 1025, 11)]
        lam = [lamina_step(case, PAPER_70B, b, batches).step_s for b in range(1, 1025, 11)]
        for steps in (homog, lam):
            assert all(x <= y for x, y in zip(steps, steps[1:]))
            assert steps[-1] > steps[0]


def test_pipelining_never_loses_and_pays_where_both_sides_are_busy():
    for shape, cfg in ((L70, PAPER_70B), (L8, Lamina(Pool(H100, 1), Pool(H20, 2)))):
        for ctx in (512, 1024, 4096, 8192, 32768):
            case = Case(shape, ctx)
            plain, best = lamina_step(case, cfg, batches=1), lamina_step(case, cfg)
            assert best.tokens_per_s >= plain.tokens_per_s
            assert best.batch == plain.batch
    case = Case(L70, 8192)
    assert (
        lamina_step(case, PAPER_70B).tokens_per_s
        > 1.05 * lamina_step(case, PAPER_70B, batches=1).tokens_per_s
    )
    # n = 1 is the plain sum of the parts
    plain = lamina_step(case, PAPER_70B, batches=1)
    parts = plain.model_s + plain.attention_s + plain.network_s + Knobs().step_overhead_s
    assert plain.step_s == pytest.approx(parts)


def test_equal_cost_configs_stay_within_the_price_margin():
    for shape in (L70, L8):
        rows = equal_cost_rows(shape, [4096], [2, 4, 8])
        for homog, lam in zip(rows[0::2], rows[1::2]):
            assert lam["price_per_h"] <= homog["price_per_h"] * 1.05 + 1e-9
    prices = {r["config"]: r["price_per_h"] for r in equal_cost_rows(L8, [4096], [2, 4])}
    # Lamina's Table 5: DOP (1,2) $20.32 vs 2xH100 $22.12, (2,4) $40.64 vs 4xH100 $44.24
    assert prices == {
        "2xH100": 22.12,
        "Lamina 1xH100+2xH20": 20.32,
        "4xH100": 44.24,
        "Lamina 2xH100+4xH20": 40.64,
    }
    # with a wider margin an extra H20 is bought only when the KV heads still split evenly
    lam = equal_cost_rows(L70, [4096], [4], Knobs(price_margin=0.5))[1]
    assert lam["config"] == "Lamina 2xH100+8xH20" and lam["price_per_h"] <= 44.24 * 1.5


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="needs at least 1 GPU, got 0"):
        Pool(H100, 0)
    with pytest.raises(ValueError, match="context length must be positive, got -1"):
        Case(L70, -1)
    with pytest.raises(ValueError, match="context length must be positive"):
        equal_cost_rows(L70, [4096, 0], [4])
    with pytest.raises(ValueError, match="at least 1 GPU"):
        equal_cost_rows(L70, [4096], [0])
    assert equal_cost_rows(L70, [4096], [2]) == []  # 1 H100 cannot hold 70B: size left out


def test_the_script_refuses_bad_flags_and_writes_its_files(refused, monkeypatch, capsys):
    import sim_lamina
    from common.report import results_root

    script = sim_lamina.__file__
    assert "must be positive" in refused(sim_lamina.parse_args, script, ["--contexts", "-4"])
    assert "unknown --models" in refused(sim_lamina.parse_args, script, ["--models", "gpt"])
    assert ">= 1" in refused(sim_lamina.parse_args, script, ["--gpus", "0"])
    flags = ["--models", "llama3-8b", "--contexts", "4096", "--gpus", "2", "--name", "t_lamina"]
    monkeypatch.setattr(sys, "argv", [script, *flags])
    sim_lamina.main()
    out = capsys.readouterr().out
    assert "Lamina 1xH100+2xH20" in out and "paper: +16.1% .. +90.1%" in out
    data = json.loads((results_root() / "sim" / "t_lamina.json").read_text())
    assert len(data["rows"]) == 2 and data["summary"]["all"]["pairs"] == 1
    assert (results_root() / "sim" / "t_lamina.png").stat().st_size > 0
