"""PEFT LoRA adapters: parse, validate against the base model, convert to the SGMV layout.

An adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors``. The
checks that need no tensor values are peft_checks.py's (the frontend runs them alone on an
upload); here the values are read, checked finite and converted. Every check runs before
anything is kept, so a refused adapter leaves nothing behind, and each
refusal is an AdapterError with a stable ``code`` and a message naming the offending field,
tensor or shape. Config fields other than the ones read here (e.g. ``auto_map``) are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from punica_x.dtypes import dtype_name
from punica_x.lora.edges import edge_digest, edge_groups
from punica_x.lora.expert_layout import to_expert_layout
from punica_x.lora.layout import GROUPS, to_sgmv_layout  # noqa: F401  (GROUPS: re-exported)
from punica_x.lora.peft_checks import (  # noqa: F401  (re-exported: the adapter's vocabulary)
    CONFIG_FILE,
    PICKLE_SUFFIXES,
    TARGET_MODULES,
    WEIGHTS_FILE,
    AdapterError,
    Checked,
    LoraTarget,
    check_files,
    check_tensor,
    declared_modules,
    digest,
    expected_shape,
    expert_factor,
)
from punica_x.lora.peft_options import PeftOptions
from punica_x.side_thread import on_side_thread

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class LoraAdapter:
    """A validated adapter in SGMV layout (see punica_x.ops.sgmv).

    groups[g] = (a [L, R_g, h_in], b [L, sum_j r_j * h_out_j]) for each projection group with
    at least one targeted slice; ranks[g] = rank of each slice of g (0 = not targeted).
    LoRA on the edges: groups["embed"] = (A^T [vocab, r], B^T [r, hidden]) and
    groups["head"] = (A^T [hidden, r], B^T [r, vocab]), ranks (r,). LoRA on a mixture of
    experts: groups "experts.gate_up_proj", "experts.down_proj" and "gate" (lora/expert_layout.py).
    scaling is folded into b.
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
    weights_path = folder / WEIGHTS_FILE
    with _SafetensorsFile(weights_path) as f:
        checked = check_files(
            folder, target, max_rank, f.keys, lambda key: _check_edge_base(key, f, target)
        )
        tensors = _read_tensors(f, checked, target)
    stored = ",".join(sorted({dtype_name(t.dtype) for t in tensors.values()}))
    declared = declared_modules(target, tensors)
    tensors = _split_fused(_scaled(tensors, checked.options), target)
    modules = tuple(m for m in TARGET_MODULES if any(k[1] == m for k in tensors))
    ranks, groups = to_sgmv_layout(tensors, modules, target, dtype)
    edge_ranks, edge_tensors = edge_groups(tensors, dtype)
    ranks.update(edge_ranks)
    groups.update(edge_tensors)
    expert_ranks, expert_tensors = to_expert_layout(tensors, target, dtype)
    ranks.update(expert_ranks)
    groups.update(expert_tensors)
    sha = digest(checked.config_bytes, weights_path.read_bytes())
    top = max(
        t.shape[0] // expert_factor(target, m) for (_, m, ab), t in tensors.items() if ab == "A"
    )
    return LoraAdapter(top, checked.alpha, checked.scaling, declared, ranks, groups, sha, stored)


class _SafetensorsFile:
    """The weights file, opened when check_files first lists its keys (after the folder and
    config checks, as they come first); closed on exit."""

    def __init__(self, path: Path) -> None:
        self.path, self.handle, self.f = path, None, None

    def keys(self) -> list[str]:
        try:
            self.handle = safe_open(str(self.path), framework="pt", device="cpu")
        except (SafetensorError, OSError, ValueError) as exc:
            raise AdapterError(
                "bad_weights", f"{WEIGHTS_FILE} is not a valid safetensors file: {exc}"
            ) from None
        self.f = self.handle.__enter__()
        return list(self.f.keys())

    def get_tensor(self, key: str) -> torch.Tensor:
        return self.f.get_tensor(key)

    def __enter__(self) -> _SafetensorsFile:
        return self

    def __exit__(self, *exc) -> None:
        if self.handle is not None:
            self.handle.__exit__(*exc)


def _read_tensors(f: _SafetensorsFile, checked: Checked, target: LoraTarget) -> dict:
    """{(layer, module, 'A'|'B'): tensor}, each checked: shape, dtype, finite values. The
    values are checked all at once (_all_finite); only a file holding a NaN or Inf is checked
    tensor by tensor, so the error is the one the first bad tensor gives, as check_peft_header
    finds it."""
    tensors = {where: f.get_tensor(key) for where, key in checked.tensors.items()}
    finite = _all_finite(list(tensors.values()))
    for where, key in checked.tensors.items():
        t = tensors[where]
        want = expected_shape(target, checked.options, *where)
        check_tensor(key, str(t.dtype).removeprefix("torch."), tuple(t.shape), want)
        if not finite and not torch.isfinite(t).all():
            raise AdapterError("non_finite", f"{key} contains NaN or Inf values")
    return tensors


# a float is NaN or Inf when its exponent bits are all set: (the values' integer view, them)
_EXPONENT = {
    torch.float16: (torch.int16, 0x7C00),
    torch.bfloat16: (torch.int16, 0x7F80),
    torch.float32: (torch.int32, 0x7F800000),
}


def _all_finite(tensors: list[torch.Tensor]) -> bool:
    """No NaN or Inf in any of them: one pass over each dtype's values, concatenated (an
    adapter has hundreds of small tensors; one isfinite each cost more than the rest of its
    parse)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t.reshape(-1))
    for dtype, parts in by_dtype.items():
        flat = torch.cat(parts)
        if dtype in _EXPONENT:
            view, exponent = _EXPONENT[dtype]
            if bool(((flat.view(view) & exponent) == exponent).any()):
                return False
        elif flat.is_floating_point() and not bool(torch.isfinite(flat).all()):
            return False
    return True


def _check_edge_base(key: str, f: _SafetensorsFile, target: LoraTarget) -> None:
    """PEFT's copy of the base embedding / head: refused unless it is the base model's."""
    t = f.get_tensor(key)
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
        (layer, module, ab): t.float().mul_(options.scaling(layer, module))
        if ab == "B"
        else t.float()
        for (layer, module, ab), t in tensors.items()
    }
