"""GGUF files read natively (models.gguf_native): the default model's Q4_1 / Q8_0 tensors
served in their own blocks against the same file dequantized to float32 (--quantization
none), and the reader's refusals."""

from __future__ import annotations

import shutil
import struct

import numpy as np
import pytest
import torch
from helpers import CHAT_QUESTIONS, chat_prompts, write_gguf

from punica_x import LLM, SamplingParams
from punica_x.config import ModelConfig
from punica_x.engine.memory import weights_bytes
from punica_x.layers.linear import Dense
from punica_x.models import gguf_header, gguf_native
from punica_x.models.loader import default_model_path
from punica_x.ops.quant_dense import QuantCpuDense

QUESTIONS = CHAT_QUESTIONS
TEXT = "The quick brown fox jumps over the lazy dog. Paris is the capital of France, and"


def test_unpermute_matches_transformers():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    proc = LlamaTensorProcessor(config={"num_attention_heads": 4, "num_key_value_heads": 2})
    w = np.arange(32 * 3).reshape(32, 3)
    for heads, name in ((4, "blk.0.attn_q.weight"), (2, "blk.0.attn_k.weight")):
        want = proc.process(weights=w, name=name).weights
        np.testing.assert_array_equal(gguf_native.unpermute_rows(w, heads), want)


def test_tensor_names():
    assert gguf_native.hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_native.hf_name("blk.12.ffn_down.weight") == "model.layers.12.mlp.down_proj.weight"
    assert gguf_native.hf_name("blk.3.attn_q.bias") == "model.layers.3.self_attn.q_proj.bias"
    assert gguf_native.hf_name("blk.3.attn_qkv.weight") is None
    assert gguf_native.hf_name("something.else") is None


def test_quantization_setting_is_checked():
    from frontend.cli_serve import QUANTIZATION_CHOICES

    assert QUANTIZATION_CHOICES == ModelConfig.QUANTIZATION
    for bad in ("int3", "", "AUTO", "q4_1", None, 4):
        with pytest.raises(ValueError, match="quantization must be one of"):
            ModelConfig(quantization=bad)


def test_auto_dequantizes_off_the_cpu_and_int8_int4_are_refused_there():
    """The block kernels run on the CPU only: auto serves a GPU dequantized (the loader warns
    and reports the dtype); int8 / int4, which ask for blocks, are refused before loading."""
    assert ModelConfig(device="cpu").served_quantization() == "auto"
    assert ModelConfig(device="cuda").served_quantization() == "none"
    assert ModelConfig(device="cuda", quantization="none").served_quantization() == "none"
    for asked in ("int8", "int4"):
        assert ModelConfig(device="cpu", quantization=asked).served_quantization() == asked
        with pytest.raises(ValueError, match=f"quantization '{asked}' runs on the CPU only"):
            ModelConfig(device="cuda", quantization=asked).served_quantization()


def _header(pairs: list[bytes]) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, 0, len(pairs)) + b"".join(pairs)


def _string(text: str) -> bytes:
    return struct.pack("<Q", len(text.encode())) + text.encode()


def test_architecture_is_read_past_other_keys_of_every_type(tmp_path):
    """general.architecture after scalars, a string, arrays of numbers and of strings (the
    header reader skips each by its type); the pairs after it are read as well (a malformed
    one refuses the file: models.gguf_header)."""
    pairs = [
        _string("a.u8") + struct.pack("<IB", 0, 7),
        _string("a.f64") + struct.pack("<Id", 12, 1.5),
        _string("a.str") + struct.pack("<I", 8) + _string("hello"),
        _string("a.ints") + struct.pack("<IIQ", 9, 5, 3) + struct.pack("<3i", 1, 2, 3),
        _string("a.strs") + struct.pack("<IIQ", 9, 8, 2) + _string("x") + _string("yz"),
        _string("general.architecture") + struct.pack("<I", 8) + _string("mistral"),
        _string("z.after") + struct.pack("<IH", 2, 3),
    ]
    path = tmp_path / "m.gguf"
    path.write_bytes(_header(pairs))
    assert gguf_native.architecture(path) == "mistral"
    path.write_bytes(_header(pairs[:5]))
    assert gguf_native.architecture(path) == ""
    path.write_bytes(_header([*pairs, _string("z.bad") + struct.pack("<I", 99)]))
    with pytest.raises(ValueError, match="GGUF value type 99"):
        gguf_native.architecture(path)


def test_a_malformed_header_is_refused(tmp_path):
    path = tmp_path / "bad.gguf"
    cases = {
        "a key of 1 TiB": _header([struct.pack("<Q", 1 << 40)]),
        "cut inside a key": _header([_string("general.architecture")[:12]]),
        "cut after a key": _header([_string("general.architecture")]),
        "an unknown type": _header([_string("k") + struct.pack("<I", 99)]),
        "not GGUF": b"NOPE" + bytes(40),
        "version 1": b"GGUF" + struct.pack("<IQQ", 1, 0, 0),
        "empty": b"",
        "arrays in arrays": _header([_string("k") + struct.pack("<IIQ", 9, 9, 1) * 10000]),
        "not UTF-8": _header([struct.pack("<Q", 2) + b"\xff\xfe"]),
    }
    for what, data in cases.items():
        path.write_bytes(data)
        with pytest.raises(ValueError, match="^bad.gguf: a malformed GGUF header"):
            gguf_native.architecture(path)
            pytest.fail(what)


@pytest.mark.slow
def test_default_model_natively_matches_its_dequantized_reference():
    """x in float32 (quant_activations="float") and x rounded to int16 per block (the
    default): the dequantized model's tokens, logprobs within float32 summation noise.
    (int8, llama.cpp's arithmetic, moves this model's logprobs by up to ~1.2 nats: tested
    on the kernels and the packed tiny models)"""
    native = LLM(quantization="auto", dtype="float32", quant_activations="float")
    model = native.engine.model
    dense = [m for m in model.modules() if isinstance(m, Dense)]
    assert dense and all(isinstance(m.backend, QuantCpuDense) for m in dense)
    assert {m.backend.format for m in dense} == {"Q4_1", "Q8_0"}  # projections, tied head
    assert model.weight_formats() == "Q4_1,Q8_0"
    assert model.embed_from_head and model.embed_tokens.weight.numel() == 0
    tensors = gguf_header.read_header(default_model_path()).tensors
    file_bytes = sum(gguf_header.nbytes(t) for t in tensors)
    assert weights_bytes(model) <= 1.15 * file_bytes, (weights_bytes(model), file_bytes)

    tok = native.tokenizer
    prompts = chat_prompts(tok, QUESTIONS)
    greedy = SamplingParams(max_tokens=24, temperature=0)
    scored = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    got = native.generate(prompts, sampling=greedy)
    got_lp = native.generate([TEXT], sampling=scored)[0].prompt_logprobs[1:]
    digests = dict(model.edge_digests)
    del native, model, dense
    x16 = LLM(quantization="auto", dtype="float32")
    assert {m.backend.x_bits for m in x16.engine.model.modules() if isinstance(m, Dense)} == {16}
    x16_tokens = [o.token_ids for o in x16.generate(prompts, sampling=greedy)]
    x16_lp = x16.generate([TEXT], sampling=scored)[0].prompt_logprobs[1:]
    del x16
    ref = LLM(quantization="none", dtype="float32")
    want = ref.generate(prompts, sampling=greedy)
    want_lp = ref.generate([TEXT], sampling=scored)[0].prompt_logprobs[1:]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    deltas = [abs(a.logprob - b.logprob) for a, b in zip(got_lp, want_lp)]
    assert len(deltas) > 10 and max(deltas) < 1e-3, deltas  # float32 sums in another order
    assert x16_tokens == [o.token_ids for o in want]
    deltas = [abs(a.logprob - b.logprob) for a, b in zip(x16_lp, want_lp)]
    assert len(deltas) > 10 and max(deltas) < 2e-2, deltas  # measured: <= 4e-3
    assert digests == ref.engine.model.edge_digests
    assert ref.engine.model.weight_formats() == "float32"


@pytest.mark.slow
def test_a_nan_scale_is_refused_at_load_naming_the_tensor(tmp_path):
    path = tmp_path / "bad.gguf"
    shutil.copy(default_model_path(), path)
    tensors = gguf_header.read_header(path).tensors
    t = next(t for t in tensors if t.name == "blk.2.attn_v.weight")
    with open(path, "r+b") as f:  # the first block's fp16 scale of row 0 becomes NaN
        f.seek(t.offset)
        f.write(bytes([0x00, 0x7E]))
    with pytest.raises(ValueError, match=r"blk\.2\.attn_v\.weight: row 0 has a non-finite"):
        LLM(model=str(path), quantization="auto")


def test_unknown_tensor_is_refused(tmp_path):
    path = write_gguf(
        tmp_path / "x.gguf", {"blk.0.mystery.weight": (np.zeros(4, np.float32), None)}
    )
    with pytest.raises(ValueError, match="unexpected tensor 'blk.0.mystery.weight'"):
        list(gguf_native.read_tensors(path, 1, 1))


def test_non_finite_float_tensor_is_refused(tmp_path):
    norm = np.array([1, np.nan, 1, 1], np.float32)
    path = write_gguf(tmp_path / "x.gguf", {"output_norm.weight": (norm, None)})
    with pytest.raises(ValueError, match="output_norm.weight: non-finite"):
        list(gguf_native.read_tensors(path, 1, 1))


def test_quantized_float_mix_in_one_layer_is_dequantized():
    """q in blocks, k and v as floats: the fused layer serves floats (exactly the blocks')."""
    from gguf import GGMLQuantizationType, quants

    from punica_x.ops.quant_dense import QuantBlocks

    layer = Dense(64, (32, 32), False, torch.float32, torch.device("cpu"))
    w = np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32)
    q = quants.quantize(w, GGMLQuantizationType.Q8_0)
    layer.load_slice(0, "weight", QuantBlocks("q", "Q8_0", torch.from_numpy(q.copy()), 64))
    layer.load_slice(1, "weight", torch.ones(32, 64))
    assert layer.quantized_weight() is None
    want = quants.dequantize(q, GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(layer.weight[:32].numpy(), want)
    assert (layer.weight[32:] == 1).all() and not layer.quant_parts
    with pytest.raises(ValueError, match="expected a weight of 32 x 64"):
        layer.load_slice(1, "weight", QuantBlocks("k", "Q8_0", torch.from_numpy(q[:8].copy()), 64))
