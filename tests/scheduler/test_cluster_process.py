"""The scheduler over engine processes (--runner-backend process: each runner's engine in a
process of its own on this machine, reached over ZeroMQ): the greedy and seeded tokens of
the in-process engine, errors that cross as their own type, a refused build that fails the
start with its reason and leaves no process behind, and SIGKILL of an engine process: every
request completes with the tokens of a run nobody killed, on the process the restart policy
starts in the dead one's place."""

from __future__ import annotations

import asyncio
import os

import pytest
from cluster_kills import SEEDED, SP, cluster_config, cluster_reference, sigkill_at_a_random_point
from helpers import consume

from punica_x.config import EngineConfig, ModelConfig
from punica_x.core import FinishReason
from punica_x.lora.peft_errors import AdapterError
from punica_x.lora.pool import UnknownAdapterError
from punica_x.models.loader import describe_model
from punica_x.request import EngineRequest
from scheduler.cluster import Scheduler
from scheduler.runners import process_wire as wire
from scheduler.runners.process_runner import ProcessRunner


@pytest.fixture(scope="module")
def config(tiny_model_dir):
    return cluster_config(tiny_model_dir)


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tiny_adapters):
    return cluster_reference(tiny_model_dir, tiny_adapters, "process")


@pytest.fixture(scope="module")
def cluster(config, tiny_adapters):
    def factory(rid):
        return ProcessRunner(config, rid)

    sched = Scheduler(
        [factory("runner-0"), factory("runner-1")],
        factory,
        tokenizer=describe_model(config.model).tokenizer,
    )
    asyncio.run(sched.register_adapter("r8", tiny_adapters["r8"]))
    yield sched
    sched.shutdown()


def test_engine_processes_serve_the_in_process_tokens(cluster, reference):
    prompts, ref = reference
    rows = cluster.runners()
    assert [r.backend for r in rows] == ["process", "process"]
    assert len({r.pid for r in rows} | {os.getpid()}) == 3

    async def main():
        sps = [SP, SEEDED, SP, SEEDED]
        adapters = ["r8", None, None, "r8"]
        streams = [
            await cluster.open(EngineRequest(prompts[i], sps[i], adapters[i], f"p{i}"))
            for i in range(4)
        ]
        placed = [s.slot.runner_id for s in streams]
        return sps, adapters, placed, await asyncio.gather(*(consume(s) for s in streams))

    sps, adapters, placed, results = asyncio.run(main())
    assert placed == ["runner-0", "runner-0", "runner-0", "runner-1"]
    for i, (tokens, last) in enumerate(results):
        assert last.finish_reason is FinishReason.LENGTH, last.error
        assert tokens == last.token_ids == ref[sps[i].seed, adapters[i]][i]


def test_a_burst_of_calls_crosses_in_few_messages(cluster, reference, monkeypatch):
    """Opens made on one turn of the loop cross as one message (process_wire's batches)
    and their replies come back batched too: every request gets its own tokens, and one
    closed at once (its abort queued behind its open) ends without harming the others."""
    prompts, ref = reference
    sizes = []
    real = wire.frames
    monkeypatch.setattr(wire, "frames", lambda pairs: sizes.append(len(pairs)) or real(pairs))

    async def main():
        adapters = [None, "r8"] * 6
        streams = await asyncio.gather(
            *(
                cluster.open(EngineRequest(prompts[i % 6], SP, adapters[i], f"burst{i}"))
                for i in range(12)
            )
        )
        await streams[0].aclose()  # aborted before it could finish
        return adapters, await asyncio.gather(*(consume(s) for s in streams[1:]))

    adapters, results = asyncio.run(main())
    for i, (tokens, last) in enumerate(results, start=1):
        assert last.finish_reason is FinishReason.LENGTH, last.error
        assert tokens == ref[SP.seed, adapters[i]][i % 6]
    assert max(sizes) > 1, sizes


def test_errors_cross_as_their_own_type(cluster, tiny_adapters):
    handle = cluster.slots[0].handle

    async def main():
        with pytest.raises(AdapterError) as refused:
            await handle.register_adapter("bad", tiny_adapters["r8"], sha256="0" * 64)
        assert refused.value.code == "sha256_mismatch"
        with pytest.raises(UnknownAdapterError):
            handle.validate([1, 2, 3], SP, "never-registered")
        with pytest.raises(ValueError, match="vocab|token"):
            handle.validate([10**9], SP, None)
        with pytest.raises(ValueError, match="no such call"):
            await handle._remote("__del__")

    asyncio.run(main())
    assert handle.alive()


def test_a_pin_crosses_to_the_process(cluster, tiny_adapters):
    """A pinned registration loads the adapter in the runner's process with no request."""
    handle = cluster.slots[0].handle

    async def main():
        await handle.register_adapter("pinned", tiny_adapters["r4"], version=900, pinned=True)
        for _ in range(400):  # the runner's own view (its snapshot, read by a poll)
            _, snapshot = await handle._remote("poll", -1, 0.0)  # acknowledges nothing
            if "pinned" in snapshot.resident:
                return True
            await asyncio.sleep(0.05)
        return False

    assert asyncio.run(main())


def test_a_failed_build_raises_its_reason_and_leaves_no_process(tmp_path):
    bad = EngineConfig(model=ModelConfig(model=str(tmp_path / "no-such-model")))
    before = set(os.listdir("/proc"))
    with pytest.raises(Exception, match="no-such-model"):
        ProcessRunner(bad, "runner-bad")
    children = [p for p in set(os.listdir("/proc")) - before if p.isdigit()]
    for pid in children:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                assert b"process_main" not in f.read()
        except FileNotFoundError:
            pass


@pytest.mark.parametrize("trial", range(3))
def test_sigkill_of_an_engine_process_loses_no_request(cluster, reference, trial):
    sigkill_at_a_random_point(cluster, reference, 200 + trial)
