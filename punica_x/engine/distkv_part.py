"""An engine's part in DistKV (Infinite-LLM): lending blocks to peers through its rManager,
borrowing for requests too long for it, and DGFM's moves home. The Engine holds one
(`engine.distkv`), built over its cache, batcher, planner and request table."""

from __future__ import annotations

import dataclasses
import logging

from punica_x.attention.dist import DistContext
from punica_x.kv import swap_home
from punica_x.kv.blocks import blocks_needed
from punica_x.kv.borrowing import KVBorrowing
from punica_x.kv.head_split import HeadSplitKV
from punica_x.kv.rmanager import KVBorrower, LendCaps, RManager
from punica_x.kv.swap_home import Pick
from punica_x.runtime import Request

log = logging.getLogger("punica_x.engine.engine")


class DistKVPart:
    """DistKV on one engine; off (nothing lent, nothing borrowed) until enable().

    rmanager: serves this runner's lent blocks to peers (None while off).
    peer_losses: runners lost while holding blocks this runner's requests borrowed.
    fixed_order: the batch-invariant mode (attention.dist: the parts chained in key order)."""

    def __init__(
        self, cache, batcher, planner, requests: dict[str, Request], swap, dims, fixed_order=False
    ) -> None:
        self.cache, self.batcher, self.planner = cache, batcher, planner
        self.requests, self.swap, self.dims = requests, swap, dims
        self.fixed_order = fixed_order
        self.rmanager: RManager | None = None
        self.peer_losses = 0

    def enable(
        self,
        runner_id: str,
        borrower: KVBorrower,
        caps: LendCaps,
        overlap: bool = False,
        pool=None,
    ) -> RManager:
        """Take part in DistKV: lend blocks to peers within `caps` (the returned rManager
        serves them) and let requests too long for this runner borrow through `borrower`.
        overlap: remote micro-attention runs on `pool` while the local part runs (else in
        the step's thread after it: where runners share the cores, that is faster)."""
        if self.swap is not None:
            raise ValueError(
                "DistKV runs with the fcfs policy: the mlfq policy's KV swapping does not "
                "move borrowed blocks"
            )
        if isinstance(self.cache, HeadSplitKV):
            raise ValueError(
                "DistKV does not run with attention workers (Lamina): the KV lives on the "
                "attention workers, which lend none"
            )
        d = self.dims
        if any(d.layer_windows) or d.attn_softcap:
            raise ValueError(
                f"DistKV does not serve {d.family} models: remote micro-attention has no "
                "sliding window or logit soft-capping"
            )
        attention = self.planner.attention
        if self.fixed_order and not hasattr(attention, "finish_state"):
            raise ValueError(
                "DistKV in the batch-invariant mode chains the CPU attention kernel's state, "
                f"which the {attention.name!r} attention backend has not: use "
                "--batch-invariant off for DistKV on this device"
            )
        self.rmanager = RManager(runner_id, self.cache, attention, caps)
        headroom = self.batcher.config.borrow_headroom
        self.batcher.borrowing = KVBorrowing(self.cache, borrower, headroom)
        # the chained order runs the parts one after another: nothing to overlap
        if overlap and self.fixed_order:
            log.info("DistKV: no overlap in the batch-invariant mode (parts run in key order)")
        self.planner.dist = DistContext(
            runner_id,
            borrower,
            pool,
            overlap and not self.fixed_order,
            fixed_order=self.fixed_order,
        )
        return self.rmanager

    def remote_picks(self, creditor: str, blocks: int) -> list[Pick]:
        """DGFM, debtor side: up to `blocks` blocks this runner's requests hold on
        `creditor` (punica_x/kv/swap_home.py). Call it while the engine is held."""
        return swap_home.remote_picks(self.requests.values(), creditor, blocks)

    def bring_home(self, runner_id: str, creditor: str, picks: list[Pick], data: list) -> None:
        """DGFM, debtor side: the picks' KV copies into this runner's blocks, the requests'
        extents rewritten (swap_home.bring_home). Call it while the engine is held."""
        swap_home.bring_home(self.cache, self.requests, runner_id, creditor, picks, data)

    def peers_lend(self) -> bool:
        """Whether peers could lend this runner's requests blocks now."""
        borrowing = self.batcher.borrowing
        return borrowing is not None and borrowing.capacity_blocks() > 0

    def stop_lending(self) -> None:
        """Lend no more blocks to peers (a runner being drained); nothing while off."""
        if self.rmanager is not None:
            self.rmanager.caps = dataclasses.replace(self.rmanager.caps, max_blocks=0)

    def capacity_blocks(self) -> int:
        """The most KV blocks one request can hold: this runner's cache, plus what its peers
        could lend under DistKV."""
        borrowing = self.batcher.borrowing
        extra = borrowing.capacity_blocks() if borrowing is not None else 0
        return self.cache.allocator.num_blocks + extra

    def lost_peer(self, owner: str) -> None:
        """A runner holding borrowed blocks is gone: the requests with blocks there keep
        their KV before the first of them and recompute from there, borrowing again
        (KVBorrowing.cut_at), or, when the runners left cannot hold them now, go back to the
        queue to wait for room (as a new request would); this step's other requests run
        again next step (what it wrote is rewritten identically)."""
        self.peer_losses += 1
        log.warning("runner %s holding borrowed KV blocks is gone", owner)
        borrowing = self.batcher.borrowing
        borrowing.borrower.lost(owner)  # its blocks leave the capacity now
        for r in list(self.batcher.running):
            if not any(e.owner == owner for e in r.remote):
                continue
            if blocks_needed(r.num_tokens, self.cache.block_size) > self.capacity_blocks():
                r.remote = [e for e in r.remote if e.owner != owner]
                self.batcher.preempt(r)  # the others cannot hold it now: it waits for room
                continue
            kept = borrowing.cut_at(r, owner)
            r.num_preemptions += 1  # its KV after `kept` is recomputed
            log.info("%s recomputes from token %d of %d", r.request_id, kept, r.num_tokens)
