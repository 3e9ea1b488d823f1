"""What bench_generate --device cuda writes without building a PEFT model or a HF model in
memory: random weights in shards with HF's index, and adapters in PEFT's format. Both must
load in HF (+ PEFT) and in punica-x, with every tensor where the reference tools put it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from common.gpu_generate import write_random_adapters  # noqa: E402
from common.shapes import _write_random_weights  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_random_weights_in_shards_load_in_hf_and_in_punica_x(tmp_path, tiny_model_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    from punica_x import LLM

    config = AutoConfig.from_pretrained(tiny_model_dir)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    folder = tmp_path / "model"
    folder.mkdir()
    config.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tiny_model_dir / name).read_bytes())
    _write_random_weights(meta, 0.02, folder, shard_bytes=64 << 10)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(folder.glob("*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == {p.name for p in shards}

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    params = dict(hf.named_parameters())
    assert set(index["weight_map"]) == set(params)
    norm = params["model.norm.weight"]
    assert torch.equal(norm, torch.ones_like(norm))
    q = params["model.layers.0.self_attn.q_proj.weight"]
    assert 0.015 < float(q.detach().std()) < 0.025 and torch.isfinite(q).all()
    out = LLM(model=str(folder), dtype="float32", kv_cache_bytes=16 << 20).generate(["hi"])
    assert out[0].token_ids


def test_random_adapters_match_peft_keys_and_load_in_both(tmp_path, tiny_model_dir):
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from punica_x import LLM

    (path,) = write_random_adapters(tiny_model_dir, 1, 4, tmp_path / "ours")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=4, lora_alpha=4, target_modules=TARGETS, init_lora_weights=False)
    get_peft_model(base, cfg).save_pretrained(tmp_path / "peft")
    want = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    got = load_file(path / "adapter_model.safetensors")
    assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in want.items()}
    assert all(v.dtype == torch.bfloat16 and torch.isfinite(v).all() for v in got.values())

    fresh = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    peft = PeftModel.from_pretrained(fresh, path)
    b = peft.base_model.model.model.layers[0].mlp.down_proj.lora_B["default"].weight
    key = "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"
    assert torch.equal(b.to(torch.bfloat16), got[key])
    llm = LLM(model=str(tiny_model_dir), dtype="float32", kv_cache_bytes=16 << 20)
    info = llm.load_adapter("a0", str(path))
    assert info.rank == 4 and set(info.target_modules) == set(TARGETS)
    assert llm.generate(["hi"], ["a0"])[0].token_ids


def test_gpu_flags_are_refused_without_cuda_and_request_counts_must_be_positive():
    import argparse

    import pytest
    from common.gpu_generate import add_gpu_args, check_gpu_args

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    add_gpu_args(ap)
    for bad in (
        ["--tokenizer", "x"],
        ["--model", "some/path", "--tokenizer", "x"],
        ["--gpu-requests", "32"],
        ["--attention-backend", "torch"],
        ["--device", "cuda", "--gpu-requests", "0"],
        ["--device", "cuda", "--gpu-requests", "32,-1"],
        ["--device", "cuda", "--gpu-requests", "1e9x"],
        ["--device", "cuda", "--gpu-requests", ""],
        ["--device", "cuda", "--dry-run"],
        ["--dry-run", "--gpu-requests", "0"],
    ):
        with pytest.raises(SystemExit) as info:
            check_gpu_args(ap, ap.parse_args(bad))
        assert info.value.code == 2, bad
    ok = check_gpu_args(ap, ap.parse_args(["--device", "cuda", "--gpu-requests", "8,16"]))
    assert ok.gpu_requests == "8,16"
    # the GPU run's path on the CPU (gpu_check --dry-run) takes the GPU flags
    ok = check_gpu_args(ap, ap.parse_args(["--dry-run", "--gpu-requests", "4"]))
    assert ok.dry_run and ok.gpu_requests == "4"
    # a CPU run of a random model's shape takes its tokenizer folder
    ok = check_gpu_args(ap, ap.parse_args(["--model", "smollm2-135m", "--tokenizer", "t"]))
    assert ok.tokenizer == "t"


def test_a_run_stopped_midway_keeps_the_rows_it_measured(monkeypatch, tmp_path):
    """A timeout's SIGTERM (SystemExit 124) in the second request count: the first count's
    rows and the second's throughput-only rows are written before the exit goes on."""
    from types import SimpleNamespace

    import pytest
    from common import gpu_generate as gg

    engine = SimpleNamespace(loaded=SimpleNamespace(model_dir=tmp_path), graphs=None)
    llm = SimpleNamespace(engine=engine, load_adapter=lambda *a: None)
    monkeypatch.setattr(gg, "_load", lambda args, counts: (llm, {"model": "m"}))
    monkeypatch.setattr(gg, "write_random_adapters", lambda *a: [tmp_path / "a0", tmp_path / "a1"])

    def rows_for(llm, n, sp, args, out):
        out.append({"requests": n, "workload": "backbone", "tok_s": 1.0})
        if n == 128:
            raise SystemExit(124)
        out[-1]["step_ms"] = 2.0

    saved = []
    monkeypatch.setattr(gg, "_rows_for", rows_for)
    monkeypatch.setattr(gg, "_save", lambda args, rows, summary: saved.append(list(rows)))
    args = SimpleNamespace(rank=4, max_tokens=4, hf_workloads="none")
    with pytest.raises(SystemExit):
        gg._run(args, [32, 128], tmp_path)
    assert saved[0] == [{"requests": 32, "workload": "backbone", "tok_s": 1.0, "step_ms": 2.0}]
    assert [r["requests"] for r in saved[-1]] == [32, 128]
