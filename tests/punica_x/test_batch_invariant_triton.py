"""The tiny model served through the batch-invariant Triton kernels (the CUDA side of
ops.invariance): the dense projections and LM head (ops.triton_gemm), the norms
(ops.triton_norm) and the paged attention (attention.triton_paged) serve a whole engine, give
the torch paths' tokens, and give a request the same tokens and bit-identical logprobs alone
or at any position of a batch of mixed adapters, prefilled whole or in chunks.

On CUDA (gpu-marked: the real kernels, with batch_invariant=on choosing them and the CUDA
SGMV in its fixed order). On a CPU the same engine runs them through Triton's interpreter
(tests/triton_interpreter.py), named as backends, with the registries allowing them on the
CPU for the test: the engine's plumbing, the kernels' structure and the bits are tested
where no GPU is; what the interpreter cannot show is the GPU's own arithmetic."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_llm
from triton_interpreter import interpreted, mended, skip_without_triton

pytestmark = pytest.mark.triton
skip_without_triton()
from punica_x import SamplingParams  # noqa: E402
from punica_x.attention import BACKENDS as ATTENTION  # noqa: E402
from punica_x.engine.cuda_graphs import DecodeGraphs, replay_capture  # noqa: E402
from punica_x.ops.dense import BACKENDS as DENSE  # noqa: E402
from punica_x.ops.fused import BACKENDS as FUSED  # noqa: E402
from punica_x.ops.sgmv import sgmv_fixed_order  # noqa: E402

NAMES = ("r4", "r8", "r16")
MODELS = [None, *NAMES]
PROMPTS = ["the quick brown fox", "hello world", "paged attention keeps", "numbers 0123"]
# short runs: the interpreter takes ~0.1 s a kernel call on a CPU
SP = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=2)


@pytest.fixture
def on_device(monkeypatch):
    """The engine's settings that put its kernels on the Triton backends: on CUDA the mode
    itself; on a CPU the backends named, allowed on the CPU, in the mended interpreter."""
    if not interpreted():
        yield dict(device="cuda", batch_invariant="on")
        return
    for registry in (DENSE, FUSED, ATTENTION):
        monkeypatch.setitem(registry.needs, "triton", ("cpu", (torch.float32, torch.bfloat16)))
    names = dict(dense_backend="triton", fused_backend="triton", attention_backend="triton")
    with mended():
        yield dict(device="cpu", batch_invariant="off", sgmv_backend="cpu", **names)


def serve(model_dir, adapters, where, dtype, **kwargs):
    llm = tiny_llm(model_dir, dtype=dtype, **where, **kwargs)
    if interpreted():  # what batch_invariant=on takes on CUDA: SGMV in its fixed order
        llm.engine.sgmv = sgmv_fixed_order(llm.engine.device)
    for name in NAMES:
        llm.load_adapter(name, str(adapters[name]))
    return llm


def result(out):
    return out.token_ids, [(lp.logprob, lp.top) for lp in out.logprobs]


def test_the_engine_runs_on_the_triton_kernels(tiny_model_dir, tiny_adapters, on_device):
    llm = serve(tiny_model_dir, tiny_adapters, on_device, "float32")
    assert llm.engine.planner.attention.name == "triton"
    linears = [m for m in llm.engine.model.modules() if hasattr(m, "backend")]
    assert linears and {m.backend.name for m in linears} == {"triton"}
    if not interpreted():
        info = llm.engine.describe()
        assert info.batch_invariant and llm.engine.sgmv.fixed_order
    torch_paths = dict(dense_backend="torch", fused_backend="torch", attention_backend="torch")
    ref = tiny_llm(tiny_model_dir, sgmv_backend="torch_ref", batch_invariant="off", **torch_paths)
    for name in NAMES:
        ref.load_adapter(name, str(tiny_adapters[name]))
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    ours = llm.generate(PROMPTS, MODELS, greedy)
    want = ref.generate(PROMPTS, MODELS, greedy)
    assert [o.token_ids for o in ours] == [o.token_ids for o in want]


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.gpu)])
def test_alone_equals_every_position_of_a_batch_and_chunks_equal_the_whole(
    tiny_model_dir, tiny_adapters, on_device, dtype
):
    """float32 everywhere: a changed order of additions shows in every logprob's bits (a
    bfloat16 output rounds most of them away on a model this small); bfloat16 on CUDA."""
    llm = serve(tiny_model_dir, tiny_adapters, on_device, dtype, prefix_caching=False)
    combos = [(p, m) for p in range(3) for m in (None, "r8")]
    alone = {c: result(llm.generate([PROMPTS[c[0]]], [c[1]], SP)[0]) for c in combos}
    slots = [combos[(5 * i) % len(combos)] for i in range(9)]  # each combo, one twice
    batch = llm.generate([PROMPTS[p] for p, _ in slots], [m for _, m in slots], SP)
    for i, ((p, m), out) in enumerate(zip(slots, batch)):
        assert result(out) == alone[(p, m)], (i, p, m)
    chunked = serve(tiny_model_dir, tiny_adapters, on_device, dtype, max_batched_tokens=3)
    outs = chunked.generate(PROMPTS[:3], ["r8"] * 3, SP)
    for p, out in enumerate(outs):
        assert result(out) == alone[(p, "r8")], p


def test_decode_graphs_replay_the_triton_plan_bit_for_bit(tiny_model_dir, tiny_adapters, on_device):
    """Decode steps replayed from graphs (engine/graph_attention.py's triton buffers: padded
    rows, each row its own block table) give eager's tokens and logprob bits. On a CPU the
    graphs "replay" by running the forward again on their fixed buffers (replay_capture)."""
    kw = dict(prefix_caching=False, max_batch_size=8, block_size=4)
    want = serve(tiny_model_dir, tiny_adapters, on_device, "float32", cuda_graphs=False, **kw)
    want = [result(o) for o in want.generate(PROMPTS, MODELS, SP)]
    llm = serve(tiny_model_dir, tiny_adapters, on_device, "float32", **kw)
    e = llm.engine
    if interpreted():
        e.graphs = DecodeGraphs(
            e.model, e.cache.kv, e.sgmv, e.cache.allocator, e.planner.lora.h_out,
            e.config.cache.block_size, e.max_model_len, 8, e.config.lora.max_lora_rank,
            e.device, capture=replay_capture, attention="triton",
        )  # fmt: skip
    got = [result(o) for o in llm.generate(PROMPTS, MODELS, SP)]
    assert e.graphs.stats.replays > 0 and e.graphs.stats.failures == 0
    assert got == want
