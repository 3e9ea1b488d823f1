"""The runner's public face: every name scheduler/ and frontend/ may use of punica_x, and where
it lives (tests/test_layers.py keeps them off everything else).

Names are imported on first use (PEP 562), so a module that needs a request type does not
load the model stack (transformers, the kernels) with it; `from punica_x.api import X`
costs what importing X's own module costs.
"""

from __future__ import annotations

import importlib

# name -> the module that defines it, by concept
_WHERE: dict[str, str] = {
    # a request and what comes back
    "EngineRequest": "punica_x.request",
    "SamplingParams": "punica_x.core",
    "RequestOutput": "punica_x.core",
    "FinishReason": "punica_x.core",
    "TokenLogprob": "punica_x.core",
    "MAX_LOGPROBS": "punica_x.core",
    "Resume": "punica_x.core",
    "KVSnapshot": "punica_x.core",
    "JSON_OBJECT": "punica_x.sampling.structured",
    "canonical_schema": "punica_x.sampling.structured",
    # refusals and failures
    "InvalidRequest": "punica_x.errors",
    "ContextTooLong": "punica_x.errors",
    "UnknownAdapterError": "punica_x.lora.pool",
    "AdapterError": "punica_x.lora.peft_checks",
    "RunnerLost": "punica_x.engine.async_engine",
    "StreamMoved": "punica_x.engine.async_engine",
    # configuration
    "EngineConfig": "punica_x.config",
    "ModelConfig": "punica_x.config",
    "MemoryConfig": "punica_x.config",
    "prepare_main": "punica_x.prepare",
    "quiet_wait_s": "punica_x.models.invariant_choice",  # $PUNICA_X_QUIET_WAIT, checked
    # a runner: its engine, stepping on a thread, and what it tells about itself
    "Engine": "punica_x.engine.engine",
    "AsyncEngine": "punica_x.engine.async_engine",
    "RequestStream": "punica_x.engine.async_engine",
    "LoadedModel": "punica_x.models.loader",
    "describe_model": "punica_x.models.loader",
    "EngineInfo": "punica_x.engine.report",
    "EngineStats": "punica_x.engine.report",
    "ModelInfo": "punica_x.engine.report",
    "RequestLimits": "punica_x.engine.report",
    # adapters
    "AdapterInfo": "punica_x.lora.pool",
    "LoraTarget": "punica_x.lora.peft_checks",
    "check_peft_header": "punica_x.lora.peft_checks",  # an upload's checks without torch
    "slot_bytes": "punica_x.lora.slots",  # bytes of an adapter of a rank on every projection
    # prefix caching: the block names a prefix-aware placement computes as the runners do
    "block_name": "punica_x.kv.prefix",
    "cache_key": "punica_x.kv.prefix",
    # DistKV between runners: the rManager a runner serves its peers through
    "RManager": "punica_x.kv.rmanager",
    "LendCaps": "punica_x.kv.rmanager",
    "MicroPlan": "punica_x.kv.rmanager",
    "PeerLost": "punica_x.kv.rmanager",
    "RemoteExtent": "punica_x.core",
    # Lamina: attention workers a runner starts in processes of its own
    "AttentionWorker": "punica_x.kv.attention_worker",
    "WorkerSpec": "punica_x.kv.attention_worker",
    "WorkerRef": "punica_x.attention.lamina",
    # process wiring
    "freeze_heap": "punica_x.heap",
    "thaw": "punica_x.heap",
    "in_side_thread": "punica_x.side_thread",
}
_RENAMED = {"prepare_main": "main"}  # the name in its own module, where it differs

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"punica_x.api has no {name!r} (the public names: punica_x/api.py)")
    value = getattr(importlib.import_module(module), _RENAMED.get(name, name))
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return __all__
