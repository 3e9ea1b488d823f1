"""Engine features on CUDA against the CPU engine, token for token (device_pair-marked): sampling
features in a batch of adapters and the base model, logprobs, JSON schemas, MLFQ swapping KV
to pinned host memory (and a live copy out of it), migration (recompute, live KV copy),
DistKV (the socket channel to a CUDA creditor, CUDA runners borrowing from each other).
float32 on both sides: the CUDA engines run torch attention (FlashInfer has no float32
kernel) and the CUDA SGMV kernel, the CPU reference the PyTorch paths (nothing to compile for
the CPU). Seeded sampling draws on CPU generators, so on the tiny model (peaked distributions)
both draw the same tokens. Without CUDA the same tests run CPU against CPU (DEVICE "cpu"), so
the harness and every expectation that is not the device's own arithmetic fail in make test,
not only on the next lent GPU (the DistKV test's expected borrowing stayed at 8 blocks for a
day after borrow_headroom made it 9)."""

from __future__ import annotations

import json
import random
import re
from types import SimpleNamespace

import jsonschema
import pytest
import torch
from helpers import RESUME_CASES, random_micro_plan, tiny_llm

from punica_x import SamplingParams
from punica_x.attention import get_attention_backend
from punica_x.config import BatchConfig, CacheConfig, EngineConfig, ModelConfig
from punica_x.core import FinishReason
from punica_x.engine import Engine
from punica_x.kv.blocks import KVCache, KVCacheSpec
from punica_x.kv.rmanager import LendCaps, RManager
from punica_x.models.loader import load_model
from punica_x.sampling.structured import canonical_schema
from scheduler.distkv.channel import KVChannel, KVChannelServer
from scheduler.distkv.network import KVNetwork, default_caps

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_DEVICE = dict(device=DEVICE, dtype="float32", attention_backend="torch")
TORCH_PATHS = dict(dense_backend="torch", fused_backend="torch")
REFERENCE = dict(ON_DEVICE, device="cpu", sgmv_backend="torch_ref", **TORCH_PATHS)
NAMES = ("r4", "r8", "r16", "r64")
PROMPTS = ["the quick brown fox", "hello world", "paged attention keeps", "a multi tenant lora"]
PROMPTS += ["numbers 0123", "one backbone", "kv cache in blocks", "the lazy dog jumps"]
MIXED = ["r4", None, "r8", "r16", "r64", None, "r4", "r16"]
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def warm(engine, names) -> None:
    """The adapters resident before the first step, so that every run schedules alike."""
    for name in names:
        ref = engine.adapters.acquire(name)
        engine.adapters.wait_ready(ref)
        engine.adapters.release(ref)


def llm_on(model_dir, adapters, where: dict, names=NAMES, **kwargs):
    """The tiny model on `where` (ON_DEVICE or REFERENCE) with the tiny adapters `names`
    loaded and resident."""
    llm = tiny_llm(model_dir, **where, **kwargs)
    for name in names:
        llm.load_adapter(name, str(adapters[name]))
    warm(llm.engine, names)
    if where["device"] == "cuda":
        assert llm.engine.device.type == "cuda" and llm.engine.sgmv.name == "cuda"
    return llm


@pytest.fixture(scope="module")
def pair(tiny_model_dir, tiny_adapters):
    """(the CPU reference, the engine on DEVICE), every tiny adapter loaded in both."""
    return tuple(llm_on(tiny_model_dir, tiny_adapters, w) for w in (REFERENCE, ON_DEVICE))


def assert_same(want, got, tag="") -> None:
    """Final outputs of the reference and the device: the same tokens, text and finish."""
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(want, got)):
        where = (tag, i, a.error, b.error)
        assert a.token_ids and b.token_ids == a.token_ids, where
        assert b.text == a.text, where
        assert (b.finish_reason, b.stop_reason) == (a.finish_reason, a.stop_reason), where


def assert_logprobs_close(want, got, tag="") -> None:
    """TokenLogprob lists (None entries too): the same ids, values within 1e-4."""
    assert want is not None and got is not None and len(got) == len(want), tag
    for i, (a, b) in enumerate(zip(want, got)):
        assert (a is None) == (b is None), (tag, i)
        if a is None:
            continue
        assert b.token_id == a.token_id, (tag, i)
        assert b.logprob == pytest.approx(a.logprob, abs=1e-4), (tag, i)
        assert [t for t, _ in b.top] == [t for t, _ in a.top], (tag, i)
        assert [v for _, v in b.top] == pytest.approx([v for _, v in a.top], abs=1e-4), (tag, i)


def feature_params(plain) -> list[SamplingParams]:
    """One sampling feature per prompt (plain: their greedy outputs): penalties, logit_bias,
    min_p, seeded top-k / top-p, min_tokens holding a stop token id back, a stop string (the
    greedy text's last 3 printable ASCII characters in a row), seeded, greedy."""
    sp = dict(max_tokens=16, ignore_eos=True, temperature=0)
    g = [o.token_ids for o in plain]
    return [
        SamplingParams(**sp, presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.4),
        SamplingParams(**sp, logit_bias=((g[1][0], -100.0), (g[1][3], 4.0))),
        SamplingParams(**sp | dict(temperature=1.0), min_p=0.2, seed=11),
        SamplingParams(**sp | dict(temperature=0.9), top_k=8, top_p=0.85, seed=1234),
        SamplingParams(max_tokens=16, temperature=0, min_tokens=5, stop_token_ids=(g[4][1],)),
        SamplingParams(**sp, stop=(re.findall("[ -~]{3}", plain[5].text)[-1],)),
        SamplingParams(**sp | dict(temperature=1.0), seed=-3),
        SamplingParams(**sp),
    ]


@pytest.mark.device_pair
def test_sampling_features_in_a_mixed_batch_match_the_cpu_engine(pair):
    plain = pair[0].generate(PROMPTS, MIXED, GREEDY)
    params = feature_params(plain)
    want, got = (llm.generate(PROMPTS, MIXED, params) for llm in pair)
    assert_same(want, got, "features")
    for i in (0, 1, 4):  # penalties, bias and the held stop token change the greedy tokens
        assert want[i].token_ids != plain[i].token_ids, i
    assert want[4].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    assert len(want[4].token_ids) >= 5 and plain[4].token_ids[1] not in want[4].token_ids[:5]
    assert want[5].finish_reason is FinishReason.STOP and want[5].stop_reason == params[5].stop[0]


LONG_PROMPTS = ["the quick brown fox jumps over the lazy dog and keeps on running far away"]
LONG_PROMPTS += ["hello world", "paged attention keeps every block of the cache in use"]
LONG_PROMPTS += ["a multi tenant lora server batches many adapters"]
CHUNKED = dict(max_batched_tokens=5, num_blocks=14, block_size=4)


@pytest.mark.device_pair
@pytest.mark.parametrize("engine_args", [{}, CHUNKED], ids=["one-step-prefill", "chunked"])
def test_logprobs_match_the_cpu_engine(tiny_model_dir, tiny_adapters, engine_args):
    lp = dict(max_tokens=8, ignore_eos=True)
    greedy = SamplingParams(**lp, temperature=0, logprobs=3, prompt_logprobs=3)
    params = [greedy, SamplingParams(**lp, temperature=0.8, seed=7, logprobs=2, prompt_logprobs=0)]
    params *= 2
    adapters = [None, "r4", "r16", "r64"]
    llms = [llm_on(tiny_model_dir, tiny_adapters, w, **engine_args) for w in (REFERENCE, ON_DEVICE)]
    want, got = (llm.generate(LONG_PROMPTS, adapters, params) for llm in llms)
    assert_same(want, got, "logprobs")
    if engine_args:  # chunked prefills, and preempted requests recomputed, on both
        assert all(llm.engine.batcher.num_preemptions > 0 for llm in llms)
    for i, (a, b) in enumerate(zip(want, got)):
        assert len(a.prompt_logprobs) == len(a.prompt_token_ids) and len(a.logprobs) == 8
        assert len(a.logprobs[0].top) == params[i].logprobs
        assert_logprobs_close(a.prompt_logprobs, b.prompt_logprobs, ("prompt", i))
        assert_logprobs_close(a.logprobs, b.logprobs, ("sampled", i))


COUNT, COLOR = {"type": "integer", "minimum": 0, "maximum": 99}, {"enum": ["red", "green"]}
PROPERTIES = {"count": COUNT, "color": COLOR, "ok": {"type": "boolean"}}
SCHEMAS = [
    {"type": "object", "properties": PROPERTIES, "required": list(PROPERTIES)}
    | {"additionalProperties": False},
    {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
]


@pytest.mark.device_pair
def test_json_schema_outputs_match_the_cpu_engine_and_parse(pair):
    prompts, adapters, params, schemas = [], [], [], []
    for seed in range(4):
        for k, schema in enumerate(SCHEMAS):
            prompts.append(f"json please {seed} {k}")
            adapters.append(MIXED[(seed + k) % len(MIXED)])
            text = canonical_schema(schema)
            sp = dict(max_tokens=64, temperature=1.0 if seed else 0, seed=seed, json_schema=text)
            params.append(SamplingParams(**sp))
            schemas.append(schema)
    prompts, adapters, params = prompts + [PROMPTS[0]], adapters + ["r8"], params + [GREEDY]
    want, got = (llm.generate(prompts, adapters, params) for llm in pair)
    assert_same(want, got, "json")
    for a, schema in zip(want, schemas):
        assert a.finish_reason is FinishReason.STOP, (a.text, a.error)
        jsonschema.validate(json.loads(a.text), schema)


MLFQ_LENGTHS, MLFQ_ADAPTERS = [40, 6, 24, 3], ["r8", None, "r8", None]  # MLFQ reorders them
MLFQ = dict(policy="mlfq", mlfq_quantum_s=1.0, mlfq_levels=4, max_batch_size=2, swap_blocks=64)


def mlfq_engine(model_dir, adapters):
    """test_batcher_mlfq's set-up on DEVICE: every prefill predicted at 0.5 s (level 0) and
    every step charged 1 s against a 1 s quantum, batches of 2, 14 blocks of 4 tokens, 64
    host blocks to swap into."""
    e = llm_on(model_dir, adapters, ON_DEVICE, ("r8",), num_blocks=14, block_size=4, **MLFQ).engine
    e.batcher.timer = SimpleNamespace(predict=lambda tokens: 0.5, observe=lambda *_: None)
    charge = e.batcher.after_step
    e.batcher.after_step = lambda scheduled, seconds: charge(scheduled, 1.0)
    return e


def run_mlfq(e, todo: list, dest) -> tuple[dict, list]:
    """A newcomer every 3 steps; the first request found swapped out (its KV in the host
    pool) is taken with that KV and finished on `dest`. Returns the final outputs of both."""
    done, moved, steps = {}, [], 0
    while e.has_unfinished() or todo:
        if todo and steps % 3 == 0:
            rid, prompt, sp, adapter = todo.pop(0)
            e.add_request(prompt, sp, adapter, request_id=rid)
        done.update({o.request_id: o for o in e.step() if o.finished})
        steps += 1
        swapped = [r for r in e.requests.values() if r.host_block_ids]
        if swapped and not moved and e.swap.stats.swaps_in:  # one came back already
            r, rid = swapped[0], swapped[0].request_id
            adapter, n = MLFQ_ADAPTERS[int(rid[1:])], r.num_computed_tokens
            resume = e.take(rid, with_kv=True)
            assert resume.kv is not None and resume.kv.num_tokens == n > 0
            new = dest.add_request(r.prompt_token_ids, r.sampling, adapter, rid, resume=resume)
            assert new.num_computed_tokens == min(n, new.num_tokens - 1)  # KV taken, not redone
            moved.append(r.request_id)
    while dest.has_unfinished():
        done.update({o.request_id: o for o in dest.step() if o.finished})
    return done, moved


@pytest.mark.device_pair
@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_mlfq_swapping_gives_the_cpu_engines_tokens(pair, tiny_model_dir, tiny_adapters, seeded):
    sp = dict(temperature=1.0, seed=5) if seeded else dict(temperature=0)
    params = [SamplingParams(max_tokens=n, ignore_eos=True, **sp) for n in MLFQ_LENGTHS]
    want = pair[0].generate(PROMPTS[:4], MLFQ_ADAPTERS, params)  # FCFS, never preempted
    e = mlfq_engine(tiny_model_dir, tiny_adapters)
    assert e.swap.host.kv.is_pinned() or DEVICE != "cuda"
    dest = llm_on(tiny_model_dir, tiny_adapters, ON_DEVICE, ("r8",), block_size=4)
    todo = [(f"m{i}", PROMPTS[i], params[i], MLFQ_ADAPTERS[i]) for i in range(4)]
    done, moved = run_mlfq(e, todo, dest.engine)
    assert e.batcher.num_pauses > 0 and len(moved) == 1
    stats = e.swap.stats
    assert stats.swaps_out > 0 and stats.swaps_in > 0 and stats.recomputes == 0
    assert_same(want, [done[f"m{i}"] for i in range(4)], "mlfq")
    assert all(done[f"m{i}"].finish_reason is FinishReason.LENGTH for i in range(4))
    assert e.cache.allocator.num_free == 14 and e.swap.num_free == 64


MOVE_PROMPT = "hello world, the migration"


@pytest.fixture(scope="module")
def movers(pair, tiny_model_dir, tiny_adapters):
    """(two engines on DEVICE with different engine seeds, the CPU reference)."""
    on = [llm_on(tiny_model_dir, tiny_adapters, ON_DEVICE, ("r8",), seed=s) for s in (0, 5)]
    return on[0].engine, on[1].engine, pair[0].engine


def run_one(engine, sp, steps=1000):
    """MOVE_PROMPT on adapter r8 (at most `steps` steps) -> (outputs, request)."""
    outs = []
    req = engine.add_request(MOVE_PROMPT, sp, "r8", on_output=outs.append)
    while not req.finished and steps:
        engine.step()
        steps -= 1
    return outs, req


def streamed(outs):  # the tokens and text a client was sent
    return [t for o in outs for t in o.new_token_ids], "".join(o.new_text for o in outs)


@pytest.mark.device_pair
@pytest.mark.parametrize("case", sorted(RESUME_CASES))
@pytest.mark.parametrize("move", ["recompute", "live-kv", "live-kv-to-cpu"])
def test_a_request_moved_from_the_device_continues_exactly(movers, case, move):
    first, second, ref = movers
    target = ref if move == "live-kv-to-cpu" else second
    sp = SamplingParams(max_tokens=14, ignore_eos=True, **RESUME_CASES[case])
    reference, _ = run_one(ref, sp)
    unmoved, _ = run_one(first, sp)
    assert streamed(unmoved) == streamed(reference)
    before, req = run_one(first, sp, steps=5)
    n = len(req.prompt_token_ids) + 5 - 1  # the last sampled token is not computed yet
    resume = first.take(req.request_id, with_kv=move != "recompute")
    assert not first.requests and not first.cache.allocator.num_used
    assert (resume.kv is not None) == (move != "recompute")
    after = []
    moved = target.add_request(MOVE_PROMPT, sp, "r8", on_output=after.append, resume=resume)
    assert moved.num_computed_tokens == (0 if move == "recompute" else n)
    while not moved.finished:
        target.step()
    assert streamed(before + after) == streamed(reference)
    last, want = after[-1], reference[-1]
    assert last.token_ids == want.token_ids and last.finish_reason is FinishReason.LENGTH
    if sp.logprobs is not None:
        assert_logprobs_close(want.logprobs, last.logprobs, "moved logprobs")
        assert_logprobs_close(want.prompt_logprobs, last.prompt_logprobs, "moved prompt")


LAYERS, KV_HEADS, HEADS, DIM, BLOCK, KEY = 2, 2, 4, 8, 4, b"k" * 32


def creditor(device: str, dtype: torch.dtype, seed: int) -> RManager:
    cache = KVCache(KVCacheSpec(LAYERS, KV_HEADS, DIM, BLOCK, dtype), 16, torch.device(device))
    g = torch.Generator().manual_seed(seed)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=g).to(dtype))
    return RManager("c", cache, get_attention_backend(device, "torch"), LendCaps(12, 4))


@pytest.mark.device_pair
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_channel_to_a_device_creditor_returns_what_its_rmanager_returns(dtype):
    """A debtor sends device tensors over the socket to a creditor whose cache is on DEVICE:
    what comes back (on the host) is what that rManager returns called directly, close to a
    CPU creditor's, and the K/V written into the lent blocks are the same everywhere."""
    rng = random.Random(11)
    remote, direct, host = (creditor(where, dtype, 5) for where in (DEVICE, DEVICE, "cpu"))
    ids = remote.lend("d", "r", 6)
    assert direct.lend("d", "r", 6) == ids == host.lend("d", "r", 6)
    server = KVChannelServer(remote, KEY, node="here")
    ch = KVChannel("c", server.address, "d", "here", KEY)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    same = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-5, rtol=8e-3)
    try:
        for step in range(3):
            plan, rows, written = random_micro_plan(ids, rng, BLOCK)
            micros = (ch.prepare("d", plan), direct.prepare("d", plan), host.prepare("d", plan))
            for layer in range(LAYERS):
                g = torch.Generator().manual_seed(100 * step + layer)
                shapes = ((rows, HEADS, DIM), (written, KV_HEADS, DIM), (written, KV_HEADS, DIM))
                qkv = [torch.randn(s, generator=g).to(dtype) for s in shapes]
                on = [t.to(DEVICE) for t in qkv]
                (out, lse), (d_out, d_lse), (h_out, h_lse) = (
                    m.run(layer, *args, 0.35) for m, args in zip(micros, (on, on, qkv))
                )
                assert out.device.type == "cpu"  # the channel hands back host tensors
                assert (out.dtype, lse.dtype) == (dtype, torch.float32)
                torch.testing.assert_close(out, d_out.cpu(), **same)
                torch.testing.assert_close(lse, d_lse.cpu(), atol=1e-5, rtol=1e-6)
                torch.testing.assert_close(out.float(), h_out.float(), **tol)
                torch.testing.assert_close(lse, h_lse, atol=1e-4, rtol=1e-5)
        assert torch.equal(remote.cache.kv.cpu(), direct.cache.kv.cpu())  # the same K/V written
        assert torch.equal(remote.cache.kv.cpu(), host.cache.kv)
        assert server.frames == 3 * (1 + LAYERS)
    finally:
        ch.close()
        server.close()


DISTKV_PROMPT = [(i * 7) % 200 + 3 for i in range(150)]  # 190 tokens with the output: 12 blocks
DISTKV_GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def distkv_models(tiny_model_dir):
    """The tiny model loaded on DEVICE (shared by its runners) and on the CPU (reference)."""
    model = dict(model=str(tiny_model_dir), dtype="float32", **TORCH_PATHS)  # CUDA's defaults
    return tuple(load_model(ModelConfig(**model, device=d)) for d in (DEVICE, "cpu"))


def distkv_engine(shared, device: str, num_blocks: int, chunk: int = 2048, **backends) -> Engine:
    model = ModelConfig(model="unused", dtype="float32", device=device)
    cache, batch = CacheConfig(num_blocks=num_blocks), BatchConfig(max_batched_tokens=chunk)
    config = EngineConfig(model, cache, batch=batch, attention_backend="torch", **backends)
    return Engine(config, shared)


def run_engine(e: Engine, adapter_path) -> tuple[dict, int]:
    """A too-long request on adapter r16 and a short one on the base model -> (final tokens,
    the most blocks the long one held on peers)."""
    e.adapters.register("r16", str(adapter_path))
    warm(e, ["r16"])
    e.add_request(DISTKV_PROMPT, DISTKV_GREEDY, "r16", request_id="q0")
    e.add_request(DISTKV_PROMPT[:20], DISTKV_GREEDY, request_id="q1")
    final, most = {}, 0
    while e.has_unfinished():
        final.update({o.request_id: o.token_ids for o in e.step() if o.finished})
        r = e.requests.get("q0")
        most = max(most, sum(len(x.block_ids) for x in r.remote) if r is not None else 0)
    return final, most


@pytest.mark.device_pair
@pytest.mark.parametrize(("chunk", "overlap"), [(16, False), (2048, True)])
def test_distkv_between_device_runners_matches_one_big_cpu_engine(
    distkv_models, tiny_adapters, chunk, overlap
):
    """Runner a (4 blocks) borrows 9 blocks on b and c (6 each), all on DEVICE: q0's 12 blocks
    less the 3 it keeps of a's 4 (a quarter left to q1 beside it: BatchConfig.borrow_headroom);
    the remote micro-attention runs in the step's thread or overlapped on the network's pool."""
    on, cpu = distkv_models
    big = distkv_engine(cpu, "cpu", 64, sgmv_backend="torch_ref")  # room for everything
    want, _ = run_engine(big, tiny_adapters["r16"])
    engines = {"a": distkv_engine(on, DEVICE, 4, chunk)}
    engines |= {"b": distkv_engine(on, DEVICE, 6), "c": distkv_engine(on, DEVICE, 6)}
    net = KVNetwork()
    for rid, e in engines.items():
        borrower = net.add_runner(rid)
        caps = default_caps(e.cache.allocator.num_blocks)
        net.attach(rid, e.distkv.enable(rid, borrower, caps, overlap, pool=net.pool))
    a, b, c = engines.values()
    try:
        got, most = run_engine(a, tiny_adapters["r16"])
    finally:
        net.shutdown()
    assert got == want and len(want["q0"]) == 40
    assert most == 9 and b.distkv.rmanager.calls > 0 and c.distkv.rmanager.calls > 0
    assert net.ledger.debts() == {}
    assert [e.cache.allocator.num_free for e in (a, b, c)] == [4, 6, 6]
