"""The persistent batch (batching/persistent.py): a decode step of the requests of the step
before is planned from that step's tensors by deltas. Its batch must be the one the planner
makes from spans (the same inputs, positions, KV slots, and bit for bit the same attention),
through requests leaving, new blocks, a wider table and in-flight inputs; anything else is
planned from spans; and an engine gives the same tokens with it as without it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import tiny_llm

from punica_x import SamplingParams
from punica_x.batching.schedule import ScheduledRequest
from punica_x.runtime import Request, RequestStatus

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir, tiny_adapters):
    llm = tiny_llm(tiny_model_dir, max_batch_size=8, overlap="off")
    for name in ("r4", "r8"):
        llm.load_adapter(name, str(tiny_adapters[name]))
    return llm


def fresh_planner(llm):
    """The engine's planner with nothing kept (the engine's own steps keep rows too)."""
    planner = llm.engine.planner
    planner.forget()
    planner.rows.advances = 0
    return planner


def requests(n: int, size: int, rng: torch.Generator, num_blocks: int) -> list[Request]:
    """n running requests with prompts of 1..3 blocks, each already holding blocks for its
    prompt and its first decode (random, distinct block ids)."""
    perm = torch.randperm(num_blocks, generator=rng).tolist()
    out = []
    for _ in range(n):
        length = int(torch.randint(1, 3 * size, (1,), generator=rng))
        r = Request(prompt_token_ids=list(range(3, 3 + length)), sampling=GREEDY)
        r.status = RequestStatus.RUNNING
        r.block_ids = [perm.pop() for _ in range(length // size + 1)]
        out.append(r)
    return out


def decode_one(rs: list[Request], token: int = 7) -> None:
    """What a synchronous step does to each decoding request: it computed its input, sampled
    one token."""
    for r in rs:
        r.num_computed_tokens = r.num_tokens
        r.output_token_ids.append(token)


def grow(rs: list[Request], size: int, free: list[int]) -> None:
    """The batcher's growth: a block for each request whose next token starts one."""
    for r in rs:
        if len(r.block_ids) * size < r.num_tokens:
            r.block_ids.append(free.pop())


def assert_same_batch(llm, fast, slow) -> None:
    """Two batches of the same rows: equal inputs, positions, slots, sample rows, and the
    attention kernel's outputs on random q over the engine's KV cache equal bit for bit."""
    assert torch.equal(fast.input_ids, slow.input_ids)
    assert torch.equal(fast.positions, slow.positions)
    assert torch.equal(fast.sample_rows, slow.sample_rows)
    a, b = fast.attention, slow.attention
    assert torch.equal(a.slot_blocks, b.slot_blocks)
    assert torch.equal(a.slot_offsets, b.slot_offsets)
    kv = llm.engine.cache.kv
    heads, dim = kv.shape[3], kv.shape[-1]
    q = torch.randn(len(fast.input_ids), heads * 2, dim, dtype=kv.dtype)
    out_a, lse_a = a.attend(q, kv, 0, 0.125)
    out_b, lse_b = b.attend(q, kv, 0, 0.125)
    assert torch.equal(out_a, out_b) and torch.equal(lse_a, lse_b)


def test_decode_steps_by_deltas_are_the_steps_planned_from_spans(llm):
    planner = fresh_planner(llm)
    kv = llm.engine.cache.kv
    kv.normal_()  # every block holds something: a wrong block changes the attention
    size = llm.engine.cache.block_size
    rng = torch.Generator().manual_seed(0)
    rs = requests(6, size, rng, kv.shape[0])
    free = sorted(set(range(kv.shape[0])) - {b for r in rs for b in r.block_ids})
    prefill = [ScheduledRequest(r, r.num_tokens) for r in rs]
    planner.plan(prefill)  # the prompts: planned from spans, their rows kept
    for r in rs:
        r.num_computed_tokens = r.num_tokens
        r.output_token_ids.append(5)
    grow(rs, size, free)
    kept = planner.rows
    for step in range(2 * size + 3):  # every request crosses blocks; the table widens
        if step == 5:
            rs.pop(2)  # a request left (finished): the delta
        if step == 9:
            rs.pop(0)
        rows = [ScheduledRequest(r, 1) for r in rs]
        advances = kept.advances
        fast, ordered = planner.plan(rows)
        assert kept.advances == advances + 1, f"step {step} was planned from spans"
        slow, _ = planner._plan_spans(ordered)
        assert_same_batch(llm, fast, slow)
        decode_one(rs, token=10 + step)
        grow(rs, size, free)
    assert kept.tables.shape[1] > 3  # it widened past the first steps' width


@pytest.mark.parametrize("known", [False, True])
def test_in_flight_inputs_are_fills_of_the_previous_samples(llm, known):
    planner = fresh_planner(llm)
    size = llm.engine.cache.block_size
    rng = torch.Generator().manual_seed(1)
    rs = requests(4, size, rng, llm.engine.cache.kv.shape[0])
    planner.plan([ScheduledRequest(r, r.num_tokens) for r in rs])
    for i, r in enumerate(rs):  # overlapped: each prompt's sample still on the device, in
        r.num_computed_tokens = r.num_tokens  # sample rows that are not the row order
        r.num_inflight, r.inflight_row = 1, 3 - i
    if known:  # this one's token is known
        rs[1].num_inflight = 0
        rs[1].output_token_ids.append(42)
    fast, ordered = planner.plan([ScheduledRequest(r, 1) for r in rs])
    assert planner.rows.advances == 1
    slow, _ = planner._plan_spans(ordered)
    assert_same_batch(llm, fast, slow)
    pairs = list(zip(fast.input_fills.where.tolist(), fast.input_fills.source.tolist()))
    expected = list(zip(slow.input_fills.where.tolist(), slow.input_fills.source.tolist()))
    assert pairs == expected and len(pairs) == 4 - known
    if known:
        assert fast.input_ids[[s.request for s in ordered].index(rs[1])] == 42


def kept_then(llm, change) -> bool:
    """Whether a decode step is planned from the kept rows after `change(requests)`."""
    planner = fresh_planner(llm)
    size = llm.engine.cache.block_size
    rs = requests(4, size, torch.Generator().manual_seed(2), llm.engine.cache.kv.shape[0])
    planner.plan([ScheduledRequest(r, r.num_tokens) for r in rs])
    decode_one(rs)
    rows = change(rs) or [ScheduledRequest(r, 1) for r in rs]
    planner.plan(rows)
    return planner.rows.advances == 1


def test_anything_but_a_decode_of_the_kept_requests_is_planned_from_spans(llm):
    size = llm.engine.cache.block_size
    assert kept_then(llm, lambda rs: None)

    def joined(rs):  # a request that was not in the step before
        new = requests(1, size, torch.Generator().manual_seed(9), 4)[0]
        new.block_ids = [0]
        new.prompt_token_ids = [3]
        return [ScheduledRequest(r, 1) for r in [*rs, new]]

    def recomputed(rs):  # preempted and back: its length is not the kept one's
        rs[0].num_computed_tokens -= 1

    def ran_unseen(rs):  # a decode of its last token, one token past the kept length
        decode_one(rs[3:])

    def chunk(rs):  # two tokens for one request
        rs[1].output_token_ids.append(9)
        return [ScheduledRequest(r, 2 if i == 1 else 1) for i, r in enumerate(rs)]

    def scoring(rs):  # prompt logprobs: the planner scores them from spans
        rs[2].sampling = replace(GREEDY, prompt_logprobs=1)

    for change in (joined, recomputed, ran_unseen, chunk, scoring):
        assert not kept_then(llm, change), change.__name__


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_an_engine_gives_the_same_tokens_with_and_without_the_kept_rows(
    tiny_model_dir, tiny_adapters, overlap
):
    prompts = ["the quick brown fox", "hello world", "paged attention keeps", "numbers 0123"]
    params = [
        replace(GREEDY, max_tokens=40),
        replace(GREEDY, max_tokens=23, logprobs=2),  # leaves early: rows leave mid-way
        replace(GREEDY, max_tokens=40, temperature=0.8, seed=3),
        replace(GREEDY, max_tokens=40),
    ]
    adapters = ["r4", "r8", None, "r4"]
    results = []
    for keep in (None, True, False):
        llm = tiny_llm(tiny_model_dir, overlap=overlap, max_batch_size=8)
        for name in ("r4", "r8"):
            llm.load_adapter(name, str(tiny_adapters[name]))
        if keep is None:  # a stop token the last request meets mid-way: under overlap
            # its row in the next step is wasted, and the rows after it move up one
            ids = llm.generate(prompts[3:], adapters[3:], params[3:])[0].token_ids
            stop = next(t for i, t in enumerate(ids) if i >= 10 and t not in ids[:i])
            params[3] = replace(params[3], stop_token_ids=(stop,))
            continue
        planner = llm.engine.planner
        if not keep:
            planner.rows = None
        outs = llm.generate(prompts, adapters, params)
        results.append([(o.token_ids, o.text, o.finish_reason) for o in outs])
        if keep:
            assert planner.rows.advances >= 30
        flat = [(e.token_id, e.logprob) for e in outs[1].logprobs]
        results[-1].append(flat)
        llm.engine.shutdown()
    assert results[0] == results[1]
    assert len(results[0][3][0]) < 40  # it stopped at its stop token


def test_an_engine_that_swaps_kv_keeps_no_rows(tiny_model_dir):
    """MLFQ swaps KV to the host and back: a swapped-in request has new blocks at the same
    length, which kept tables would not know; its engine plans every step from spans."""
    swapping = tiny_llm(tiny_model_dir, policy="mlfq", num_blocks=32, swap_blocks=64)
    assert swapping.engine.swap is not None and swapping.engine.planner.rows is None
    plain = tiny_llm(tiny_model_dir, num_blocks=32)
    assert plain.engine.swap is None and plain.engine.planner.rows is not None
