"""What the control plane needs from a runner, whether in-process or a Ray actor."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Protocol

from punica_x.core import Resume, SamplingParams
from punica_x.engine.async_engine import RequestStream
from punica_x.lora.adapter import LoraTarget
from punica_x.lora.pool import AdapterInfo
from punica_x.request import EngineRequest


@dataclass(frozen=True)
class RunnerStats:
    running: int
    waiting: int
    kv_blocks_used: int
    kv_blocks_free: int
    adapter_loads: int
    adapter_evictions: int
    adapter_device_bytes: int
    preemptions: int
    aborts: int = 0  # requests aborted in the engine (a client left, a cancel)
    # MLFQ (zeros under FCFS): running requests paused for higher-priority ones, and their
    # KV swapped to the host pool and back (requests, bytes)
    pauses: int = 0
    swaps_out: int = 0
    swaps_in: int = 0
    swap_bytes_out: int = 0
    swap_bytes_in: int = 0
    # DistKV: blocks this runner lends to peers' requests, and its requests hold on peers
    kv_blocks_lent: int = 0
    kv_blocks_borrowed: int = 0
    # DistKV: micro-attention calls this runner's requests sent to peers, and their summed
    # round trips in seconds (punica_x.attention.dist.RemoteStats)
    remote_attention_calls: int = 0
    remote_attention_seconds: float = 0.0
    # prefix caching (punica_x/kv/prefix.py): blocks kept only for their content, and per
    # adapter ("" for the base model) the tokens admitted requests looked up and found,
    # as (adapter, queried tokens, hit tokens), adapters in name order
    kv_blocks_cached: int = 0
    prefix_cache: tuple[tuple[str, int, int], ...] = ()
    # CUDA graphs (punica_x/engine/cuda_graphs.py): graphs captured, decode steps replayed
    # from one, and decode steps that ran eagerly (a shape or feature they do not cover)
    cuda_graphs: int = 0
    cuda_graph_steps: int = 0
    eager_decode_steps: int = 0

    @classmethod
    def total(cls, per: list[RunnerStats], waiting: int = 0) -> RunnerStats:
        """Sums over runners (prefix_cache summed per adapter), `waiting` added."""
        total = {
            f.name: sum(getattr(p, f.name) for p in per)
            for f in fields(cls)
            if f.name != "prefix_cache"
        }
        total["waiting"] += waiting
        merged: dict[str, tuple[int, int]] = {}
        for adapter, queries, hits in (row for p in per for row in p.prefix_cache):
            q, h = merged.get(adapter, (0, 0))
            merged[adapter] = (q + queries, h + hits)
        total["prefix_cache"] = tuple((a, q, h) for a, (q, h) in sorted(merged.items()))
        return cls(**total)

    @property
    def prefix_cache_queries(self) -> int:
        return sum(q for _, q, _ in self.prefix_cache)

    @property
    def prefix_cache_hits(self) -> int:
        return sum(h for _, _, h in self.prefix_cache)


@dataclass(frozen=True)
class ModelInfo:
    name: str
    max_model_len: int
    model_dir: Path
    dtype: str  # the serving dtype, as ModelConfig.dtype names it ("float32", "bfloat16")
    family: str = "llama"  # the model family (punica_x/models/registry.py)
    weight_format: str = ""  # what the dense weights are served as ("bfloat16", "Q4_1,Q8_0")
    weight_bytes: int = 0  # the bytes the model's weights hold on one runner


@dataclass(frozen=True)
class RequestLimits:
    """What a runner refuses a request for that depends only on its model and KV pool
    (punica_x.engine.check_request): the scheduler checks against these while no runner is
    active (one is restarting). num_blocks: the most KV blocks one request can hold; holder
    names them in the error."""

    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    holder: str = "the KV cache holds"

    def check(self, prompt: list[int], sampling: SamplingParams) -> None:
        """Raise what the runner's validate() would for the prompt (ValueError,
        ContextTooLong); adapters are checked by the caller."""
        from punica_x.engine import check_request

        check_request(
            prompt,
            sampling,
            self.vocab_size,
            self.max_model_len,
            self.block_size,
            self.num_blocks,
            self.holder,
        )


@dataclass(frozen=True)
class RunnerInfo:
    """What a runner is, built once by the runner from its engine (scheduler/local.py
    describe_runner) and read by the scheduler: where it runs, its model and LoRA limits, its
    batch and KV pool."""

    node: str
    pid: int
    device: str
    model: ModelInfo
    lora_target: LoraTarget
    max_lora_rank: int
    vocab_size: int
    max_batch_size: int
    max_working_set: int
    block_size: int
    kv_blocks_total: int
    kv_bytes_per_token: int
    kv_blocks_swap: int  # the MLFQ host pool (0 under FCFS)
    prefix_caching: bool = False  # it reuses cached prefixes (punica_x/kv/prefix.py)


class RunnerHandle(Protocol):
    """A runner as the scheduler drives it: LocalRunner (a thread in this process) and
    RayRunner (an actor) implement all of it; the scheduler is typed against this."""

    runner_id: str
    backend: str  # "thread" or "ray"
    info: RunnerInfo
    tokenizer: object | None  # None: the scheduler brings its own (Ray runners)
    error: str | None  # why it stopped, once it has

    def validate(self, prompt: list[int], sampling: SamplingParams, adapter: str | None) -> None:
        """The refusals open() would raise (ValueError, UnknownAdapterError), without
        adding the request."""

    async def open(
        self, request: EngineRequest, on_preempt: Callable[[], None] | None = None
    ) -> RequestStream:
        """Add a request (refusals raise here) and return its output stream; closing the
        stream aborts the request. A request with `resume` continues one moved here from its
        tokens (or its KV); on_preempt: called when the runner preempts it."""

    async def take(self, request_id: str, with_kv: bool = False) -> Resume | None:
        """Take a request out to move it (its stream ends with StreamMoved); with_kv: its
        KV comes along."""

    async def register_adapter(
        self, name: str, path: Path, sha256: str | None = None, version: int | None = None
    ) -> AdapterInfo:
        """Install `path` as the current version of `name`; with `sha256`, files with another
        digest are refused (AdapterError "sha256_mismatch"). version: its id on every runner
        (AdapterPool.register; None: the runner numbers it)."""

    async def unregister_adapter(self, name: str) -> None: ...

    def has_version(self, version: int) -> bool:
        """Whether this runner still holds adapter version `version` (current, or in use)."""

    def resident_adapters(self) -> frozenset[str]: ...

    def stats(self) -> RunnerStats: ...

    def limits(self) -> RequestLimits:
        """What validate() checks prompts against (kept while no runner is active)."""

    def stop_lending(self) -> None:
        """DistKV: lend no more blocks to peers (a runner being drained)."""

    def alive(self) -> bool: ...

    def shutdown(self) -> None: ...
