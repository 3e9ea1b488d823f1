"""Lamina's attention workers in processes of their own (scheduler/lamina/): the engine's
outputs over the DistKV data plane equal the plain engine's; the workers refuse peers
without the key and answer malformed frames with an error, serving on; a model worker's
shutdown stops them."""

from __future__ import annotations

import pickle
import platform
import random
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
    assert len(launcher.processes) == 2 and all(p.process.is_alive() for p in launcher.processes)


def test_a_peer_without_the_key_is_refused_and_the_worker_serves_on(engines):
    plain, split, launcher = engines
    address = launcher.processes[0].address
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
    address = launcher.processes[1].address
    channel = KVChannel("attention-1", address, "other", platform.node(), launcher.authkey)
    try:
        with pytest.raises(Exception) as info:
            channel._call(frame)
        assert "PeerLost" not in type(info.value).__name__
    finally:
        channel.close()
    prompt = [[11, 12, 13]]
    assert generate(split, prompt, ["r8"]) == generate(plain, prompt, ["r8"])


def test_shutdown_stops_the_worker_processes(tiny_model_dir):
    launcher = ProcessWorkers(threads=1)
    engine = Engine(config(tiny_model_dir, attention_workers=1), attention_launcher=launcher)
    procs = [p.process for p in launcher.processes]
    assert len(procs) == 1 and procs[0].is_alive()
    engine.shutdown()
    assert not procs[0].is_alive() and launcher.processes == []
