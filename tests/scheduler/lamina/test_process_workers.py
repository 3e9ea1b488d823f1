"""Lamina's attention workers in processes of their own (scheduler/lamina/): the engine's
outputs over the DistKV data plane equal the plain engine's; the workers refuse peers
without the key and answer malformed frames with an error, serving on; a model worker's
shutdown stops them."""

from __future__ import annotations

import os
import pickle
import platform
import random
import signal
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client

import pytest

from punica_x import SamplingParams
from punica_x.config import EngineConfig
from punica_x.engine.engine import Engine
from punica_x.engine.llm import _apply_kwargs
from scheduler.distkv.channel import KVChannel
from scheduler.lamina.launcher import ProcessWorkers

SP = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)


def config(model_dir, **kwargs) -> EngineConfig:
    kw = dict(model=str(model_dir), dtype="float32", kv_cache_bytes=8 << 20, **kwargs)
    return _apply_kwargs(EngineConfig(), kw)


def generate(engine: Engine, prompts, adapters) -> list:
    reqs = [engine.add_request(p, SP, a) for p, a in zip(prompts, adapters)]
    while engine.has_unfinished():
        engine.step()
    return [(r.output_token_ids, [t.logprob for t in r.logprobs]) for r in reqs]


@pytest.fixture(scope="module")
def engines(tiny_model_dir, tiny_adapters):
    launcher = ProcessWorkers(threads=1)
    split = Engine(config(tiny_model_dir, attention_workers=2), attention_launcher=launcher)
    plain = Engine(config(tiny_model_dir))
    for e in (plain, split):
        for name in ("r8", "r16"):
            e.adapters.register(name, str(tiny_adapters[name]))
    yield plain, split, launcher
    split.shutdown()
    plain.shutdown()


def test_outputs_equal_the_plain_engine(engines):
    plain, split, launcher = engines
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(4, 30))] for _ in range(6)]
    adapters = [None, "r8", "r16", None, "r16", "r8"]
    want, got = generate(plain, prompts, adapters), generate(split, prompts, adapters)
    for (tokens, logprobs), (tokens2, logprobs2) in zip(want, got):
        assert tokens == tokens2
        assert max(abs(a - b) for a, b in zip(logprobs, logprobs2)) <= 1e-5
    assert len(launcher.workers) == 2
    assert all(w.process.process.is_alive() for w in launcher.workers)
    calls, seconds = zip(*(w.counters() for w in launcher.workers))  # the b"I" frame
    assert calls[0] == calls[1] > 0 and min(seconds) > 0


def test_a_peer_without_the_key_is_refused_and_the_worker_serves_on(engines):
    plain, split, launcher = engines
    address = launcher.workers[0].process.address
    with pytest.raises((AuthenticationError, EOFError, ConnectionError)):
        Client(address.unix, "AF_UNIX", authkey=b"not the key, 16 bytes at least")
    prompt = [[7, 8, 9, 10]]
    assert generate(split, prompt, [None]) == generate(plain, prompt, [None])


@pytest.mark.parametrize(
    "frame",
    [b"", b"Z", b"P" + b"not a pickle", b"R\x00\x01", b"G" + pickle.dumps([10**9]), b"S"],
)
def test_malformed_frames_get_an_error_and_the_worker_serves_on(engines, frame):
    plain, split, launcher = engines
    address = launcher.workers[1].process.address
    channel = KVChannel("attention-1", address, "other", platform.node(), launcher.authkey)
    try:
        with pytest.raises(Exception) as info:
            channel._call(frame)
        assert "PeerLost" not in type(info.value).__name__
    finally:
        channel.close()
    prompt = [[11, 12, 13]]
    assert generate(split, prompt, ["r8"]) == generate(plain, prompt, ["r8"])


def test_a_killed_worker_is_replaced_and_every_stream_finishes_the_same(engines):
    """SIGKILL of an attention worker mid-stream: the next step finds it gone, a fresh
    process replaces it and every request recomputes its KV from its tokens, to the plain
    engine's tokens, within seconds of the death."""
    plain, split, launcher = engines
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randrange(4, 30))] for _ in range(4)]
    adapters = ["r16", None, "r8", None]
    want = generate(plain, prompts, adapters)
    reqs = [split.add_request(p, SP, a) for p, a in zip(prompts, adapters)]
    while min(len(r.output_token_ids) for r in reqs) < 3:
        split.step()
    old = launcher.workers[1].pid
    os.kill(old, signal.SIGKILL)
    killed = time.monotonic()
    while split.attention_worker_losses == 0:
        split.step()
    split.step()  # the first step on the new worker
    assert time.monotonic() - killed < 10
    while split.has_unfinished():
        split.step()
    assert launcher.workers[1].pid not in (0, old)
    got = [(r.output_token_ids, [t.logprob for t in r.logprobs]) for r in reqs]
    for (tokens, logprobs), (tokens2, logprobs2) in zip(want, got):
        assert tokens == tokens2
        assert max(abs(a - b) for a, b in zip(logprobs, logprobs2)) <= 1e-5


def test_shutdown_stops_the_worker_processes(tiny_model_dir):
    launcher = ProcessWorkers(threads=1)
    engine = Engine(config(tiny_model_dir, attention_workers=1), attention_launcher=launcher)
    procs = [w.process.process for w in launcher.workers]
    assert len(procs) == 1 and procs[0].is_alive()
    engine.shutdown()
    assert not procs[0].is_alive() and launcher.workers == []
