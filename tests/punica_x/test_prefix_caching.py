"""Automatic prefix caching in the engine (punica_x/kv/prefix.py): outputs equal to the cache
off (mixed adapters, chunked prefill, preemption, MLFQ swaps), no sharing across adapters,
adapter versions or salts, in-batch reuse, prompt logprobs, and no block reference leaked
after a randomized run of aborts, preemptions and migrations."""

from __future__ import annotations

import random

import pytest
from helpers import CACHE_CONFIGS, charge_one_second, rewrite_config, tiny_llm

from punica_x import SamplingParams
from punica_x.errors import InvalidRequest

SP = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)
ADAPTERS = [None, "r8", "r16", None, "r8", "r16"]


def workload(seed: int = 0, system_len: int = 37) -> list[list[int]]:
    """Six prompts sharing a system prompt of system_len tokens, then their own question."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 300) for _ in range(system_len)]
    return [system + [rng.randrange(3, 300) for _ in range(rng.randrange(1, 12))] for _ in range(6)]


def make(tiny_model_dir, tiny_adapters, **kwargs):
    llm = tiny_llm(tiny_model_dir, **kwargs)
    for name in ("r8", "r16"):
        llm.load_adapter(name, str(tiny_adapters[name]))
    return llm


def run_two_waves(llm, prompts, sampling=SP):
    """The first two prompts, then all six (the second wave finds the first's blocks)."""
    first = llm.generate(prompts[:2], ADAPTERS[:2], sampling)
    return first + llm.generate(prompts, ADAPTERS, sampling)


def assert_same(outs_off, outs_on, tol: float = 1e-5) -> None:
    """Same tokens; logprobs equal up to rounding (a cached prefix's rows were computed in
    another batch, whose GEMMs have other row counts): 1e-5 in float32; in bfloat16 (the
    default on CPUs with AVX512-BF16 / AMX) 2e-2, though Zen 4 measured no difference."""
    for off, on in zip(outs_off, outs_on):
        assert on.token_ids == off.token_ids
        for a, b in zip(off.logprobs, on.logprobs):
            assert a.token_id == b.token_id and b.logprob == pytest.approx(a.logprob, abs=tol)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


CONFIGS = CACHE_CONFIGS


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_outputs_equal_the_cache_off(tiny_model_dir, tiny_adapters, name, dtype):
    kwargs = CONFIGS[name]
    prompts = workload()
    outs = {}
    for on in (False, True):
        llm = make(tiny_model_dir, tiny_adapters, prefix_caching=on, dtype=dtype, **kwargs)
        if kwargs.get("policy") == "mlfq":
            charge_one_second(llm)
        outs[on] = run_two_waves(llm, prompts)
        e = llm.engine
        if on:
            stats = e.batcher.prefix.stats
            assert sum(stats.hits.values()) > 0 and set(stats.hits) >= {"", "r8", "r16"}
        else:
            assert e.batcher.prefix is None
        if name == "chunked-preempted":
            assert e.batcher.num_preemptions > 0
        if name == "mlfq-swapped":
            assert e.swap.stats.swaps_out > 0
        assert e.cache.allocator.num_used == 0
    assert_same(outs[False], outs[True], 1e-5 if dtype == "float32" else 2e-2)


def test_a_recomputed_request_finds_its_own_prefix(tiny_model_dir, tiny_adapters):
    llm = make(tiny_model_dir, tiny_adapters, max_batched_tokens=7, num_blocks=20, block_size=4)
    prompts = workload(1)
    llm.generate(prompts[:4], ADAPTERS[:4], SP)
    e = llm.engine
    assert e.batcher.num_preemptions > 0
    stats = e.batcher.prefix.stats
    # every admission after a preemption found at least the blocks it had completed
    assert sum(stats.hits.values()) > 0


def test_an_adapter_and_each_of_its_versions_compute_their_own_blocks(
    tiny_model_dir, tiny_adapters, tmp_path
):
    """The same prompt under the base model, two adapters, and a second version of one
    adapter: no block is shared, and each gives the output a cold engine gives."""
    prompt = workload(2)[0]
    # the same files under another alpha: other weights in effect, same tensors on disk
    v2 = rewrite_config(tiny_adapters["r8"], tmp_path / "r8v2", lora_alpha=3)
    llm = make(tiny_model_dir, tiny_adapters)
    e = llm.engine
    outs = {}
    for adapter in (None, "r8", "r16"):
        outs[adapter] = llm.generate([prompt], [adapter], SP)[0]
    assert sum(e.batcher.prefix.stats.hits.values()) == 0
    llm.load_adapter("r8", str(v2))
    second = llm.generate([prompt], ["r8"], SP)[0]
    assert e.batcher.prefix.stats.hits["r8"] == 0  # the old version's blocks are not used
    again = llm.generate([prompt], ["r8"], SP)[0]
    assert e.batcher.prefix.stats.hits["r8"] > 0  # ... its own are
    cold = tiny_llm(tiny_model_dir, prefix_caching=False)
    cold.load_adapter("r8", str(v2))
    assert second.token_ids == again.token_ids == cold.generate([prompt], ["r8"], SP)[0].token_ids
    assert second.token_ids != outs["r8"].token_ids


def test_salts_keep_caches_apart(tiny_model_dir, tiny_adapters):
    e = make(tiny_model_dir, tiny_adapters).engine
    prompt = workload(3)[0]

    def hits_of(salt):
        before = e.batcher.prefix.stats.hits[""]
        e.add_request(prompt, SP, cache_salt=salt)
        while e.has_unfinished():
            e.step()
        return e.batcher.prefix.stats.hits[""] - before

    assert hits_of("tenant-a") == 0
    assert hits_of("tenant-b") == 0
    assert hits_of(None) == 0
    assert hits_of("tenant-a") == hits_of("tenant-b") == hits_of("") > 0  # "" is None's
    with pytest.raises(InvalidRequest, match="cache_salt"):
        e.add_request(prompt, SP, cache_salt=b"bytes")
    with pytest.raises(InvalidRequest, match="cache_salt"):
        e.add_request(prompt, SP, cache_salt=7)
    assert not e.requests and e.adapters.stats  # nothing held by the refusals


def test_n_copies_of_a_prompt_prefill_it_once(tiny_model_dir, tiny_adapters):
    """Requests of one prompt added together: the first computes it, the others wait a step
    and reuse every full block (in-batch sharing)."""
    llm = make(tiny_model_dir, tiny_adapters, block_size=4)
    prompt = workload(4, system_len=30)[0]
    sp = SamplingParams(max_tokens=4, temperature=0.8, seed=1, ignore_eos=True)
    seeds = [SamplingParams(max_tokens=4, temperature=0.8, seed=s, ignore_eos=True) for s in (1, 2)]
    outs = llm.generate([prompt] * 3, ["r16"] * 3, [sp, *seeds])
    stats = llm.engine.batcher.prefix.stats
    full = (len(prompt) - 1) // 4 * 4
    assert stats.queries["r16"] == 3 * len(prompt) and stats.hits["r16"] == 2 * full
    cold = make(tiny_model_dir, tiny_adapters, prefix_caching=False)
    ref = cold.generate([prompt] * 3, ["r16"] * 3, [sp, *seeds])
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]


def test_prompt_logprobs_are_computed_not_skipped(tiny_model_dir, tiny_adapters):
    """A request asking for prompt logprobs reuses no block before its unscored positions;
    its prompt logprobs equal the cache-off ones, and it still leaves blocks for others."""
    prompt = workload(5)[0]
    asking = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=1, ignore_eos=True)
    plain = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    llm = make(tiny_model_dir, tiny_adapters)
    llm.generate([prompt], ["r8"], plain)
    out = llm.generate([prompt], ["r8"], asking)[0]
    stats = llm.engine.batcher.prefix.stats
    assert stats.hits["r8"] == 0
    ref = make(tiny_model_dir, tiny_adapters, prefix_caching=False).generate(
        [prompt], ["r8"], asking
    )[0]
    assert len(out.prompt_logprobs) == len(prompt)
    for a, b in zip(ref.prompt_logprobs[1:], out.prompt_logprobs[1:]):
        assert a.token_id == b.token_id and b.logprob == pytest.approx(a.logprob, abs=1e-5)
    llm.generate([prompt], ["r8"], plain)
    assert stats.hits["r8"] > 0


def test_no_block_reference_leaks_after_random_aborts_preemptions_and_migrations(
    tiny_model_dir, tiny_adapters
):
    rng = random.Random(7)
    engines = [
        make(
            tiny_model_dir, tiny_adapters, num_blocks=14, block_size=4, max_batched_tokens=9
        ).engine
        for _ in range(2)
    ]
    prompts = workload(6, system_len=13) + workload(7, system_len=21)
    live: dict[str, int] = {}  # request id -> engine index
    for _ in range(120):
        op = rng.random()
        if op < 0.35 or not live:
            k = rng.randrange(2)
            sp = SamplingParams(max_tokens=rng.randrange(1, 12), temperature=0, ignore_eos=True)
            adapter = rng.choice([None, "r8", "r16"])
            req = engines[k].add_request(rng.choice(prompts), sp, adapter, cache_salt="t")
            live[req.request_id] = k
        elif op < 0.5:
            rid = rng.choice(sorted(live))
            engines[live.pop(rid)].abort(rid)
        elif op < 0.65:  # a migration, with a live KV copy or by recomputation
            rid = rng.choice(sorted(live))
            k = live.pop(rid)
            req = engines[k].requests.get(rid)
            resume = engines[k].take(rid, with_kv=rng.random() < 0.5)
            if resume is not None:
                adapter = req.adapter.name if req.adapter is not None else None
                engines[1 - k].add_request(
                    req.prompt_token_ids, req.sampling, adapter, rid, resume=resume
                )
                live[rid] = 1 - k
        for e in engines:
            for out in e.step():
                if out.finished:
                    live.pop(out.request_id, None)
    for e in engines:
        while e.has_unfinished():
            e.step()
    assert any(e.batcher.num_preemptions for e in engines)
    for e in engines:
        a = e.cache.allocator
        assert a.num_used == 0 and all(n == 0 for n in a._refs)
        assert sorted(a._free + list(a._lru)) == list(range(a.num_blocks))
        assert len(a._cached) == a.num_cached > 0
        assert sum(e.batcher.prefix.stats.hits.values()) > 0


def test_a_deleted_adapters_counters_go_with_it(tiny_model_dir, tiny_adapters):
    """A tenant uploading and deleting adapters in a loop must not grow the runner's
    statistics or /metrics' series: unregistering drops the adapter's prefix counters, and
    the stats a runner reports name only the base model and registered adapters."""
    llm = tiny_llm(tiny_model_dir)
    sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    for i in range(3):
        llm.load_adapter(f"a{i}", str(tiny_adapters["r4"]))
        llm.generate(["the quick brown fox jumps"], [f"a{i}"], sp)
    llm.generate(["the quick brown fox jumps"], [None], sp)
    stats = llm.engine.batcher.prefix.stats
    assert {"", "a0", "a1", "a2"} <= set(stats.queries)
    llm.unload_adapter("a0")
    llm.unload_adapter("a1")
    assert set(stats.queries) == {"", "a2"} and set(stats.hits) <= {"", "a2"}
    stats.record("a1", 5, 0)  # a request of a1 still running when it was deleted
    shown = [a for a, _, _ in llm.engine.stats().prefix_cache]
    assert shown == ["", "a2"]
