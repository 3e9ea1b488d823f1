"""DistKV over in-process runners (tiny model): a request too long for its runner borrows
blocks on peers, computes attention where they live, and its greedy output equals one runner
with room for all of it; losing a creditor mid-decode recomputes it with the same output;
admission and growth stop at the cluster's capacity with errors that say so."""

from __future__ import annotations

import asyncio
import time

import pytest
from kv_engines import BLOCK, GREEDY, PROMPT, engine, network, run

from punica_x.attention import get_attention_backend
from punica_x.config import BatchConfig, CacheConfig, EngineConfig, ModelConfig
from punica_x.core import FinishReason, SamplingParams
from punica_x.engine import Engine
from punica_x.models.loader import load_model
from punica_x.request import EngineRequest
from scheduler.distkv.network import default_caps


@pytest.fixture(scope="module")
def reference(shared):
    big = engine(shared, 64)
    short = PROMPT[:20]
    return {k: v.token_ids for k, v in run(big, [PROMPT, short]).items()}


@pytest.mark.parametrize(("chunk", "overlap"), [(16, False), (100, True), (2048, False)])
def test_a_request_longer_than_its_runner_borrows_and_matches_one_big_runner(
    shared, reference, chunk, overlap
):
    a, b, c = engine(shared, 4, chunk), engine(shared, 6), engine(shared, 6)
    net = network({"a": a, "b": b, "c": c}, overlap)
    most = []

    def watch(_):
        r = a.requests.get("q0")
        if r is not None:
            most.append(sum(len(e.block_ids) for e in r.remote))

    out = run(a, [PROMPT, PROMPT[:20]], on_step=watch)
    assert out["q0"].token_ids == reference["q0"]
    assert out["q1"].token_ids == reference["q1"]  # a plain request in the same batches
    # 12 blocks: 3 local (it leaves a quarter of a's 4 to the others: HEADROOM), 9 borrowed
    assert max(most) == 9
    assert b.distkv.rmanager.calls > 0 and c.distkv.rmanager.calls > 0
    # everything went back: the ledger holds no debt, every cache is free again
    assert net.ledger.debts() == {}
    assert [e.cache.allocator.num_free for e in (a, b, c)] == [4, 6, 6]


def test_a_creditor_lost_mid_decode_recomputes_with_identical_output(shared, reference):
    a, b, c = engine(shared, 4), engine(shared, 10), engine(shared, 10)
    net = network({"a": a, "b": b, "c": c})
    killed = []

    def kill(steps):
        r = a.requests.get("q0")
        if not killed and r is not None and len(r.output_token_ids) == 20:
            holder = r.remote[0].owner
            net.remove(holder, dead=True)
            killed.append(holder)

    out = run(a, [PROMPT], on_step=kill)
    assert killed and out["q0"].token_ids == reference["q0"]
    assert a.distkv.peer_losses == 1 and out["q0"].finish_reason is FinishReason.LENGTH
    survivor = c if killed[0] == "b" else b
    assert survivor.cache.allocator.num_free == 10 and net.ledger.debts() == {}


def test_a_refused_borrow_waits_for_room_then_completes(shared, reference):
    a, b = engine(shared, 4), engine(shared, 10)
    net = network({"a": a, "b": b})
    own = b.cache.allocator.allocate(10)  # b's own work holds every block for a while
    released = []

    def release(steps):
        if steps == 5:
            b.cache.allocator.free(own)
            released.append(a.batcher.borrowing.refusals)

    out = run(a, [PROMPT], on_step=release)
    assert released[0] > 0  # it asked and was refused before room appeared
    assert out["q0"].token_ids == reference["q0"]
    assert net.ledger.refusals > 0


@pytest.mark.parametrize("patience", [0.05, float("inf")])
def test_a_borrow_refused_for_give_up_s_ends_with_an_error_not_a_wait_forever(shared, patience):
    """b's own work holds every block: a's too-long request is refused again and again. After
    give_up_s of refusals in all (over its yields, each of which restarts the patience clock)
    it ends with ERROR and an error naming the wait; a's blocks and the ledger come back
    clean, and a short request on a still runs."""
    a, b = engine(shared, 4), engine(shared, 10)
    net = network({"a": a, "b": b})
    b.cache.allocator.allocate(10)
    a.batcher.borrowing.patience_s, a.batcher.borrowing.give_up_s = patience, 0.4
    t0 = time.monotonic()
    final = {}
    a.add_request(PROMPT, GREEDY, request_id="q0")
    while a.has_unfinished() and time.monotonic() - t0 < 10:
        final.update({o.request_id: o for o in a.step() if o.finished})
        time.sleep(0.005)
    out = final["q0"]
    assert out.finish_reason is FinishReason.ERROR
    assert "no peer runner lent the KV blocks" in out.error and "for 0.4 s" in out.error
    assert time.monotonic() - t0 >= 0.4
    if patience < 0.4:
        assert a.batcher.borrowing.yields >= 1  # the yields did not reset the give-up clock
    assert a.cache.allocator.num_free == 4 and net.ledger.debts() == {}
    assert run(a, [PROMPT[:20]])["q0"].finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("patience", [0.2, None])
def test_two_borrowers_holding_what_the_other_needs_do_not_wait_forever(shared, patience):
    """a (on A) holds A's 6 blocks and 3 of B's, and will need 2 more of B's; b (on B) holds
    B's other 3 and needs 4 of A's: each waits for the other. After `patience` seconds of
    refusals one gives its blocks back and starts over; both complete with the greedy tokens
    of one big runner and every block comes home. patience None (waiting forever, the
    behaviour without the guard) leaves both stuck: the test's control."""
    pa = [(i * 7) % 200 + 3 for i in range(130)]  # 170 tokens with the output: 11 blocks
    pb = [(i * 5) % 190 + 7 for i in range(110)]  # 150: 10 blocks
    want = {k: v.token_ids for k, v in run(engine(shared, 64), [pa, pb]).items()}
    a, b = engine(shared, 6), engine(shared, 6)
    net = network({"a": a, "b": b})
    for e in (a, b):
        e.batcher.borrowing.patience_s = patience if patience is not None else float("inf")
        e.batcher.borrowing.headroom_fraction = 0  # the deadlock's blocks as counted above
    a.add_request(pa, GREEDY, request_id="q0")
    final = {}
    while not a.requests["q0"].remote:  # a is prefilled, on 3 of B's blocks
        a.step()
    b.add_request(pb, GREEDY, request_id="q1")
    deadline = time.monotonic() + (10 if patience is not None else 3)
    while (a.has_unfinished() or b.has_unfinished()) and time.monotonic() < deadline:
        outs = a.step() + b.step()
        final.update({o.request_id: o for o in outs if o.finished})
        if not outs:
            time.sleep(0.005)
    if patience is None:
        assert not final, "nothing held them up: the test's deadlock is not one"
        return
    assert {k: v.token_ids for k, v in final.items()} == want
    assert a.batcher.borrowing.yields + b.batcher.borrowing.yields >= 1
    assert [e.cache.allocator.num_free for e in (a, b)] == [6, 6]
    assert net.ledger.debts() == {}


def test_admission_and_growth_stop_at_the_cluster_capacity(shared):
    a, b = engine(shared, 4), engine(shared, 6)
    alone = engine(shared, 4)
    long = [5] * 150
    with pytest.raises(ValueError, match="the KV cache holds 64"):
        alone.check_prompt(long)  # without DistKV: one runner's cache
    network({"a": a, "b": b})
    assert a.distkv.capacity_blocks() == 4 + 5  # b lends 90% of its 6 blocks
    a.check_prompt(long[:143])
    with pytest.raises(ValueError, match=r"KV caches \(DistKV\) hold 144"):
        a.check_prompt(long)
    out = run(a, [long[:130]])["q0"]  # fits to 144 tokens, asks for 170
    assert out.finish_reason is FinishReason.LENGTH and len(out.token_ids) == 15
    assert "the cluster's KV caches hold 144 tokens" in out.error


def cluster(shared, sizes, distkv=True, policy="fcfs"):
    from scheduler.cluster import Scheduler
    from scheduler.runners.local import LocalRunner

    runners = []
    for i, n in enumerate(sizes):
        config = EngineConfig(
            model=ModelConfig(model="unused", dtype="float32"),
            cache=CacheConfig(block_size=BLOCK, num_blocks=n),
            batch=BatchConfig(max_batched_tokens=64, policy=policy),
        )
        runners.append(LocalRunner(config, f"runner-{i}", shared=shared))
    return Scheduler(runners, distkv=distkv)


def test_the_scheduler_places_a_too_long_request_and_the_runners_lend(shared, reference):
    """Thread runners of 6 blocks each: a 190-token request (12 blocks) is placed on one,
    borrows on the others (7 blocks: it leaves 1 of its runner's 6 free for others,
    HEADROOM), and the admin view shows the loans while it runs."""
    from punica_x.errors import ContextTooLong

    async def main():
        sched = cluster(shared, [6, 6, 6])
        stream = await sched.open(EngineRequest(PROMPT, GREEDY, None, "long"))
        tokens, views = [], []
        async for out in stream:
            tokens += out.new_token_ids
            if len(tokens) == 30:
                views = sched.runners()
        with pytest.raises(ContextTooLong, match=r"KV caches \(DistKV\) hold 256"):
            await sched.open(EngineRequest([5] * 300, GREEDY, None, "too-long"))  # 6 + 5 + 5 blocks
        after = sched.runners()
        sched.shutdown()
        return tokens, views, after

    tokens, views, after = asyncio.run(main())
    assert tokens == reference["q0"]
    borrowed = {v.id: v.kv_blocks_borrowed for v in views}
    lent = {v.id: v.kv_blocks_lent for v in views}
    home = max(borrowed, key=borrowed.get)
    assert borrowed[home] == 7 and sum(lent.values()) == 7 and lent[home] == 0
    assert all(v.kv_blocks_lent == v.kv_blocks_borrowed == 0 for v in after)
    calls = {v.id: v.remote_attention_calls for v in after}  # only the debtor sends
    assert calls[home] > 0 and sum(calls.values()) == calls[home]
    assert all((v.remote_attention_seconds > 0) == (v.id == home) for v in after)


@pytest.mark.parametrize("kind", ["no-distkv", "mlfq"])
def test_without_distkv_the_same_request_is_refused_naming_one_runner(shared, kind):
    """--no-distkv, or the mlfq policy (its KV swapping does not move borrowed blocks, so its
    runners are left out of DistKV, logged): a too-long prompt is refused as on one runner,
    and the cluster still starts."""
    from punica_x.errors import ContextTooLong

    async def main():
        if kind == "mlfq":
            sched = cluster(shared, [6, 6], policy="mlfq")
        else:
            sched = cluster(shared, [6, 6, 6], distkv=False)
        try:
            assert all(s.handle.engine.distkv.rmanager is None for s in sched.slots)
            with pytest.raises(ContextTooLong, match="the KV cache holds 96"):
                await sched.open(EngineRequest(PROMPT, GREEDY, None, "long"))
        finally:
            sched.shutdown()

    asyncio.run(main())


def test_dgfm_swaps_a_debt_cycle_home_and_the_outputs_stay_identical(shared):
    """A lends to B while B's request borrows on A (A's short request freed its blocks):
    a 2-cycle of 10 blocks. The swap brings each side's blocks home, keeps every runner's
    memory use, and both long requests finish exactly as on one big runner."""
    long_a = [(i * 5) % 200 + 3 for i in range(330)]  # 21 blocks, 22 by the end
    long_b = [(i * 11) % 200 + 3 for i in range(230)]  # 15 blocks
    short = [(i * 3) % 200 + 3 for i in range(150)]  # 10 blocks, done after its prefill
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    big = engine(shared, 64)
    want = {}
    for i, p in enumerate((long_a, long_b)):
        big.add_request(p, sp, request_id=f"w{i}")
    while big.has_unfinished():
        want.update({o.request_id: o.token_ids for o in big.step() if o.finished})
    a, b, c = engine(shared, 20), engine(shared, 14), engine(shared, 4)
    net = network({"a": a, "b": b, "c": c})
    for e in (a, b, c):
        e.batcher.borrowing.headroom_fraction = 0  # the cycle's blocks as counted here
    a.add_request(short, SamplingParams(max_tokens=1), request_id="s")
    a.add_request(long_a, sp, request_id="w0")
    outs = {o.request_id: o for o in a.step()}  # prefills: w0 takes 10 local + 11 on b
    assert outs["s"].finished and a.cache.allocator.num_free == 10
    b.add_request(long_b, sp, request_id="w1")
    outs.update({o.request_id: o for o in b.step()})  # 3 local + 12 borrowed, 10 of them on a
    debts = net.ledger.debts()
    assert debts[("a", "b")] == 11 and debts[("b", "a")] == 10
    used = [e.cache.allocator.num_used for e in (a, b, c)]
    swaps = net.defragment({"a": a, "b": b, "c": c}, min_swap=4)
    assert [(s.cycle, s.blocks) for s in swaps] == [(("a", "b"), 10)]
    after = net.ledger.debts()
    assert after[("a", "b")] == 1 and ("b", "a") not in after
    assert [e.cache.allocator.num_used for e in (a, b, c)] == used  # no block lost or made
    home = {
        rid: sum(len(x.block_ids) for x in e.requests[w].remote if x.owner == rid)
        for rid, e, w in (("a", a, "w0"), ("b", b, "w1"))
    }
    assert home == {"a": 10, "b": 10}
    final = {}
    while a.has_unfinished() or b.has_unfinished():
        for e in (a, b):
            final.update({o.request_id: o.token_ids for o in e.step() if o.finished})
    assert final == want
    assert net.ledger.debts() == {}
    assert [e.cache.allocator.num_free for e in (a, b, c)] == [20, 14, 4]


def test_paused_holds_every_runner_between_steps_while_fn_runs(shared):
    """DGFM swaps run with the cycle's runners paused: a command sent to a paused runner
    waits until the swap is done."""
    import threading

    from scheduler.distkv.group import paused

    async def main():
        sched = cluster(shared, [6, 6])
        handles = [s.handle for s in sched.slots]
        ran = threading.Event()

        def swap():
            late = handles[0].async_engine.submit(ran.set)
            assert not ran.wait(0.3), "a paused runner ran a command"
            return late

        try:
            late = await asyncio.to_thread(paused, handles, swap)
            await asyncio.wrap_future(late)
            assert ran.is_set()
            assert await sched.defragment_kv() == []  # no debts, nothing to swap
        finally:
            sched.shutdown()

    asyncio.run(main())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_invariant_borrowing_gives_one_big_runners_bits(tiny_model_dir, dtype):
    """batch_invariant=on: a request that borrows (prefilled in chunks of 16, 8 of its 12 blocks
    on two peers) gets the tokens and logprob bits of one runner with room for all of it, and
    so does a plain request in its batches: its attention's parts run one after another in key
    order, each going on from the state the one before left (attention.dist). With the parts'
    results merged instead, the borrower's logprobs differ (float32 and bfloat16 here)."""
    model = ModelConfig(model=str(tiny_model_dir), dtype=dtype, batch_invariant="on")
    shared = load_model(model)
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=2)

    def make(num_blocks, chunk=2048):
        config = EngineConfig(
            model=ModelConfig(model="unused", dtype=dtype, batch_invariant="on"),
            cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks),
            batch=BatchConfig(max_batched_tokens=chunk),
        )
        return Engine(config, shared)

    def results(e):
        for i, p in enumerate([PROMPT, PROMPT[:20]]):
            e.add_request(p, sp, request_id=f"q{i}")
        outs = {}
        while e.has_unfinished():
            outs.update((o.request_id, o) for o in e.step() if o.finished)
        lps = {k: [(lp.logprob, lp.top) for lp in o.logprobs] for k, o in outs.items()}
        return {k: (o.token_ids, lps[k]) for k, o in outs.items()}

    big = make(64)
    assert big.invariance.on
    want = results(big)
    a, b, c = make(4, 16), make(6), make(6)
    net = network({"a": a, "b": b, "c": c})
    assert a.planner.dist.fixed_order and not a.planner.dist.overlap
    assert results(a) == want
    assert b.distkv.rmanager.calls > 0 and c.distkv.rmanager.calls > 0
    assert net.ledger.debts() == {}
    # an attention backend without the kernel's state (CUDA's Triton one) is refused up front
    d = make(4)
    d.planner.attention = get_attention_backend("cpu", "torch")
    with pytest.raises(ValueError, match="chains the CPU attention kernel's state"):
        d.distkv.enable("d", net.add_runner("d"), default_caps(4))
