"""The mixture-of-experts families (models/moe_families.py) against HF transformers + PEFT on
a tiny random model of each one's own config class: greedy tokens and prompt logprobs in
float32 for a batch mixing base rows with adapters on attention only, on attention + experts +
router (PEFT's target_parameters), on one expert stack at another rank, and with rank and
alpha patterns on the expert stacks (one layer at another rank); bf16 within its
rounding; both checkpoint layouts of the experts; the refusals."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    assert_matches_hf_fp32,
    assert_within_bf16_of_hf,
    make_peft_adapter,
    make_tiny_family,
    tiny_llm,
)
from transformers import AutoConfig

from punica_x import SamplingParams
from punica_x.models.llama import LlamaDims
from punica_x.models.moe import MoeBlock

PROMPTS = [
    "the quick brown fox",
    "hello world",
    "a mixture of experts routes every token to a few of its experts",
    "a multi tenant lora",
    "the router picks two experts",
    "and the last one",
]
ADAPTERS = [None, "experts", "attn", "experts", "down", "patterned"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EVERYTHING = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"]
_EXPERTS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
CASES = {
    # top-k weights normalized; layer 1 a dense MLP (mlp_only_layers); per-head q/k norms
    "qwen3_moe": dict(_EXPERTS, head_dim=32, norm_topk_prob=True, mlp_only_layers=[1]),
    # a shared expert gated by a sigmoid, q/k/v biases; weights not normalized
    "qwen2_moe": dict(_EXPERTS, shared_expert_intermediate_size=48, norm_topk_prob=False),
    # top-2 of 4, normalized, in float32; block_sparse_moe.experts.{e}.w1|w3|w2 on disk
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    # q / k norms over the whole projection; top-3 of 8 not normalized
    "olmoe": dict(num_experts=8, num_experts_per_tok=3),
}


@pytest.fixture(scope="module", params=list(CASES))
def moe_model(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    family = request.param
    folder = make_tiny_family(tmp_path_factory.mktemp(family), family, **CASES[family])
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    root = folder.parent
    adapters = {
        "attn": make_peft_adapter(base, root / "attn-lora", 8, ATTENTION, 3),
        "experts": make_peft_adapter(
            base, root / "experts-lora", 4, ["q_proj", "o_proj"], 4, target_parameters=EVERYTHING
        ),
        "down": make_peft_adapter(
            base, root / "down-lora", 6, ["k_proj"], 5, target_parameters=["down_proj"]
        ),
        # layer 0's down stack at rank 2, every gate|up stack at alpha 11, q at rank 6
        "patterned": make_peft_adapter(
            base,
            root / "patterned-lora",
            4,
            ["q_proj"],
            6,
            target_parameters=EVERYTHING[:2],
            rank_pattern={"model.layers.0.mlp.experts.down_proj": 2, "q_proj": 6},
            alpha_pattern={"experts.gate_up_proj": 11.0},
        ),
    }
    return family, folder, adapters


def test_the_registry_finds_the_family_and_its_experts(moe_model):
    family, folder, _ = moe_model
    dims = LlamaDims.from_hf_config(AutoConfig.from_pretrained(folder))
    spec = dims.moe
    assert dims.family == family and spec is not None
    assert spec.num_experts == CASES[family].get("num_experts", 4)
    assert spec.norm_topk == (family in ("qwen3_moe", "mixtral"))
    assert spec.float_weights == (family == "mixtral")
    assert (spec.shared_size > 0) == (family == "qwen2_moe")
    assert spec.sparse_layers == ((True, False) if family == "qwen3_moe" else (True, True))
    assert dims.qk_norm == (family == "qwen3_moe") and dims.qk_norm_full == (family == "olmoe")
    assert dims.attention_bias == (family in ("qwen2_moe",))
    model = tiny_llm(folder).engine.model
    kinds = [type(layer.mlp) is MoeBlock for layer in model.layers]
    assert kinds == list(spec.sparse_layers)


def test_greedy_tokens_and_logprobs_equal_hf_peft_in_float32(moe_model):
    """Base rows and the three adapters' rows in one batch: greedy tokens equal, every prompt
    token's logprob within 1e-4 of HF + PEFT's."""
    family, folder, adapters = moe_model
    llm = tiny_llm(folder)
    for name, path in adapters.items():
        llm.load_adapter(name, str(path))
    assert_matches_hf_fp32(llm, folder, adapters, PROMPTS, ADAPTERS, 12, family)


def test_the_batch_invariant_mode_holds_for_the_experts(moe_model):
    """batch_invariant=on: every prompt on every adapter (router and expert LoRA among them)
    gives the same tokens and logprob bits alone as in one batch with all the others. float32,
    where a changed order of additions shows in every logprob. Before the router's LoRA and
    the shared expert's gate ran a row at a time (ops.per_row), rows of the expert adapter
    differed in all four families, and base rows too in Qwen2-MoE."""
    family, folder, adapters = moe_model
    llm = tiny_llm(folder, batch_invariant="on")
    for name, path in adapters.items():
        llm.load_adapter(name, str(path))
    assert llm.engine.describe().batch_invariant
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)

    def result(out):
        return out.token_ids, [(lp.logprob, lp.top) for lp in out.logprobs]

    combos = [(p, a) for p in range(len(PROMPTS)) for a in sorted(set(ADAPTERS), key=str)]
    alone = {c: result(llm.generate([PROMPTS[c[0]]], [c[1]], sp)[0]) for c in combos}
    batch = llm.generate([PROMPTS[p] for p, _ in combos], [a for _, a in combos], sp)
    differ = [c for c, out in zip(combos, batch) if result(out) != alone[c]]
    assert not differ, (family, differ)


def test_prompt_logprobs_within_bf16_tolerance(moe_model):
    """The prompt's logprobs within bf16's rounding of HF + PEFT's float32 ones, as the mean
    over the prompt (tests/helpers.py: a flipped routing moves one position further)."""
    family, folder, adapters = moe_model
    assert_within_bf16_of_hf(folder, adapters, PROMPTS, ADAPTERS, family, routed=True)


def test_fused_expert_checkpoints_load_as_the_per_expert_ones(moe_model, tmp_path):
    """transformers 5's in-memory layout (mlp.experts.gate_up_proj [E, 2 I, H], down_proj
    [E, H, I]) saved as it is serves exactly what the per-expert checkpoint serves."""
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    family, folder, _ = moe_model
    fused = tmp_path / "fused"
    shutil.copytree(folder, fused)
    (fused / "model.safetensors").unlink()
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, str(fused / "model.safetensors"), metadata={"format": "pt"})
    from punica_x import SamplingParams

    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    want = tiny_llm(folder).generate(PROMPTS, None, sp)
    got = tiny_llm(fused).generate(PROMPTS, None, sp)
    for a, b in zip(want, got):
        assert a.token_ids == b.token_ids
        assert [x.logprob for x in a.logprobs] == [x.logprob for x in b.logprobs]


def test_a_checkpoint_missing_an_expert_is_refused(moe_model, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    family, folder, _ = moe_model
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    state = load_file(str(folder / "model.safetensors"))
    expert = "w2" if family == "mixtral" else "down_proj"
    dropped = [k for k in state if f"experts.1.{expert}" in k and "layers.0." in k]
    assert len(dropped) == 1
    del state[dropped[0]]
    save_file(state, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match="missing 1 tensors.*experts.1.down_proj"):
        tiny_llm(broken)


def test_an_adapter_on_the_dense_mlp_names_is_refused(moe_model, tiny_adapters):
    """A dense model's MLP adapter (gate_proj, up_proj, down_proj) on a MoE base: refused by
    name, the family's modules offered."""
    from punica_x.lora.adapter import AdapterError

    family, folder, _ = moe_model
    with pytest.raises(AdapterError, match=f"this {family} base model's modules are") as err:
        tiny_llm(folder).load_adapter("dense", str(tiny_adapters["r16"]))
    assert err.value.code in ("unknown_module", "shape_mismatch")


def _qwen3_moe(**changes):
    """A Qwen3-MoE config's fields with `changes`, past HF's own validation (its strict
    dataclass refuses some at assignment), as a hand-edited config.json would be read."""
    from types import SimpleNamespace

    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(num_hidden_layers=4, num_experts=8, num_experts_per_tok=2)
    return SimpleNamespace(**{**config.to_dict(), **changes})


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"num_experts_per_tok": 9}, "num_experts_per_tok 9 exceeds the 8 experts"),
        ({"num_experts_per_tok": 0}, "num_experts_per_tok must be a positive integer"),
        ({"num_experts": -1}, "num_experts must be a positive integer"),
        ({"num_experts": 2.5}, "num_experts must be a positive integer"),
        ({"num_experts": True}, "num_experts must be a positive integer"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step must be a positive integer"),
        ({"decoder_sparse_step": "2"}, "decoder_sparse_step must be a positive integer"),
        ({"moe_intermediate_size": -4}, "moe_intermediate_size must be a positive integer"),
        ({"shared_expert_intermediate_size": "48"}, "shared_expert_intermediate_size must be"),
        ({"mlp_only_layers": 3}, "mlp_only_layers must be a list of layer indices"),
        ({"mlp_only_layers": [1.5]}, "mlp_only_layers must be a list of layer indices"),
        ({"clip_qkv": 8.0}, "clip_qkv 8.0"),
    ],
)
def test_absurd_expert_configs_are_refused_by_name(changes, match):
    with pytest.raises(ValueError, match=match):
        LlamaDims.from_hf_config(_qwen3_moe(**changes))


def test_sparse_layers_follow_mlp_only_layers_and_the_sparse_step():
    spec = LlamaDims.from_hf_config(_qwen3_moe(decoder_sparse_step=2, mlp_only_layers=[3])).moe
    assert spec.sparse_layers == (False, True, False, False)


def test_the_upload_check_reads_an_expert_adapter_as_the_runner_does(moe_model):
    """check_peft_header (the frontend's, without torch values) and the runner's parse agree:
    the rank is each expert's r, not PEFT's r * E rows, and the expert parameters are named."""
    from punica_x.lora.adapter import load_peft_adapter
    from punica_x.lora.peft_checks import check_peft_header

    family, folder, adapters = moe_model
    target = tiny_llm(folder).engine.adapters.target
    summary = check_peft_header(adapters["experts"], target, 64)
    loaded = load_peft_adapter(adapters["experts"], target, 64, torch.float32)
    assert summary.rank == loaded.rank == 4
    assert summary.target_modules == loaded.target_modules
    assert summary.target_modules == (
        "q_proj",
        "o_proj",
        *("experts.gate_up_proj", "experts.down_proj", "gate"),
    )


def _rewritten(adapter, dst, config=None, tensors=None):
    """A copy of `adapter` with its config's fields and its tensors changed (tensors: a
    function of the {name: tensor} dict)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(adapter, dst)
    if config:
        cfg = json.loads((dst / "adapter_config.json").read_text())
        (dst / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
    if tensors:
        path = str(dst / "adapter_model.safetensors")
        save_file(tensors(load_file(path)), path)
    return dst


def _dropped(word):
    return lambda state: {k: v for k, v in state.items() if word not in k}


def _copied_to_layer_1(state):
    moved = {k.replace("layers.0.", "layers.1."): v.clone() for k, v in state.items()}
    return {**state, **moved}


REFUSALS = {
    "not a list": ({"target_parameters": "mlp.experts.gate_up_proj"}, None, "bad_config"),
    "not a name": ({"target_parameters": [3]}, None, "bad_config"),
    "unknown": ({"target_parameters": ["mlp.experts.up_proj"]}, None, "unknown_module"),
    "one layer": (
        {"target_parameters": ["model.layers.0.mlp.experts.gate_up_proj"]},
        None,
        "unknown_module",
    ),
    "no weights": (None, _dropped("mlp.experts"), "bad_weights"),
    "router not declared": ({"target_parameters": EVERYTHING[:2]}, None, "bad_weights"),
    "dense layer": (None, _copied_to_layer_1, "shape_mismatch"),
    "rank": ({"r": 2}, None, "shape_mismatch"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_bad_expert_adapters_are_refused_by_name(moe_model, tmp_path, case):
    """Each refusal an AdapterError with its code, at upload (check_peft_header) and on the
    runner alike; nothing of the adapter is kept."""

    family, folder, adapters = moe_model
    config, tensors, code = REFUSALS[case]
    if case == "dense layer" and family != "qwen3_moe":
        pytest.skip("only the qwen3_moe case has a dense layer (mlp_only_layers)")
    bad = _rewritten(adapters["experts"], tmp_path / "bad", config, tensors)
    llm = tiny_llm(folder)
    assert_refused_alike(llm, bad, code)
    assert "bad" not in llm.engine.adapters.names()


def test_an_expert_adapter_for_another_expert_count_is_refused(moe_model, tmp_path):
    """Made for 8 experts, loaded on Mixtral's 4 (or the other way): a shape mismatch naming
    the tensor, not a silently wrong expert split."""
    from transformers import AutoModelForCausalLM

    from punica_x.lora.adapter import AdapterError

    family, folder, _ = moe_model
    other = "olmoe" if family == "mixtral" else "mixtral"
    src = make_tiny_family(tmp_path / other, other, **CASES[other])
    base = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    foreign = make_peft_adapter(
        base, tmp_path / "foreign", 4, ["q_proj"], 1, target_parameters=EVERYTHING[:2]
    )
    with pytest.raises(AdapterError, match="experts") as err:
        tiny_llm(folder).load_adapter("foreign", str(foreign))
    assert err.value.code == "shape_mismatch"


def test_target_parameters_on_a_dense_base_is_refused(tiny_model_dir, tiny_adapters, tmp_path):
    from punica_x.lora.adapter import AdapterError

    bad = _rewritten(tiny_adapters["r4"], tmp_path / "bad", {"target_parameters": ["w"]})
    with pytest.raises(AdapterError, match="has no experts") as err:
        tiny_llm(tiny_model_dir).load_adapter("bad", str(bad))
    assert err.value.code == "unsupported_option"


def _per_expert_copy(src, dst, family: str, num_experts: int):
    """`src` (LoRA on both expert stacks, PEFT's target_parameters) rewritten as an older
    checkpoint names it: each expert's gate_proj / up_proj / down_proj (Mixtral: w1 / w3 /
    w2 under block_sparse_moe) with its own A [r, in] and B [out, r], the same function."""
    import json
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    names = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"} if family == "mixtral" else {}
    parent = "block_sparse_moe" if family == "mixtral" else "mlp"
    shutil.copytree(src, dst)
    state, out = load_file(str(src / "adapter_model.safetensors")), {}
    stacks = re.compile(r"^(.*\.layers\.\d+\.)mlp\.experts\.(base_layer\.)?lora_(A|B)\.weight$")
    for key, t in state.items():
        m = stacks.match(key)
        if m is None:
            out[key] = t
            continue
        projs = ("gate_proj", "up_proj") if m.group(2) else ("down_proj",)
        for e in range(num_experts):
            if m.group(3) == "A":  # [r * E, in]: expert e's rows
                part = t.view(num_experts, -1, t.shape[1])[e]
                pieces = {p: part for p in projs}
            else:  # [out, r * E] as [out, r, E]; gate|up's out is gate's rows then up's
                b = t.view(t.shape[0], -1, num_experts)[:, :, e]
                pieces = dict(zip(projs, b.chunk(len(projs))))
            for p, piece in pieces.items():
                name = f"{m.group(1)}{parent}.experts.{e}.{names.get(p, p)}.lora_{m.group(3)}"
                out[f"{name}.weight"] = piece.clone()
    save_file(out, str(dst / "adapter_model.safetensors"))
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg["target_modules"] = sorted(cfg["target_modules"]) + sorted(
        names.get(p, p) for p in ("gate_proj", "up_proj", "down_proj")
    )
    cfg["target_parameters"] = None
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


def _stacked_and_older(moe_model, tmp_path):
    """An adapter on both expert stacks (and q_proj), and its per-expert copy."""
    from transformers import AutoModelForCausalLM

    family, folder, _ = moe_model
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    stacked = make_peft_adapter(
        base, tmp_path / "stacked", 4, ["q_proj"], 8, target_parameters=EVERYTHING[:2]
    )
    experts = LlamaDims.from_hf_config(AutoConfig.from_pretrained(folder)).moe.num_experts
    return stacked, _per_expert_copy(stacked, tmp_path / "older", family, experts)


def test_older_per_expert_checkpoints_serve_what_their_stacks_do(moe_model, tmp_path):
    """The per-expert names of older PEFT checkpoints (Mixtral's w1 / w3 / w2) fold into the
    stacks' layout: an adapter rewritten in them gives HF + PEFT's tokens and logprobs for the
    stacked original, mixed with base rows."""
    family, folder, _ = moe_model
    stacked, older = _stacked_and_older(moe_model, tmp_path)
    llm = tiny_llm(folder)
    llm.load_adapter("older", str(older))
    prompts, names = PROMPTS[:3], ["older", None, "older"]
    assert_matches_hf_fp32(llm, folder, {"older": stacked}, prompts, names, 10, family)


def _no_expert_1(state):
    return {k: v for k, v in state.items() if ".experts.1." not in k}


def _expert_99(state):
    return {k.replace(".experts.0.", ".experts.99."): v for k, v in state.items()}


@pytest.mark.parametrize(
    "case, change, code",
    [
        ("an expert missing", dict(tensors=_no_expert_1), "bad_weights"),
        ("an expert the base lacks", dict(tensors=_expert_99), "shape_mismatch"),
        ("both formats", dict(config={"target_parameters": EVERYTHING[:2]}), "bad_weights"),
    ],
)
def test_bad_per_expert_checkpoints_are_refused(moe_model, tmp_path, case, change, code):
    family, folder, _ = moe_model
    stacked, older = _stacked_and_older(moe_model, tmp_path)
    if case == "both formats":  # the stacks' tensors beside the per-expert ones
        from safetensors.torch import load_file

        stacks = load_file(str(stacked / "adapter_model.safetensors"))
        change = dict(change, tensors=lambda state: {**state, **stacks})
    bad = _rewritten(older, tmp_path / "bad", change.get("config"), change.get("tensors"))
    assert_refused_alike(tiny_llm(folder), bad, code)


def assert_refused_alike(llm, bad, code: str) -> None:
    """`bad` refused with `code` at upload (check_peft_header) and on the runner alike."""
    from punica_x.lora.adapter import AdapterError
    from punica_x.lora.peft_checks import check_peft_header

    with pytest.raises(AdapterError) as upload:
        check_peft_header(bad, llm.engine.adapters.target, 64)
    with pytest.raises(AdapterError) as runner:
        llm.load_adapter("bad", str(bad))
    assert upload.value.code == runner.value.code == code, str(runner.value)
