"""The batch-invariant mode's decision for a model being loaded (punica_x.ops.invariance):
from ModelConfig.batch_invariant, the device and dtype, the dense and fused backends a user
named, and for ``auto`` the first-load timings of the dense backends and the SGMV kernels' two
orders on the model's own shapes."""

from __future__ import annotations

import importlib.util
import logging
from collections import Counter

import torch

from punica_x.config import ModelConfig
from punica_x.env import DENSE_BACKEND, FUSED_BACKEND
from punica_x.ops import isa as isa_mod
from punica_x.ops.dense import tune_dense
from punica_x.ops.invariance import Invariance, decide, relative_cost
from punica_x.ops.registry import CPU_KERNEL_DTYPES, TRITON_DTYPES
from punica_x.ops.sgmv import order_timings

log = logging.getLogger("punica_x.invariance")


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

    def cost() -> dict[str, float]:
        timings = []
        for (n, k, rows), count in Counter(model.float_dense_shapes()).items():
            tuned = tune_dense(device, dtype, n, k, rows)
            timings.append((count, tuned.timings_ms if tuned else {}))
        lora = order_timings(model.dims.lora_shapes(), dtype)
        return {"dense projections": relative_cost(timings), "LoRA": relative_cost(lora)}

    invariance = decide(cfg.batch_invariant, device.type, kernels, named, cost)
    log.info("batch invariance: %s", invariance.reason)
    return invariance
