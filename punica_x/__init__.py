"""punica-x runner: one shared backbone serving many LoRA adapters per batch.

The names below are imported on first use (PEP 562): importing a torch-free module of the
package (punica_x.lora.peft_checks, the frontend's upload check) does not load torch."""

from __future__ import annotations

import importlib

_WHERE = {
    "LLM": "punica_x.engine.llm",  # pulls in the model stack (transformers)
    "AdapterError": "punica_x.lora.peft_checks",
    "BatchConfig": "punica_x.config",
    "CacheConfig": "punica_x.config",
    "EngineConfig": "punica_x.config",
    "EngineRequest": "punica_x.request",
    "FinishReason": "punica_x.core",
    "LoraConfig": "punica_x.config",
    "ModelConfig": "punica_x.config",
    "RequestOutput": "punica_x.core",
    "SamplingParams": "punica_x.core",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'punica_x' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
