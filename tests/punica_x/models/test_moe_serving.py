"""What the engine does around the model works unchanged on a mixture of experts (a tiny
Qwen3-MoE with a dense layer, and adapters on its attention, experts and router): prefix-cache
hits, chunked prefill with preemption and MLFQ swaps give the plain run's tokens; a request
moved by recomputation or by a live KV copy continues exactly; DistKV borrowing matches one
big runner; the memory plan counts the experts' weights. The routing is computed in every
step, never cached: each of these runs recomputes it for every token it computes."""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path

import pytest
import torch
from helpers import (
    CACHE_CONFIGS,
    charge_one_second,
    make_peft_adapter,
    make_tiny_family,
    tiny_llm,
)
from safetensors.torch import load_file, save_file

from punica_x import SamplingParams
from punica_x.config import BatchConfig, CacheConfig, EngineConfig, ModelConfig
from punica_x.engine import Engine
from punica_x.engine.memory import weights_bytes
from punica_x.models.loader import load_model
from punica_x.models.quantize import quantize_blocks
from punica_x.ops.quant_dense import QuantCpuDense, dequantize_blocks

SP = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)
NAMES = [None, "experts", "attn", None, "experts", "attn"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("moe-serving")
    folder = make_tiny_family(
        root / "qwen3-moe",
        "qwen3_moe",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    )
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    adapters = {
        "attn": make_peft_adapter(base, root / "attn", 8, ["q_proj", "v_proj"], 1),
        "experts": make_peft_adapter(
            base, root / "experts", 4, ["o_proj"], 2, target_parameters=EXPERTS
        ),
    }
    return folder, adapters


def make(moe, **kwargs):
    folder, adapters = moe
    llm = tiny_llm(folder, **kwargs)
    for name, path in adapters.items():
        llm.load_adapter(name, str(path))
    return llm


def workload(seed: int = 0) -> list[list[int]]:
    """Six prompts sharing a 37-token system prompt, then their own question."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 300) for _ in range(37)]
    return [system + [rng.randrange(3, 300) for _ in range(rng.randrange(1, 12))] for _ in range(6)]


def two_waves(llm, prompts):
    """The first two prompts, then all six (the second wave finds the first's blocks)."""
    return llm.generate(prompts[:2], NAMES[:2], SP) + llm.generate(prompts, NAMES, SP)


def assert_same(want, got, tol: float = 1e-5) -> None:
    for a, b in zip(want, got, strict=True):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.token_id == y.token_id and y.logprob == pytest.approx(x.logprob, abs=tol)


@pytest.mark.parametrize("name", list(CACHE_CONFIGS))
def test_prefix_hits_preemption_and_swaps_give_the_plain_runs_outputs(moe, name):
    prompts = workload()
    plain = two_waves(make(moe, prefix_caching=False), prompts)
    llm = make(moe, prefix_caching=True, **CACHE_CONFIGS[name])
    if name == "mlfq-swapped":
        charge_one_second(llm)
    assert_same(plain, two_waves(llm, prompts))
    e = llm.engine
    assert sum(e.batcher.prefix.stats.hits.values()) > 0
    assert set(e.batcher.prefix.stats.hits) >= {"", "experts", "attn"}
    if name == "chunked-preempted":
        assert e.batcher.num_preemptions > 0
    if name == "mlfq-swapped":
        assert e.swap.stats.swaps_out > 0
    assert e.cache.allocator.num_used == 0


def _run(engine, prompt, adapter, resume=None, steps=None):
    outs = []
    req = engine.add_request(prompt, SP, adapter, on_output=outs.append, resume=resume)
    n = 0
    while not req.finished and (steps is None or n < steps):
        engine.step()
        n += 1
    return outs, req


@pytest.mark.parametrize("with_kv", [False, True], ids=["recomputed", "live-copy"])
@pytest.mark.parametrize("adapter", [None, "experts"])
def test_a_moved_request_continues_exactly(moe, with_kv, adapter):
    first, second = make(moe).engine, make(moe).engine
    prompt = workload()[2]
    reference, _ = _run(first, prompt, adapter)
    before, req = _run(first, prompt, adapter, steps=4)
    resume = first.take(req.request_id, with_kv)
    assert (resume.kv is not None) == with_kv
    after, moved = _run(second, prompt, adapter, resume=resume)
    tokens = [t for o in before + after for t in o.new_token_ids]
    assert tokens == reference[-1].token_ids == moved.output_token_ids
    got = [lp.logprob for o in before + after for lp in o.new_logprobs]
    want = [lp.logprob for o in reference for lp in o.new_logprobs]
    assert got == pytest.approx(want, abs=1e-4)


def _engine(shared, num_blocks: int) -> Engine:
    config = EngineConfig(
        model=ModelConfig(model="unused", dtype="float32"),
        cache=CacheConfig(block_size=16, num_blocks=num_blocks),
        batch=BatchConfig(max_batched_tokens=2048),
    )
    return Engine(config, shared)


def test_distkv_borrowing_matches_one_big_runner(moe):
    """A request of 12 blocks on a runner of 4 borrows 8 on two peers and computes attention
    where they live; its tokens equal one runner with room for all of it."""
    from scheduler.distkv.network import KVNetwork, default_caps

    folder, _ = moe
    shared = load_model(ModelConfig(model=str(folder), dtype="float32"))
    prompt = [(i * 7) % 200 + 3 for i in range(150)]
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)

    def run(e):
        req = e.add_request(prompt, greedy, request_id="q")
        while e.has_unfinished():
            e.step()
        return req.output_token_ids

    want = run(_engine(shared, 64))
    a, b, c = _engine(shared, 4), _engine(shared, 6), _engine(shared, 6)
    net = KVNetwork()
    for rid, e in {"a": a, "b": b, "c": c}.items():
        borrower = net.add_runner(rid)
        caps = default_caps(e.cache.allocator.num_blocks)
        net.attach(rid, e.distkv.enable(rid, borrower, caps, False, pool=net.pool))
    assert run(a) == want
    assert b.distkv.rmanager.calls > 0 and c.distkv.rmanager.calls > 0
    assert net.ledger.debts() == {}


def test_the_memory_plan_counts_every_experts_weights(moe):
    """The plan's weights are the model's parameters, each expert's included (8 experts of
    layer 0 hold more than the dense MLP of layer 1), and a planned engine generates as a
    fixed one."""
    folder, _ = moe
    fixed = make(moe)
    planned = make(moe, utilization=0.05, kv_fraction=0.1, host_bytes=64 << 20)
    model = planned.engine.model
    assert planned.engine.memory_plan.weights_bytes == weights_bytes(model)
    experts = sum(weights_bytes(m) for m in model.layers[0].mlp.experts_gate_up)
    assert experts > weights_bytes(model.layers[1].mlp) > 0
    prompts = workload()[:3]
    want = [o.token_ids for o in fixed.generate(prompts, NAMES[:3], SP)]
    assert [o.token_ids for o in planned.generate(prompts, NAMES[:3], SP)] == want


# what --quantization turns into blocks (quantize_on_load): every projection, expert (fused
# stacks and Mixtral's w1|w3|w2 included) and shared expert; not the router (mlp.gate), the
# shared expert's gate, the norms or an untied embedding. The head: in Q8_0.
BLOCKED = re.compile(r"\.(experts\.|shared_expert\.|[a-z]+_proj\.)")


def dequantized_moe(src, dst, fmt: str) -> tuple[Path, set[str]]:
    """A float32 copy of the checkpoint `src` holding what its blocks dequantize to, and the
    names replaced. The engine blocks each weight by rows, 32 values along its input dim
    (the last); an expert's gate|up [2I, hidden] is its gate's rows then its up's, and a
    fused stack [E, out, in] is E such weights, so each checkpoint tensor, seen as rows of
    its last dim, is blocked here as the engine blocks it."""
    shutil.copytree(src, dst)
    state = load_file(str(src / "model.safetensors"))
    replaced = set()
    for name, w in state.items():
        form = "Q8_0" if name == "lm_head.weight" else fmt if BLOCKED.search(name) else None
        if form is not None:
            blocks = quantize_blocks(name, w.reshape(-1, w.shape[-1]), form)
            state[name] = dequantize_blocks(blocks, torch.float32).reshape(w.shape)
            replaced.add(name)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst, replaced


def scored(llm, prompts) -> tuple[list[list[int]], list[float]]:
    """One mixed batch (the adapters NAMES): each prompt's greedy tokens, and the logprobs of
    every prompt token after the first and of every generated token, in order."""
    sp = SamplingParams(
        max_tokens=10, temperature=0, ignore_eos=True, logprobs=0, prompt_logprobs=0
    )
    outs = llm.generate(prompts, NAMES, sp)
    lps = [p.logprob for o in outs for p in [*o.prompt_logprobs[1:], *o.logprobs]]
    return [o.token_ids for o in outs], lps


@pytest.mark.parametrize("mode, fmt", [("int8", "Q8_0"), ("int4", "Q4_1")])
def test_on_load_quantization_blocks_every_expert_and_keeps_the_router(moe, mode, fmt, tmp_path):
    """--quantization int8 / int4 on a mixture of experts serves every expert (the bulk of
    its weights) from blocks, not only the attention; the router stays float. What it
    computes, expert and attention adapters over the blocks in one batch: the same greedy
    tokens and logprobs (within 1e-4, another order of sums) as a float32 checkpoint holding
    the blocks' dequantized values with the same adapters (measured: < 2e-5)."""
    folder, adapters = moe
    llm = make(moe, quantization=mode, quant_activations="float")
    block = llm.engine.model.layers[0].mlp
    assert all(isinstance(m.backend, QuantCpuDense) for m in block.experts())
    assert {m.backend.format for m in block.experts()} == {fmt}
    assert not isinstance(block.gate.backend, QuantCpuDense)
    ref_dir, replaced = dequantized_moe(folder, tmp_path / "dequantized", fmt)
    assert "model.layers.0.mlp.gate.weight" not in replaced
    assert sum(".experts." in n for n in replaced) == 3 * block.num_experts
    prompts = workload()
    got, want = scored(llm, prompts), scored(make((ref_dir, adapters)), prompts)
    assert got[0] == want[0]
    assert len(got[1]) == len(want[1]) > 6 * 40
    delta = max(abs(x - y) for x, y in zip(got[1], want[1]))
    assert delta < 1e-4, delta
