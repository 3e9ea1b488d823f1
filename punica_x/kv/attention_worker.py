"""Lamina's attention worker (seed 003, sec. 4): a slice of every request's KV heads and the
attention over them, no model weights.

A model worker (a runner whose attention runs here: punica_x/attention/lamina.py) keeps the
block bookkeeping (allocator, prefix cache, swap decisions) and sends, per step, one
MicroPlan (the step's spans and the slots of its new tokens) and, per layer, the query rows
of this worker's heads with the new tokens' K/V; the worker writes K/V into its blocks,
computes attention and returns (out, lse). With W workers over N_kv KV heads, worker w holds
heads [w N_kv / W, (w + 1) N_kv / W) of every block (head-level partitioning, sec. 4.3): each
worker's load is 1/W of every request's, whatever the sequence lengths, and the block ids are
the model worker's, the same on every worker. The same object serves an in-process model
worker directly and a remote one behind a KVChannelServer (scheduler/distkv/channel.py)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from punica_x.kv.blocks import KVCache, KVCacheSpec
from punica_x.kv.rmanager import MicroPlan, PeerLost


@dataclass(frozen=True)
class HeadSlice:
    """Worker `index` of `count` holds KV heads [lo, hi) of `num_kv_heads` and the query
    heads that read them, [lo * G, hi * G) with G = num_heads / num_kv_heads."""

    index: int
    count: int
    num_heads: int
    num_kv_heads: int

    @property
    def lo(self) -> int:
        return self.index * self.num_kv_heads // self.count

    @property
    def hi(self) -> int:
        return (self.index + 1) * self.num_kv_heads // self.count

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def kv_heads(self) -> slice:
        return slice(self.lo, self.hi)

    def q_heads(self) -> slice:
        return slice(self.lo * self.group, self.hi * self.group)


def head_slices(num_heads: int, num_kv_heads: int, workers: int) -> list[HeadSlice]:
    """The head slices of `workers` attention workers; ValueError (naming the model's KV
    heads) when the count is not a positive integer dividing them."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"attention workers must be a positive integer, got {workers!r}")
    if num_kv_heads % workers:
        divisors = [n for n in range(1, num_kv_heads + 1) if num_kv_heads % n == 0]
        raise ValueError(
            f"{workers} attention workers cannot split this model's {num_kv_heads} KV heads "
            f"evenly (head-level partitioning); choose one of {divisors}"
        )
    return [HeadSlice(i, workers, num_heads, num_kv_heads) for i in range(workers)]


@dataclass(frozen=True)
class WorkerSpec:
    """What an attention worker is built from: its head slice, the KV geometry (the model's
    layers, head_dim, block size, dtype and block count), each layer's sliding window (0: all
    keys) and the logit soft-cap (0: none), and the attention backend's name and order (the
    model worker's choice, so both compute the same way)."""

    heads: HeadSlice
    num_layers: int
    head_dim: int
    block_size: int
    num_blocks: int
    dtype: torch.dtype
    windows: tuple[int, ...]
    softcap: float
    backend: str
    fixed_order: bool = False  # batch-invariant order (ops.invariance): no flash attention

    def cache_spec(self) -> KVCacheSpec:
        n = self.heads.hi - self.heads.lo
        return KVCacheSpec(self.num_layers, n, self.head_dim, self.block_size, self.dtype)


class AttentionWorker:
    """One attention worker's KV slice [num_blocks, L, 2, N_kv / W, P, D] and its attention
    backend. Thread-safe enough for its use: one model worker's calls at a time, read_blocks /
    write_blocks between steps."""

    def __init__(self, spec: WorkerSpec, device: torch.device | str = "cpu") -> None:
        from punica_x.attention import get_attention_backend

        self.spec = spec
        self.device = torch.device(device)
        self.cache = KVCache(spec.cache_spec(), spec.num_blocks, self.device)
        self.attention = get_attention_backend(self.device, spec.backend, spec.dtype)
        if spec.fixed_order:
            self.attention = self.attention.fixed_order()
        self.alive = True
        # the model worker's block tables as of its last plan (MicroPlan.tables): request
        # id -> block ids, the place of a request's KV should the model worker die
        self.tables: dict[str, tuple[int, ...]] = {}
        self.calls = 0  # per-layer attention calls served
        self.seconds = 0.0  # spent computing them
        self._lock = threading.Lock()

    @property
    def kv_bytes(self) -> int:
        kv = self.cache.kv
        return kv.numel() * kv.element_size()

    def stop(self) -> None:
        """This worker is gone: every later call raises PeerLost."""
        self.alive = False

    def restart(self) -> None:
        """Serve again with an empty cache (a replaced worker: what it held is lost)."""
        self.cache = KVCache(self.spec.cache_spec(), self.spec.num_blocks, self.device)
        self.tables = {}
        self.alive = True

    def _check(self) -> None:
        if not self.alive:
            raise PeerLost(f"attention-{self.spec.heads.index}", "the attention worker is gone")

    def prepare(self, debtor: str, plan: MicroPlan) -> _WorkerStep:
        """Plan one step of the model worker `debtor` (KVPeer.prepare): the spans' attention
        and the slots of the new K/V; ValueError for block ids outside this cache."""
        self._check()
        n = self.spec.num_blocks
        used = {b for sp in plan.spans for b in sp.block_ids} | set(plan.write_blocks)
        bad = sorted(b for b in used if not 0 <= b < n)
        if bad:
            raise ValueError(f"block ids {bad[:8]} outside this attention worker's {n} blocks")
        if len(plan.write_blocks) != len(plan.write_offsets):
            raise ValueError("write_blocks and write_offsets differ in length")
        if plan.tables is not None:
            self._keep_tables(plan.tables)
        meta = self.attention.plan(list(plan.spans), self.spec.block_size, self.device)
        blocks = torch.tensor(plan.write_blocks, dtype=torch.int64, device=self.device)
        offsets = torch.tensor(plan.write_offsets, dtype=torch.int64, device=self.device)
        return _WorkerStep(self, meta, blocks, offsets)

    def _keep_tables(self, tables) -> None:
        n = self.spec.num_blocks
        kept = {str(rid): tuple(int(b) for b in ids) for rid, ids in tables}
        if any(not 0 <= b < n for ids in kept.values() for b in ids):
            raise ValueError(f"a block table holds block ids outside this worker's {n} blocks")
        self.tables = kept

    def block_tables(self) -> dict[str, tuple[int, ...]]:
        """The block tables of the model worker's last plan that sent them, less those whose
        blocks were written since by write_blocks (a swap-in or a copy into blocks another
        request held: what they point to is no longer that request's)."""
        self._check()
        return dict(self.tables)

    def counters(self) -> tuple[int, float]:
        """(per-layer attention calls served, seconds spent computing them) so far."""
        with self._lock:
            return self.calls, self.seconds

    def read_blocks(self, ids: list[int]) -> torch.Tensor:
        """A copy of blocks `ids` of this slice, [n, L, 2, N_kv / W, P, D] on the CPU."""
        self._check()
        index = torch.tensor(ids, dtype=torch.int64, device=self.device)
        return self.cache.kv.index_select(0, index).cpu()

    def write_blocks(self, ids: list[int], data: torch.Tensor) -> None:
        """Write read_blocks' tensor (this slice's heads) into blocks `ids`."""
        self._check()
        written = set(ids)
        stale = [rid for rid, t in self.tables.items() if written.intersection(t)]
        for rid in stale:
            del self.tables[rid]
        index = torch.tensor(ids, dtype=torch.int64, device=self.device)
        self.cache.kv.index_copy_(0, index, data.to(self.device, self.cache.kv.dtype))


class _WorkerStep:
    """One prepared step (MicroAttention): run() once per layer."""

    def __init__(self, worker: AttentionWorker, meta, blocks, offsets) -> None:
        self.worker, self.meta = worker, meta
        self.blocks, self.offsets = blocks, offsets

    def run(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
        """Write k, v [W, N_kv / W, D] into the step's slots, then (out [R, H_q / W, D],
        lse [R, H_q / W] float32) of q [R, H_q / W, D] over the step's spans."""
        w = self.worker
        w._check()
        spec = w.spec
        if not 0 <= layer < spec.num_layers:
            raise ValueError(f"layer {layer} outside 0..{spec.num_layers - 1}")
        kv = w.cache.kv
        t0 = time.perf_counter()
        if self.blocks.numel():
            kv[self.blocks, layer, 0, :, self.offsets] = k.to(kv.device, kv.dtype)
            kv[self.blocks, layer, 1, :, self.offsets] = v.to(kv.device, kv.dtype)
        q = q.to(kv.device, kv.dtype).contiguous()
        window = spec.windows[layer] if spec.windows else 0
        result = self.meta.attend(q, kv, layer, scale, window, spec.softcap)
        with w._lock:
            w.calls += 1
            w.seconds += time.perf_counter() - t0
        return result
