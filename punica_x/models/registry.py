"""The model families punica-x serves, found from a HF config (vLLM's model registry: an
architecture name -> what to build). Every family runs the shared Llama decoder
(punica_x/models/llama.py) with what its Family declares (a mixture of experts: its MLP
is models/moe.py's block)."""

from __future__ import annotations

from punica_x.models.family import Family
from punica_x.models.gemma import GEMMA2, GEMMA3
from punica_x.models.moe_families import MOE_FAMILIES
from punica_x.models.phi3 import PHI3
from punica_x.models.qwen2 import QWEN2
from punica_x.models.qwen3 import QWEN3

LLAMA = Family("llama", ("LlamaForCausalLM",), ("llama",))
MISTRAL = Family("mistral", ("MistralForCausalLM",), ("mistral",))
FAMILIES = (LLAMA, MISTRAL, QWEN2, QWEN3, PHI3, GEMMA2, GEMMA3, *MOE_FAMILIES)
SUPPORTED_ARCHITECTURES = tuple(a for f in FAMILIES for a in f.architectures)


def family_of(config) -> Family:
    """The Family of a HF config (by architectures, else model_type); ValueError naming what
    is supported otherwise."""
    archs = tuple(getattr(config, "architectures", None) or ())
    for family in FAMILIES:
        if set(archs) & set(family.architectures):
            return family
    model_type = getattr(config, "model_type", "")
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    raise ValueError(
        f"unsupported model: architectures={list(archs)} model_type={model_type!r}; "
        f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )
