"""punica-x runner: one shared backbone serving many LoRA adapters per batch."""

from punica_x.config import BatchConfig, CacheConfig, EngineConfig, LoraConfig, ModelConfig
from punica_x.core import FinishReason, RequestOutput, SamplingParams
from punica_x.lora.adapter import AdapterError
from punica_x.request import EngineRequest

__all__ = [
    "LLM",
    "AdapterError",
    "BatchConfig",
    "CacheConfig",
    "EngineConfig",
    "EngineRequest",
    "FinishReason",
    "LoraConfig",
    "ModelConfig",
    "RequestOutput",
    "SamplingParams",
]


def __getattr__(name: str):
    # LLM pulls in the model stack (transformers); import it on first use only.
    if name == "LLM":
        from punica_x.engine.llm import LLM

        return LLM
    raise AttributeError(name)
