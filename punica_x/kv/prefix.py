"""Automatic prefix caching (vLLM's automatic prefix caching, SGLang's RadixAttention, LoRAX's
prefix tree per adapter): a request reuses the KV of the longest prefix of its tokens that
a finished (or running) request on this runner already computed, and prefills only the rest.

Blocks are named by a hash chain: block i of a request is named
``blake2b(name of block i-1 | its P token ids)``, and block 0's parent is the request's
cache key, the hash of WHAT COMPUTED THE KV and WHO MAY SEE IT:
- the base model, or one adapter version (AdapterRef.cache_id: a layer's K and V depend
  on the adapter's projections, so blocks are never shared across adapters, and a new
  version of an adapter never finds the blocks of the old one);
- a salt (the server passes the tenant, and the request's `cache_salt`): a shared prefix
  cache is a timing side channel (a hit answers faster), so by default a tenant only ever
  hits blocks its own requests computed (vLLM's cache_salt).

Only full blocks are named, once the step that computed their last token has run; a hit
is always a whole number of blocks, and at least the request's last token is computed (its
logits are needed), so a request never writes into a block it shares. A request that asks
for prompt logprobs needs the logits of every prompt position not yet scored: it reuses
nothing before them. Blocks borrowed from peers (DistKV) and KV imported from another
runner are not named.

In-batch sharing (SGLang's in-batch prefix caching): a waiting request whose next block is
being computed by a request in this very step waits one step and then reuses it, so `n`
choices of one prompt (or a burst of one tenant's system prompt) prefill it once."""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter
from dataclasses import dataclass, field

from punica_x.kv.blocks import BlockAllocator
from punica_x.runtime import Request

DIGEST_SIZE = 16  # bytes of each block name (blake2b): collisions are out of reach


def cache_key(adapter_id: str | None, salt: str | None) -> bytes:
    """The parent name of a request's first block: what computes its KV (None: the base
    model; else AdapterRef.cache_id) and who may share it (salt; None or "": anyone who
    uses the same model or adapter version on this runner)."""
    h = hashlib.blake2b(digest_size=DIGEST_SIZE, person=b"punica-x-prefix")
    h.update(b"base" if adapter_id is None else b"adapter\0" + adapter_id.encode())
    if salt:
        h.update(b"\0salt\0" + salt.encode("utf-8", "surrogatepass"))
    return h.digest()


def block_name(parent: bytes, tokens: list[int]) -> bytes:
    """The name of a full block holding `tokens`, after the block named `parent`."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=DIGEST_SIZE).digest()


@dataclass
class PrefixStats:
    """Tokens looked up (queries) and found (hits), per adapter name ("" for the base model):
    every request admitted with the cache on queries all its tokens once per admission (a
    recomputed request again)."""

    queries: Counter[str] = field(default_factory=Counter)
    hits: Counter[str] = field(default_factory=Counter)

    def record(self, adapter: str, queried: int, hit: int) -> None:
        self.queries[adapter] += queried
        self.hits[adapter] += hit

    def forget(self, adapter: str) -> None:
        """Drop an adapter's counters (it was deleted)."""
        self.queries.pop(adapter, None)
        self.hits.pop(adapter, None)


class PrefixCache:
    """One runner's prefix cache over its block allocator (see the module docstring)."""

    def __init__(self, allocator: BlockAllocator, block_size: int) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.stats = PrefixStats()
        self.pending: set[bytes] = set()  # names of blocks this step computes (in-batch)
        # names of blocks the step still on the device computes (overlapped steps: named when
        # it is postprocessed, after the next step is scheduled)
        self.inflight_pending: set[bytes] = set()

    def names(self, r: Request, num_blocks: int) -> list[bytes]:
        """The names of r's first num_blocks full blocks (extending r.block_names, which
        keeps those computed so far: tokens are only ever appended)."""
        names = r.block_names
        if len(names) < num_blocks:
            tokens, size = r.all_token_ids, self.block_size
            parent = names[-1] if names else r.cache_key
            for i in range(len(names), num_blocks):
                parent = block_name(parent, tokens[i * size : (i + 1) * size])
                names.append(parent)
        return names[:num_blocks]

    def reusable_blocks(self, r: Request) -> int:
        """How many of r's full blocks a hit may cover: all but the last token is reused at
        most, and with prompt logprobs nothing from the first prompt position not scored."""
        last = r.num_tokens - 1
        sp = r.sampling
        if sp.prompt_logprobs is not None and len(r.prompt_logprobs) < len(r.prompt_token_ids):
            last = min(last, len(r.prompt_logprobs) - 1)
        return max(0, last) // self.block_size

    def reuse(self, r: Request) -> bool:
        """Give r, which holds no KV yet, the cached blocks of its longest cached prefix (its
        num_computed_tokens moves past them). False when r should wait a step instead: its
        next block is being computed by a request in this step."""
        if r.cache_key is None:
            return True
        names = self.names(r, self.reusable_blocks(r))
        ids = self.allocator.lookup(names)
        if len(ids) < len(names) and (
            names[len(ids)] in self.pending or names[len(ids)] in self.inflight_pending
        ):
            self.allocator.free(ids)
            return False
        r.block_ids.extend(ids)
        r.num_computed_tokens = len(ids) * self.block_size
        return True

    def admitted(self, r: Request) -> None:
        """r was admitted after reuse(): count the lookup, and note the blocks its step fills."""
        if r.cache_key is None:
            return
        adapter = r.adapter.name if r.adapter is not None else ""
        self.stats.record(adapter, r.num_tokens, r.num_computed_tokens)

    def computing(self, r: Request, num_new_tokens: int) -> None:
        """r computes num_new_tokens this step: the full blocks they complete are pending
        (waiting requests that need them wait one step, see reuse)."""
        if r.cache_key is None or r.remote:
            return
        start = r.num_computed_tokens // self.block_size
        end = min((r.num_computed_tokens + num_new_tokens) // self.block_size, len(r.block_ids))
        if end > start:
            self.pending.update(self.names(r, end)[start:])

    def computed(self, r: Request, start: int, num_new_tokens: int) -> None:
        """A step computed r's tokens [start, start + num_new_tokens): name the blocks it
        completed. Requests with borrowed blocks are not cached."""
        if r.cache_key is None or r.remote:
            return
        first = start // self.block_size
        end = min((start + num_new_tokens) // self.block_size, len(r.block_ids))
        if end <= first:
            return
        names = self.names(r, end)
        for i in range(first, end):
            self.allocator.name(r.block_ids[i], names[i])

    def undo(self, r: Request) -> None:
        """r, given blocks by reuse(), was not admitted after all: it lets them go."""
        if r.block_ids:
            self.allocator.free(r.block_ids)
            r.block_ids.clear()
        r.num_computed_tokens = 0
