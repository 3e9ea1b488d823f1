"""A runner's streams as the scheduler tracks them (RunnerSlot.streams), with the KV blocks
they commit: what placement reads for every request it places.

Summing every stream's blocks for each placement made an admission cost O(streams): 256
requests arriving together cost the server's event loop a quadratic ~30 ms. The table keeps
the sum by increments (a stream in, a stream out) for as long as no stream's token count
changed, and sums again after one did (ClusterStream.tokens_epoch): once per delivery of
tokens at most, not once per request placed."""

from __future__ import annotations

from scheduler.policy.placement import blocks_for
from scheduler.stream import ClusterStream


class StreamTable(dict):
    """request id -> ClusterStream. committed(block_size, total): the KV blocks the streams
    commit, each min(blocks_for(its tokens), total) (a DistKV request holds at most the
    runner's blocks here)."""

    __slots__ = ("_key", "_sum")

    def __init__(self) -> None:
        super().__init__()
        self._key: tuple[int, int, int] | None = None  # (tokens epoch, block size, total)
        self._sum = 0

    def committed(self, block_size: int, total: int) -> int:
        key = (ClusterStream.tokens_epoch, block_size, total)
        if key != self._key:
            self._sum = sum(min(blocks_for(s.num_tokens, block_size), total) for s in self.values())
            self._key = key
        return self._sum

    def _valid(self) -> bool:
        return self._key is not None and self._key[0] == ClusterStream.tokens_epoch

    def _blocks(self, stream: ClusterStream) -> int:
        _, block_size, total = self._key
        return min(blocks_for(stream.num_tokens, block_size), total)

    def __setitem__(self, request_id: str, stream: ClusterStream) -> None:
        if self._valid():
            old = self.get(request_id)
            self._sum += self._blocks(stream) - (0 if old is None else self._blocks(old))
        super().__setitem__(request_id, stream)

    def __delitem__(self, request_id: str) -> None:
        if self._valid() and request_id in self:
            self._sum -= self._blocks(self[request_id])
        super().__delitem__(request_id)

    def pop(self, request_id: str, *default):
        if self._valid() and request_id in self:
            self._sum -= self._blocks(self[request_id])
        return super().pop(request_id, *default)

    def _forget(self) -> None:
        self._key = None

    def clear(self) -> None:
        self._forget()
        super().clear()

    def popitem(self):
        self._forget()
        return super().popitem()

    def setdefault(self, request_id: str, stream: ClusterStream):
        self._forget()
        return super().setdefault(request_id, stream)

    def update(self, *args, **kwargs) -> None:
        self._forget()
        super().update(*args, **kwargs)

    def __ior__(self, other):
        self._forget()
        return super().__ior__(other)
