"""What the admin API (GET /admin/runners) and /metrics show of each runner: one typed row,
built from the fleet's slot and the runner's last stats."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class RunnerRow:
    id: str
    backend: str
    node: str | None
    pid: int | None
    device: str | None
    state: str
    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    kv_blocks_lent: int = 0  # DistKV: blocks lent to peers' requests
    kv_blocks_borrowed: int = 0  # DistKV: blocks its requests hold on peers
    remote_attention_calls: int = 0
    remote_attention_seconds: float = 0.0
    kv_blocks_cached: int = 0  # prefix caching: kept for their content, evictable
    # prefix caching: tokens admitted requests looked up and found, in all and per adapter
    # ("" for the base model) as (adapter, queried, hit)
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache: tuple[tuple[str, int, int], ...] = ()
    resident_adapters: int = 0
    # "runner" (weights and KV), or "model" under Lamina, whose attention and KV are on its
    # attention_workers: {role, index, pid, node, kv_heads [first, end), kv_blocks_used} each
    # (every worker holds its heads of every block the model worker uses)
    role: str = "runner"
    attention_workers: tuple[dict, ...] = ()
    attention_worker_losses: int = 0
    error: str | None = None
    replaces: str | None = None  # the dead runner it was started in place of
    # its kernels run in batch-invariant order (EngineInfo.batch_invariant; None: no engine),
    # and why: runners started at other times may decide `auto` differently
    batch_invariant: bool | None = None
    batch_invariant_reason: str = ""

    def as_json(self) -> dict:
        return dataclasses.asdict(self)


def runner_row(slot) -> RunnerRow:
    """The row of a fleet slot (a RunnerSlot); a starting or dead runner reports no load."""
    h = slot.handle
    node, pid, device = slot.where
    fixed = dict(id=slot.runner_id, backend=slot.backend, node=node, pid=pid, device=device)
    fixed.update(state=slot.state, error=slot.error, replaces=slot.replaces)
    if h is None or slot.state == "dead":
        return RunnerRow(**fixed)
    s = h.stats()
    return RunnerRow(
        **fixed,
        running=s.running,
        waiting=s.waiting,
        kv_blocks_used=s.kv_blocks_used,
        kv_blocks_free=s.kv_blocks_free,
        kv_blocks_lent=s.kv_blocks_lent,
        kv_blocks_borrowed=s.kv_blocks_borrowed,
        remote_attention_calls=s.remote_attention_calls,
        remote_attention_seconds=s.remote_attention_seconds,
        kv_blocks_cached=s.kv_blocks_cached,
        prefix_cache_queries=s.prefix_cache_queries,
        prefix_cache_hits=s.prefix_cache_hits,
        prefix_cache=s.prefix_cache,
        resident_adapters=len(h.resident_adapters()),
        batch_invariant=h.info.batch_invariant,
        batch_invariant_reason=h.info.batch_invariant_reason,
        role="model" if s.attention_workers else "runner",
        attention_workers=tuple(
            dict(
                role="attention",
                index=i,
                pid=pid,
                node=node,
                kv_heads=[lo, hi],
                kv_blocks_used=s.kv_blocks_used,  # a slice of the heads of each
            )
            for i, pid, node, lo, hi in s.attention_workers
        ),
        attention_worker_losses=s.attention_worker_losses,
    )
