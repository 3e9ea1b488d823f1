"""In-process runners for the DistKV tests (tiny model): an Engine of a given cache size, a
KVNetwork joining several, and a loop that runs one to the end."""

from __future__ import annotations

from punica_x.config import BatchConfig, CacheConfig, EngineConfig, ModelConfig
from punica_x.core import SamplingParams
from punica_x.engine import Engine
from scheduler.distkv.network import KVNetwork, default_caps

BLOCK = 16
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
PROMPT = [(i * 7) % 200 + 3 for i in range(150)]  # 190 tokens with the output: 12 blocks


def engine(shared, num_blocks, chunk=2048) -> Engine:
    config = EngineConfig(
        model=ModelConfig(model="unused", dtype="float32"),
        cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks),
        batch=BatchConfig(max_batched_tokens=chunk),
    )
    return Engine(config, shared)


def network(engines: dict[str, Engine], overlap: bool = False) -> KVNetwork:
    net = KVNetwork()
    for rid, e in engines.items():
        caps = default_caps(e.cache.allocator.num_blocks)
        borrower = net.add_runner(rid)
        net.attach(rid, e.distkv.enable(rid, borrower, caps, overlap, pool=net.pool))
    return net


def run(e: Engine, prompts, others=(), on_step=None) -> dict:
    for i, p in enumerate(prompts):
        e.add_request(p, GREEDY, request_id=f"q{i}")
    final = {}
    steps = 0
    while e.has_unfinished():
        for out in e.step():
            if out.finished:
                final[out.request_id] = out
        for o in others:
            o.step()
        steps += 1
        if on_step is not None:
            on_step(steps)
    return final
