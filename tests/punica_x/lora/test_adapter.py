"""Every adapter refusal: a clear AdapterError (stable code, message naming the problem),
nothing half-registered, and the runner keeps serving."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    make_peft_adapter,
    make_tiny_llama,
    plant_value,
    rewrite_config,
    tiny_llm,
    trojan_checkpoint,
)
from safetensors.torch import load_file, save_file

from punica_x import AdapterError, SamplingParams
from punica_x.lora.peft_checks import check_peft_header

SP = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir, tiny_adapters):
    llm = tiny_llm(tiny_model_dir, max_lora_rank=32)
    llm.load_adapter("good", str(tiny_adapters["r8"]))
    return llm


@pytest.fixture(scope="module")
def base(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


def refused(llm, path, code: str, match: str) -> None:
    """The runner refuses `path` with `code`, and so does the frontend's torch-free check of
    the same files (peft_checks.check_peft_header)."""
    header_check(llm, path, code)
    before = llm.generate(["hello world"], ["good"], SP)[0].token_ids
    with pytest.raises(AdapterError, match=match) as info:
        llm.load_adapter("bad", str(path))
    assert info.value.code == code
    assert "bad" not in llm.engine.adapters.names()
    with pytest.raises(AdapterError):  # a refused new version never replaces a good one
        llm.load_adapter("good", str(path))
    assert llm.generate(["hello world"], ["good"], SP)[0].token_ids == before


def header_check(llm, path, code: str | None) -> None:
    target, max_rank = llm.engine.adapters.target, llm.engine.config.lora.max_lora_rank
    if code is None:
        check_peft_header(path, target, max_rank)
        return
    with pytest.raises(AdapterError) as info:
        check_peft_header(path, target, max_rank)
    assert info.value.code == code, str(info.value)


def test_pickle_weights_refused_and_never_unpickled(llm, tiny_adapters, tmp_path):
    marker = tmp_path / "pwned"
    path = rewrite_config(tiny_adapters["r4"], tmp_path / "a")
    pickled = trojan_checkpoint(path / "adapter_model.safetensors", marker)
    (path / "adapter_model.bin").write_bytes(pickled)  # beside good safetensors weights
    refused(llm, path, "pickle_not_allowed", r"refusing pickle files \['adapter_model.bin'\]")
    (path / "adapter_model.bin").rename(path / "weights.pt")
    refused(llm, path, "pickle_not_allowed", "weights.pt")
    assert not marker.exists()


def test_pickle_renamed_to_safetensors_refused_and_never_unpickled(llm, tiny_adapters, tmp_path):
    marker = tmp_path / "pwned"
    path = rewrite_config(tiny_adapters["r4"], tmp_path / "a")
    weights = path / "adapter_model.safetensors"
    weights.write_bytes(trojan_checkpoint(weights, marker))
    refused(llm, path, "bad_weights", "not a valid safetensors file")
    assert not marker.exists()


def test_dora_refused(llm, base, tmp_path):
    path = make_peft_adapter(base, tmp_path / "dora", 8, ["q_proj"], seed=1, use_dora=True)
    refused(llm, path, "dora_not_supported", "DoRA")


def test_modules_to_save_refused(llm, base, tmp_path):
    path = make_peft_adapter(
        base, tmp_path / "mts", 8, ["q_proj"], seed=2, modules_to_save=["lm_head"]
    )
    refused(llm, path, "modules_to_save_not_supported", "modules_to_save")


def test_bias_refused(llm, base, tmp_path):
    path = make_peft_adapter(base, tmp_path / "bias", 8, ["q_proj"], seed=3, bias="lora_only")
    refused(llm, path, "bias_not_supported", "bias='lora_only'")


def test_unknown_peft_type_refused(llm, tiny_adapters, tmp_path):
    path = rewrite_config(tiny_adapters["r4"], tmp_path / "loha", peft_type="LOHA")
    refused(llm, path, "unknown_peft_type", "peft_type 'LOHA'")


def test_rank_above_max_refused(llm, tiny_adapters):
    refused(llm, tiny_adapters["r64"], "rank_too_large", "rank 64 exceeds max_lora_rank 32")


def test_shapes_of_another_model_refused(llm, tmp_path):
    from transformers import AutoModelForCausalLM

    other = make_tiny_llama(tmp_path / "other", hidden_size=32, intermediate_size=64)
    base = AutoModelForCausalLM.from_pretrained(other, dtype=torch.float32)
    path = make_peft_adapter(base, tmp_path / "x", 8, ["q_proj"], seed=4)
    refused(
        llm, path, "shape_mismatch", r"q_proj.lora_A.weight: shape \(8, 32\) .*expected \(8, 64\)"
    )


def test_unknown_module_refused(llm, base, tiny_adapters, tmp_path):
    path = rewrite_config(tiny_adapters["r4"], tmp_path / "fc1", target_modules=["q_proj", "fc1"])
    refused(llm, path, "unknown_module", r"unknown target modules \['fc1'\]")
    path = rewrite_config(tiny_adapters["r4"], tmp_path / "regex", target_modules=".*proj")
    weights = load_file(path / "adapter_model.safetensors")
    weights["base_model.model.model.layers.0.mlp.fc1.lora_A.weight"] = torch.zeros(4, 64)
    save_file(weights, path / "adapter_model.safetensors")
    refused(
        llm, path, "unknown_module", "unexpected module in 'base_model.model.model.layers.0.mlp.fc1"
    )


def test_non_finite_values_refused(llm, tiny_adapters, tmp_path):
    path = rewrite_config(tiny_adapters["r4"], tmp_path / "nan")
    weights = load_file(path / "adapter_model.safetensors")
    key = sorted(weights)[3]
    weights[key][0, 0] = float("nan")
    save_file(weights, path / "adapter_model.safetensors")
    refused(llm, path, "non_finite", "contains NaN or Inf")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), "max", "tiny"])
def test_values_are_checked_in_every_float_dtype(llm, tiny_adapters, tmp_path, dtype, value):
    """The runner's one pass over all values (adapter._all_finite, on the exponent bits)
    refuses NaN and +-Inf in each dtype, naming the tensor, and lets the largest finite
    value and a subnormal through, as torch.isfinite does; a mixed-dtype file too."""
    from punica_x.lora.adapter import load_peft_adapter

    path = rewrite_config(tiny_adapters["r4"], tmp_path / "a")
    weights = {k: t.to(dtype) for k, t in load_file(path / "adapter_model.safetensors").items()}
    names = sorted(weights)
    weights[names[0]] = weights[names[0]].float()  # another dtype beside it
    name = names[-2]
    plant_value(weights, name, dtype, value)
    save_file(weights, path / "adapter_model.safetensors")
    target, rank = llm.engine.adapters.target, llm.engine.config.lora.max_lora_rank
    if bool(torch.isfinite(weights[name]).all()):
        assert load_peft_adapter(path, target, rank, torch.float32).rank == 4
        return
    with pytest.raises(AdapterError, match="NaN or Inf") as info:
        load_peft_adapter(path, target, rank, torch.float32)
    assert info.value.code == "non_finite" and name in str(info.value)


def test_missing_files_and_bad_config_refused(llm, tiny_adapters, tmp_path):
    path = rewrite_config(tiny_adapters["r4"], tmp_path / "nofile")
    (path / "adapter_model.safetensors").unlink()
    refused(llm, path, "missing_file", "adapter_model.safetensors not found")
    path = rewrite_config(tiny_adapters["r4"], tmp_path / "json")
    (path / "adapter_config.json").write_text("{not json")
    refused(llm, path, "bad_config", "not valid JSON")
    path = rewrite_config(tiny_adapters["r4"], tmp_path / "rank", r="sixteen")
    refused(llm, path, "bad_config", "r must be a positive integer")
    path = rewrite_config(tiny_adapters["r4"], tmp_path / "pattern", rank_pattern={"q_proj": 2})
    refused(llm, path, "shape_mismatch", r"expected \(2, 64\) for rank 2")  # the file's is 4


def test_missing_layer_refused(llm, tiny_adapters, tmp_path):
    path = rewrite_config(tiny_adapters["r4"], tmp_path / "layer")
    weights = load_file(path / "adapter_model.safetensors")
    del weights["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"]
    save_file(weights, path / "adapter_model.safetensors")
    refused(llm, path, "bad_weights", "missing lora_B of v_proj in layer 1")


def test_rslora_scaling(tiny_model_dir, base, tmp_path):
    """use_rslora scales by alpha / sqrt(r), as PEFT does."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = make_peft_adapter(
        base, tmp_path / "rs", 16, ["q_proj", "down_proj"], seed=6, alpha=8, use_rslora=True
    )
    llm = tiny_llm(tiny_model_dir)
    info = llm.load_adapter("rs", str(path))
    assert info.rank == 16 and info.target_modules == ("q_proj", "down_proj")
    ids = llm.tokenizer.encode("the quick brown fox")
    ours = llm.generate(
        [ids], ["rs"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    )
    ref = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), path
    ).eval()
    x = torch.tensor([ids])
    out = ref.generate(
        x, attention_mask=torch.ones_like(x), max_new_tokens=12, min_new_tokens=12, do_sample=False
    )
    assert ours[0].token_ids == out[0, len(ids) :].tolist()


def _cast(src, dst, dtypes: dict[str, torch.dtype] | torch.dtype):
    """A copy of adapter `src` whose A/B tensors are saved in another dtype (one for all, or
    per tensor name; the rest stay as they are)."""
    path = rewrite_config(src, dst)
    weights = load_file(path / "adapter_model.safetensors")
    if isinstance(dtypes, torch.dtype):
        dtypes = dict.fromkeys(weights, dtypes)
    weights = {k: t.to(dtypes.get(k, t.dtype)).contiguous() for k, t in weights.items()}
    save_file(weights, path / "adapter_model.safetensors")
    return path


def test_stored_dtype_is_the_uploads_and_the_tensors_are_in_the_serving_dtype(
    tiny_model_dir, tiny_adapters, tmp_path
):
    """stored_dtype names what the file holds (a sorted comma list when it mixes dtypes);
    the SGMV tensors, and so nbytes and the pool's byte budget, are in the serving dtype:
    2 bytes an element in bfloat16 and float16, whatever the upload held."""
    from punica_x.config import LoraConfig, ModelConfig
    from punica_x.lora.adapter import LoraTarget, load_peft_adapter
    from punica_x.lora.pool import AdapterPool
    from punica_x.models.loader import describe_model

    dims = describe_model(ModelConfig(model=str(tiny_model_dir))).dims
    target = LoraTarget(dims.num_layers, dims.lora_shapes())
    f32 = tiny_adapters["r8"]
    f16 = _cast(f32, tmp_path / "f16", torch.float16)
    first_b = "base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"
    mixed = _cast(f32, tmp_path / "mixed", {first_b: torch.bfloat16})
    assert load_peft_adapter(f32, target, 64, torch.float32).stored_dtype == "float32"
    assert load_peft_adapter(f16, target, 64, torch.float32).stored_dtype == "float16"
    assert load_peft_adapter(mixed, target, 64, torch.float32).stored_dtype == "bfloat16,float32"
    served = {
        dtype: load_peft_adapter(f16, target, 64, dtype)
        for dtype in (torch.float32, torch.bfloat16, torch.float16)
    }
    numel = sum(a.numel() + b.numel() for a, b in served[torch.float32].groups.values())
    for dtype, adapter in served.items():
        assert {t.dtype for pair in adapter.groups.values() for t in pair} == {dtype}
        assert adapter.stored_dtype == "float16"
        assert adapter.nbytes == numel * dtype.itemsize
    for dtype in (torch.float32, torch.bfloat16):
        pool = AdapterPool(target, LoraConfig(), torch.device("cpu"), dtype)
        try:
            info = pool.register("x", f32)
            assert info.nbytes == numel * dtype.itemsize  # what the device budget charges
            ref = pool.acquire("x")
            pool.wait_ready(ref)
            assert pool.stats.device_bytes_used == numel * dtype.itemsize
            assert ref.weights.stored_dtype == "float32"  # kept through the load (.to)
            pool.release(ref)
        finally:
            pool.shutdown()


def test_digest_is_the_sha256_of_config_nul_weights(tiny_model_dir, tiny_adapters):
    """The adapter's sha256 is what a client computes from its two files (hashed without
    joining them in memory: an 8B model's adapters are hundreds of MB)."""
    import hashlib

    from punica_x.config import ModelConfig
    from punica_x.lora.adapter import LoraTarget, load_peft_adapter
    from punica_x.models.loader import describe_model

    dims = describe_model(ModelConfig(model=str(tiny_model_dir))).dims
    target = LoraTarget(dims.num_layers, dims.lora_shapes())
    folder = tiny_adapters["r16"]
    raw = (folder / "adapter_config.json").read_bytes()
    raw += b"\0" + (folder / "adapter_model.safetensors").read_bytes()
    got = load_peft_adapter(folder, target, 64, torch.float32).sha256
    assert got == hashlib.sha256(raw).hexdigest()


def test_sgmv_layout_puts_each_slice_at_its_top_rank_and_zero_pads():
    """Per group and layer: the targeted slices' A stacked at each slice's largest rank over
    the layers, B transposed and flattened slice after slice; a smaller rank or a layer
    without the module leaves zeros; rounded once to the serving dtype."""
    from types import SimpleNamespace

    from punica_x.lora.layout import to_sgmv_layout

    shapes = {"q_proj": (6, 6), "k_proj": (6, 2), "v_proj": (6, 2)}
    target = SimpleNamespace(num_layers=2, shapes=shapes)
    g = torch.Generator().manual_seed(3)
    qa0, qb0 = torch.randn(3, 6, generator=g), torch.randn(6, 3, generator=g)
    qa1, qb1 = torch.randn(1, 6, generator=g), torch.randn(6, 1, generator=g)
    va1, vb1 = torch.randn(2, 6, generator=g), torch.randn(2, 2, generator=g)
    tensors = {(0, "q_proj", "A"): qa0, (0, "q_proj", "B"): qb0}
    tensors |= {(1, "q_proj", "A"): qa1, (1, "q_proj", "B"): qb1}
    tensors |= {(1, "v_proj", "A"): va1, (1, "v_proj", "B"): vb1}
    ranks, groups = to_sgmv_layout(tensors, ("q_proj", "v_proj"), target, torch.bfloat16)
    assert ranks == {"qkv": (3, 0, 2)}
    a, b = groups["qkv"]
    assert a.shape == (2, 5, 6) and b.shape == (2, 3 * 6 + 2 * 2)
    want_a, want_b = torch.zeros(2, 5, 6), torch.zeros(2, 22)
    want_a[0, :3], want_a[1, :1], want_a[1, 3:5] = qa0, qa1, va1
    want_b[0, :18] = qb0.t().reshape(-1)
    want_b[1, :6] = qb1.t().reshape(-1)  # rank 1 of q's top 3: two zero rows follow
    want_b[1, 18:] = vb1.t().reshape(-1)
    assert torch.equal(a, want_a.to(torch.bfloat16)) and torch.equal(b, want_b.to(torch.bfloat16))
