"""Kernels with documented wrappers: SGMV (multi-LoRA) and its backend registry."""

from punica_x.ops.sgmv import (
    SgmvWeights,
    add_lora_sgmv,
    available_backends,
    get_backend,
    sgmv_expand,
    sgmv_shrink,
)

__all__ = [
    "SgmvWeights",
    "add_lora_sgmv",
    "available_backends",
    "get_backend",
    "sgmv_expand",
    "sgmv_shrink",
]
