"""DistKV's socket data plane (scheduler/distkv/channel.py): a debtor's KVChannel to a creditor's
KVChannelServer gives exactly what calling the creditor's rManager directly gives (out, lse
and the K/V written into the lent blocks), over the Unix socket and over TCP, in float32 and
bfloat16; the creditor's errors come back as themselves; a creditor that is gone, or a key
that is not the group's, is PeerLost."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch
from helpers import random_micro_plan

from punica_x.attention import get_attention_backend
from punica_x.attention.paged import SeqSpan
from punica_x.kv.blocks import KVCache, KVCacheSpec
from punica_x.kv.rmanager import LendCaps, MicroPlan, PeerLost, RManager
from scheduler.distkv.channel import ChannelAddress, KVChannel, KVChannelServer

LAYERS, KV_HEADS, HEADS, DIM, BLOCK = 2, 2, 4, 8, 4
KEY = b"k" * 32


def creditor(dtype: torch.dtype, seed: int, backend: str = "torch") -> RManager:
    spec = KVCacheSpec(LAYERS, KV_HEADS, DIM, BLOCK, dtype)
    cache = KVCache(spec, 16, torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=g).to(dtype))
    return RManager("c", cache, get_attention_backend("cpu", backend), LendCaps(12, 4))


@pytest.mark.parametrize("family", ["unix", "tcp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_channel_returns_what_the_rmanager_returns(family, dtype):
    rng = random.Random(hash((family, str(dtype))) & 0xFFFF)
    remote, direct = creditor(dtype, 5), creditor(dtype, 5)
    ids = remote.lend("d", "r", 6)
    assert direct.lend("d", "r", 6) == ids
    server = KVChannelServer(remote, KEY, node="here")
    # the debtor on another node reaches the creditor over TCP
    ch = KVChannel("c", server.address, "d", "here" if family == "unix" else "elsewhere", KEY)
    try:
        for step in range(3):
            plan, rows, written = random_micro_plan(ids, rng, BLOCK)
            micro_ch, micro = ch.prepare("d", plan), direct.prepare("d", plan)
            for layer in range(LAYERS):
                g = torch.Generator().manual_seed(100 * step + layer)
                q = torch.randn(rows, HEADS, DIM, generator=g).to(dtype)
                k = torch.randn(written, KV_HEADS, DIM, generator=g).to(dtype)
                v = torch.randn(written, KV_HEADS, DIM, generator=g).to(dtype)
                out, lse = micro_ch.run(layer, q, k, v, 0.35)
                want_out, want_lse = micro.run(layer, q, k, v, 0.35)
                assert out.dtype == dtype and lse.dtype == torch.float32
                assert torch.equal(out, want_out.to(dtype)) and torch.equal(lse, want_lse)
        assert torch.equal(remote.cache.kv, direct.cache.kv)  # the same K/V written
        assert server.frames == 3 * (1 + LAYERS)
    finally:
        ch.close()
        server.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_chained_run_returns_the_rmanagers_state(dtype):
    """The batch-invariant order's frame (attention.dist): the state the creditor's kernel
    goes on to, bit for bit as a direct call gives it; a state of the wrong size is refused
    by the creditor, which serves on."""
    rng = random.Random(7)
    remote, direct = creditor(dtype, 3, "cpu"), creditor(dtype, 3, "cpu")
    ids = remote.lend("d", "r", 6)
    assert direct.lend("d", "r", 6) == ids
    server = KVChannelServer(remote, KEY, node="here")
    ch = KVChannel("c", server.address, "d", "here", KEY)
    try:
        plan, rows, written = random_micro_plan(ids, rng, BLOCK)
        micro_ch, micro = ch.prepare("d", plan), direct.prepare("d", plan)
        g = torch.Generator().manual_seed(11)
        q = torch.randn(rows, HEADS, DIM, generator=g).to(dtype)
        k = torch.randn(written, KV_HEADS, DIM, generator=g).to(dtype)
        v = torch.randn(written, KV_HEADS, DIM, generator=g).to(dtype)
        state = torch.randn(rows, HEADS, DIM + 2, generator=g)
        state[..., DIM + 1] = state[..., DIM + 1].abs() + 1  # a sum so far, positive
        got = micro_ch.run(1, q, k, v, 0.35, state=state.clone())
        want = micro.run(1, q, k, v, 0.35, state=state.clone())
        assert got.dtype == torch.float32 and torch.equal(got, want)
        assert not torch.equal(got, state)  # it went on over the lent keys
        with pytest.raises(ValueError, match="needs its state"):
            micro_ch.run(1, q, k, v, 0.35, state=state[:, :, :-1])
        assert torch.equal(micro_ch.run(1, q, k, v, 0.35, state=state.clone()), want)
    finally:
        ch.close()
        server.close()


@contextlib.contextmanager
def connected(seed: int):
    """A float32 creditor serving on a channel server, and debtor d's channel to it."""
    rm = creditor(torch.float32, seed)
    server = KVChannelServer(rm, KEY, node="n")
    ch = KVChannel("c", server.address, "d", "n", KEY)
    try:
        yield rm, server, ch
    finally:
        ch.close()
        server.close()


def test_no_new_kv_rows_and_the_creditors_errors_come_back():
    with connected(1) as (rm, _, ch):
        ids = rm.lend("d", "r", 2)
        other = rm.lend("d2", "r2", 1)
        plan = MicroPlan(("r",), (SeqSpan(0, 1, 5, list(ids)),), (), ())
        empty, q = torch.empty(0, KV_HEADS, DIM), torch.randn(1, HEADS, DIM)
        out, lse = ch.prepare("d", plan).run(1, q, empty, empty, 0.3)
        want_out, want_lse = rm.prepare("d", plan).run(1, q, empty, empty, 0.3)
        assert torch.equal(out, want_out) and torch.equal(lse, want_lse)
        stray = MicroPlan(("r",), (SeqSpan(0, 1, 2, list(other)),), (), ())
        with pytest.raises(ValueError, match="not lent to d"):
            ch.prepare("d", stray)
        rm.stop()  # the creditor stopped: its PeerLost names the owner the debtor knows
        with pytest.raises(PeerLost) as lost:
            ch.prepare("d", plan)
        assert lost.value.owner == "c"


def test_a_creditor_that_is_gone_is_peer_lost():
    with connected(2) as (rm, server, ch):
        ids = rm.lend("d", "r", 2)
        plan = MicroPlan(("r",), (SeqSpan(0, 1, 5, list(ids)),), (), ())
        ch.prepare("d", plan)
        server.close()  # its process died: the socket closes under the debtor
        with pytest.raises(PeerLost):
            ch.prepare("d", plan)
        assert ch.conn is None
        with pytest.raises(PeerLost):  # and stays lost
            ch.prepare("d", plan)
        gone = ChannelAddress("n", server.address.unix, server.address.tcp)
        with pytest.raises(PeerLost):  # nothing listens there any more
            KVChannel("c", gone, "d", "n", KEY)


def test_a_debtor_without_the_groups_key_is_refused():
    rm = creditor(torch.float32, 3)
    server = KVChannelServer(rm, KEY, node="n")
    try:
        with pytest.raises(PeerLost):
            KVChannel("c", server.address, "d", "n", b"x" * 32)
        ch = KVChannel("c", server.address, "d", "n", KEY)  # the server still serves
        ids = rm.lend("d", "r", 1)
        ch.prepare("d", MicroPlan(("r",), (SeqSpan(0, 1, 3, list(ids)),), (), ()))
        ch.close()
    finally:
        server.close()


def test_a_server_without_a_real_key_is_refused():
    """multiprocessing skips authentication for an empty key: the server will not start so."""
    with pytest.raises(ValueError, match="authkey"):
        KVChannelServer(creditor(torch.float32, 4), b"", node="n")


def test_two_plans_prepared_with_one_creditor_each_run_their_own():
    """The batch-invariant order sends a request's extents round by round; when one creditor
    holds two of them, the debtor prepares two plans there before running either: each run
    goes to its own plan (one connection kept only the last: 'shape mismatch' on the
    creditor, or keys of the wrong plan). A plan past the newest KEPT_PLANS is refused."""
    from scheduler.distkv.channel import KEPT_PLANS

    with connected(6) as (rm, _, ch):
        first, second = rm.lend("d", "r", 2), rm.lend("d", "r", 3)
        plans = [
            MicroPlan(("r",), (SeqSpan(0, 1, 8, list(first)),), (first[1],), (1,)),
            MicroPlan(("r",), (SeqSpan(0, 1, 12, list(second)),), (), ()),
        ]
        g = torch.Generator().manual_seed(3)
        q = torch.randn(1, HEADS, DIM, generator=g)
        new = torch.randn(1, KV_HEADS, DIM, generator=g)
        none = torch.empty(0, KV_HEADS, DIM)
        args = [(new, new), (none, none)]  # the first plan writes one token, the second none
        prepared = [ch.prepare("d", p) for p in plans]
        got = [prepared[i].run(0, q, *args[i], 0.3) for i in (1, 0)]  # either order
        want = [rm.prepare("d", plans[i]).run(0, q, *args[i], 0.3) for i in (1, 0)]
        for (o, s), (wo, ws) in zip(got, want):
            assert torch.equal(o, wo) and torch.equal(s, ws)
        for _ in range(KEPT_PLANS):
            ch.prepare("d", plans[1])
        with pytest.raises(RuntimeError, match="run before prepare"):
            prepared[0].run(0, q, new, new, 0.3)


def test_ray_transport_runs_each_prepared_plan_too():
    """The same over Ray's transport (actor methods kv_prepare / kv_run, called here without
    Ray): two plans prepared with one creditor each run their own."""
    from scheduler.distkv.actor import KVActorMethods

    rm = creditor(torch.float32, 8)
    actor = KVActorMethods.__new__(KVActorMethods)
    actor.rm, actor.micro = rm, {}
    first, second = rm.lend("d", "r", 2), rm.lend("d", "r", 3)
    plans = [
        MicroPlan(("r",), (SeqSpan(0, 1, 8, list(first)),), (), ()),
        MicroPlan(("r",), (SeqSpan(0, 1, 12, list(second)),), (), ()),
    ]
    q, none = torch.randn(1, HEADS, DIM), torch.empty(0, KV_HEADS, DIM)
    for slot, plan in enumerate(plans):
        actor.kv_prepare("d", plan, slot)
    for slot, plan in enumerate(plans):
        got = actor.kv_run("d", 0, q, none, none, 0.3, None, slot)
        want = rm.prepare("d", plan).run(0, q, none, none, 0.3)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    actor.kv_reclaim_debtor("d")
    assert actor.micro == {}
