"""Engine.describe() / stats() / limits() / stop_lending(): what a runner reads of its engine
(punica_x/engine/report.py), without reaching into the batcher, cache or adapter pool."""

import dataclasses
import json

import pytest
from helpers import tiny_llm

from punica_x import SamplingParams
from punica_x.engine.report import EngineInfo, EngineStats
from punica_x.errors import ContextTooLong
from scheduler.runners.interface import RunnerInfo, describe_runner


def test_describe_stats_and_limits_of_a_tiny_engine(tiny_model_dir):
    llm = tiny_llm(tiny_model_dir)
    e = llm.engine
    info = e.describe()
    assert info.block_size == e.config.cache.block_size
    # tiny_llm's 64 MiB of float32 K and V blocks, from the model's own config.json
    hf = json.loads((tiny_model_dir / "config.json").read_text())
    head_dim = hf["hidden_size"] // hf["num_attention_heads"]
    per_token = 2 * hf["num_hidden_layers"] * hf["num_key_value_heads"] * head_dim * 4
    assert info.kv_blocks_total == (64 << 20) // (per_token * info.block_size)
    assert info.model.max_model_len == e.max_model_len and info.vocab_size > 0
    assert info.device == "cpu" and info.kv_blocks_swap == 0
    before = e.stats()
    assert before.running == before.waiting == before.kv_blocks_used == 0
    assert before.kv_blocks_free == info.kv_blocks_total
    llm.generate(["the quick brown fox"], sampling=SamplingParams(max_tokens=2, temperature=0))
    assert e.stats().aborts == 0 and e.stats().kv_blocks_used == 0
    limits = e.limits()
    assert limits.num_blocks == info.kv_blocks_total and limits.holder == "the KV cache holds"
    with pytest.raises(ContextTooLong):
        limits.check([1] * (e.max_model_len + 1), SamplingParams(max_tokens=1))
    e.stop_lending()  # no DistKV: nothing to stop, no error


def test_a_runners_info_is_its_engines_and_where_it_runs(tiny_model_dir):
    info = tiny_llm(tiny_model_dir).engine.describe()
    runner = describe_runner(info)
    assert isinstance(runner, RunnerInfo) and runner.node and runner.pid > 0
    for f in dataclasses.fields(EngineInfo):
        assert getattr(runner, f.name) == getattr(info, f.name)


def test_stats_total_sums_engines_and_merges_prefix_rows():
    a = EngineStats(1, 2, 3, 4, 0, 0, 0, 0, prefix_cache=(("", 10, 4), ("x", 2, 0)))
    b = EngineStats(1, 0, 1, 1, 0, 0, 0, 1, prefix_cache=(("x", 3, 3),))
    t = EngineStats.total([a, b], waiting=5)
    assert (t.running, t.waiting, t.kv_blocks_used, t.preemptions) == (2, 7, 4, 1)
    assert t.prefix_cache == (("", 10, 4), ("x", 5, 3))
    assert (t.prefix_cache_queries, t.prefix_cache_hits) == (15, 7)
