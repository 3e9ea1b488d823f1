"""PEFT's per-module options of a LoRA config: `rank_pattern` and `alpha_pattern` (a module's
own rank and alpha) and `layers_to_transform` (adapters on a subset of layers), read as PEFT
applies them (peft.tuners.lora.LoraModel._create_and_replace, peft.utils.other.get_pattern_key),
and validated as hostile input.

PEFT matches a pattern key against a module's name ("model.layers.3.self_attn.q_proj") as
the regular expression `(.*\\.)?(KEY)$`. A tenant's regular expression would run in this
server (and may backtrack for ever), so keys are taken as module names or dotted suffixes of
them: letters, digits, `_` and `.` only (what PEFT users write: "q_proj",
"model.layers.3.self_attn.q_proj"), matched as PEFT matches them; any other key is refused."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

MAX_PATTERNS = 1024
MAX_KEY_CHARS = 256
_KEY = re.compile(r"^[A-Za-z0-9_.]+$")


class OptionError(ValueError):
    """A refused option (the adapter parser turns it into AdapterError "bad_config")."""


@dataclass(frozen=True)
class PeftOptions:
    """r and alpha: the config's defaults; ranks / alphas: the patterns (name or dotted
    suffix -> value), first match wins as in PEFT; layers: the layers adapters are on (None:
    all); rslora: scaling alpha / sqrt(r) instead of alpha / r."""

    r: int
    alpha: float
    rslora: bool = False
    ranks: dict[str, int] = field(default_factory=dict)
    alphas: dict[str, float] = field(default_factory=dict)
    layers: frozenset[int] | None = None

    def rank(self, layer: int, module: str) -> int:
        return _match(self.ranks, _name(layer, module), self.r)

    def scaling(self, layer: int, module: str) -> float:
        """The scale of module's B in `layer`: its alpha over its rank (or its square root)."""
        r, alpha = self.rank(layer, module), _match(self.alphas, _name(layer, module), self.alpha)
        return alpha / math.sqrt(r) if self.rslora else alpha / r

    @property
    def max_rank(self) -> int:
        return max([self.r, *self.ranks.values()])


def read_options(config: dict, r: int, alpha: float, num_layers: int) -> PeftOptions:
    """The options of `config` (r, alpha: its validated defaults); OptionError naming the
    field when one is malformed."""
    ranks = _patterns(config.get("rank_pattern"), "rank_pattern", _positive_int)
    alphas = _patterns(config.get("alpha_pattern"), "alpha_pattern", _finite)
    layers = config.get("layers_to_transform")
    if layers is not None:
        layers = [layers] if isinstance(layers, int) and not isinstance(layers, bool) else layers
        if (
            not isinstance(layers, list)
            or not layers
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers)
            or not all(0 <= i < num_layers for i in layers)
        ):
            raise OptionError(
                f"layers_to_transform must be layer indices in [0, {num_layers}), "
                f"got {config.get('layers_to_transform')!r}"
            )
        layers = frozenset(layers)
    return PeftOptions(r, alpha, bool(config.get("use_rslora")), ranks, alphas, layers)


def _patterns(value, name: str, convert) -> dict:
    if value is None or value == {}:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_PATTERNS:
        raise OptionError(f"{name} must be an object of at most {MAX_PATTERNS} entries")
    out = {}
    for key, v in value.items():
        if not isinstance(key, str) or len(key) > MAX_KEY_CHARS or not _KEY.match(key):
            raise OptionError(
                f"{name} key {str(key)[:64]!r}: module names or dotted suffixes of them "
                "(letters, digits, '_', '.') only; regular expressions are not accepted"
            )
        out[key] = convert(v, f"{name}[{key!r}]")
    return out


def _positive_int(v, what: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise OptionError(f"{what} must be a positive integer, got {v!r}")
    return v


def _finite(v, what: str) -> float:
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise OptionError(f"{what} must be a finite number, got {v!r}")
    return float(v)


def _name(layer: int, module: str) -> str:
    """A projection's module name in the base model, as PEFT matches patterns against it
    (layer -1: the embedding and the LM head, outside the layers)."""
    if layer < 0:
        return "model.embed_tokens" if module == "embed_tokens" else module
    mlp = ("gate_proj", "up_proj", "down_proj", "gate_up_proj", "gate")  # gate: a router
    parent = "mlp" if module in mlp or module.startswith("experts.") else "self_attn"
    return f"model.layers.{layer}.{parent}.{module}"


def _match(patterns: dict, name: str, default):
    """PEFT's get_pattern_key: the first key whose `(.*\\.)?(KEY)$` matches `name` (keys
    are plain names here, so '.' is the only metacharacter, as in PEFT's own use)."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default
