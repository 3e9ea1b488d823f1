"""Pinned adapters (AdapterPool.pin): loaded on the device without a request and never
evicted while pinned, the pin kept by the name's later versions, at most PIN_FRACTION of
the device pool pinned (AdapterError "pin_limit"), unpinning makes them evictable again."""

from __future__ import annotations

import time

import pytest
from helpers import tiny_llm

from punica_x import AdapterError, SamplingParams
from punica_x.lora.pool import PIN_FRACTION, UnknownAdapterError

SP = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def _resident(pool, name, timeout=30.0) -> None:
    deadline = time.monotonic() + timeout
    while name not in pool.resident():
        assert time.monotonic() < deadline, f"{name} never became resident"
        pool.poll()
        time.sleep(0.005)


def _llm(tiny_model_dir, tiny_adapters, budget_of=("r16", "r8")):
    probe = tiny_llm(tiny_model_dir)
    nbytes = {n: probe.load_adapter(n, str(p)).nbytes for n, p in tiny_adapters.items()}
    llm = tiny_llm(tiny_model_dir, device_bytes=sum(nbytes[n] for n in budget_of))
    for n in ("r4", "r8", "r16"):
        llm.load_adapter(n, str(tiny_adapters[n]))
    return llm, nbytes


def test_a_pinned_adapter_loads_at_once_and_is_never_evicted(tiny_model_dir, tiny_adapters):
    llm, nbytes = _llm(tiny_model_dir, tiny_adapters)
    pool = llm.engine.adapters
    assert nbytes["r8"] <= PIN_FRACTION * (nbytes["r16"] + nbytes["r8"])
    pool.pin("r8")
    _resident(pool, "r8")  # loaded without any request naming it
    assert pool.pinned() == {"r8"}
    for name in ("r16", "r4", "r16", "r4"):  # the others take turns in the rest of the pool
        llm.generate(["hello world"], [name], SP)
        assert "r8" in pool.resident()
    assert pool.stats.evictions >= 2
    pool.pin("r8", False)
    llm.generate(["hello world"], ["r16"], SP)
    llm.generate(["hello world"], ["r4"], SP)
    llm.generate(["hello world"], ["r16"], SP)
    assert "r8" not in pool.resident() and pool.pinned() == frozenset()


def test_pins_hold_at_most_a_share_of_the_pool(tiny_model_dir, tiny_adapters):
    llm, nbytes = _llm(tiny_model_dir, tiny_adapters)
    pool = llm.engine.adapters
    assert nbytes["r16"] > PIN_FRACTION * (nbytes["r16"] + nbytes["r8"])
    with pytest.raises(AdapterError) as refused:
        pool.pin("r16")
    assert refused.value.code == "pin_limit" and pool.pinned() == frozenset()
    pool.pin("r4")
    pool.pin("r8")
    pool.pin("r4")  # again: nothing changes
    assert nbytes["r4"] + nbytes["r8"] <= PIN_FRACTION * (nbytes["r16"] + nbytes["r8"])
    with pytest.raises(AdapterError):
        pool.pin("r16")  # still over the share, with less of it left
    with pytest.raises(UnknownAdapterError):
        pool.pin("nope")
    assert pool.pinned() == {"r4", "r8"}


def test_the_pin_belongs_to_the_name(tiny_model_dir, tiny_adapters):
    """A new version of a pinned name is pinned in its place; registering with pinned=
    pins or unpins the held version; unregistering drops the pin."""
    llm, _ = _llm(tiny_model_dir, tiny_adapters)
    pool = llm.engine.adapters
    first = pool.register("r8", str(tiny_adapters["r8"]), pinned=True)
    _resident(pool, "r8")
    second = pool.register("r8", str(tiny_adapters["r4"]))
    assert second.version != first.version and pool.pinned() == {"r8"}
    _resident(pool, "r8")
    assert pool.info("r8").version == second.version
    pool.register("r8", str(tiny_adapters["r4"]), version=second.version, pinned=False)
    assert pool.pinned() == frozenset()
    pool.pin("r8")
    pool.unregister("r8")
    assert pool.pinned() == frozenset()
