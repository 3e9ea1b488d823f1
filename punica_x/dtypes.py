"""The serving dtypes by name (ground floor: config, ops and lora all use these names)."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16": the names ModelConfig.dtype, the CLI and the API use."""
    return str(dtype).removeprefix("torch.")
