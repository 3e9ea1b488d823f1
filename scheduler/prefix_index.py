"""What the scheduler believes each runner holds in its prefix cache, for cache-aware
placement (placement.place). No runner is asked: the scheduler remembers the blocks of the
requests it placed (their prompt when placed, prompt and output when they end) per runner,
in LRU order, up to the runner's KV pool size, as the runner's own cache keeps them
(punica_x/kv/prefix.py). So it is approximate, like SGLang's cache-aware router's tree:
a runner may have evicted blocks under pressure, and that only costs a placement that
finds less than hoped. The same class serves the server and the cluster simulator.

Blocks are named as the runners name them (punica_x.kv.prefix.block_name), under a key of
the adapter (name and the scheduler's version of it) and the request's cache salt."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from punica_x.api import block_name, cache_key


def block_names(
    tokens: Sequence[int], block_size: int, adapter: str | None, salt: str | None
) -> list[bytes]:
    """The names of the full blocks of `tokens` for `adapter` (None: the base model, else
    its name with its version, e.g. "t3/style@17") and `salt`."""
    parent = cache_key(adapter, salt)
    names = []
    for i in range(len(tokens) // block_size):
        parent = block_name(parent, list(tokens[i * block_size : (i + 1) * block_size]))
        names.append(parent)
    return names


class PrefixIndex:
    """One runner's cached block names as the scheduler believes them, LRU, at most
    `capacity` (the runner's KV blocks)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(0, capacity)
        self._names: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._names)

    def record(self, names: Sequence[bytes]) -> None:
        """The runner now holds these blocks (most recently used)."""
        for name in names:
            self._names[name] = None
            self._names.move_to_end(name)
        while len(self._names) > self.capacity:
            self._names.popitem(last=False)

    def match(self, names: Sequence[bytes]) -> int:
        """How many of `names`, from the first, the runner is believed to hold."""
        n = 0
        for name in names:
            if name not in self._names:
                break
            n += 1
        return n

    def clear(self) -> None:
        """The runner lost its cache (it died or was replaced)."""
        self._names.clear()


class PrefixTracker:
    """The scheduler's PrefixIndex per runner (kept on each fleet slot, so it goes with a
    dead runner), fed as requests are placed and end. version_of(adapter key): its current
    version id (None when unknown), part of the names: a new version is a new cache."""

    def __init__(self, version_of: Callable[[str], int | None]) -> None:
        self.version_of = version_of

    def names(self, stream, block_size: int, tokens: Sequence[int] | None = None) -> list[bytes]:
        """The names of `stream`'s prompt blocks (or of `tokens` of it), kept on the stream."""
        adapter = stream.adapter
        if adapter is not None:
            adapter = f"{adapter}@{self.version_of(adapter)}"
        if tokens is not None:
            return block_names(tokens, block_size, adapter, stream.cache_salt)
        cached = getattr(stream, "prefix_names", None)
        if cached is None or cached[0] != block_size:
            cached = (
                block_size,
                block_names(stream.prompt, block_size, adapter, stream.cache_salt),
            )
            stream.prefix_names = cached
        return cached[1]

    def cached(self, stream, slots) -> dict[str, int]:
        """Per runner id, the tokens of `stream`'s prompt its runner is believed to hold."""
        out = {}
        for slot in slots:
            index = self._index(slot)
            if index is not None and len(index):
                size = slot.handle.info.block_size
                n = index.match(self.names(stream, size))
                if n:
                    out[slot.runner_id] = n * size
        return out

    def placed(self, stream, slot) -> None:
        """`stream` runs on `slot` now: its prompt's blocks will be there."""
        index = self._index(slot)
        if index is not None:
            index.record(self.names(stream, slot.handle.info.block_size))

    def left(self, stream, slot) -> None:
        """`stream` left `slot` (ended, or moved): its prompt and output blocks stay cached
        there."""
        index = self._index(slot)
        if index is not None:
            tokens = list(stream.prompt) + list(stream.token_ids)
            index.record(self.names(stream, slot.handle.info.block_size, tokens))

    @staticmethod
    def _index(slot) -> PrefixIndex | None:
        h = slot.handle
        if h is None or not h.info.prefix_caching:
            return None
        if slot.prefix is None:
            slot.prefix = PrefixIndex(h.info.kv_blocks_total)
        return slot.prefix
