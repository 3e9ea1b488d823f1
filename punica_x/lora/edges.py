"""LoRA on the model's edges: the embedding (PEFT's lora_embedding_A [r, vocab], _B
[hidden, r]) and the LM head (lora_A [r, hidden], lora_B [vocab, r]), outside the layers.
Their tensors are keyed under layer EDGE while parsing and become groups "embed" / "head"
of LoraAdapter (A^T and B^T, B scaled). Importing it does not import torch."""

from __future__ import annotations

import hashlib
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

EDGE_MODULES = ("embed_tokens", "lm_head")
EDGE = -1
EDGE_KEY = re.compile(
    r"^base_model\.model\.(?:model\.(embed_tokens)\.lora_embedding_(A|B)"
    r"|(lm_head)\.lora_(A|B)\.weight)$"
)
# PEFT saves the base embedding / head beside edge LoRA (save_embedding_layers): accepted
# only as a copy of the base model's own (LoraTarget.edge_digests), never as a replacement.
EDGE_BASE_KEY = re.compile(
    r"^base_model\.model\.(model\.embed_tokens|lm_head)\.base_layer\.weight$"
)

EDGE_GROUPS = {"embed_tokens": "embed", "lm_head": "head"}


def edge_digest(weight: torch.Tensor) -> str:
    """A digest of an [vocab, hidden] embedding or head by value (its bfloat16 rounding, so a
    float32 checkpoint and a bfloat16 copy of it agree)."""
    import torch  # (here: the module's names serve torch-free checks, peft_checks.py)

    h = hashlib.sha256(str(tuple(weight.shape)).encode())
    for chunk in weight.detach().reshape(-1).split(1 << 24):
        h.update(chunk.to("cpu", torch.bfloat16).view(torch.int16).numpy().tobytes())
    return h.hexdigest()


def edge_groups(tensors: dict, dtype: torch.dtype) -> tuple[dict, dict]:
    """(ranks, groups) of the edge modules among scaled tensors {(layer, module, ab): t}."""
    ranks, groups = {}, {}
    for module, group in EDGE_GROUPS.items():
        if (EDGE, module, "A") in tensors:
            a, b = tensors[(EDGE, module, "A")], tensors[(EDGE, module, "B")]
            groups[group] = (a.t().to(dtype).contiguous(), b.t().to(dtype).contiguous())
            ranks[group] = (a.shape[0],)
    return ranks, groups
