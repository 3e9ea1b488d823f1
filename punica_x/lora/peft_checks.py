"""A PEFT adapter's checks that need no torch: its folder, adapter_config.json, and the names,
dtypes and shapes its safetensors header declares, against what the base model offers
(LoraTarget). Importing this module does not import torch.

load_peft_adapter (adapter.py) runs them before it reads the tensors (then checks the values
are finite and converts them); the frontend runs check_peft_header on an upload, which adds
the values' NaN / Inf check on their bits, to refuse it and learn its rank, modules, digest
and dtypes before a runner parses it once.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from punica_x.lora import expert_keys, safetensors_header
from punica_x.lora.edges import EDGE, EDGE_BASE_KEY, EDGE_KEY, EDGE_MODULES
from punica_x.lora.peft_errors import AdapterError
from punica_x.lora.peft_options import OptionError, PeftOptions, read_options
from punica_x.lora.safetensors_header import TensorEntry

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
# Options that change what the adapter computes in ways this runner does not implement.
_UNSUPPORTED = {
    "layer_replication": "layer_replication",
    "trainable_token_indices": "trainable_token_indices",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
}
FLOAT_DTYPES = ("float16", "bfloat16", "float32")


@dataclass(frozen=True)
class LoraTarget:
    """What the base model offers an adapter: layer count and (in, out) of each projection;
    fused: the modules its family fuses, as the projections they hold in order (Phi-3:
    qkv_proj = q_proj|k_proj|v_proj): adapters name those instead of the projections, and an
    adapter on a fused module becomes one SGMV slice per projection (the same A, B's rows of
    that projection), exactly what PEFT computes on the fused module. family: its name.
    A mixture of experts: num_experts (E), expert_shapes (in, out) of "experts.gate_up_proj",
    "experts.down_proj" and the router "gate" (lora/expert_keys.py), and sparse_layers, the
    layers that have experts."""

    num_layers: int
    shapes: dict[str, tuple[int, int]]
    fused: dict[str, tuple[str, ...]] = field(default_factory=dict)
    family: str = "llama"
    # (vocab, hidden) and the base weights' digests (edge_digest) for LoRA on embed_tokens /
    # lm_head; vocab 0: not offered
    vocab_size: int = 0
    hidden_size: int = 0
    edge_digests: dict[str, str] = field(default_factory=dict)
    num_experts: int = 0
    expert_shapes: dict[str, tuple[int, int]] = field(default_factory=dict)
    sparse_layers: tuple[bool, ...] = ()

    @property
    def modules(self) -> tuple[str, ...]:
        """The module names an adapter of this base model may target."""
        inside = {m for parts in self.fused.values() for m in parts}
        edges = EDGE_MODULES if self.vocab_size else ()
        offered = [m for m in TARGET_MODULES if m in self.shapes and m not in inside]
        return tuple(offered) + tuple(self.fused) + edges

    def shape(self, module: str) -> tuple[int, int]:
        """(in, out) of a module adapters target (a fused one's out: its projections'; the
        embedding's in is the vocabulary, as PEFT's lora_embedding_A [r, vocab] reads)."""
        if module == "embed_tokens":
            return self.vocab_size, self.hidden_size
        if module == "lm_head":
            return self.hidden_size, self.vocab_size
        if module in self.expert_shapes:
            return self.expert_shapes[module]
        if expert_keys.per_expert(module) is not None:
            return expert_keys.per_expert_shape(module, self.expert_shapes)
        parts = self.fused.get(module)
        if parts is None:
            return self.shapes[module]
        return self.shapes[parts[0]][0], sum(self.shapes[p][1] for p in parts)


@dataclass(frozen=True)
class AdapterSummary:
    """What the checks learn of an adapter without its values: its largest rank, the modules
    it targets (in the base model's order), the sha256 of config + NUL + weights, and the
    dtype(s) of its A/B tensors ("float16"; sorted and comma-joined when mixed). Equal to
    the same fields of load_peft_adapter's LoraAdapter."""

    rank: int
    target_modules: tuple[str, ...]
    sha256: str
    stored_dtype: str


@dataclass(frozen=True)
class Checked:
    """An adapter that passed every check but its values: its config (and the bytes it was
    read from), rank options, and per LoRA tensor (layer, module, "A"|"B") its key in the
    file; edge_bases: the keys of copies of the base embedding / head (checked by value)."""

    config: dict
    config_bytes: bytes
    alpha: float
    scaling: float
    options: PeftOptions
    tensors: dict[tuple[int, str, str], str]
    edge_bases: tuple[str, ...]


def check_peft_header(path: str | Path, target: LoraTarget, max_rank: int) -> AdapterSummary:
    """Every check of load_peft_adapter but the value of a copied base embedding / head, from
    the files' bytes: the safetensors header for names, dtypes and shapes, the values' bits
    for NaN and Inf (numpy); raises the AdapterError it would, in the same order."""
    folder = Path(path)
    weights = folder / WEIGHTS_FILE
    header: dict[str, TensorEntry] = {}

    def keys() -> list[str]:
        header.update(read_header(weights))
        return list(header)

    checked = check_files(folder, target, max_rank, keys)
    data = weights.read_bytes()
    declared = declared_modules(target, checked.tensors)
    for (layer, module, ab), key in checked.tensors.items():
        entry = header[key]
        want = expected_shape(target, checked.options, layer, module, ab)
        check_tensor(key, entry.dtype, entry.shape, want)
        if not entry.finite(data):
            raise AdapterError("non_finite", f"{key} contains NaN or Inf values")
    a_rows = [
        header[k].shape[0] // expert_factor(target, module)
        for (_, module, ab), k in checked.tensors.items()
        if ab == "A"
    ]
    dtypes = ",".join(sorted({header[k].dtype for k in checked.tensors.values()}))
    return AdapterSummary(max(a_rows), declared, digest(checked.config_bytes, data), dtypes)


def check_files(folder: Path, target: LoraTarget, max_rank: int, keys, check_base=None) -> Checked:
    """The folder, config and tensor names; `keys()` lists the weights file's tensor names
    (an AdapterError "bad_weights" when it is not a safetensors file); `check_base(key)`, when
    given, checks each copy of a base embedding / head before the other names are parsed."""
    if not folder.is_dir():
        raise AdapterError("not_found", f"adapter directory not found: {folder}")
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)
    if pickles:
        raise AdapterError(
            "pickle_not_allowed",
            f"refusing pickle files {pickles}: upload {WEIGHTS_FILE} (safetensors) only",
        )
    config, config_bytes = read_config(folder / CONFIG_FILE)
    rank, alpha, scaling = check_config(config, max_rank)
    options = check_options(config, rank, alpha, target, max_rank)
    if not (folder / WEIGHTS_FILE).is_file():
        raise AdapterError("missing_file", f"{WEIGHTS_FILE} not found in {folder}")
    names = list(keys())
    check_target_modules(config.get("target_modules"), target)
    parameters = expert_keys.targeted_parameters(
        config.get("target_parameters"), target.num_experts
    )
    bases = tuple(k for k in names if EDGE_BASE_KEY.match(k))
    for key in bases if check_base is not None else ():
        check_base(key)
    parsed = {parse_key(k, target, parameters): k for k in names if k not in bases}
    bare = sorted(set(parameters) - {m for _, m, _ in parsed})
    if bare:
        raise AdapterError("bad_weights", f"target_parameters {bare} have no weights")
    check_coverage(parsed, config, target, options.layers)
    return Checked(config, config_bytes, alpha, scaling, options, parsed, bases)


def read_header(path: Path) -> dict[str, TensorEntry]:
    """safetensors_header.read_header, its refusals as AdapterError "bad_weights"."""
    try:
        return safetensors_header.read_header(path)
    except (OSError, ValueError) as exc:
        raise AdapterError(
            "bad_weights", f"{WEIGHTS_FILE} is not a valid safetensors file: {exc}"
        ) from None


def expected_shape(
    target: LoraTarget, options: PeftOptions, layer: int, module: str, ab: str
) -> tuple[tuple[int, int], int]:
    """(the shape a LoRA tensor must have: A [rank, in], B [out, rank]; that rank)."""
    h_in, h_out = target.shape(module)
    rank = options.rank(layer, module)
    rows = rank * expert_factor(target, module)  # an expert stack's r of each expert
    return ((rows, h_in) if ab == "A" else (h_out, rows)), rank


def expert_factor(target: LoraTarget, module: str) -> int:
    """E for an expert stack's LoRA (A [r * E, in]), 1 for any other module's."""
    return target.num_experts if module in expert_keys.EXPERT_STACKS else 1


def declared_modules(target: LoraTarget, tensors) -> tuple[str, ...]:
    """The modules an adapter's tensors {(layer, module, ab): ...} target, in the base
    model's order, its expert parameters last."""
    present = {expert_keys.stack_of(k[1]) for k in tensors}  # per-expert modules: their stack
    return tuple(m for m in target.modules + expert_keys.EXPERT_MODULES if m in present)


def check_tensor(key: str, dtype: str, shape: tuple[int, ...], want) -> None:
    """A LoRA tensor's shape against expected_shape's `want` and its dtype (as torch names
    it: "float16")."""
    (expected, rank) = want
    if tuple(shape) != expected:
        raise AdapterError(
            "shape_mismatch",
            f"{key}: shape {tuple(shape)} does not match "
            f"the base model (expected {expected} for rank {rank})",
        )
    if dtype not in FLOAT_DTYPES:
        raise AdapterError(
            "bad_weights", f"{key}: dtype torch.{dtype} (want float16/bfloat16/float32)"
        )


def digest(config_bytes: bytes, weights_bytes: bytes) -> str:
    """sha256 of config + NUL + weights, without joining their bytes."""
    sha = hashlib.sha256(config_bytes)
    sha.update(b"\0")
    sha.update(weights_bytes)
    return sha.hexdigest()


def check_options(config: dict, rank: int, alpha: float, target: LoraTarget, max_rank: int):
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


def read_config(path: Path) -> tuple[dict, bytes]:
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


def check_config(config: dict, max_rank: int) -> tuple[int, float, float]:
    """(rank, alpha, scaling) of a LoRA config this runner serves; AdapterError otherwise."""
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


def check_target_modules(targets, target: LoraTarget) -> None:
    if targets is None or isinstance(targets, str):
        return  # "all-linear" or a regex: the weights file decides what is targeted
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise AdapterError("bad_config", f"target_modules must be a list of names, got {targets!r}")
    offered = set(target.modules) | (set(expert_keys.PER_EXPERT) if target.num_experts else set())
    unknown = sorted(set(targets) - offered)
    if unknown:
        raise AdapterError("unknown_module", f"unknown target modules {unknown}; {offer(target)}")


def offer(target: LoraTarget) -> str:
    """What an adapter of this base model may target, for refusals (names the family: an
    adapter made for another family targets other module names)."""
    experts = f"; {expert_keys.offered(target.num_experts)}" if target.num_experts else ""
    return f"this {target.family} base model's modules are {', '.join(target.modules)}{experts}"


def parse_key(key: str, target: LoraTarget, parameters: tuple[str, ...] = ()):
    """(layer, module, "A"|"B") of one LoRA tensor name; parameters: the expert parameters
    the config's target_parameters names (expert_keys.targeted_parameters)."""
    expert = expert_keys.parse(key, parameters, target.num_experts) if target.num_experts else None
    if expert is not None:
        layer, module, ab = expert
        if layer >= target.num_layers or not target.sparse_layers[layer]:
            raise AdapterError(
                "shape_mismatch", f"{key}: layer {layer} of the base model has no experts"
            )
        return layer, module, ab
    edge = EDGE_KEY.match(key)
    if edge and target.vocab_size:
        module = edge.group(1) or edge.group(3)
        return EDGE, module, edge.group(2) or edge.group(4)
    m = _KEY.match(key)
    if not m:
        raise AdapterError(
            "unknown_module", f"unexpected tensor {key!r}: only LoRA A/B weights; {offer(target)}"
        )
    layer, parent, module, ab = int(m.group(1)), m.group(2), m.group(3), m.group(4)
    if module not in target.modules or _PARENT.get(module) != parent:
        raise AdapterError("unknown_module", f"unexpected module in {key!r}; {offer(target)}")
    if layer >= target.num_layers:
        raise AdapterError(
            "shape_mismatch",
            f"{key}: layer {layer} but the base model has {target.num_layers} layers",
        )
    return layer, module, ab


def check_coverage(
    parsed: dict, config: dict, target: LoraTarget, layers: frozenset[int] | None
) -> None:
    """Every targeted module has A and B in every layer (in layers_to_transform's, when
    set, and in no other)."""
    modules = {m for _, m, _ in parsed}
    if not modules:
        raise AdapterError("bad_weights", f"{WEIGHTS_FILE} holds no LoRA weights")
    expert_keys.check_every_expert(modules, target.num_experts)
    declared = config.get("target_modules")
    names = {expert_keys.declared_name(m) for m in modules}
    if isinstance(declared, list):
        declared = declared + sorted(names & set(expert_keys.EXPERT_MODULES))
        extra = sorted(names - set(declared))
        if extra:
            raise AdapterError(
                "bad_weights", f"weights for {extra} not in target_modules {declared}"
            )
        missing = sorted(set(declared) - names)
        if missing:
            raise AdapterError("bad_weights", f"target_modules {missing} have no weights")
    wanted = range(target.num_layers) if layers is None else sorted(layers)
    for module in modules:
        where = [EDGE] if module in EDGE_MODULES else wanted
        for layer in expert_keys.layers_of(where, module, target.sparse_layers):
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
