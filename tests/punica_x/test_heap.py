"""The step loop does not pay for the process's heap (punica_x/heap.py): building an engine
freezes what is alive, thaw gives frozen cycles back to the collector, and a decode step
leaves the collector nothing: no new tracked objects and no cyclic garbage, whatever the
batch."""

from __future__ import annotations

import gc
import weakref

import pytest
from helpers import tiny_llm

from punica_x import SamplingParams
from punica_x.heap import freeze_heap, thaw


class Node:
    def __init__(self) -> None:
        self.other = self


@pytest.fixture
def unfrozen():
    gc.unfreeze()
    yield
    freeze_heap("test done")


def test_building_an_engine_freezes_the_heap(tiny_model_dir, unfrozen, monkeypatch):
    resident = [{"i": i} for i in range(20_000)]  # a heap made before punica-x starts
    monkeypatch.setenv("PUNICA_X_GC_FREEZE", "0")
    tiny_llm(tiny_model_dir)
    assert gc.get_freeze_count() == 0  # off: nothing frozen
    monkeypatch.setenv("PUNICA_X_GC_FREEZE", "1")
    tiny_llm(tiny_model_dir)
    assert gc.get_freeze_count() >= len(resident)
    assert len(gc.get_objects()) < len(resident)  # collections no longer walk it


def test_thaw_collects_frozen_cycles(unfrozen):
    node = Node()
    alive = weakref.ref(node)
    freeze_heap("test")
    del node
    gc.collect()
    assert alive() is not None  # a frozen cycle is not collected...
    assert thaw("test") >= 1
    assert alive() is None  # ...until it is thawed
    assert gc.get_freeze_count() > 0  # and the rest is frozen again


def _device_idle(engine) -> None:
    """Wait until an overlapped step's forward is done (its device thread allocates tensors
    while it runs; counted then, they would look like growth)."""
    if engine.in_flight():
        engine.overlap.inflight.logits.result()


@pytest.mark.parametrize("overlap", ["off", "on"])
@pytest.mark.parametrize("batch", [2, 16])
def test_a_decode_step_leaves_the_collector_nothing(tiny_model_dir, batch, overlap):
    engine = tiny_llm(tiny_model_dir, overlap=overlap).engine
    sp = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request([5 + i, 7, 9, 11], sp, None)
    for _ in range(3):  # every request decoding
        engine.step()
    _device_idle(engine)
    gc.collect()
    gc.disable()
    try:
        before = len(gc.get_objects())
        for _ in range(20):
            outputs = engine.step()
            assert len(outputs) == batch
        del outputs
        _device_idle(engine)
        # counted after a collection, as `before` was: a collection stops tracking tuples of
        # plain values, and an overlapped step's are alive in flight at both counts
        garbage = gc.collect()
        grown = len(gc.get_objects()) - before
    finally:
        gc.enable()
    engine.shutdown()  # its device thread (overlap on) ends now, not during the next test
    # nothing accumulates per step or per request (one object a step would be 20 here; the
    # slack is for other threads of the test process)
    assert grown < 20, grown
    assert garbage == 0  # no reference cycles: everything a step made is freed at once


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_a_dropped_engine_is_freed_at_once(tiny_model_dir, overlap):
    """No reference cycle holds an engine (its KV cache) after its last reference goes: one
    that only the collector could free would stay for good once the heap is frozen."""
    import weakref

    llm = tiny_llm(tiny_model_dir, overlap=overlap)
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    llm.generate([[5, 7, 9]], sampling=sp)
    llm.engine.step()  # an overlapped step of the finished request's row, left on the device
    alive = weakref.ref(llm.engine)
    gc.disable()
    try:
        del llm
        assert alive() is None
    finally:
        gc.enable()
