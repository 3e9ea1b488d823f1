"""What an engine tells about itself: what it is (EngineInfo, built once), its counters and
gauges now (EngineStats) and the limits a request is checked against (RequestLimits).

Engine.describe() / stats() / limits() build these from the engine's parts (the functions
here take the Engine: it imports this module, not the other way round), so a runner (a
thread runner, a Ray actor) and the scheduler read them without reaching into the batcher,
the KV cache or the adapter pool. stats() runs on another thread than the engine's step loop:
its gauges are read without a lock (a snapshot, not a ledger)."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, fields
from pathlib import Path

from punica_x.core import SamplingParams
from punica_x.dtypes import dtype_name
from punica_x.engine.checks import check_request
from punica_x.engine.memory import weights_bytes
from punica_x.lora.adapter import LoraTarget


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
class EngineInfo:
    """What an engine is: its device, model and LoRA limits, its batch and KV pool."""

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
    # its kernels run in batch-invariant order (punica_x/ops/invariance.py), and why
    batch_invariant: bool = False
    batch_invariant_reason: str = ""


@dataclass(frozen=True)
class EngineStats:
    """An engine's gauges and counters; total() sums several (a cluster's runners)."""

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
    # Lamina (punica_x/attention/lamina.py): attention workers lost and replaced, and each
    # worker as (index, pid, node, first KV head, end KV head); () without attention workers
    attention_worker_losses: int = 0
    attention_workers: tuple[tuple[int, int, str, int, int], ...] = ()

    @classmethod
    def total(cls, per: list[EngineStats], waiting: int = 0) -> EngineStats:
        """Sums over engines (prefix_cache summed per adapter), `waiting` added."""
        total = {
            f.name: sum(getattr(p, f.name) for p in per)
            for f in fields(cls)
            if f.name not in ("prefix_cache", "attention_workers")
        }
        total["attention_workers"] = tuple(w for p in per for w in p.attention_workers)
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
class RequestLimits:
    """What an engine refuses a request for that depends only on its model and KV pool
    (punica_x.engine.check_request): the scheduler checks against these while no runner is
    active (one is restarting). num_blocks: the most KV blocks one request can hold; holder
    names them in the error."""

    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    holder: str = "the KV cache holds"

    def check(self, prompt: list[int], sampling: SamplingParams) -> None:
        """Raise what the engine would for the prompt (ValueError, ContextTooLong); adapters
        are checked by the caller."""
        check_request(
            prompt,
            sampling,
            self.vocab_size,
            self.max_model_len,
            self.block_size,
            self.num_blocks,
            self.holder,
        )


def describe(e) -> EngineInfo:
    """The EngineInfo of `e` as built (its memory plan applied)."""
    config, spec, model = e.config, e.cache.spec, e.model
    return EngineInfo(
        device=str(e.device),
        model=ModelInfo(
            e.loaded.name,
            e.max_model_len,  # the memory plan may cap the model's own
            e.loaded.model_dir,
            dtype_name(e.dtype),
            model.dims.family,
            model.weight_formats(),
            weights_bytes(model),
        ),
        lora_target=e.adapters.target,
        max_lora_rank=config.lora.max_lora_rank,
        vocab_size=model.dims.vocab_size,
        max_batch_size=config.batch.max_batch_size,
        max_working_set=config.batch.max_working_set,
        block_size=e.cache.block_size,
        kv_blocks_total=e.cache.allocator.num_blocks,
        kv_bytes_per_token=spec.bytes_per_block // spec.block_size,
        kv_blocks_swap=e.swap.num_blocks if e.swap is not None else 0,
        prefix_caching=e.batcher.prefix is not None,
        batch_invariant=e.invariance.on,
        batch_invariant_reason=e.invariance.reason,
    )


def limits(e) -> RequestLimits:
    """The limits `e` checks prompts against now (DistKV: its peers' lendable blocks too)."""
    blocks = e.distkv.capacity_blocks()
    lends = blocks > e.cache.allocator.num_blocks
    return RequestLimits(
        e.model.dims.vocab_size,
        e.max_model_len,
        e.cache.block_size,
        blocks,
        "the cluster's KV caches (DistKV) hold" if lends else "the KV cache holds",
    )


def stats(e) -> EngineStats:
    """`e`'s gauges and counters now (read from another thread than its step loop)."""
    pool = e.adapters.stats
    return EngineStats(
        running=len(e.batcher.running),
        waiting=len(e.batcher.waiting),
        kv_blocks_used=e.cache.allocator.num_used,
        kv_blocks_free=e.cache.allocator.num_free,
        adapter_loads=pool.loads,
        adapter_evictions=pool.evictions,
        adapter_device_bytes=pool.device_bytes_used,
        preemptions=e.batcher.num_preemptions,
        aborts=e.num_aborts,
        pauses=e.batcher.num_pauses,
        **(_swap_counters(e.swap.stats) if e.swap is not None else {}),
        **_distkv_gauges(e),
        **_prefix_counters(e),
        **_graph_counters(e),
        attention_worker_losses=e.attention_worker_losses,
        attention_workers=worker_rows(e.cache),
    )


def worker_rows(cache) -> tuple[tuple[int, int, str, int, int], ...]:
    """Lamina's attention workers of a cache (kv/head_split.py) as (index, pid, node, first
    KV head, end KV head): a worker in a process of its own reports its pid, one in the
    engine's process the engine's; () for a cache of its own."""
    node = platform.node()
    rows = []
    for ref in getattr(cache, "workers", ()):
        pid = getattr(ref.peer, "pid", None) or os.getpid()
        where = getattr(ref.peer, "node", None) or node  # a Ray actor may be on another node
        rows.append((ref.heads.index, int(pid), where, ref.heads.lo, ref.heads.hi))
    return tuple(rows)


def _graph_counters(e) -> dict:
    if e.graphs is None:
        return {}
    s = e.graphs.stats
    return dict(cuda_graphs=s.captures, cuda_graph_steps=s.replays, eager_decode_steps=s.eager)


def _prefix_counters(e) -> dict:
    prefix = e.batcher.prefix
    if prefix is None:
        return {}
    queries, hits = dict(prefix.stats.queries), dict(prefix.stats.hits)  # (another thread's)
    # a deleted adapter's requests still running may record after its counters were dropped
    # (Engine.unregister_adapter): only the base model's and registered adapters' are shown
    shown = {""} | set(e.adapters.names())
    return dict(
        kv_blocks_cached=e.cache.allocator.num_cached,
        prefix_cache=tuple((a, queries[a], hits.get(a, 0)) for a in sorted(queries) if a in shown),
    )


def _distkv_gauges(e) -> dict[str, float]:
    rm = e.distkv.rmanager
    if rm is None:
        return {}
    borrowed = sum(
        len(x.block_ids)
        for r in list(e.requests.values())  # read from another thread: a gauge, not a ledger
        for x in list(r.remote)
        if x.owner != rm.runner_id
    )
    remote = e.planner.dist.stats
    return dict(
        kv_blocks_lent=rm.lent_blocks,
        kv_blocks_borrowed=borrowed,
        remote_attention_calls=remote.calls,
        remote_attention_seconds=remote.seconds,
    )


def _swap_counters(s) -> dict[str, int]:
    return dict(
        swaps_out=s.swaps_out,
        swaps_in=s.swaps_in,
        swap_bytes_out=s.bytes_out,
        swap_bytes_in=s.bytes_in,
    )
