"""Adapter pool: byte-budgeted device slots, LRU eviction, background loading, atomic reload."""

from __future__ import annotations

import threading

import pytest
from helpers import rewrite_config, tiny_llm

from punica_x import AdapterError, SamplingParams
from punica_x.core import FinishReason
from punica_x.lora.pool import UnknownAdapterError

SP = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def sizes(llm, adapters):
    return {n: llm.load_adapter(n, str(p)).nbytes for n, p in adapters.items()}


def run(llm, prompt, adapter):
    return llm.generate([prompt], [adapter], SP)[0].token_ids


def test_device_budget_is_in_bytes_and_evicts_lru(tiny_model_dir, tiny_adapters):
    probe = tiny_llm(tiny_model_dir)
    nbytes = sizes(probe, tiny_adapters)
    assert nbytes["r4"] < nbytes["r8"] < nbytes["r16"]  # rank- and target-aware cost
    budget = nbytes["r16"] + nbytes["r8"]
    llm = tiny_llm(tiny_model_dir, device_bytes=budget)
    sizes(llm, {k: v for k, v in tiny_adapters.items() if k != "r64"})
    pool = llm.engine.adapters
    expected = {n: run(probe, "hello world", n) for n in ("r4", "r8", "r16")}
    assert run(llm, "hello world", "r16") == expected["r16"]
    assert run(llm, "hello world", "r8") == expected["r8"]
    assert pool.stats.evictions == 0 and pool.stats.device_bytes_used == budget
    assert run(llm, "hello world", "r4") == expected["r4"]  # evicts r16, the least recently used
    assert pool.stats.evictions == 1
    assert pool.stats.device_bytes_used == nbytes["r8"] + nbytes["r4"]
    assert run(llm, "hello world", "r16") == expected["r16"]
    assert pool.stats.device_bytes_used <= budget


def test_adapter_larger_than_pool_refused(tiny_model_dir, tiny_adapters):
    llm = tiny_llm(tiny_model_dir, device_bytes=1000)
    with pytest.raises(AdapterError, match="the device pool holds 1000") as info:
        llm.load_adapter("big", str(tiny_adapters["r16"]))
    assert info.value.code == "too_large"


def test_referenced_adapters_are_not_evicted(tiny_model_dir, tiny_adapters):
    probe = tiny_llm(tiny_model_dir)
    nbytes = sizes(probe, tiny_adapters)
    llm = tiny_llm(tiny_model_dir, device_bytes=nbytes["r16"] + nbytes["r8"])
    sizes(llm, {k: tiny_adapters[k] for k in ("r8", "r16", "r4")})
    engine = llm.engine
    long = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    a = engine.add_request("hello world", long, "r16")
    b = engine.add_request("hello world", long, "r8")
    c = engine.add_request("hello world", SP, "r4")
    engine.adapters.wait_ready(a.adapter)
    engine.adapters.wait_ready(b.adapter)
    engine.step()
    assert not c.adapter.ready and engine.adapters.stats.evictions == 0
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out
    assert done[c.request_id].token_ids == run(probe, "hello world", "r4")
    assert done[a.request_id].token_ids[:8] == run(probe, "hello world", "r16")


def test_loading_does_not_stall_the_running_batch(tiny_model_dir, tiny_adapters, monkeypatch):
    llm = tiny_llm(tiny_model_dir)
    llm.load_adapter("slow", str(tiny_adapters["r16"]))
    engine = llm.engine
    release = threading.Event()
    original = engine.adapters._load

    def slow_load(v, host):
        release.wait(timeout=30)
        return original(v, host)

    monkeypatch.setattr(engine.adapters, "_load", slow_load)
    running = engine.add_request(
        "the quick brown fox", SamplingParams(max_tokens=30, ignore_eos=True)
    )
    engine.step()
    waiting = engine.add_request("hello world", SP, "slow")
    for _ in range(5):
        engine.step()
    # the batch kept going while "slow" loaded (a token may still be on the device: overlap)
    assert len(running.output_token_ids) + running.num_inflight == 6
    assert not waiting.adapter.ready and not waiting.output_token_ids
    release.set()
    engine.adapters.wait_ready(waiting.adapter)
    while not waiting.finished:
        engine.step()
    assert len(waiting.output_token_ids) == SP.max_tokens


def test_same_name_reload_is_atomic(tiny_model_dir, tiny_adapters):
    probe = tiny_llm(tiny_model_dir)
    probe.load_adapter("v1", str(tiny_adapters["r4"]))
    probe.load_adapter("v2", str(tiny_adapters["r16"]))
    long = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    v1 = probe.generate(["hello world"], ["v1"], long)[0].token_ids
    v2 = probe.generate(["hello world"], ["v2"], long)[0].token_ids
    assert v1 != v2

    llm = tiny_llm(tiny_model_dir)
    engine = llm.engine
    first = llm.load_adapter("x", str(tiny_adapters["r4"]))
    old = engine.add_request("hello world", long, "x")
    for _ in range(4):
        engine.step()
    second = llm.load_adapter("x", str(tiny_adapters["r16"]))
    assert second.version > first.version
    new = engine.add_request("hello world", long, "x")
    while engine.has_unfinished():
        engine.step()
    assert old.output_token_ids == v1  # finished on the version it started with
    assert new.output_token_ids == v2
    assert engine.adapters.info("x").version == second.version
    assert first.version not in engine.adapters._versions  # old version dropped once unused


def test_unregister_defers_until_unused(tiny_model_dir, tiny_adapters):
    llm = tiny_llm(tiny_model_dir)
    llm.load_adapter("x", str(tiny_adapters["r8"]))
    engine = llm.engine
    running = engine.add_request("hello world", SP, "x")
    engine.step()
    llm.unload_adapter("x")
    with pytest.raises(UnknownAdapterError):
        engine.add_request("hello world", SP, "x")
    while engine.has_unfinished():
        engine.step()
    assert running.finish_reason is FinishReason.LENGTH and len(running.output_token_ids) == 8
    assert engine.adapters.stats.device_bytes_used == 0


def test_host_cache_eviction_reloads_from_disk(tiny_model_dir, tiny_adapters, tmp_path):
    probe = tiny_llm(tiny_model_dir)
    nbytes = sizes(probe, tiny_adapters)
    expected = {n: run(probe, "hello world", n) for n in ("r4", "r8")}
    llm = tiny_llm(tiny_model_dir, device_bytes=nbytes["r8"], host_bytes=nbytes["r8"])
    paths = {n: rewrite_config(tiny_adapters[n], tmp_path / n) for n in ("r4", "r8")}
    for n, p in paths.items():
        llm.load_adapter(n, str(p))
    pool = llm.engine.adapters
    assert run(llm, "hello world", "r4") == expected["r4"]
    assert run(llm, "hello world", "r8") == expected["r8"]  # evicts r4 from device
    assert run(llm, "hello world", "r4") == expected["r4"]  # reloaded from disk
    assert pool.stats.loads == 3
    rewrite_config(paths["r8"], paths["r8"], lora_alpha=99)
    out = llm.generate(["hello world"], ["r8"], SP)[0]  # r8 must reload: the file changed
    assert out.finish_reason is FinishReason.ERROR and "changed on disk" in out.error
    assert run(llm, "hello world", "r4") == expected["r4"]


def test_register_with_sha256_refuses_other_files(tiny_model_dir, tiny_adapters):
    llm = tiny_llm(tiny_model_dir)
    pool = llm.engine.adapters
    first = pool.register("x", tiny_adapters["r4"])
    assert pool.register("x", tiny_adapters["r4"], first.sha256).sha256 == first.sha256
    expected = run(llm, "hello world", "x")
    with pytest.raises(AdapterError, match="expected " + first.sha256) as info:
        pool.register("x", tiny_adapters["r8"], first.sha256)
    assert info.value.code == "sha256_mismatch"
    assert pool.info("x").sha256 == first.sha256  # the current version stays
    assert run(llm, "hello world", "x") == expected


def test_a_named_version_is_kept_and_a_held_one_can_come_back(tiny_model_dir, tiny_adapters):
    """register(version=N) installs the files as version N; registering a version the pool
    still holds (a request uses it: a rollback to it) makes it current again as it was; a
    version id of another adapter is refused."""
    llm = tiny_llm(tiny_model_dir)
    engine, pool = llm.engine, llm.engine.adapters
    long = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    first = pool.register("x", tiny_adapters["r4"], version=41)
    assert (first.version, pool.info("x").version) == (41, 41)
    old = engine.add_request("hello world", long, "x")  # holds version 41
    engine.step()
    second = pool.register("x", tiny_adapters["r16"], version=42)
    assert pool.info("x") == second and pool.has_version(41)
    back = pool.register("x", tiny_adapters["r16"], version=41)  # the held one, not these files
    assert back == first and pool.info("x").rank == 4
    assert not pool.has_version(42)  # current no more and unused: dropped
    with pytest.raises(AdapterError, match="version 41"):
        pool.register("y", tiny_adapters["r8"], version=41)
    while engine.has_unfinished():
        engine.step()
    assert old.finished and pool.has_version(41)  # current again, so kept
