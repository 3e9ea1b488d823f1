"""A model worker's block tables reach its attention workers with its plans, and a dead model
worker's requests' KV is read off them (scheduler/lamina/rescue.py): the copy equals the
model worker's view of it, another runner continues from it recomputing only the last token,
with the greedy tokens of a run nobody disturbed; blocks overwritten since (a swap-in, a
copy) are never handed out as a request's, and bad tables are refused."""

from __future__ import annotations

import pytest
import torch

from punica_x import SamplingParams
from punica_x.config import EngineConfig
from punica_x.core import Resume
from punica_x.engine.engine import Engine
from punica_x.engine.llm import _apply_kwargs
from punica_x.kv.attention_worker import AttentionWorker, WorkerSpec, head_slices
from punica_x.kv.rmanager import MicroPlan
from scheduler.distkv.channel import KVChannel
from scheduler.lamina.launcher import ProcessWorkers
from scheduler.lamina.rescue import KVRescue, LaminaWorkers

SP = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)


def config(model_dir, **kwargs) -> EngineConfig:
    kw = dict(model=str(model_dir), dtype="float32", kv_cache_bytes=8 << 20, **kwargs)
    return _apply_kwargs(EngineConfig(), kw)


@pytest.fixture(scope="module")
def engines(tiny_model_dir, tiny_adapters):
    launcher = ProcessWorkers("model-0", threads=1)
    split = Engine(config(tiny_model_dir, attention_workers=2), attention_launcher=launcher)
    plain = Engine(config(tiny_model_dir))
    for e in (plain, split):
        e.adapters.register("r8", str(tiny_adapters["r8"]))
    yield plain, split, launcher
    split.shutdown()
    plain.shutdown()


PROMPTS = [list(range(5, 25)), list(range(40, 47)), list(range(90, 131))]
ADAPTERS = [None, "r8", None]


def run(engine: Engine, until: int | None = None):
    reqs = [engine.add_request(p, SP, a) for p, a in zip(PROMPTS, ADAPTERS)]
    while engine.has_unfinished():
        if until is not None and min(len(r.output_token_ids) for r in reqs) >= until:
            break
        engine.step()
    return reqs


def test_the_kv_read_off_the_workers_continues_on_another_runner(engines):
    plain, split, launcher = engines
    want = [r.output_token_ids for r in run(plain)]
    reqs = run(split, until=6)
    tables = KVChannel(
        "attention-0", launcher.workers[0].process.address, "t", "", launcher.authkey
    )
    try:  # the tables of the last plan: every request holding blocks, as the engine has them
        assert tables.block_tables() == {r.request_id: tuple(r.block_ids) for r in reqs}
    finally:
        tables.close()
    rescue = KVRescue(launcher.describe(), split.cache.block_size)
    continued = []
    for req, prompt, adapter in zip(reqs, PROMPTS, ADAPTERS):
        sent = list(req.output_token_ids)
        n = len(prompt) + len(sent) - 1  # the last token sent has no KV yet
        kv = rescue.kv(req.request_id, n)
        assert torch.equal(kv.blocks, split.cache.export_blocks(req.block_ids, n))
        other = plain.add_request(prompt, SP, adapter, resume=Resume(tuple(sent), kv=kv))
        assert other.num_computed_tokens == n  # only the last token is computed again
        continued.append((sent, other))
        split.abort(req.request_id)
    rescue.close()
    while plain.has_unfinished():
        plain.step()
    for (sent, other), tokens in zip(continued, want):
        assert other.output_token_ids == tokens
        assert sent == tokens[: len(sent)]


def test_unknown_requests_and_short_tables_give_nothing(engines):
    plain, split, launcher = engines
    rescue = KVRescue(launcher.describe(), split.cache.block_size)
    assert rescue.kv("no such request", 10) is None
    assert rescue.kv("no such request", 0) is None
    rescue.close()
    gone = LaminaWorkers("model-0", launcher.authkey, ())
    assert KVRescue(gone, 16).kv("x", 10) is None


def test_workers_caught_while_one_restarts_give_no_copy(engines):
    """A model worker described while one of its workers was being replaced (its address
    gone for a moment) names only the others: their slices are not the request's KV, so no
    copy comes of them (the request recomputes) instead of one with missing heads."""
    plain, split, launcher = engines
    reqs = run(split, until=4)
    whole = launcher.describe()
    assert whole.heads == split.cache.spec.num_kv_heads == 2
    caught = LaminaWorkers(whole.model_id, whole.authkey, whole.workers[:1])
    assert caught.heads == 1
    for at in (caught, LaminaWorkers(whole.model_id, whole.authkey, whole.workers[1:])):
        rescue = KVRescue(at, split.cache.block_size, heads=whole.heads)
        assert rescue.kv(reqs[0].request_id, len(PROMPTS[0])) is None
        rescue.close()
    assert LaminaWorkers(whole.model_id, whole.authkey, whole.workers[1:]).heads == 0
    rescue = KVRescue(whole, split.cache.block_size, heads=2)
    assert rescue.kv(reqs[0].request_id, len(PROMPTS[0])) is not None
    rescue.close()
    for r in reqs:
        split.abort(r.request_id)


def worker() -> AttentionWorker:
    heads = head_slices(4, 2, 1)[0]
    spec = WorkerSpec(heads, 2, 8, 4, 16, torch.float32, (), 0.0, "torch")
    return AttentionWorker(spec)


def plan(tables) -> MicroPlan:
    return MicroPlan((), (), (), (), tables)


def test_blocks_written_between_plans_drop_the_tables_that_held_them():
    w = worker()
    w.prepare("m", plan((("a", (1, 2)), ("b", (3,)))))
    w.prepare("m", plan(None))  # unchanged: kept
    assert w.block_tables() == {"a": (1, 2), "b": (3,)}
    w.write_blocks([2], w.read_blocks([5]))  # a swap-in into a block "a" held
    assert w.block_tables() == {"b": (3,)}
    w.prepare("m", plan((("c", (2,)),)))
    assert w.block_tables() == {"c": (2,)}
    w.restart()
    assert w.block_tables() == {}


@pytest.mark.parametrize(
    "tables",
    [
        (("a", (99,)),),  # outside the worker's 16 blocks
        (("a", (-1,)),),
        (("a", ("x",)),),
        (("a", None),),
        "not tables",
    ],
)
def test_bad_tables_are_refused_and_the_old_ones_kept(tables):
    w = worker()
    w.prepare("m", plan((("a", (1,)),)))
    with pytest.raises((ValueError, TypeError)):
        w.prepare("m", plan(tables))
    assert w.block_tables() == {"a": (1,)}
