"""The MLFQ batcher (punica_x/batching/batcher_mlfq.py): on its own with a fake clock (who runs, KV
swapped out and back bit for bit, the pool exhausted), and in the engine (greedy and seeded
outputs equal to FCFS's while requests are paused, swapped and recomputed)."""

from __future__ import annotations

import pytest
import torch
from helpers import FixedTimer, compute_scheduled, tiny_llm

from punica_x import SamplingParams
from punica_x.batching.batcher_mlfq import MLFQBatcher
from punica_x.config import BatchConfig
from punica_x.core import FinishReason
from punica_x.kv.blocks import KVCache, KVCacheSpec
from punica_x.kv.swap import SwapPool
from punica_x.runtime import Request

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=4, block_size=4, dtype=torch.float32)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def make(num_blocks=16, swap_blocks=16, batch_size=1, quantum=1.0, levels=3, starve=5.0):
    cache = KVCache(SPEC, num_blocks, torch.device("cpu"))
    swap = SwapPool(SPEC, swap_blocks, torch.device("cpu"))
    config = BatchConfig(
        max_batch_size=batch_size,
        max_batched_tokens=64,
        policy="mlfq",
        mlfq_quantum_s=quantum,
        mlfq_levels=levels,
        mlfq_starve_s=starve,
    )
    clock = Clock()
    return MLFQBatcher(cache, config, swap, clock=clock), clock


def request(rid: str, prompt_len: int = 8) -> Request:
    sp = SamplingParams(max_tokens=1000, ignore_eos=True)
    return Request(prompt_token_ids=list(range(1, prompt_len + 1)), sampling=sp, request_id=rid)


def step(b: MLFQBatcher, clock: Clock, seconds: float, preempted: list | None = None) -> list[str]:
    """One engine step as the engine runs it: schedule, compute (KV written, a token
    sampled when the prompt is done), charge; returns who ran (and puts the schedule's
    preempted requests in `preempted`)."""
    schedule = b.schedule()
    scheduled = schedule.rows
    assert not schedule.overflow
    if preempted is not None:
        preempted += schedule.preempted
    compute_scheduled(scheduled)
    clock.t += seconds
    b.after_step(scheduled, seconds)
    return [s.request.request_id for s in scheduled]


def test_a_new_short_request_runs_before_a_demoted_long_one():
    b, clock = make()
    b.add(request("long"))
    assert step(b, clock, 0.6) == ["long"]
    assert step(b, clock, 0.6) == ["long"]  # 1.2 s > level 0's quantum: demoted
    assert b.priority["long"].level == 1
    b.add(request("short"))
    assert b.priority["short"].level == 0  # skip-join: its prefill fits level 0's quantum
    assert step(b, clock, 0.1) == ["short"]
    assert b.num_pauses == 1
    long = next(r for r in b.waiting if r.request_id == "long")
    assert long.block_ids and long.num_computed_tokens == 9  # paused, its KV kept


def test_a_long_prompt_skips_the_levels_its_prefill_would_overrun():
    b, _ = make(levels=4)
    b.timer.a, b.timer.b = 0.0, 0.05  # 0.05 s per token
    b.add(request("short", prompt_len=10))  # 0.5 s: level 0 (quantum 1)
    b.add(request("mid", prompt_len=30))  # 1.5 s: level 1 (2)
    b.add(request("long", prompt_len=60))  # 3.0 s: level 2 (4)
    assert [b.priority[r].level for r in ("short", "mid", "long")] == [0, 1, 2]


def test_a_request_is_never_starved_forever():
    """A demoted request under a stream of new short ones runs again once it has waited past
    the starvation limit."""
    b, clock = make(starve=5.0)
    b.add(request("long"))
    for _ in range(4):
        step(b, clock, 1.0)
    assert b.priority["long"].level == 2
    ran = []
    for i in range(20):
        b.add(request(f"s{i}"))
        ran.append(step(b, clock, 1.0)[0])
    assert ran[0] == "s0" and "long" in ran
    assert ran.index("long") <= 6  # it waited at most the limit plus a step
    assert b.priority["long"].promotions >= 1


def test_kv_is_swapped_out_for_a_higher_priority_request_and_back_bit_for_bit():
    b, clock = make(num_blocks=4, swap_blocks=8)
    b.add(request("long", prompt_len=8))
    step(b, clock, 0.6)
    step(b, clock, 0.6)  # demoted; 9 tokens computed in 3 blocks
    long = b.running[0]
    marks = torch.randn(len(long.block_ids), *b.cache.kv.shape[1:])
    b.cache.kv[torch.tensor(long.block_ids)] = marks
    b.add(request("big", prompt_len=12))  # needs 3 of the 4 blocks: long must give its up
    assert step(b, clock, 0.1) == ["big"]
    assert long.block_ids == [] and len(long.host_block_ids) == 3
    assert b.swap.stats.swaps_out == 1 and b.swap.stats.recomputes == 0
    big = b.running[0]
    b.remove(big)  # finished: its blocks are free again
    assert step(b, clock, 0.1) == ["long"]
    assert long.host_block_ids == [] and long.num_computed_tokens == 10
    assert torch.equal(b.cache.kv[torch.tensor(long.block_ids[:3])], marks)
    assert b.swap.stats.swaps_in == 1
    assert b.swap.stats.bytes_out == b.swap.stats.bytes_in == 3 * SPEC.bytes_per_block
    assert b.swap.num_free == 8


def test_blocks_are_taken_only_from_a_lower_level():
    """A swapped request does not take its blocks back from a later arrival of its own level
    (they would trade their KV back and forth at every demotion); from a lower level it does."""
    b, clock = make(num_blocks=4, swap_blocks=8)
    b.add(request("a"))
    step(b, clock, 0.6)
    step(b, clock, 0.6)  # level 1, 3 of the 4 blocks
    b.add(request("b"))
    assert step(b, clock, 0.6) == ["b"]  # level 0: a is swapped out
    assert step(b, clock, 0.6) == ["b"]  # b: level 1 too, a first by arrival
    assert b.priority["a"].level == b.priority["b"].level == 1
    assert step(b, clock, 0.6) == ["b"]  # a would need b's blocks: same level, b keeps them
    assert b.swap.stats.swaps_out == 1
    step(b, clock, 0.6)
    step(b, clock, 0.6)
    step(b, clock, 0.6)  # b has used level 1's 2 s: level 2
    assert b.priority["b"].level == 2
    assert step(b, clock, 0.1) == ["a"]  # now a's level is higher: b gives its blocks up
    assert b.swap.stats.swaps_out == 2 and b.swap.stats.swaps_in == 1


def test_holders_of_one_level_out_of_blocks_still_make_progress():
    """Every request waits on blocks held within one level: the order decides (the first
    takes the last one's blocks) instead of nobody running."""
    b, clock = make(num_blocks=4, swap_blocks=8, batch_size=2)
    b.add(request("a", prompt_len=7))
    b.add(request("b", prompt_len=7))
    assert step(b, clock, 0.01) == ["a", "b"]  # 2 blocks each, all 4 used
    assert step(b, clock, 0.01) == ["a", "b"]  # 8 tokens each: full blocks
    assert step(b, clock, 0.01) == ["a"]  # both need a third block: b's go to a
    assert b.swap.stats.swaps_out == 1


def test_a_full_host_pool_falls_back_to_recompute():
    b, clock = make(num_blocks=4, swap_blocks=2)  # 2 host blocks: long's 3 do not fit
    b.add(request("long"))
    step(b, clock, 0.6)
    step(b, clock, 0.6)
    long = b.running[0]
    b.add(request("big", prompt_len=12))
    preempted = []
    assert step(b, clock, 0.1, preempted) == ["big"]
    assert long.block_ids == [] and long.host_block_ids == []
    assert long.num_computed_tokens == 0 and long.num_preemptions == 1
    assert preempted == [long]  # the engine tells on_preempt (the scheduler may move it)
    assert b.swap.stats.recomputes == 1 and b.swap.stats.swaps_out == 0


def test_proactive_swap_in_brings_the_next_request_back_when_blocks_free_up():
    b, clock = make(num_blocks=6, swap_blocks=8, batch_size=1)
    b.add(request("long"))
    step(b, clock, 0.6)
    step(b, clock, 0.6)  # 3 blocks, level 1
    long = b.running[0]
    b.add(request("big", prompt_len=16))  # 4 + 1 blocks: long is swapped out
    step(b, clock, 0.1)
    assert long.host_block_ids
    b.remove(b.running[0])
    b.add(request("tiny", prompt_len=2))  # level 0: runs, and 5 blocks stay free
    assert step(b, clock, 0.01) == ["tiny"]
    assert not long.host_block_ids and long.block_ids  # swapped in before it was picked
    assert b.swap.stats.swaps_in == 1


def test_removing_a_swapped_request_frees_its_host_blocks():
    b, clock = make(num_blocks=4, swap_blocks=8)
    b.add(request("long"))
    step(b, clock, 0.6)
    step(b, clock, 0.6)
    long = b.running[0]
    b.add(request("big", prompt_len=12))
    step(b, clock, 0.1)
    assert long.host_block_ids
    b.remove(long)  # an abort, a disconnect
    assert b.swap.num_free == 8 and "long" not in b.priority


# -- in the engine -------------------------------------------------------------------------
PROMPTS = ["the quick brown fox", "hello world", "paged attention keeps", "a multi tenant lora"]
LENGTHS = [40, 6, 24, 3]  # heavy and light: MLFQ reorders them


def sampling(seeded: bool) -> list[SamplingParams]:
    return [
        SamplingParams(
            max_tokens=n,
            temperature=1.0 if seeded else 0,
            seed=5 if seeded else None,
            ignore_eos=True,
        )
        for n in LENGTHS
    ]


@pytest.fixture(scope="module")
def fcfs_outputs(tiny_model_dir, tiny_adapters):
    llm = tiny_llm(tiny_model_dir)
    llm.load_adapter("r8", str(tiny_adapters["r8"]))
    adapters = ["r8", None, "r8", None]
    return {
        seeded: [o.token_ids for o in llm.generate(PROMPTS, adapters, sampling(seeded))]
        for seeded in (False, True)
    }


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("swap_blocks", [64, 0], ids=["swap", "recompute"])
def test_engine_outputs_under_mlfq_equal_fcfs(
    tiny_model_dir, tiny_adapters, fcfs_outputs, seeded, swap_blocks
):
    """Every step charged 1 s against a 1 s quantum (requests demote after 1, 2, 4 steps),
    a newcomer every 3 steps at the top level, batches of 2 and 14 KV blocks: requests are
    paused and evicted, swapped out and in (or, with no host pool, recomputed), and must
    produce the very tokens FCFS does."""
    llm = tiny_llm(
        tiny_model_dir,
        policy="mlfq",
        mlfq_quantum_s=1.0,
        mlfq_levels=4,
        max_batch_size=2,
        num_blocks=14,
        block_size=4,
        swap_blocks=swap_blocks,
    )
    llm.load_adapter("r8", str(tiny_adapters["r8"]))
    e = llm.engine
    e.batcher.timer = FixedTimer()
    charge = e.batcher.after_step
    e.batcher.after_step = lambda scheduled, seconds: charge(scheduled, 1.0)
    todo = list(zip(PROMPTS, sampling(seeded), ["r8", None, "r8", None]))
    done, steps = {}, 0
    while e.has_unfinished() or todo:
        if todo and steps % 3 == 0:
            p, sp, a = todo.pop(0)
            e.add_request(p, sp, a, request_id=f"m{3 - len(todo)}")
        for out in e.step():
            if out.finished:
                done[out.request_id] = out
        steps += 1
    assert e.batcher.num_pauses > 0
    stats = e.swap.stats
    if swap_blocks:
        assert stats.swaps_out > 0 and stats.swaps_in == stats.swaps_out
        assert stats.recomputes == 0
    else:
        assert stats.recomputes > 0 and stats.swaps_out == 0
    for i in range(4):
        out = done[f"m{i}"]
        assert out.finish_reason is FinishReason.LENGTH
        assert out.token_ids == fcfs_outputs[seeded][i], i
    assert e.cache.allocator.num_free == 14 and e.swap.num_free == swap_blocks


def test_fcfs_stays_the_default_and_allocates_no_host_pool(tiny_model_dir):
    llm = tiny_llm(tiny_model_dir)
    assert type(llm.engine.batcher).__name__ == "Batcher" and llm.engine.swap is None
    with pytest.raises(ValueError, match="policy"):
        tiny_llm(tiny_model_dir, policy="lifo")
