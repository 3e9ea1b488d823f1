"""bench_adapters: its workload (Zipf names, first uses), the adapters it writes (accepted by
the server's own checks), bad flags refused, and a toy run end to end: a moto store, a real
server loading adapters on first use, every request served and every adapter registered."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
from bench_adapters import first_uses, zipf_names
from common.adapter_store import config_json, draw_ranks, model_shapes, weights_bytes

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_adapters.py"
SMOL = SimpleNamespace(hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                       num_key_value_heads=3, num_hidden_layers=2)  # fmt: skip


def test_zipf_names_favour_a_few_of_the_hot_set_and_repeat_with_the_seed():
    names = zipf_names(100, 5000, 1.0, seed=3)
    assert names == zipf_names(100, 5000, 1.0, seed=3)
    assert set(names) <= {f"a{i}" for i in range(100)}
    top, count = Counter(names).most_common(1)[0]
    assert count > 5000 / 100 * 5  # the head is several times a uniform draw's share
    assert top != "a0" or Counter(zipf_names(100, 5000, 1.0, seed=4)).most_common(1)[0][0] != "a0"
    uniform = Counter(zipf_names(10, 5000, 0.0, seed=3))
    assert max(uniform.values()) < 2 * min(uniform.values())


def test_first_uses_marks_the_first_request_of_each_adapter():
    assert first_uses(["a1", "a2", "a1", "a3", "a2"]) == [True, True, False, True, False]


def test_ranks_are_drawn_by_weight():
    ranks = draw_ranks(4000, [8, 64], [3, 1], seed=0)
    assert 2700 < ranks.count(8) < 3300
    assert draw_ranks(10, [8, 64], [0, 1], seed=0) == [64] * 10


def test_a_written_adapter_passes_the_servers_checks(tmp_path):
    from punica_x.api import LoraTarget, check_peft_header

    shapes = model_shapes(SMOL, ["q_proj", "v_proj"])
    assert shapes.projections == {"self_attn.q_proj": (576, 576), "self_attn.v_proj": (576, 192)}
    (tmp_path / "adapter_config.json").write_bytes(config_json(16, ["q_proj", "v_proj"]))
    weights = weights_bytes(shapes, 16, seed=1)
    (tmp_path / "adapter_model.safetensors").write_bytes(weights)
    assert weights != weights_bytes(shapes, 16, seed=2)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"], cfg["peft_type"]) == (16, 32, "LORA")
    target = LoraTarget(2, {"q_proj": (576, 576), "k_proj": (576, 192), "v_proj": (576, 192),
                            "o_proj": (576, 576), "gate_proj": (576, 1536),
                            "up_proj": (576, 1536), "down_proj": (1536, 576)})  # fmt: skip
    summary = check_peft_header(tmp_path, target, 64)
    assert (summary.rank, sorted(summary.target_modules)) == (16, ["q_proj", "v_proj"])
    with pytest.raises(ValueError):
        model_shapes(SMOL, ["q_proj", "nope"])


@pytest.mark.parametrize(
    "flags",
    [["--adapters", "0"], ["--hot", "11", "--adapters", "10"], ["--streams", "0"],
     ["--ranks", "8,128", "--rank-weights", "1,1"], ["--ranks", "8,16"], ["--ranks", "a"],
     ["--rank-weights", "nan,1,1,1"], ["--rank-weights", "0,0,0,0"], ["--zipf", "-1"],
     ["--zipf", "nan"], ["--requests", "0"], ["--register-clients", "0"], ["--rounds", "0"]],
)  # fmt: skip
def test_bad_flags_are_refused(refused, flags):
    import bench_adapters

    assert "error" in refused(bench_adapters.parse_args, SCRIPT, flags)


def test_a_toy_run_loads_on_first_use_and_registers_the_rest(tmp_path):
    env = dict(os.environ, PUNICA_X_RESULTS=str(tmp_path / "results"))
    flags = ["--adapters", "7", "--hot", "4", "--requests", "10", "--streams", "3",
             "--max-tokens", "3", "--ranks", "8,64", "--rank-weights", "1,1",
             "--rounds", "2"]  # fmt: skip
    done = subprocess.run([sys.executable, str(SCRIPT), *flags], capture_output=True,
                          text=True, timeout=600, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = (tmp_path / "results").glob("*/bench_adapters.json")
    report = json.loads(path.read_text())
    named = report["workload"]["adapters_named"]
    assert len(report["rounds"]) == 2
    for rnd in report["rounds"]:  # each round on a fresh server: its cold pass loads again
        for run in ("cold", "warm"):
            assert rnd[run]["errors"] == 0, rnd[run]["first_errors"]
            assert rnd[run]["tokens"] == 10 * 3
            assert rnd[run]["cpu_s"]["server"] > 0
        assert rnd["cold"]["cpu_s"]["store"] > rnd["warm"]["cpu_s"]["store"]  # no reads warm
        assert rnd["cold"]["first_use_ttft_ms"]["n"] == named
        assert rnd["cold_over_warm"] == round(rnd["cold"]["tok_s"] / rnd["warm"]["tok_s"], 3)
    ratios = sorted(r["cold_over_warm"] for r in report["rounds"])
    assert report["cold_over_warm_range"] == ratios
    assert report["cold_over_warm_median"] == round(sum(ratios) / 2, 3)
    assert (
        report["cold"]
        == report["rounds"][
            [r["cold_over_warm"] for r in report["rounds"]].index(report["cold_over_warm"])
        ]["cold"]
        and report["cold_over_warm"] == ratios[0]
    )
    reg = report["register"]
    assert (reg["loads"], reg["failed"]) == (7 - named, 0)
    disk = [p["disk"] for p in reg["points"]]
    assert disk == sorted(disk) and disk[-1] > disk[0]
    assert report["at_scale"]["models"]["entries"] == 1 + 7  # the base model and every adapter
    assert report["restart"]["models"]["entries"] == 1 + 7  # all of them restored
