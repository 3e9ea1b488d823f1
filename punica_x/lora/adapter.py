"""PEFT LoRA adapters: parse, validate against the base model, convert to the SGMV layout.

An adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors``. Every
check runs before anything is kept, so a refused adapter leaves nothing behind, and each
refusal is an AdapterError with a stable ``code`` and a message naming the offending field,
tensor or shape. Config fields other than the ones read here (e.g. ``auto_map``) are ignored.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from punica_x.dtypes import dtype_name
from punica_x.lora.edges import (
    EDGE,
    EDGE_BASE_KEY,
    EDGE_KEY,
    EDGE_MODULES,
    edge_digest,
    edge_groups,
)
from punica_x.lora.layout import GROUPS, to_sgmv_layout  # noqa: F401  (GROUPS: re-exported)
from punica_x.lora.peft_options import OptionError, PeftOptions, read_options
from punica_x.side_thread import on_side_thread

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PARENT = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
    "qkv_proj": "self_attn",  # fused modules of some families (LoraTarget.fused)
    "gate_up_proj": "mlp",
}
_KEY = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)\.weight$"
)
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Options that change what the adapter computes in ways this runner does not implement.
_UNSUPPORTED = {
    "layer_replication": "layer_replication",
    "trainable_token_indices": "trainable_token_indices",
    "target_parameters": "target_parameters",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
}


class AdapterError(ValueError):
    """A refused adapter. ``code`` is stable (frontends map it to API errors)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class LoraTarget:
    """What the base model offers an adapter: layer count and (in, out) of each projection;
    fused: the modules its family fuses, as the projections they hold in order (Phi-3:
    qkv_proj = q_proj|k_proj|v_proj): adapters name those instead of the projections, and an
    adapter on a fused module becomes one SGMV slice per projection (the same A, B's rows of
    that projection), exactly what PEFT computes on the fused module. family: its name."""

    num_layers: int
    shapes: dict[str, tuple[int, int]]
    fused: dict[str, tuple[str, ...]] = field(default_factory=dict)
    family: str = "llama"
    # (vocab, hidden) and the base weights' digests (edge_digest) for LoRA on embed_tokens /
    # lm_head; vocab 0: not offered
    vocab_size: int = 0
    hidden_size: int = 0
    edge_digests: dict[str, str] = field(default_factory=dict)

    @property
    def modules(self) -> tuple[str, ...]:
        """The module names an adapter of this base model may target."""
        inside = {m for parts in self.fused.values() for m in parts}
        edges = EDGE_MODULES if self.vocab_size else ()
        return tuple(m for m in TARGET_MODULES if m not in inside) + tuple(self.fused) + edges

    def shape(self, module: str) -> tuple[int, int]:
        """(in, out) of a module adapters target (a fused one's out: its projections'; the
        embedding's in is the vocabulary, as PEFT's lora_embedding_A [r, vocab] reads)."""
        if module == "embed_tokens":
            return self.vocab_size, self.hidden_size
        if module == "lm_head":
            return self.hidden_size, self.vocab_size
        parts = self.fused.get(module)
        if parts is None:
            return self.shapes[module]
        return self.shapes[parts[0]][0], sum(self.shapes[p][1] for p in parts)


@dataclass(frozen=True)
class LoraAdapter:
    """A validated adapter in SGMV layout (see punica_x.ops.sgmv).

    groups[g] = (a [L, R_g, h_in], b [L, sum_j r_j * h_out_j]) for each projection group with
    at least one targeted slice; ranks[g] = rank of each slice of g (0 = not targeted).
    LoRA on the edges: groups["embed"] = (A^T [vocab, r], B^T [r, hidden]) and
    groups["head"] = (A^T [hidden, r], B^T [r, vocab]), ranks (r,). scaling is folded into b.
    The tensors are in the serving dtype (load_peft_adapter's
    `dtype`), so nbytes is what the adapter costs the pool; stored_dtype is the dtype of the
    uploaded A/B tensors ("float16"; a comma list, sorted, when the file mixes dtypes:
    "bfloat16,float32")."""

    rank: int
    alpha: float
    scaling: float
    target_modules: tuple[str, ...]
    ranks: dict[str, tuple[int, ...]]
    groups: dict[str, tuple[torch.Tensor, torch.Tensor]]
    sha256: str
    stored_dtype: str

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.groups.values())

    def to(self, device: torch.device, non_blocking: bool = False) -> LoraAdapter:
        groups = {
            g: (a.to(device, non_blocking=non_blocking), b.to(device, non_blocking=non_blocking))
            for g, (a, b) in self.groups.items()
        }
        return replace(self, groups=groups)


def load_peft_adapter(
    path: str | Path, target: LoraTarget, max_rank: int, dtype: torch.dtype
) -> LoraAdapter:
    """Parse and validate the PEFT adapter at `path`; raises AdapterError. Its torch ops run on
    a thread of its own (punica_x.side_thread): a caller's long-lived worker thread would keep
    the OpenMP team they start and slow every step loop of the process."""
    return on_side_thread(_load_peft_adapter, path, target, max_rank, dtype)


def _load_peft_adapter(path, target: LoraTarget, max_rank: int, dtype: torch.dtype) -> LoraAdapter:
    folder = Path(path)
    if not folder.is_dir():
        raise AdapterError("not_found", f"adapter directory not found: {folder}")
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
    if pickles:
        raise AdapterError(
            "pickle_not_allowed",
            f"refusing pickle files {pickles}: upload {WEIGHTS_FILE} (safetensors) only",
        )
    config, config_bytes = _read_config(folder / CONFIG_FILE)
    rank, alpha, scaling = _check_config(config, max_rank)
    options = _options(config, rank, alpha, target, max_rank)
    weights_path = folder / WEIGHTS_FILE
    if not weights_path.is_file():
        raise AdapterError("missing_file", f"{WEIGHTS_FILE} not found in {folder}")
    weights_bytes = weights_path.read_bytes()
    tensors = _read_weights(weights_path, config, target, options)
    stored = ",".join(sorted({dtype_name(t.dtype) for t in tensors.values()}))
    declared = tuple(m for m in target.modules if any(k[1] == m for k in tensors))
    tensors = _split_fused(_scaled(tensors, options), target)
    modules = tuple(m for m in TARGET_MODULES if any(k[1] == m for k in tensors))
    ranks, groups = to_sgmv_layout(tensors, modules, target, dtype)
    edge_ranks, edge_tensors = edge_groups(tensors, dtype)
    ranks.update(edge_ranks)
    groups.update(edge_tensors)
    sha = hashlib.sha256(config_bytes)  # of config + NUL + weights, without joining their bytes
    sha.update(b"\0")
    sha.update(weights_bytes)
    top = max(t.shape[0] for (_, _, ab), t in tensors.items() if ab == "A")
    return LoraAdapter(top, alpha, scaling, declared, ranks, groups, sha.hexdigest(), stored)


def _options(config: dict, rank: int, alpha: float, target: LoraTarget, max_rank: int):
    """rank_pattern, alpha_pattern, layers_to_transform (punica_x/lora/peft_options.py)."""
    try:
        options = read_options(config, rank, alpha, target.num_layers)
    except OptionError as exc:
        raise AdapterError("bad_config", str(exc)) from None
    if options.max_rank > max_rank:
        raise AdapterError(
            "rank_too_large", f"rank {options.max_rank} exceeds max_lora_rank {max_rank}"
        )
    return options


def _read_config(path: Path) -> tuple[dict, bytes]:
    if not path.is_file():
        raise AdapterError("missing_file", f"{CONFIG_FILE} not found in {path.parent}")
    raw = path.read_bytes()
    try:
        config = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterError("bad_config", f"{CONFIG_FILE} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError("bad_config", f"{CONFIG_FILE} must hold a JSON object")
    return config, raw


def _check_config(config: dict, max_rank: int) -> tuple[int, float, float]:
    peft_type = config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise AdapterError(
            "unknown_peft_type", f"peft_type {peft_type!r} is not supported (LORA only)"
        )
    if config.get("use_dora"):
        raise AdapterError("dora_not_supported", "DoRA adapters (use_dora=true) are not supported")
    if config.get("modules_to_save"):
        raise AdapterError(
            "modules_to_save_not_supported",
            f"modules_to_save={config['modules_to_save']!r} would replace base-model "
            "modules per adapter; not supported",
        )
    bias = config.get("bias", "none")
    if bias != "none" or config.get("lora_bias"):
        raise AdapterError("bias_not_supported", f"bias={bias!r}: only bias='none' is supported")
    for key, what in _UNSUPPORTED.items():
        if config.get(key):
            raise AdapterError("unsupported_option", f"{what} is not supported")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError("bad_config", f"r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError("rank_too_large", f"rank {rank} exceeds max_lora_rank {max_rank}")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise AdapterError("bad_config", f"lora_alpha must be a finite number, got {alpha!r}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(alpha), float(scaling)


def _check_target_modules(targets, target: LoraTarget) -> None:
    if targets is None or isinstance(targets, str):
        return  # "all-linear" or a regex: the weights file decides what is targeted
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise AdapterError("bad_config", f"target_modules must be a list of names, got {targets!r}")
    unknown = sorted(set(targets) - set(target.modules))
    if unknown:
        raise AdapterError("unknown_module", f"unknown target modules {unknown}; {_offer(target)}")


def _offer(target: LoraTarget) -> str:
    """What an adapter of this base model may target, for refusals (names the family: an
    adapter made for another family targets other module names)."""
    return f"this {target.family} base model's modules are {', '.join(target.modules)}"


def _read_weights(path: Path, config: dict, target: LoraTarget, options: PeftOptions) -> dict:
    """{(layer, module, 'A'|'B'): tensor} with names, shapes and values checked."""
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterError(
            "bad_weights", f"{WEIGHTS_FILE} is not a valid safetensors file: {exc}"
        ) from None
    _check_target_modules(config.get("target_modules"), target)
    with handle as f:
        keys = list(f.keys())
        bases = [k for k in keys if EDGE_BASE_KEY.match(k)]
        for key in bases:
            _check_edge_base(key, f.get_tensor(key), target)
        parsed = {_parse_key(k, target): k for k in keys if k not in bases}
        _check_coverage(parsed, config, target, options.layers)
        tensors = {}
        for (layer, module, ab), key in parsed.items():
            t = f.get_tensor(key)
            h_in, h_out = target.shape(module)
            rank = options.rank(layer, module)
            want = (rank, h_in) if ab == "A" else (h_out, rank)
            if tuple(t.shape) != want:
                raise AdapterError(
                    "shape_mismatch",
                    f"{key}: shape {tuple(t.shape)} does not match "
                    f"the base model (expected {want} for rank {rank})",
                )
            if t.dtype not in _FLOAT_DTYPES:
                raise AdapterError(
                    "bad_weights", f"{key}: dtype {t.dtype} (want float16/bfloat16/float32)"
                )
            if not torch.isfinite(t).all():
                raise AdapterError("non_finite", f"{key} contains NaN or Inf values")
            tensors[(layer, module, ab)] = t
    return tensors


def _check_edge_base(key: str, t: torch.Tensor, target: LoraTarget) -> None:
    """PEFT's copy of the base embedding / head: refused unless it is the base model's."""
    module = "embed_tokens" if "embed_tokens" in key else "lm_head"
    want = target.edge_digests.get(module)
    same = (
        want is not None
        and tuple(t.shape) == (target.vocab_size, target.hidden_size)
        and t.dtype in _FLOAT_DTYPES
        and edge_digest(t) == want
    )
    if not same:
        raise AdapterError(
            "modules_to_save_not_supported",
            f"{key}: the adapter carries its own {module} weights, which differ from the base "
            "model's (a resized or retrained vocabulary); only LoRA deltas are served (save "
            "the adapter with save_embedding_layers=False if they are the base model's)",
        )


def _parse_key(key: str, target: LoraTarget) -> tuple[int, str, str]:
    edge = EDGE_KEY.match(key)
    if edge and target.vocab_size:
        module = edge.group(1) or edge.group(3)
        return EDGE, module, edge.group(2) or edge.group(4)
    m = _KEY.match(key)
    if not m:
        raise AdapterError(
            "unknown_module", f"unexpected tensor {key!r}: only LoRA A/B weights; {_offer(target)}"
        )
    layer, parent, module, ab = int(m.group(1)), m.group(2), m.group(3), m.group(4)
    if module not in target.modules or _PARENT.get(module) != parent:
        raise AdapterError("unknown_module", f"unexpected module in {key!r}; {_offer(target)}")
    if layer >= target.num_layers:
        raise AdapterError(
            "shape_mismatch",
            f"{key}: layer {layer} but the base model has {target.num_layers} layers",
        )
    return layer, module, ab


def _check_coverage(
    parsed: dict, config: dict, target: LoraTarget, layers: frozenset[int] | None
) -> None:
    """Every targeted module has A and B in every layer (in layers_to_transform's, when
    set, and in no other)."""
    modules = {m for _, m, _ in parsed}
    if not modules:
        raise AdapterError("bad_weights", f"{WEIGHTS_FILE} holds no LoRA weights")
    declared = config.get("target_modules")
    if isinstance(declared, list):
        extra = sorted(modules - set(declared))
        if extra:
            raise AdapterError(
                "bad_weights", f"weights for {extra} not in target_modules {declared}"
            )
        missing = sorted(set(declared) - modules)
        if missing:
            raise AdapterError("bad_weights", f"target_modules {missing} have no weights")
    wanted = range(target.num_layers) if layers is None else sorted(layers)
    for module in modules:
        for layer in [EDGE] if module in EDGE_MODULES else wanted:
            for ab in "AB":
                if (layer, module, ab) not in parsed:
                    raise AdapterError(
                        "bad_weights", f"missing lora_{ab} of {module} in layer {layer}"
                    )
    if layers is not None:
        outside = sorted({layer for layer, _, _ in parsed if layer != EDGE} - layers)
        if outside:
            raise AdapterError(
                "bad_weights", f"weights for layers {outside} outside layers_to_transform"
            )


def _split_fused(tensors: dict, target: LoraTarget) -> dict:
    """A fused module's A and B as each of its projections': the same A ([r, h_in]), and
    the rows of B ([h_out, r]) that compute that projection."""
    out = {}
    for (layer, module, ab), t in tensors.items():
        parts = target.fused.get(module)
        if parts is None:
            out[(layer, module, ab)] = t
            continue
        row = 0
        for part in parts:
            n = target.shapes[part][1]
            out[(layer, part, ab)] = t if ab == "A" else t[row : row + n]
            row += n
    return out


def _scaled(tensors: dict, options: PeftOptions) -> dict:
    """float32 tensors, each B scaled by its module's alpha over its rank (per layer and
    module: alpha_pattern, rank_pattern)."""
    return {
        (layer, module, ab): t.float() * (options.scaling(layer, module) if ab == "B" else 1.0)
        for (layer, module, ab), t in tensors.items()
    }
