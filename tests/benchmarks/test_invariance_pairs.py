"""The batch-invariant mode's on / off pairs shared by bench_invariance, bench_generate
(--batch-invariant both) and bench_serve (--batch-invariant both): the order alternates by
round, the costs pair by round, the table has every workload, bad flags are refused."""

from __future__ import annotations

import argparse

import bench_generate
import bench_serve
import pytest
from common.generate_columns import invariance_table
from common.invariance_pairs import cost, invariance_rounds
from common.serve_invariance import mode_row
from common.workload import make_adapters, make_prompts, workload_names

from punica_x import SamplingParams
from punica_x.config import ModelConfig
from punica_x.models.loader import describe_model


def test_the_order_alternates_by_round_and_the_cost_pairs_by_round():
    orders = []

    def measure(order):
        orders.append(order)
        r = len(orders)
        return {"on": 2.0 * r, "off": 1.0 * r} if r != 3 else {"on": 3.0, "off": 1.0}

    per_round = invariance_rounds({"w": measure}, 4)
    assert orders == [("on", "off"), ("off", "on")] * 2
    assert per_round[("w", "on")] == [2.0, 4.0, 3.0, 8.0]
    assert cost(per_round, "w") == {"median": 2.0, "min": 2.0, "max": 3.0}


def test_a_mode_row_is_its_median_round():
    rounds = [(4.0, 40, [0.1], [0.01]), (2.0, 40, [0.2], [0.02]), (3.0, 30, [0.3], [0.03])]
    row = mode_row("on", rounds)
    assert row["mode"] == "on" and row["tok_s"] == 10.0 and row["elapsed_s_median"] == 3.0
    assert row["ttft_p50_ms"] == pytest.approx(300.0) and row["itl_p99_ms"] == pytest.approx(30)


@pytest.mark.slow
def test_the_generate_table_has_its_workloads_and_the_backbone(tmp_path):
    n = 2
    meta = describe_model(ModelConfig())  # the default model, without its weights
    prompts = make_prompts(meta.tokenizer, n)
    paths = make_adapters(meta.model_dir, n, 4, tmp_path)
    args = argparse.Namespace(
        dtype="bfloat16", quantization="auto", decode_steps=2, rounds=1, max_tokens=3
    )
    sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    names = {w: a for w, a in workload_names(n).items() if w in ("distinct", "identical")}
    rows = invariance_table(args, None, prompts, paths, names, sp)
    assert [r["workload"] for r in rows] == [*names, "backbone"]
    for row in rows:
        assert row["on_tok_s"] > 0 and row["off_tok_s"] > 0
        for part in ("generate", "decode", "prefill"):
            low, high = row[f"{part}_range"]
            assert 0 < low <= row[part] <= high


@pytest.mark.parametrize("script", [bench_generate, bench_serve])
@pytest.mark.parametrize("bad", ["yes", "", "ON", "1"])
def test_a_bad_mode_is_refused(refused, script, bad):
    err = refused(script.parse_args, script.__file__, ["--batch-invariant", bad])
    assert "--batch-invariant" in err and "invalid choice" in err


@pytest.mark.parametrize(
    ("script", "flags", "says"),
    [
        (bench_generate, ["--device", "cuda", "--batch-invariant", "both"], "for CPU runs"),
        (bench_generate, ["--dry-run", "--batch-invariant", "both"], "for CPU runs"),
        (bench_serve, ["--batch-invariant", "both", "--features"], "not with --features"),
        (bench_serve, ["--batch-invariant", "both", "--open-loop", "1"], "not with --features"),
    ],
)
def test_a_mode_with_a_question_it_does_not_answer_is_refused(refused, script, flags, says):
    assert says in refused(script.parse_args, script.__file__, flags)


def test_a_cuda_run_takes_the_mode_on_or_off(monkeypatch):
    """On CUDA the mode's kernels (Triton) run with --batch-invariant on, into a file of its
    own beside the default run's."""
    for mode in ("on", "off"):
        argv = ["bench_generate.py", "--device", "cuda", "--batch-invariant", mode]
        monkeypatch.setattr("sys.argv", argv)
        assert bench_generate.parse_args().batch_invariant == mode
