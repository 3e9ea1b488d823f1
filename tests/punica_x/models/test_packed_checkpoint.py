"""GPTQ and AWQ checkpoints (tiny random Llamas quantized into each format here): served in
blocks they compute what their dequantized values compute; --quantization none is that
reference exactly; malformed ones are refused at load naming the tensor or field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import assert_matches_hf_fp32, make_peft_adapter, make_tiny_llama, tiny_llm
from safetensors.torch import load_file, save_file

from punica_x import SamplingParams
from punica_x.layers.linear import Dense
from punica_x.models.packed_checkpoint import PackedFormat, packed_format, read_packed, unpack
from punica_x.ops.quant_dense import QuantBlocks, QuantCpuDense, dequantize_blocks

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = ["the quick brown fox", "hello world, this is", "paged attention keeps"]


def quantize_group_wise(w: torch.Tensor, group: int, sym: bool, lowest_zero: int = 0):
    """Round-to-nearest 4-bit codes of w [N, K]: (q [N, K], z [G, N], s [G, N] fp16)."""
    n, k = w.shape
    g = k if group == -1 else group
    wg = w.view(n, k // g, g)
    if sym:
        s = (wg.abs().amax(-1) / 7.5).clamp_min(1e-4).half()
        z = torch.full((n, k // g), 8)
    else:
        lo, hi = wg.amin(-1), wg.amax(-1)
        s = ((hi - lo) / 15).clamp_min(1e-4).half()
        z = (-lo / s.float()).round().clamp(lowest_zero, 15).long()
    q = (wg / s.float().unsqueeze(-1)).round() + z.unsqueeze(-1)
    return q.clamp(0, 15).long().view(n, k), z.t().contiguous(), s.t().contiguous()


# The two published layouts, written out here from their packers rather than taken from
# punica_x (issue 77: a layout mistake shared by the product and its test passed). A word is
# an int32; its code i (4 bits) sits at bits [4i, 4i + 4).
#
# AWQ "gemm" (AutoAWQ's WQLinear_GEMM.from_linear, awq/modules/linear/gemm.py, read at
# casper-hansen/AutoAWQ 88e4c76): intweight [K, N]; for each word col of a row,
# `order_map = [0, 2, 4, 6, 1, 3, 5, 7]` and
# `qweight[:, col] |= intweight[:, col * 8 + order_map[i]] << (i * 4)`, qzeros [G, N / 8] the
# same from zeros [G, N]; W = (q - z) * s. vLLM's awq_triton.py unpacks it with the reverse
# order [0, 4, 1, 5, 2, 6, 3, 7]: column j of a word is `(word >> (4 * reverse[j])) & 0xF`.
AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def _int32(acc: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2^32) as the int32 of the same bits (what the packers store)."""
    return torch.where(acc >= 2**31, acc - 2**32, acc).to(torch.int32)


def gptq_pack(q, z, v1: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ (AutoGPTQ's QuantLinear.pack, auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py,
    read at AutoGPTQ/AutoGPTQ 9f7d370): `qweight[row] |= intweight[j] << (bits * (j - i))`
    for the 8 consecutive k = i.. i+7 of a row, so qweight [K / 8, N]; then `zeros -= 1` and
    `qzeros[:, col] |= zeros[:, j] << (bits * (j - i))` for 8 consecutive n: qzeros
    [G, N / 8] holding z - 1. vLLM's gptq q_gemm.cu adds it back, `zero_offset =
    use_v2_format ? 0 : 1`: the v1 ("gptq") checkpoint_format stores z - 1, "gptq_v2" z.
    q: codes [N, K]; z: zero points [G, N]."""
    n, k = q.shape
    intweight = q.t().long()  # [K, N]
    qweight = torch.zeros(k // 8, n, dtype=torch.int64)
    for j in range(8):
        qweight |= intweight[j::8] << (4 * j)  # row r, code j: k = 8r + j
    stored = z.long() - (1 if v1 else 0)
    assert stored.min() >= 0, "v1 stores z - 1: a zero point of 0 is not representable"
    qzeros = torch.zeros(z.shape[0], n // 8, dtype=torch.int64)
    for j in range(8):
        qzeros |= stored[:, j::8] << (4 * j)  # word c, code j: n = 8c + j
    return _int32(qweight), _int32(qzeros)


def awq_pack(q, z) -> tuple[torch.Tensor, torch.Tensor]:
    """AWQ gemm (above): qweight [K, N / 8], qzeros [G, N / 8], code i of word c holding
    column n = 8c + AWQ_PACK_ORDER[i]. q: codes [N, K]; z: zero points [G, N]."""
    n, k = q.shape
    intweight, zeros = q.t().long(), z.long()  # [K, N], [G, N]
    qweight = torch.zeros(k, n // 8, dtype=torch.int64)
    qzeros = torch.zeros(z.shape[0], n // 8, dtype=torch.int64)
    for i, column in enumerate(AWQ_PACK_ORDER):
        qweight |= intweight[:, column::8] << (4 * i)
        qzeros |= zeros[:, column::8] << (4 * i)
    return _int32(qweight), _int32(qzeros)


def pack(q, z, s, method: str, zero_offset: int, group: int) -> dict[str, torch.Tensor]:
    """The packed parts of one projection: codes q [N, K], zero points z and fp16 scales s
    [G, N]; zero_offset 1: GPTQ's v1 checkpoint_format (z - 1 stored)."""
    n, k = q.shape
    if method == "gptq":
        qweight, qzeros = gptq_pack(q, z, v1=zero_offset == 1)
        g = k if group == -1 else group
        return {
            "qweight": qweight,
            "qzeros": qzeros,
            "scales": s,
            "g_idx": (torch.arange(k) // g).to(torch.int32),  # desc_act False: k // group
        }
    qweight, qzeros = awq_pack(q, z)
    return {"qweight": qweight, "qzeros": qzeros, "scales": s}


def make_packed_llama(
    root: Path, method: str, sym: bool, group: int = 32, v2: bool = False, **extra
) -> tuple[Path, Path]:
    """(a tiny Llama packed as `method`, a float checkpoint of its dequantized values)."""
    src = make_tiny_llama(root / "float")
    ref, packed = root / "reference", root / f"{method}"
    shutil.copytree(src, ref)
    shutil.copytree(src, packed)
    state = load_file(str(src / "model.safetensors"))
    ref_state, packed_state = dict(state), {}
    offset = 1 if method == "gptq" and not v2 else 0
    for name, w in state.items():
        prefix = name.removesuffix(".weight")
        if not any(f".{p}." in name for p in PROJECTIONS):
            packed_state[name] = w
            continue
        q, z, s = quantize_group_wise(w, group, sym, lowest_zero=offset)
        g = w.shape[1] if group == -1 else group
        zk = z.t().repeat_interleave(g, dim=1).float()
        ref_state[name] = (q.float() - zk) * s.t().float().repeat_interleave(g, dim=1)
        for part, t in pack(q, z, s, method, offset, group).items():
            packed_state[f"{prefix}.{part}"] = t
    save_file(ref_state, str(ref / "model.safetensors"), metadata={"format": "pt"})
    save_file(packed_state, str(packed / "model.safetensors"), metadata={"format": "pt"})
    qc = {"quant_method": method, "bits": 4, "group_size": group}
    if method == "gptq":
        qc |= {"desc_act": False, "sym": sym, "checkpoint_format": "gptq_v2" if v2 else "gptq"}
    else:
        qc |= {"zero_point": True, "version": "gemm"}
    write_quant_config(packed, {**qc, **extra})
    return packed, ref


def write_quant_config(folder: Path, qc: dict) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = qc
    (folder / "config.json").write_text(json.dumps(cfg))


NEAR_TIE = 0.05  # nats between the reference's top two tokens
X8_NEAR_TIE = 0.25  # the same with x rounded to int8 (quant_activations="int8")


def assert_equal_but_near_ties(tokens: list[list[int]], ref_llm, margin: float) -> None:
    """Greedy tokens equal the reference's (ref_llm) up to the end, or up to a position where
    the reference's logprobs of its token and ours differ by less than `margin`."""
    sp = SamplingParams(max_tokens=len(tokens[0]), temperature=0, logprobs=5)
    for got, out in zip(tokens, ref_llm.generate(PROMPTS, sampling=sp)):
        first = next((i for i, (a, b) in enumerate(zip(got, out.token_ids)) if a != b), None)
        if first is None:
            continue
        top = dict(out.logprobs[first].top)
        assert got[first] in top, (first, got, out.token_ids)
        assert top[out.token_ids[first]] - top[got[first]] < margin, (first, top)


def run(llm):
    """Greedy tokens of PROMPTS and the prompt logprobs of the second."""
    greedy = SamplingParams(max_tokens=12, temperature=0)
    scored = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    tokens = [o.token_ids for o in llm.generate(PROMPTS, sampling=greedy)]
    lps = llm.generate([PROMPTS[1]], sampling=scored)[0].prompt_logprobs[1:]
    return tokens, [p.logprob for p in lps]


CASES = [  # (method, sym, group, v2, block format served)
    ("gptq", True, 32, False, "Q4_0"),
    ("gptq", False, 64, False, "Q4_1"),
    ("gptq", False, -1, True, "Q4_1"),
    ("awq", False, 32, False, "Q4_1"),
    ("awq", True, 64, False, "Q4_0"),
]


@pytest.mark.parametrize(("method", "sym", "group", "v2", "fmt"), CASES)
def test_packed_checkpoint_serves_blocks_matching_its_dequantized_values(
    method, sym, group, v2, fmt, tmp_path
):
    packed, ref = make_packed_llama(tmp_path, method, sym, group, v2)
    llm = tiny_llm(packed, quantization="auto", quant_activations="float")
    dense = {n: m for n, m in llm.engine.model.named_modules() if isinstance(m, Dense)}
    assert {m.backend.format for n, m in dense.items() if n != "lm_head"} == {fmt}
    assert all(isinstance(m.backend, QuantCpuDense) for n, m in dense.items() if n != "lm_head")
    got, blocks = run(llm), run(tiny_llm(block_reference(packed, tmp_path / "blocks")))
    assert got[0] == blocks[0]  # the kernels compute what the blocks hold
    assert max(abs(a - b) for a, b in zip(got[1], blocks[1])) < 1e-4
    want = run(tiny_llm(ref))
    assert_equal_but_near_ties(got[0], tiny_llm(ref), NEAR_TIE)
    deltas = [abs(a - b) for a, b in zip(got[1], want[1])]
    # Q4_0 is exact; Q4_1 rounds each block's min -z*s to fp16 (<= 2^-11 of it), an offset
    # shared by the block's weights, which this peaked tiny model's logprobs feel
    assert deltas and max(deltas) < (1e-4 if fmt == "Q4_0" else 5e-2), deltas
    exact = run(tiny_llm(packed, quantization="none"))  # the formula in float32
    assert exact[0] == want[0]
    assert max(abs(a - b) for a, b in zip(exact[1], want[1])) < 1e-5
    # x rounded to int16 per block (the default; steps of 1/16256 of each block's largest
    # value): the blocks' own tokens but at the nearest ties, and their logprobs within a few
    # times float32 noise
    values = tiny_llm(block_reference(packed, tmp_path / "b2"))
    x16 = run(tiny_llm(packed, quantization="auto"))
    assert_equal_but_near_ties(x16[0], values, NEAR_TIE)
    assert max(abs(a - b) for a, b in zip(x16[1], blocks[1])) < 3e-3
    # to int8 (llama.cpp's; steps of 1/127 of each block's largest value, relative errors of
    # ~1% a value where bf16's are <= 0.4%): the blocks' greedy tokens but at near ties,
    # prompt logprobs within a few times what serving the blocks' values in bfloat16 moves
    # them (this random model is flat: top-2 gaps of 0.03-0.2 nats)
    x8 = run(tiny_llm(packed, quantization="auto", quant_activations="int8"))
    assert_equal_but_near_ties(x8[0], values, X8_NEAR_TIE)
    x8_err = max(abs(a - b) for a, b in zip(x8[1], blocks[1]))
    bf16 = run(tiny_llm(block_reference(packed, tmp_path / "b3"), dtype="bfloat16"))
    bf16_err = max(abs(a - b) for a, b in zip(bf16[1], blocks[1]))
    assert 0 < x8_err <= 4 * bf16_err + 0.02, (x8_err, bf16_err)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_packed_checkpoint_in_bfloat16(method, tmp_path):
    """Served in bf16 (the default on BF16 / AMX CPUs), the blocks' prompt logprobs are as
    close to the float32 values of the same blocks as bf16 serving of those values is."""
    packed, _ = make_packed_llama(tmp_path, method, False)
    ref = block_reference(packed, tmp_path / "blocks")
    exact = run(tiny_llm(ref))[1]
    blocks = tiny_llm(packed, quantization="auto", quant_activations="float", dtype="bfloat16")
    ours = run(blocks)[1]
    rounding = run(tiny_llm(ref, dtype="bfloat16"))[1]
    ours_err = max(abs(a - b) for a, b in zip(ours, exact))
    bf16_err = max(abs(a - b) for a, b in zip(rounding, exact))
    assert ours_err <= 1.5 * bf16_err + 0.05, (ours_err, bf16_err)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_q4_1_blocks_are_within_the_fp16_rounding_of_the_min(method):
    torch.manual_seed(0)
    offset = 1 if method == "gptq" else 0
    q, z, s = quantize_group_wise(torch.randn(96, 128) * 0.25, 64, False, lowest_zero=offset)
    fmt = PackedFormat(method, 64, offset)
    parts = pack(q, z, s, method, offset, 64)
    exact, blocks = unpack("p", parts, fmt, False), unpack("p", parts, fmt, True)
    assert blocks.format == "Q4_1" and blocks.name == "p.qweight"
    zk = z.t().repeat_interleave(64, dim=1).float()
    assert torch.equal(exact, (q.float() - zk) * s.t().float().repeat_interleave(64, dim=1))
    err = (dequantize_blocks(blocks, torch.float32) - exact).abs()
    bound = (zk * s.t().float().repeat_interleave(64, dim=1)).abs() * 2**-11
    assert (err <= bound).all() and err.max() > 0


def _read_as(quantization_config: dict) -> PackedFormat:
    """The format punica_x reads a checkpoint of this quantization_config as."""
    qc = {"bits": 4, "group_size": 32, **quantization_config}
    return packed_format(type("C", (), {"quantization_config": qc}))


def _assert_unpacks_to(parts: dict, fmt: PackedFormat, want: torch.Tensor) -> None:
    """The float32 values and the blocks of one projection both equal want [N, K]."""
    assert torch.equal(unpack("p", parts, fmt, False), want)
    assert torch.equal(dequantize_blocks(unpack("p", parts, fmt, True), torch.float32), want)


def test_a_hand_packed_awq_word_unpacks_to_the_columns_autoawq_packed_it_from():
    """qweight[k=1, word 1] = 0x87654321, code i (value i + 1) at bits 4i: AutoAWQ put
    column 8 + order_map[i] there, so (vLLM's reverse order [0, 4, 1, 5, 2, 6, 3, 7]: column
    j <- code reverse[j]) columns n = 8..15 of k = 1 hold 1, 5, 2, 6, 3, 7, 4, 8.
    qzeros[0, word 0] = 0x00000300: code 2 = 3, column order_map[2] = 4's zero point."""
    k, n = 32, 16
    qweight = torch.zeros(k, n // 8, dtype=torch.int32)
    qweight[1, 1] = 0x87654321 - 2**32  # the int32 of those bits
    qzeros = torch.zeros(1, n // 8, dtype=torch.int32)
    qzeros[0, 0] = 0x00000300
    scales = torch.full((1, n), 0.5, dtype=torch.float16)
    codes, zeros = torch.zeros(n, k), torch.zeros(1, n)
    codes[8:16, 1] = torch.tensor([1.0, 5, 2, 6, 3, 7, 4, 8])
    zeros[0, 4] = 3
    want = (codes - zeros.t()) * 0.5  # W[n, k] = s * (q - z)
    assert want[9, 1] == 2.5 and want[10, 1] == 1.0 and want[15, 1] == 4.0
    assert want[4, 0] == want[4, 31] == -1.5 and want[2, 1] == 0
    parts = {"qweight": qweight, "qzeros": qzeros, "scales": scales}
    _assert_unpacks_to(parts, _read_as({"quant_method": "awq", "version": "gemm"}), want)
    got = awq_pack(codes.long(), zeros.long())  # this file's packer writes those words
    assert torch.equal(got[0], qweight) and torch.equal(got[1], qzeros)


@pytest.mark.parametrize(("checkpoint_format", "z1", "z_rest"), [("gptq", 8, 1), ("gptq_v2", 7, 0)])
def test_a_hand_packed_gptq_word_unpacks_to_the_rows_autogptq_packed_it_from(
    checkpoint_format, z1, z_rest
):
    """qweight[word 1, n=2] = 0x87654321: code j (value j + 1) is k = 8 + j, column 2.
    qzeros[0, word 0] = 0x00000070: code 1 = 7 is column 1's stored zero, every other one
    stores 0; the v1 "gptq" format stores z - 1 (zero points 8 and 1), "gptq_v2" z."""
    k, n = 32, 8
    qweight = torch.zeros(k // 8, n, dtype=torch.int32)
    qweight[1, 2] = 0x87654321 - 2**32
    qzeros = torch.full((1, n // 8), 0x00000070, dtype=torch.int32)
    scales = torch.full((1, n), 0.5, dtype=torch.float16)
    codes = torch.zeros(n, k)
    codes[2, 8:16] = torch.arange(1.0, 9.0)
    zeros = torch.full((1, n), float(z_rest))
    zeros[0, 1] = z1
    want = (codes - zeros.t()) * 0.5
    assert want[2, 8] == 0.5 * (1 - z_rest) and want[2, 15] == 0.5 * (8 - z_rest)
    assert want[1, 0] == -0.5 * z1 and want[2, 16] == -0.5 * z_rest
    g_idx = (torch.arange(k) // 32).to(torch.int32)
    parts = {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx}
    qc = {"quant_method": "gptq", "desc_act": False, "checkpoint_format": checkpoint_format}
    _assert_unpacks_to(parts, _read_as(qc), want)
    got = gptq_pack(codes.long(), zeros.long(), v1=checkpoint_format == "gptq")
    assert torch.equal(got[0], qweight) and torch.equal(got[1], qzeros)


def block_reference(packed: Path, out: Path) -> Path:
    """A float checkpoint of the values the packed checkpoint's blocks hold."""
    shutil.copytree(packed, out)
    cfg = json.loads((out / "config.json").read_text())
    fmt = packed_format(type("C", (), {"quantization_config": cfg.pop("quantization_config")}))
    (out / "config.json").write_text(json.dumps(cfg))
    state = dict(read_packed([packed / "model.safetensors"], fmt, True))
    for name, value in state.items():
        if isinstance(value, QuantBlocks):
            state[name] = dequantize_blocks(value, torch.float32)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_adapters_on_a_packed_base_match_hf_peft_on_its_values(method, tmp_path):
    """PEFT adapters (a QLoRA adapter is one) on the packed base, served in its blocks, in a
    batch mixed with the base model: HF + PEFT on the dequantized checkpoint in float32."""
    from transformers import AutoModelForCausalLM

    packed, ref = make_packed_llama(tmp_path, method, True)  # Q4_0: exact
    base = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32)
    adapters = {
        "a": make_peft_adapter(base, tmp_path / "a", 4, list(PROJECTIONS), seed=3),
        "b": make_peft_adapter(base, tmp_path / "b", 8, ["q_proj", "v_proj"], seed=4),
    }
    llm = tiny_llm(packed, quantization="auto", quant_activations="float")
    for name, path in adapters.items():
        llm.load_adapter(name, str(path))
    assert_matches_hf_fp32(llm, ref, adapters, PROMPTS, ["a", None, "b"], 8, method)


def _edit(packed: Path, fn) -> None:
    path = packed / "model.safetensors"
    state = load_file(str(path))
    fn(state)
    save_file(state, str(path), metadata={"format": "pt"})


Q = "model.layers.0.self_attn.q_proj"
BAD_CONFIGS = [
    ({"bits": 8}, "bits 8: only 4-bit gptq"),
    ({"desc_act": True}, "desc_act: act-order"),
    ({"group_size": 48}, "group_size 48: groups must be a multiple of 32"),
    ({"group_size": "128"}, "group_size '128' is not a group size"),
    ({"group_size": 0}, "group_size 0 is not a group size"),
    ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not served"),
]


@pytest.mark.parametrize(("change", "message"), BAD_CONFIGS)
def test_unserved_quantization_configs_are_refused(change, message, tmp_path):
    packed, _ = make_packed_llama(tmp_path, "gptq", True, **change)
    with pytest.raises(ValueError, match=message):
        tiny_llm(packed, quantization="auto")


def test_awq_other_versions_are_refused(tmp_path):
    packed, _ = make_packed_llama(tmp_path, "awq", False, version="gemv")
    with pytest.raises(ValueError, match="version 'gemv': AWQ gemm only"):
        tiny_llm(packed, quantization="auto")


def _nan_scale(state):
    state[f"{Q}.scales"][0, 1] = float("nan")


def _act_order(state):
    state[f"{Q}.g_idx"] = state[f"{Q}.g_idx"].flip(0)


BAD_TENSORS = [
    (lambda s: s.pop(f"{Q}.qzeros"), f"{Q}.qzeros: missing"),
    (lambda s: s.pop(f"{Q}.qweight"), f"{Q}.g_idx: no {Q}.qweight beside it"),
    (_nan_scale, f"{Q}.scales: non-finite scales"),
    (_act_order, f"{Q}.g_idx: act-order groups"),
    (lambda s: s.__setitem__(f"{Q}.qweight", s[f"{Q}.qweight"][:4]), f"{Q}.scales / qzeros"),
    (lambda s: s.__setitem__(f"{Q}.qweight", s[f"{Q}.qweight"].float()), f"{Q}.qweight: expected"),
    (
        lambda s: s.__setitem__(f"{Q}.scales", s[f"{Q}.scales"][:, :8].clone()),
        f"{Q}.scales: 8 output",
    ),
    (lambda s: s.__setitem__(f"{Q}.scales", s[f"{Q}.scales"].int()), f"{Q}.scales: expected a"),
]


@pytest.mark.parametrize(("fn", "message"), BAD_TENSORS)
@pytest.mark.parametrize("quantization", ["auto", "none"])
def test_malformed_packed_tensors_are_refused_naming_them(fn, message, quantization, tmp_path):
    packed, _ = make_packed_llama(tmp_path, "gptq", True)
    _edit(packed, fn)
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        tiny_llm(packed, quantization=quantization)
