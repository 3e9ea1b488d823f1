"""rManager (Infinite-LLM / DistKV-LLM): one runner's rBlocks that cross runners.

Debtor side: a request whose KV cannot fit on its runner keeps its local blocks as the
prefix of its block table and continues in extents of blocks lent by peers
(`Request.remote`, a list of RemoteExtent in logical order). The runner borrows them through
a KVBorrower (the cluster's gManager suggests creditors) and never fetches their KV: each
layer ships the query to the creditor, which computes the micro-attention over its blocks
and returns (out, lse) to merge (DistAttention, punica_x/attention/dist.py).

Creditor side: RManager lends blocks of this runner's KV cache to peers' requests within
LendCaps, so its own requests keep their memory and their latency, refuses beyond them, and
serves the micro-attention calls over lent blocks (prepare a MicroPlan once per step, then
MicroAttention.run per layer). Lent blocks come out of the same free list as the runner's
own (the allocator is thread-safe): a debtor's calls run while the creditor steps."""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from punica_x.attention.paged import SeqSpan
from punica_x.core import RemoteExtent
from punica_x.kv.blocks import KVCache


class PeerLost(RuntimeError):
    """A creditor runner is gone (stopped, died): the blocks it held are lost with it."""

    def __init__(self, owner: str, message: str = "") -> None:
        super().__init__(message or f"runner {owner} holding borrowed KV blocks is gone")
        self.owner = owner


@dataclass(frozen=True)
class LendCaps:
    """What a runner lends at most: `max_blocks` blocks to all debtors together,
    `max_requests` debtor requests at once (each costs a micro-attention per layer per step),
    and compute: once serving peers' micro-attention took more than `max_compute_share` of
    the last `window_s` seconds, it lends no new blocks (the loans it has keep being served)
    until the share falls back."""

    max_blocks: int
    max_requests: int = 8
    max_compute_share: float = 0.5
    window_s: float = 5.0

    def __post_init__(self) -> None:
        if self.max_blocks < 0 or self.max_requests < 0:
            raise ValueError("LendCaps fields must be >= 0")
        if not 0 < self.max_compute_share <= 1 or self.window_s <= 0:
            raise ValueError("LendCaps needs 0 < max_compute_share <= 1 and window_s > 0")


@dataclass(frozen=True)
class MicroPlan:
    """A creditor's share of one debtor step, planned once per step.

    Per layer the debtor sends q [R, H_q, D] (rows of its requests that see blocks lent here)
    and k, v [W, N_kv, D] (its new tokens that land in blocks lent here). write_blocks /
    write_offsets: [W] the slot of each k/v row; spans: the attention of q's rows over lent
    blocks, in q's row coordinates (SeqSpan semantics: a span's rows are the last num_rows
    of kv_len keys, causal)."""

    request_ids: tuple[str, ...]
    spans: tuple[SeqSpan, ...]
    write_blocks: tuple[int, ...]
    write_offsets: tuple[int, ...]
    # Lamina's attention workers only: every request holding blocks on the model worker,
    # (request id, block table), when they changed since the last plan (None: unchanged).
    # A worker keeps the latest, so the KV of a dead model worker's requests can be found.
    tables: tuple[tuple[str, tuple[int, ...]], ...] | None = None


class MicroAttention(Protocol):
    def run(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        state: torch.Tensor | None = None,
    ):
        """Write k/v into their slots, then return (out [R, H_q, D], lse [R, H_q] float32);
        with `state` ([R, H_q, D + 2] float32, the batch-invariant chain: attention.dist),
        the attention goes on from it and the new state is returned instead."""


class KVPeer(Protocol):
    def prepare(self, debtor: str, plan: MicroPlan) -> MicroAttention: ...


class KVBorrower(Protocol):
    """How a runner reaches its peers' rManagers (built by the scheduler)."""

    runner_id: str

    def borrow(self, request_id: str, num_blocks: int) -> list[RemoteExtent] | None:
        """num_blocks blocks from peers (all or nothing), or None when they refuse now."""

    def give_back(self, request_id: str, extents: list[RemoteExtent]) -> None:
        """Return borrowed blocks (extents of a dead owner are dropped)."""

    def peer(self, owner: str) -> KVPeer:
        """The creditor's data plane; raises PeerLost when it is gone."""

    def capacity_blocks(self) -> int:
        """The most blocks all peers together could lend (their caps): the cluster's limit."""

    def lost(self, owner: str) -> None:
        """Runner `owner` was found gone (PeerLost): what it could lend leaves
        capacity_blocks now, before the membership says so."""


class RManager:
    """The creditor side of one runner: lends blocks of `cache` and serves micro-attention
    over them with `attention` (the runner's attention backend)."""

    def __init__(
        self, runner_id: str, cache: KVCache, attention, caps: LendCaps, clock=time.monotonic
    ) -> None:
        self.runner_id = runner_id
        self.cache = cache
        self.attention = attention
        self.caps = caps
        self._lock = threading.Lock()
        self._loans: dict[tuple[str, str], list[int]] = {}  # (debtor, request) -> block ids
        self._owner: dict[int, str] = {}  # lent block -> debtor runner
        self.refusals = 0
        self.calls = 0
        self.alive = True
        self.frozen = False  # lends nothing while a DGFM swap moves its blocks
        self.clock = clock
        self._busy: collections.deque[tuple[float, float]] = collections.deque()  # (end, s)
        self._busy_lock = threading.Lock()
        self.busy_seconds = 0.0  # serving peers' micro-attention, in all

    # -- lending --------------------------------------------------------------------------
    @property
    def lent_blocks(self) -> int:
        return len(self._owner)

    def lent_to(self) -> dict[str, int]:
        """Blocks lent per debtor runner."""
        return dict(collections.Counter(self._owner.values()))

    def lendable(self) -> int:
        """Blocks a peer could get now: free blocks, within the caps (none while serving
        peers took more than its compute share of the recent window)."""
        if self.compute_share() > self.caps.max_compute_share:
            return 0
        return max(0, min(self.caps.max_blocks - self.lent_blocks, self.cache.allocator.num_free))

    def compute_share(self) -> float:
        """Seconds spent serving peers' micro-attention over the last window_s, / window_s."""
        start = self.clock() - self.caps.window_s
        with self._busy_lock:
            while self._busy and self._busy[0][0] < start:
                self._busy.popleft()
            return sum(s for _, s in self._busy) / self.caps.window_s

    def _served(self, seconds: float) -> None:
        with self._busy_lock:
            self._busy.append((self.clock(), seconds))
            self.busy_seconds += seconds

    def lend(self, debtor: str, request_id: str, num_blocks: int) -> tuple[int, ...] | None:
        """Up to num_blocks blocks (at least one) for `request_id` of runner `debtor`, or None
        (refused: the caps are reached or nothing is free)."""
        self._check_alive()
        with self._lock:
            key = (debtor, request_id)
            new_request = key not in self._loans
            requests = len(self._loans) + (1 if new_request else 0)
            n = 0 if self.frozen else min(num_blocks, self.lendable())
            ids = self.cache.allocator.allocate(n) if n > 0 else None
            if not ids or requests > self.caps.max_requests:
                if ids:
                    self.cache.allocator.free(ids)
                self.refusals += 1
                return None
            self._loans.setdefault(key, []).extend(ids)
            for i in ids:
                self._owner[i] = debtor
            return tuple(ids)

    def reclaim(self, debtor: str, request_id: str, block_ids: tuple[int, ...]) -> None:
        """The debtor gives blocks back (its request finished, left or was preempted)."""
        with self._lock:
            held = self._loans.get((debtor, request_id), [])
            mine = [i for i in block_ids if self._owner.get(i) == debtor and i in held]
            for i in mine:
                held.remove(i)
                del self._owner[i]
            if not held:
                self._loans.pop((debtor, request_id), None)
            self.cache.allocator.free(mine)

    def take_home(self, debtor: str, picks) -> list[torch.Tensor]:
        """DGFM, creditor side: a copy of the KV of each pick's blocks ([n, L, 2, N_kv, P, D],
        on the cache's device), then the blocks taken back from `debtor`
        (punica_x/kv/swap_home.py)."""
        data = [self.cache.kv[list(ids)].clone() for _, ids in picks]
        for rid, ids in picks:
            self.reclaim(debtor, rid, ids)
        return data

    def reclaim_debtor(self, debtor: str) -> int:
        """Take back everything lent to a runner that is gone; returns the blocks freed."""
        with self._lock:
            keys = [k for k in self._loans if k[0] == debtor]
            ids = [i for k in keys for i in self._loans.pop(k)]
            for i in ids:
                del self._owner[i]
            self.cache.allocator.free(ids)
            return len(ids)

    def stop(self) -> None:
        """This runner is gone: every later call raises PeerLost."""
        self.alive = False

    def _check_alive(self) -> None:
        if not self.alive:
            raise PeerLost(self.runner_id)

    # -- serving micro-attention ----------------------------------------------------------
    def prepare(self, debtor: str, plan: MicroPlan) -> _Micro:
        """Check that every block the plan touches is lent to `debtor` (or, for this runner's
        own requests, not lent to anyone), plan the attention."""
        self._check_alive()
        used = {b for sp in plan.spans for b in sp.block_ids} | set(plan.write_blocks)
        mine = debtor == self.runner_id
        stray = sorted(
            b for b in used if (b in self._owner if mine else self._owner.get(b) != debtor)
        )
        if stray:
            raise ValueError(
                f"blocks {stray[:8]} of runner {self.runner_id} are not lent to {debtor}"
            )
        device = self.cache.kv.device
        meta = self.attention.plan(list(plan.spans), self.cache.block_size, device)
        index = torch.tensor(plan.write_blocks, dtype=torch.int64, device=device)
        offsets = torch.tensor(plan.write_offsets, dtype=torch.int64, device=device)
        return _Micro(self, debtor, meta, index, offsets)


class _Micro:
    def __init__(
        self, rm: RManager, debtor: str, meta, blocks: torch.Tensor, offsets: torch.Tensor
    ) -> None:
        self.rm, self.debtor, self.meta = rm, debtor, meta
        self.blocks, self.offsets = blocks, offsets

    def run(self, layer: int, q, k, v, scale: float, state: torch.Tensor | None = None):
        rm = self.rm
        rm._check_alive()
        kv = rm.cache.kv
        if self.blocks.numel():
            kv[self.blocks, layer, 0, :, self.offsets] = k.to(kv.device, kv.dtype)
            kv[self.blocks, layer, 1, :, self.offsets] = v.to(kv.device, kv.dtype)
        rm.calls += 1
        t0 = time.perf_counter()
        q = q.to(kv.device, kv.dtype).contiguous()
        if state is None:
            result = self.meta.attend(q, kv, layer, scale)
        else:
            result = self.meta.attend_state(q, kv, layer, scale, state.float().contiguous())
        if self.debtor != rm.runner_id:  # its own blocks (DGFM) are not a peer's compute
            rm._served(time.perf_counter() - t0)
        return result
