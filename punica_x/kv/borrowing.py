"""DistKV borrowing, the runner's half (Infinite-LLM's rManager client): a request too long
for this runner's whole cache takes blocks from peers through a KVBorrower (rmanager.py),
after its local prefix, as RemoteExtents (one per owner run).

Such a request is known to borrow from its first block on (its prompt alone is too long), so
it never preempts the requests beside it to grow, and it leaves HEADROOM of the local cache
free for them while its peers lend (less where their capacity could not hold the rest; all
of it once they refuse): one long prompt does not take a whole runner for as long as it runs
while the short requests placed there wait.

Peers may refuse (their blocks are in use). A refused request asks again after
BORROW_RETRY_S keeping what it holds (WAIT); refused for longer than patience_s it gives
every block back and starts over after a random pause (YIELD), so two requests that each
hold blocks the other needs never wait for each other for ever; with no block from its peers
for give_up_s over all its tries it ends with an error (GIVE_UP)."""

from __future__ import annotations

import enum
import random
import time

from punica_x.core import RemoteExtent
from punica_x.kv.blocks import KVCache, blocks_needed
from punica_x.kv.rmanager import KVBorrower
from punica_x.runtime import Request

BORROW_RETRY_S = 0.05  # a request whose borrow was refused asks again after this long
BORROW_PATIENCE_S = 2.0  # refused this long: it gives its blocks back (YIELD)
BORROW_GIVE_UP_S = 120.0  # no block from its peers this long, over its yields: it ends
HEADROOM = 0.25  # of the local cache a borrowing request leaves free (the default)


class Borrow(enum.Enum):
    """What a borrow came to."""

    GOT = "got"  # the request holds blocks for the tokens asked
    NO = "no"  # it does not borrow (it fits here), or the whole cluster could never hold it
    WAIT = "wait"  # peers refused: it asks again after BORROW_RETRY_S, keeping its blocks
    YIELD = "yield"  # refused for longer than patience_s: the caller frees its blocks
    GIVE_UP = "give_up"  # no block for give_up_s over all its tries: the caller ends it


class KVBorrowing:
    """cache: this runner's; borrower: its way to the peers' rManagers."""

    def __init__(self, cache: KVCache, borrower: KVBorrower, headroom: float = HEADROOM) -> None:
        self.cache, self.borrower = cache, borrower
        self.refusals = 0
        self.yields = 0  # requests that gave their blocks back (patience_s)
        self.patience_s = BORROW_PATIENCE_S
        self.give_up_s = BORROW_GIVE_UP_S
        self.headroom_fraction = headroom  # CacheConfig.borrow_headroom

    @property
    def runner_id(self) -> str:
        return self.borrower.runner_id

    def capacity_blocks(self) -> int:
        """Blocks the peers could lend one request."""
        return self.borrower.capacity_blocks()

    def borrows(self, r: Request, num_tokens: int) -> bool:
        """Whether r takes blocks from peers: num_tokens, or the tokens it already has (the
        whole prompt while its first chunks prefill), cannot fit in this runner's whole
        cache."""
        need = blocks_needed(max(num_tokens, r.num_tokens), self.cache.block_size)
        return bool(r.remote) or need > self.cache.allocator.num_blocks

    def headroom(self, need: int) -> int:
        """Free local blocks a borrowing request that needs `need` blocks leaves to the
        requests beside it: headroom_fraction (HEADROOM) of the cache, less where the peers
        could not lend the rest (capacity_blocks)."""
        total = self.cache.allocator.num_blocks
        leave = int(total * self.headroom_fraction)
        return max(0, min(leave, total + self.capacity_blocks() - need))

    def borrow(self, r: Request, num_tokens: int) -> Borrow:
        """Blocks for num_tokens of a request that borrows: the free local ones first, down to
        the headroom, then from peers, and when they refuse the headroom too (see Borrow)."""
        if not self.borrows(r, num_tokens):
            return Borrow.NO
        need = blocks_needed(num_tokens, self.cache.block_size)
        room = self.cache.allocator.num_blocks + self.capacity_blocks()
        if need > room:
            return Borrow.NO
        r.borrow_room = max(r.borrow_room, room)
        missing = need - len(r.block_ids) - sum(len(e.block_ids) for e in r.remote)
        allocator = self.cache.allocator
        missing -= self._local(r, missing, allocator.num_free - self.headroom(need))
        if missing <= 0:
            return Borrow.GOT
        got = self.borrower.borrow(r.request_id, missing)
        if got is None:  # the peers refuse: the headroom too, before it waits for them
            missing -= self._local(r, missing, allocator.num_free)
            if missing <= 0:
                return Borrow.GOT
            return self._refused(r, time.monotonic())
        r.borrow_since = r.starving_since = None
        append_extents(r, got)
        return Borrow.GOT

    def _local(self, r: Request, missing: int, spare: int) -> int:
        """Give r up to min(missing, spare) free local blocks, after what it holds; how many."""
        n = min(missing, spare)
        local = (self.cache.allocator.allocate(n) or []) if n > 0 else []
        if r.remote:  # past the local prefix: free local blocks join as an extent of ours
            append_extents(r, [RemoteExtent(self.runner_id, tuple(local))] if local else [])
        else:
            r.block_ids.extend(local)
        return len(local)

    def _refused(self, r: Request, now: float) -> Borrow:
        self.refusals += 1
        if r.starving_since is None:
            r.starving_since = now
        elif now - r.starving_since > self.give_up_s:
            return Borrow.GIVE_UP
        if r.borrow_since is None:
            r.borrow_since = now
        elif now - r.borrow_since > self.patience_s:
            r.borrow_since = None
            r.borrow_after = now + random.uniform(0.1, 1.0) * self.patience_s
            self.yields += 1
            return Borrow.YIELD
        r.borrow_after = now + BORROW_RETRY_S
        return Borrow.WAIT

    def cut_at(self, r: Request, owner: str) -> int:
        """Runner `owner` is gone with the blocks it lent r: r keeps its KV before the first
        of them (its local prefix and the extents before), gives the extents after it back
        to their owners, and recomputes from there. Returns the tokens whose KV it kept."""
        lost = next(i for i, e in enumerate(r.remote) if e.owner == owner)
        kept, after = r.remote[:lost], [e for e in r.remote[lost:] if e.owner != owner]
        r.remote = after
        self.give_back(r)
        r.remote = kept
        blocks = len(r.block_ids) + sum(len(e.block_ids) for e in kept)
        r.num_computed_tokens = min(r.num_computed_tokens, blocks * self.cache.block_size)
        return r.num_computed_tokens

    def give_back(self, r: Request) -> None:
        """Free r's blocks after its local prefix: its own (moved home by a DGFM swap) here,
        the others back to their owners."""
        me = self.runner_id
        home = [i for e in r.remote if e.owner == me for i in e.block_ids]
        if home:
            self.cache.allocator.free(home)
        away = [e for e in r.remote if e.owner != me]
        if away:
            self.borrower.give_back(r.request_id, away)


def append_extents(r: Request, extents: list[RemoteExtent]) -> None:
    """Add extents after r's blocks; one segment per owner run (one micro-attention call per
    owner per layer)."""
    for extent in extents:
        last = r.remote[-1] if r.remote else None
        if last is not None and last.owner == extent.owner:
            r.remote[-1] = RemoteExtent(last.owner, last.block_ids + extent.block_ids)
        else:
            r.remote.append(extent)
