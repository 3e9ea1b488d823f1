"""The batch-invariant mode's decision for a model being loaded (punica_x.ops.invariance):
from ModelConfig.batch_invariant, the device and dtype, the dense and fused backends a user
named, and for ``auto`` the timings of the dense backends and the SGMV kernels' two orders on
the model's own shapes.

``auto`` decides once per CPU model and kernel build (autotune's fingerprint) and model
shapes: the first start times the kernels while the machine is quiet (ops.quiet: it waits up
to $PUNICA_X_QUIET_WAIT seconds, 5 by default, for other processes to leave the CPUs) and
keeps the figures beside the kernels' timings; every later start reads them, so the same
server computes the same bits whatever the machine was doing when it started. Figures taken
under load (the wait ran out) are kept as provisional: later starts use them too, and the
first quiet one measures again. `punica-x prepare --remeasure-invariance` forgets the
decisions and measures again."""

from __future__ import annotations

import datetime
import hashlib
import importlib.util
import logging
from collections import Counter

import torch

from punica_x.config import ModelConfig, dtype_name
from punica_x.env import DENSE_BACKEND, FUSED_BACKEND, QUIET_WAIT
from punica_x.ops import autotune, quiet
from punica_x.ops import isa as isa_mod
from punica_x.ops.dense import tune_dense
from punica_x.ops.invariance import Invariance, decide, relative_cost
from punica_x.ops.registry import CPU_KERNEL_DTYPES, TRITON_DTYPES
from punica_x.ops.sgmv import order_timings

log = logging.getLogger("punica_x.invariance")
DECISIONS = "invariance:"  # the autotune cache's keys of kept decisions


def choose_invariance(
    cfg: ModelConfig, model, device: torch.device, dtype: torch.dtype
) -> Invariance:
    """The decision for `model` (a LlamaForCausalLM whose checkpoint is in, before
    finish_loading), logged; ValueError for batch_invariant=on where it cannot hold."""
    named = {
        "dense": cfg.dense_backend or DENSE_BACKEND.get() or None,
        "fused": cfg.fused_backend or FUSED_BACKEND.get() or None,
    }
    if device.type == "cuda":
        kernels = importlib.util.find_spec("triton") is not None and dtype in TRITON_DTYPES
    else:
        kernels = device.type == "cpu" and dtype in CPU_KERNEL_DTYPES and isa_mod.tuned()
    kept: dict = {}

    def cost() -> dict[str, float]:
        kept.update(measured_cost(model, device, dtype))
        return dict(sorted(kept["parts"].items(), key=lambda kv: kv[0].lower()))  # as told

    invariance = decide(cfg.batch_invariant, device.type, kernels, named, cost)
    if kept:
        note = f"{invariance.reason}; {provenance(kept)}"
        invariance = Invariance(invariance.on, note, invariance.cost)
    log.info("batch invariance: %s", invariance.reason)
    return invariance


def measured_cost(model, device: torch.device, dtype: torch.dtype) -> dict:
    """{"parts": {part: cost fraction}, "quiet", "busy", "measured", "cached"}: the kept
    figures of this model's shapes on this machine and kernel build, or measured now (on a
    quiet machine where it gets quiet within quiet_wait_s()) and kept."""
    key = decision_key(model, dtype)
    entry = autotune.recall(key)
    if entry is not None and (entry["quiet"] or not quiet.is_quiet(quiet.others_busy())):
        return {**entry, "cached": True}
    busy = quiet.wait_for_quiet(quiet_wait_s())
    entry = {
        "parts": part_costs(model, device, dtype, fresh=True),
        "quiet": quiet.is_quiet(busy),
        "busy": None if busy is None else round(busy, 3),
        "measured": datetime.datetime.now().isoformat(timespec="seconds"),
    }
    if autotune.enabled():  # timing off: nothing was measured, nothing to keep
        autotune.remember(key, entry)
    return {**entry, "cached": False}


def part_costs(model, device: torch.device, dtype: torch.dtype, fresh: bool) -> dict:
    """The mode's cost fraction on the model's dense projections and LoRA (relative_cost)."""
    timings = []
    for (n, k, rows), count in Counter(model.float_dense_shapes()).items():
        tuned = tune_dense(device, dtype, n, k, rows, fresh=fresh)
        timings.append((count, tuned.timings_ms if tuned else {}))
    lora = order_timings(model.dims.lora_shapes(), dtype, fresh=fresh)
    return {"dense projections": relative_cost(timings), "LoRA": relative_cost(lora)}


def decision_key(model, dtype: torch.dtype) -> str:
    """The kept decision's key: the model's timed shapes and dtype (the machine and kernel
    build are the autotune file's fingerprint)."""
    shapes = sorted(Counter(model.float_dense_shapes()).items())
    shapes_repr = repr((shapes, sorted(model.dims.lora_shapes().values())))
    digest = hashlib.sha256(shapes_repr.encode()).hexdigest()[:12]
    return f"{DECISIONS}{dtype_name(dtype)} shapes={digest}"


def provenance(kept: dict) -> str:
    """Where the figures came from, for the log and the runner's description."""
    when = kept["measured"]
    if kept["quiet"]:
        how = f"measured {when} on a quiet machine"
    else:
        how = (
            f"measured {when} while other processes kept {100 * kept['busy']:.0f}% of the "
            f"CPUs busy: provisional until a quiet start measures again"
        )
    if kept["cached"]:
        how += ", kept for this CPU and kernel build (punica-x prepare --remeasure-invariance)"
    return how


def quiet_wait_s() -> float:
    """$PUNICA_X_QUIET_WAIT as seconds (ValueError naming it when it is not one)."""
    raw = QUIET_WAIT.get()
    try:
        wait = float(raw)
    except ValueError:
        wait = -1.0
    if not 0 <= wait <= 3600:
        raise ValueError(f"PUNICA_X_QUIET_WAIT must be seconds from 0 to 3600, got {raw!r}")
    return wait


def forget_decisions() -> list[str]:
    """Drop every kept decision of this machine and kernel build (the next load measures)."""
    return autotune.forget(DECISIONS)
