"""GGUF files read natively: the tensors as the file stores them, without a float copy.

Projections and the embedding / LM head in a block format the CPU kernels serve (Q4_0, Q4_1,
Q8_0: ops.quant_dense) stay in their blocks; Q4_K, Q5_K, Q6_K, Q5_0 and Q5_1 are repacked
into those formats at load (models.kquants); float tensors (F32, F16, BF16: norms, or a
16-bit file) load as tensors; any other type (Q2_K, Q3_K, IQ-quants, ...) is dequantized
once with the `gguf` package, and the loader says which. Config and tokenizer come from the file's
metadata through transformers (a small cached directory, no weights in it).

Only llama-architecture files (Llama, Mistral, SmolLM) are read natively: their converter
permutes the rows of attn_q / attn_k for llama.cpp's RoPE, and this reader undoes that on the
blocks' rows, which is exact (a row of blocks moves as a whole). Other architectures keep the
dequantizing path (models.loader.convert_gguf).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from punica_x.models import gguf_header, kquants
from punica_x.models.cache_entry import building
from punica_x.ops.quant_dense import FORMAT_BY_TYPE, QuantBlocks

log = logging.getLogger(__name__)

NATIVE_ARCHITECTURES = ("llama",)
_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
# tensors a llama file may carry that the model computes itself (RoPE scaling factors)
_SKIPPED = ("rope_freqs.weight",)
_FLOATS = {"F32": np.float32, "F16": np.float16}


def architecture(path: Path) -> str:
    """The file's general.architecture ("" where it has none), from its header
    (models.gguf_header). ValueError naming the file for a header that is not GGUF version 2
    or 3, is cut short or is malformed."""
    values = gguf_header.read_header(path, ("general.architecture",)).values
    return str(values.get("general.architecture", ""))


def is_native(path: Path) -> bool:
    """Whether this reader serves `path` (a llama-architecture GGUF file)."""
    return architecture(path) in NATIVE_ARCHITECTURES


def hf_name(name: str) -> str | None:
    """The HF checkpoint name of a GGUF tensor name; None for one the model does not take."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    m = _BLK.match(name)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's permutation of q / k rows ([out, ...], out = heads x head_dim): within
    each head, rows (0, 2, 4, ..., 1, 3, ...) back to (0, 1, 2, ...) (transformers'
    reverse_permute_weights on whole rows)."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def read_tensors(path: Path, heads: int, kv_heads: int) -> Iterator[tuple[str, object]]:
    """(HF name, torch tensor or QuantBlocks) for every tensor of the file the model takes.
    ValueError naming the tensor for an unknown name or a malformed tensor."""
    from gguf import GGMLQuantizationType, quants

    header = gguf_header.read_header(path)
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    dequantized: dict[str, int] = {}
    repacked: dict[str, int] = {}
    for t in header.tensors:
        if t.name in _SKIPPED:
            continue
        name = hf_name(t.name)
        if name is None:
            raise ValueError(f"unexpected tensor {t.name!r} in {path.name}")
        kind = GGMLQuantizationType(t.ggml_type)
        data = gguf_header.tensor_data(mapped, t)
        cols = t.dims[0]  # ggml order: ne[0] is the row length (in)
        if ".attn_q." in t.name or ".attn_k." in t.name:
            data = unpermute_rows(data, heads if ".attn_q." in t.name else kv_heads)
        if kind.name in _FLOATS or kind == GGMLQuantizationType.BF16:
            value = torch.from_numpy(np.array(quants.dequantize(data, kind), dtype=np.float32))
        elif kind in FORMAT_BY_TYPE:
            rows = data.reshape(-1, data.shape[-1])
            value = QuantBlocks(t.name, FORMAT_BY_TYPE[kind], torch.from_numpy(rows.copy()), cols)
        elif kind.name in kquants.REPACKED:
            repacked[kind.name] = repacked.get(kind.name, 0) + 1
            value = kquants.repack(t.name, kind.name, data.reshape(-1, data.shape[-1]), cols)
        else:
            dequantized[kind.name] = dequantized.get(kind.name, 0) + 1
            value = torch.from_numpy(np.array(quants.dequantize(data, kind), dtype=np.float32))
        if isinstance(value, torch.Tensor) and not torch.isfinite(value).all():
            raise ValueError(f"{t.name}: non-finite values in {path.name}")
        yield name, value
    if repacked:
        log.info(
            "%s: %s repacked at load into Q4_1 / Q8_0 blocks (models.kquants)",
            path.name,
            ", ".join(f"{n} x{c}" for n, c in sorted(repacked.items())),
        )
    if dequantized:
        log.warning(
            "%s: tensors in %s are dequantized at load (no native kernel for them yet)",
            path.name,
            ", ".join(f"{n} x{c}" for n, c in sorted(dequantized.items())),
        )


def meta_dir(gguf: Path, sha: str, cache: Path) -> Path:
    """A cached HF directory with the file's config, generation config and tokenizer (no
    weights): what AutoConfig / AutoTokenizer read, built atomically on first use."""
    target = cache / f"{gguf.stem}-{sha[:16]}-meta"
    if (target / "config.json").exists():
        return target
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    with building(target) as tmp:
        data = config.to_dict()
        data.pop("quantization_config", None)
        data["architectures"] = [_CAUSAL_LM.get(config.model_type, "LlamaForCausalLM")]
        (tmp / "config.json").write_text(json.dumps(data, indent=2))
        GenerationConfig.from_model_config(config).save_pretrained(tmp)
        tok.save_pretrained(tmp)
    return target


_CAUSAL_LM = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}
