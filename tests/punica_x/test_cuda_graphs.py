"""Decode graphs (punica_x/engine/cuda_graphs.py) on the CPU: `replay_capture` stands in for a
CUDA graph (a replay runs the forward again on the same fixed buffers), so what is tested
here is everything but the capture itself: padding rows, block-table width buckets, each
row's adapter gathered into the one-row SGMV segments, the eager fallbacks. Against the same
engine without graphs, token for token. The CUDA capture is tested in test_engine_cuda.py."""

from __future__ import annotations

import threading

import pytest
import torch

from punica_x import LLM, SamplingParams
from punica_x.engine import cuda_graphs
from punica_x.engine.cuda_graphs import DecodeGraphs, bucket, replay_capture, width_buckets

ADAPTERS = ("r4", "r8", "r16", "r64")


def _llm(tiny_model_dir, tiny_adapters, **kw) -> LLM:
    kw = {"max_batch_size": 8, "block_size": 4, "dtype": "float32", **kw}
    llm = LLM(
        model=str(tiny_model_dir),
        kv_cache_bytes=16 << 20,
        attention_backend="torch",
        **kw,
    )
    for name in ADAPTERS:
        llm.load_adapter(name, str(tiny_adapters[name]))
    return llm


def _attach(llm: LLM, capture=replay_capture, max_batch_size: int = 8) -> DecodeGraphs:
    e = llm.engine
    e.graphs = DecodeGraphs(
        e.model,
        e.cache.kv,
        e.sgmv,
        e.cache.allocator,
        e.planner.lora.h_out,
        e.config.cache.block_size,
        e.max_model_len,
        max_batch_size,
        e.config.lora.max_lora_rank,
        e.device,
        capture=capture,
    )
    return e.graphs


def _requests(n: int = 5):
    prompts = [f"question {i}: " + "tell me more " * (1 + 3 * i) for i in range(n)]
    adapters = [None, "r4", "r8", "r16", "r64", "r8", None][:n]
    # seeded: each request's tokens depend on its own seed and position only, not on which
    # rows share its steps (unseeded rows draw from the engine's generator in batch order, so
    # two engines whose steps group the rows differently would draw different tokens)
    params = [
        SamplingParams(max_tokens=6 + 5 * i, ignore_eos=True, logprobs=2, seed=i) for i in range(n)
    ]
    return prompts, adapters, params


@pytest.fixture
def small_widths(monkeypatch):
    """Width buckets of 1, 2, 4, ... blocks of 4 tokens: a short generation crosses several."""
    monkeypatch.setattr(cuda_graphs, "MIN_WIDTH_BLOCKS", 1)


def test_buckets():
    assert bucket(5, (1, 2, 4, 8)) == 8 and bucket(8, (1, 2, 4, 8)) == 8
    assert bucket(9, (1, 2, 4, 8)) is None
    assert width_buckets(100) == (16, 32, 64, 100)
    assert width_buckets(16) == (16,)
    assert width_buckets(3) == (3,)


def test_graph_replays_equal_eager_with_mixed_adapters(tiny_model_dir, tiny_adapters, small_widths):
    prompts, adapters, params = _requests()
    want = _llm(tiny_model_dir, tiny_adapters).generate(prompts, adapters, params)
    llm = _llm(tiny_model_dir, tiny_adapters)
    graphs = _attach(llm)
    got = llm.generate(prompts, adapters, params)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        for lw, lg in zip(w.logprobs, g.logprobs, strict=True):
            assert lg.token_id == lw.token_id and abs(lg.logprob - lw.logprob) < 1e-4
            assert [t for t, _ in lg.top] == [t for t, _ in lw.top]
            assert all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(lg.top, lw.top))
    # 5 requests padded to 8, shrinking as they finish; several widths; LoRA and not
    assert graphs.stats.replays > 10 and graphs.stats.failures == 0
    assert len({width for _, width, _ in graphs.graphs}) >= 2
    assert {rows for rows, _, _ in graphs.graphs} >= {8, 4}
    # every borrowed scratch block went back
    assert llm.engine.cache.allocator.num_used == 0


def test_overlapped_steps_replay_graphs_on_the_device_thread(
    tiny_model_dir, tiny_adapters, small_widths, monkeypatch
):
    """Overlapped scheduling with graphs: each decode step replays on the device's thread, the
    shapes it meets first captured on the host's thread at launch (never on the device's);
    the tokens and logprobs of synchronous eager steps."""
    prompts, adapters, params = _requests()
    want = _llm(tiny_model_dir, tiny_adapters, overlap="off").generate(prompts, adapters, params)
    llm = _llm(tiny_model_dir, tiny_adapters, overlap="on")
    graphs = _attach(llm)
    host = threading.get_ident()
    captured_on, capture = [], graphs.capture

    def watched(fn, pool, device):
        captured_on.append(threading.get_ident())
        return capture(fn, pool, device)

    monkeypatch.setattr(graphs, "capture", watched)
    got = llm.generate(prompts, adapters, params)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        for lw, lg in zip(w.logprobs, g.logprobs, strict=True):
            assert lg.token_id == lw.token_id and abs(lg.logprob - lw.logprob) < 1e-4
    assert llm.engine.overlap.steps > 10 and graphs.stats.replays > 10
    assert graphs.stats.failures == 0 and len({w for _, w, _ in graphs.graphs}) >= 2
    assert captured_on and set(captured_on) == {host}
    assert llm.engine.cache.allocator.num_used == 0


def test_a_backend_reading_host_lists_runs_lora_steps_eagerly(
    tiny_model_dir, tiny_adapters, small_widths
):
    """torch_ref reads each segment's adapter from w.a / w.b (host lists), which a captured
    graph freezes at its capture (no adapter): its LoRA steps run eagerly, the backbone's
    still replay. Graphed, decode steps dropped every adapter (an H200, 2026-11-29: the
    CUDA engine with sgmv_backend=torch_ref gave tokens HF+PEFT does not)."""
    prompts, adapters, params = _requests()
    want = _llm(tiny_model_dir, tiny_adapters).generate(prompts, adapters, params)
    llm = _llm(tiny_model_dir, tiny_adapters, sgmv_backend="torch_ref")
    graphs = _attach(llm)
    assert not graphs.lora_graphs
    got = llm.generate(prompts, adapters, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert graphs.stats.eager > 0 and graphs.stats.replays == 0  # a LoRA row in every step
    base = _llm(tiny_model_dir, tiny_adapters).generate(prompts[:3], None, params[:3])
    assert [g.token_ids for g in llm.generate(prompts[:3], None, params[:3])] == [
        b.token_ids for b in base
    ]
    assert graphs.stats.replays > 0 and graphs.stats.failures == 0
    assert graphs.graphs and not any(lora for _, _, lora in graphs.graphs)


def test_backbone_replays_a_graph_without_lora(tiny_model_dir, tiny_adapters, small_widths):
    prompts, _, params = _requests(3)
    want = _llm(tiny_model_dir, tiny_adapters).generate(prompts, None, params)
    llm = _llm(tiny_model_dir, tiny_adapters)
    graphs = _attach(llm)
    got = llm.generate(prompts, None, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert graphs.graphs and not any(lora for _, _, lora in graphs.graphs)
    assert all(g is None or not g.groups for g in graphs.graphs.values())


def test_steps_graphs_do_not_cover_run_eagerly(tiny_model_dir, tiny_adapters):
    prompts, adapters, params = _requests(5)
    params[1] = SamplingParams(max_tokens=8, ignore_eos=True, prompt_logprobs=1)
    want = _llm(tiny_model_dir, tiny_adapters).generate(prompts, adapters, params)
    llm = _llm(tiny_model_dir, tiny_adapters)
    graphs = _attach(llm, max_batch_size=2)  # buckets 1, 2: five rows run eagerly
    got = llm.generate(prompts, adapters, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert graphs.stats.eager > 0 and graphs.stats.replays > 0


def test_a_capture_that_fails_leaves_that_shape_eager(tiny_model_dir, tiny_adapters, caplog):
    def broken(fn, pool, device):
        raise RuntimeError("operation not permitted when stream is capturing")

    prompts, adapters, params = _requests(3)
    want = _llm(tiny_model_dir, tiny_adapters).generate(prompts, adapters, params)
    llm = _llm(tiny_model_dir, tiny_adapters)
    graphs = _attach(llm, capture=broken)
    got = llm.generate(prompts, adapters, params)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert graphs.stats.failures >= 1 and graphs.stats.replays == 0
    assert graphs.stats.eager > 0
    assert "runs eagerly" in caplog.text
    assert llm.engine.cache.allocator.num_used == 0


def test_disabled_graphs_and_no_free_block(tiny_model_dir, tiny_adapters):
    llm = _llm(tiny_model_dir, tiny_adapters)
    graphs = _attach(llm)
    graphs.enabled = False
    prompts, adapters, params = _requests(2)
    llm.generate(prompts, adapters, params)
    assert graphs.stats.replays == 0 and not graphs.graphs
    graphs.enabled = True
    held = llm.engine.cache.allocator.allocate(llm.engine.cache.allocator.num_free)
    assert graphs._graph(2, graphs.widths[0], True) is None
    assert not graphs.graphs  # not remembered: tried again once a block is free
    llm.engine.cache.allocator.free(held)
    assert graphs._graph(2, graphs.widths[0], True) is not None


def test_capture_start_captures_every_batch_bucket(tiny_model_dir, tiny_adapters):
    llm = _llm(tiny_model_dir, tiny_adapters)
    graphs = _attach(llm)
    graphs.capture_start()
    assert set(graphs.graphs) == {
        (rows, graphs.widths[0], lora) for rows in (1, 2, 4, 8) for lora in (False, True)
    }
    assert graphs.stats.captures == 8
    assert llm.engine.cache.allocator.num_used == 0


def test_bfloat16_replays_equal_eager_at_a_bucket_size(tiny_model_dir, tiny_adapters):
    """bf16 (the default on BF16 CPUs and GPUs): 4 rows fill bucket 4, so every GEMM has
    eager's shape; only the attention's padded width differs."""
    prompts, adapters, params = _requests(4)
    want = _llm(tiny_model_dir, tiny_adapters, dtype="bfloat16").generate(prompts, adapters, params)
    llm = _llm(tiny_model_dir, tiny_adapters, dtype="bfloat16")
    graphs = _attach(llm)
    got = llm.generate(prompts, adapters, params)
    assert graphs.stats.replays > 0
    assert [g.token_ids[:2] for g in got] == [w.token_ids[:2] for w in want]
    same = sum(a == b for g, w in zip(got, want) for a, b in zip(g.token_ids, w.token_ids))
    assert same >= 0.75 * sum(len(w.token_ids) for w in want)


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_cuda_graphs_must_be_a_bool(tiny_model_dir, bad):
    with pytest.raises(ValueError, match="cuda_graphs"):
        LLM(model=str(tiny_model_dir), kv_cache_bytes=16 << 20, cuda_graphs=bad)


def test_engine_on_the_cpu_has_no_graphs(tiny_model_dir):
    llm = LLM(model=str(tiny_model_dir), dtype="float32", kv_cache_bytes=16 << 20)
    assert llm.engine.graphs is None
    with pytest.raises(TypeError):
        LLM(model=str(tiny_model_dir), kv_cache_bytes=16 << 20, cuda_graph=True)
    assert torch.device("cpu") == llm.engine.device
