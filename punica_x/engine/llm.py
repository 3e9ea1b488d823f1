"""Offline API: load adapters, generate for a list of prompts in continuous batches."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from punica_x.config import (
    BatchConfig,
    CacheConfig,
    EngineConfig,
    LoraConfig,
    MemoryConfig,
    ModelConfig,
)
from punica_x.core import RequestOutput, SamplingParams
from punica_x.engine import Engine
from punica_x.heap import freeze_heap
from punica_x.lora.pool import AdapterInfo


class LLM:
    """``LLM()`` serves the default model; ``LLM(model="path")`` a HF directory or GGUF file.

    Keyword arguments set fields of the engine config: dtype, device, max_model_len,
    quantization, quant_activations, batch_invariant ("auto" | "on" | "off": the same bits
    whatever else runs, punica_x/ops/invariance.py) (ModelConfig), block_size,
    kv_cache_bytes, num_blocks, swap_bytes, swap_blocks, prefix_caching (CacheConfig; on by
    default, docs/prefix.md), max_lora_rank, device_bytes, host_bytes, lora_dtype,
    max_loras, max_cpu_loras (LoraConfig), max_batch_size, max_batched_tokens, policy
    ("fcfs" | "mlfq"), mlfq_quantum_s, mlfq_levels, mlfq_starve_s (BatchConfig), sgmv_backend,
    seed."""

    def __init__(
        self, model: str | None = None, config: EngineConfig | None = None, **kwargs
    ) -> None:
        config = config or EngineConfig()
        config = _apply_kwargs(replace(config, model=replace(config.model, model=model)), kwargs)
        self.engine = Engine(config)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def load_adapter(self, name: str, path: str) -> AdapterInfo:
        """Register (or atomically replace) a PEFT adapter; raises AdapterError when refused.
        The heap is frozen again after it (punica_x/heap.py)."""
        info = self.engine.adapters.register(name, path)
        freeze_heap("adapter loaded")
        return info

    def unload_adapter(self, name: str) -> None:
        self.engine.unregister_adapter(name)

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        adapters: Sequence[str | None] | None = None,
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One output per prompt, in order. prompts: strings or token-id lists; adapters[i]:
        adapter name or None for the base model."""
        n = len(prompts)
        adapters = list(adapters) if adapters is not None else [None] * n
        params = (
            list(sampling) if isinstance(sampling, Sequence) else [sampling or SamplingParams()] * n
        )
        if len(adapters) != n or len(params) != n:
            raise ValueError(f"{n} prompts need {n} adapters and sampling params")
        requests = []
        try:
            for prompt, adapter, sp in zip(prompts, adapters, params):
                requests.append(self.engine.add_request(prompt, sp, adapter))
        except Exception:
            for r in requests:
                self.engine.abort(r.request_id)
            raise
        final: dict[str, RequestOutput] = {}
        while len(final) < n:
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        self.engine.drain()  # an overlapped step of finished rows: the engine is quiet after
        return [final[r.request_id] for r in requests]


_SECTIONS = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "lora": LoraConfig,
    "batch": BatchConfig,
    "memory": MemoryConfig,
}


def _apply_kwargs(config: EngineConfig, kwargs: dict) -> EngineConfig:
    updates: dict[str, dict] = {name: {} for name in _SECTIONS}
    top = {}
    for key, value in kwargs.items():
        section = next((s for s, cls in _SECTIONS.items() if key in cls.__dataclass_fields__), None)
        if section is not None:
            updates[section][key] = value
        elif key in EngineConfig.__dataclass_fields__:
            top[key] = value
        else:
            raise TypeError(f"unknown LLM option {key!r}")
    sections = {s: replace(getattr(config, s), **u) for s, u in updates.items() if u}
    return replace(config, **sections, **top)
