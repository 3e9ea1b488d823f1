"""StreamTable.committed, kept by increments, against the sum over its streams written out,
through streams joining, leaving, being replaced, getting tokens and resumes in any order."""

from __future__ import annotations

import random

from punica_x.api import EngineRequest, RequestOutput, Resume, SamplingParams
from scheduler.policy.placement import blocks_for
from scheduler.stream import ClusterStream
from scheduler.stream_table import StreamTable


class _Owner:
    def stream_served(self, stream, tokens):
        pass

    def kick(self):
        pass


def _stream(rid: str, prompt_len: int) -> ClusterStream:
    request = EngineRequest(
        list(range(1, prompt_len + 1)), SamplingParams(max_tokens=64), None, rid
    )
    return ClusterStream(_Owner(), request)


def _tokens(stream: ClusterStream, n: int) -> None:
    out = RequestOutput(stream.request_id, [], [], "", [7] * n, "x" * n, False)
    stream._deliver(out)


def _written_out(table: StreamTable, block_size: int, total: int) -> int:
    return sum(min(blocks_for(s.num_tokens, block_size), total) for s in table.values())


def test_committed_follows_every_change():
    rng = random.Random(3)
    table, pool = StreamTable(), []
    for step in range(3000):
        op = rng.random()
        if op < 0.3 or not pool:  # a new stream joins (or replaces one under the same id)
            rid = f"r{rng.randrange(40)}"
            s = _stream(rid, rng.randrange(1, 90))
            table[rid] = s
            pool.append(s)
        elif op < 0.45 and table:  # one leaves
            rid = rng.choice(list(table))
            if rng.random() < 0.5:
                table.pop(rid)
            else:
                del table[rid]
        elif op < 0.5:
            table.pop("absent", None)
        elif op < 0.8:  # tokens reach a stream, in the table or not
            _tokens(rng.choice(pool), rng.randrange(1, 20))
        elif op < 0.9:  # a resume (a move) sets where it stands
            s = rng.choice(pool)
            s.resume = Resume(tuple([3] * rng.randrange(0, 120)))
        else:
            table.update({})  # any other way in forgets the increments
        block_size, total = rng.choice([(16, 1000), (16, 4), (8, 50)])
        assert table.committed(block_size, total) == _written_out(table, block_size, total), step


def test_a_burst_of_joins_does_not_sum_again(monkeypatch):
    """Streams joining while no tokens arrive (an admission burst) are counted by one
    increment each: the sum over every stream runs once."""
    table = StreamTable()
    table.committed(16, 1000)
    summed = []
    real = StreamTable.committed

    def counting(self, block_size, total):
        key = (ClusterStream.tokens_epoch, block_size, total)
        summed.append(key != self._key)
        return real(self, block_size, total)

    monkeypatch.setattr(StreamTable, "committed", counting)
    for i in range(100):
        table[f"r{i}"] = _stream(f"r{i}", 20)
        assert table.committed(16, 1000) == 2 * (i + 1)
    assert not any(summed)
    _tokens(table["r0"], 13)  # 33 tokens: 3 blocks
    assert table.committed(16, 1000) == 201 and summed[-1]
