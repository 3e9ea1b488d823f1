"""DistKV between Ray runners (actors in their own processes).

Control plane: the gManager's ledger lives in a small actor of its own (GManagerActor), so
every runner reaches it without the scheduler; it stamps heartbeats with its own clock
(processes' monotonic clocks differ). A debtor's borrower asks its peers for heartbeats when
the ledger's are older than HEARTBEAT_S, then for suggestions, then asks the creditors in
turn (RunnerActor.kv_lend). Data plane (transport "socket", the default): every runner
serves its rManager on a KVChannelServer (scheduler/distkv/channel.py; a Unix socket for peers
on its node, TCP for the others, the group's key authenticates) and a debtor keeps one
KVChannel per creditor: per step the MicroPlan, per layer one frame with the query rows and
new K/V, (out, lse) back; straight between the runner processes, never through the scheduler
or Ray. Transport "ray" sends the same calls as Ray actor calls (kv_prepare / kv_run; ~2.8 ms
a round trip, kept to measure against). A creditor whose process is gone raises PeerLost.

ray is imported on first use."""

from __future__ import annotations

import os
import threading
import time
import uuid
from dataclasses import dataclass

from punica_x.api import MicroPlan, PeerLost, RemoteExtent
from scheduler.distkv.channel import ChannelAddress, KVChannel
from scheduler.distkv.ledger import DebtLedger, Heartbeat

TRANSPORTS = ("socket", "ray")

HEARTBEAT_S = 0.2  # a borrower refreshes the ledger's heartbeats when older than this
CALL_TIMEOUT_S = 30.0


class GManagerActor:
    """The Global Debt Ledger as a Ray actor (methods run one at a time)."""

    def __init__(self) -> None:
        self.ledger = DebtLedger()
        self.beaten = float("-inf")

    def heartbeats(self, beats: list[Heartbeat]) -> None:
        now = time.monotonic()
        for b in beats:
            self.ledger.heartbeat(Heartbeat(b.runner_id, b.free_blocks, now, b.node))
        self.beaten = now

    def age(self) -> float:
        return time.monotonic() - self.beaten

    def suggest(self, debtor: str, num_blocks: int) -> list[str]:
        return self.ledger.suggest(debtor, num_blocks, time.monotonic())

    def lent(self, debtor: str, creditor: str, blocks: int) -> None:
        self.ledger.lent(debtor, creditor, blocks)

    def returned(self, debtor: str, creditor: str, blocks: int) -> None:
        self.ledger.returned(debtor, creditor, blocks)

    def refused(self, creditor: str) -> None:
        self.ledger.refused(creditor)

    def forget(self, runner_id: str) -> None:
        self.ledger.forget(runner_id)

    def debts(self) -> dict[tuple[str, str], int]:
        return self.ledger.debts()


@dataclass(frozen=True)
class DataPlane:
    """How a runner reaches its creditors' micro-attention: `transport` (TRANSPORTS), the
    group's `authkey` and this runner's `node` (a peer on the same node is reached over its
    Unix socket)."""

    transport: str
    authkey: bytes
    node: str


class RayBorrower:
    """A runner actor's KVBorrower: `peers` are the other runners' actor handles and
    `addresses` their channel servers, `capacity` the blocks they could lend together (their
    caps; `shares`: each one's), all updated as runners come and go; a peer found gone before
    that update (lost) leaves the capacity at once. `local`: this runner's own RManager (extents
    of its own blocks, past a borrowed part, go through it)."""

    def __init__(
        self, runner_id: str, gmanager, peers: dict, capacity: int, plane: DataPlane
    ) -> None:
        self.runner_id = runner_id
        self.gmanager = gmanager
        self.peers = dict(peers)
        self.capacity = capacity
        self.shares: dict[str, int] = {}
        self.gone: set[str] = set()  # peers found gone since the last membership update
        self.plane = plane
        self.addresses: dict[str, ChannelAddress] = {}
        self.local = None
        self._channels: dict[str, KVChannel] = {}
        self._lock = threading.Lock()

    def set_peers(
        self, peers: dict, addresses: dict, capacity: int, shares: dict | None = None
    ) -> None:
        """Membership changed: channels to runners that left (or moved) are closed."""
        self.peers, self.capacity = dict(peers), capacity
        self.shares, self.gone = dict(shares or {}), set()
        self.addresses = dict(addresses)
        with self._lock:
            for rid in list(self._channels):
                if self.addresses.get(rid) != self._channels[rid].address:
                    self._channels.pop(rid).close()

    def _get(self, ref):
        import ray

        return ray.get(ref, timeout=CALL_TIMEOUT_S)

    def _refresh(self) -> None:
        import ray

        if self._get(self.gmanager.age.remote()) < HEARTBEAT_S:
            return
        beats = []
        for handle in list(self.peers.values()):
            try:
                beats.append(self._get(handle.kv_heartbeat.remote()))
            except ray.exceptions.RayError:
                continue  # gone: its stale heartbeat ages out of the suggestions
        self._get(self.gmanager.heartbeats.remote(beats))

    def borrow(self, request_id: str, num_blocks: int) -> list[RemoteExtent] | None:
        import ray

        self._refresh()
        got: list[RemoteExtent] = []
        left = num_blocks
        for creditor in self._get(self.gmanager.suggest.remote(self.runner_id, num_blocks)):
            handle = self.peers.get(creditor)
            try:
                ids = self._get(handle.kv_lend.remote(self.runner_id, request_id, left))
            except (ray.exceptions.RayError, AttributeError):
                ids = None
            if ids is None:
                self.gmanager.refused.remote(creditor)
                continue
            self.gmanager.lent.remote(self.runner_id, creditor, len(ids))
            got.append(RemoteExtent(creditor, tuple(ids)))
            left -= len(ids)
            if left == 0:
                return got
        self.give_back(request_id, got)
        return None

    def give_back(self, request_id: str, extents: list[RemoteExtent]) -> None:
        for e in extents:
            handle = self.peers.get(e.owner)
            if handle is None:
                continue  # gone, and its blocks with it
            handle.kv_reclaim.remote(self.runner_id, request_id, e.block_ids)
            self.gmanager.returned.remote(self.runner_id, e.owner, len(e.block_ids))

    def peer(self, owner: str):
        if owner == self.runner_id and self.local is not None:
            return self.local
        handle = self.peers.get(owner)
        if handle is None:
            raise PeerLost(owner)
        if self.plane.transport == "ray":
            return RayPeer(owner, handle, self._get)
        return self._channel(owner)

    def _channel(self, owner: str) -> KVChannel:
        with self._lock:
            ch = self._channels.get(owner)
            if ch is None or ch.conn is None:
                address = self.addresses.get(owner)
                if address is None:
                    raise PeerLost(owner)
                ch = KVChannel(owner, address, self.runner_id, self.plane.node, self.plane.authkey)
                self._channels[owner] = ch
            return ch

    def close(self) -> None:
        with self._lock:
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()

    def capacity_blocks(self) -> int:
        return self.capacity - sum(self.shares.get(owner, 0) for owner in self.gone)

    def lost(self, owner: str) -> None:
        self.gone.add(owner)


class RayPeer:
    def __init__(self, owner: str, handle, get) -> None:
        self.owner, self.handle, self._get = owner, handle, get
        self._slot = 0  # the next plan's slot (one debtor may prepare several in a step)

    def prepare(self, debtor: str, plan: MicroPlan) -> RayMicro:
        import ray

        slot, self._slot = self._slot, (self._slot + 1) % 2**32
        try:
            self._get(self.handle.kv_prepare.remote(debtor, plan, slot))
        except ray.exceptions.RayActorError:
            raise PeerLost(self.owner) from None
        except ray.exceptions.RayTaskError as exc:
            raise _cause(exc, self.owner) from None
        return RayMicro(self, debtor, slot)


class RayMicro:
    def __init__(self, peer: RayPeer, debtor: str, slot: int = 0) -> None:
        self.peer, self.debtor, self.slot = peer, debtor, slot

    def run(self, layer: int, q, k, v, scale: float, state=None):
        import ray

        p = self.peer
        try:
            run = p.handle.kv_run.remote(self.debtor, layer, q, k, v, scale, state, self.slot)
            return p._get(run)
        except ray.exceptions.RayActorError:
            raise PeerLost(p.owner) from None
        except ray.exceptions.RayTaskError as exc:
            raise _cause(exc, p.owner) from None


def _cause(exc, owner: str) -> Exception:
    """The creditor's exception as raised there (a stopped creditor: PeerLost)."""
    if isinstance(exc.cause, PeerLost):
        return PeerLost(owner)
    return exc.as_instanceof_cause()


class RayKVGroup:
    """The scheduler's side: the ledger actor and the membership of Ray runners in DistKV.
    join/leave keep every member's peers and borrowing capacity current."""

    def __init__(
        self, lend_fraction: float = 0.9, overlap: bool = True, transport: str = "socket"
    ) -> None:
        import ray

        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self.lend_fraction, self.overlap, self.transport = lend_fraction, overlap, transport
        self.authkey = os.urandom(32)  # channel servers accept only this group's runners
        self.gmanager = ray.remote(GManagerActor).options(num_cpus=0).remote()
        self.members: dict[str, object] = {}  # runner id -> RayRunner
        self.addresses: dict[str, ChannelAddress] = {}

    def _caps(self, runner):
        from scheduler.distkv.network import default_caps

        return default_caps(runner.info.kv_blocks_total, self.lend_fraction)

    def _capacity(self, runner_id: str) -> int:
        return sum(self._caps(r).max_blocks for rid, r in self.members.items() if rid != runner_id)

    def _peers(self, runner_id: str) -> dict:
        return {rid: r.actor for rid, r in self.members.items() if rid != runner_id}

    def join(self, runner) -> None:
        """Blocking (Ray calls): run it off the event loop once the group exists."""
        import ray

        self.members[runner.runner_id] = runner
        rid = runner.runner_id
        self.addresses[rid] = ray.get(
            runner.actor.kv_enable.remote(
                self.gmanager,
                self._peers(rid),
                self._capacity(rid),
                self._caps(runner),
                self.overlap,
                self.transport,
                self.authkey,
            ),
            timeout=CALL_TIMEOUT_S,
        )
        self._update()

    def leave(self, runner_id: str, dead: bool = True) -> None:
        """A runner left (dead or drained: the same here): its loans are freed on the others,
        which stop asking it; its blocks are gone (its debtors see PeerLost and recompute)."""
        if self.members.pop(runner_id, None) is None:
            return
        self.addresses.pop(runner_id, None)
        for r in self.members.values():
            r.actor.kv_reclaim_debtor.remote(runner_id)
        self.gmanager.forget.remote(runner_id)
        self._update()

    def debts(self) -> dict[tuple[str, str], int]:
        import ray

        return ray.get(self.gmanager.debts.remote(), timeout=CALL_TIMEOUT_S)

    async def defragment(self, slots: dict[str, object], min_swap: int = 4) -> list:
        """KVGroup.defragment: defragment_blocking on a worker thread."""
        import asyncio

        return await asyncio.to_thread(self.defragment_blocking, set(slots), min_swap)

    def has_work(self) -> bool:
        return True  # the ledger is in its actor: a pass asks it

    def shutdown(self) -> None:
        """Nothing to stop: the ledger actor goes with the Ray session."""

    def defragment_blocking(self, runner_ids: set[str], min_swap: int = 4) -> list:
        """DGFM between Ray runners (blocking Ray calls: run it off the event loop): plan the
        debt-cycle swaps (scheduler/distkv/dgfm.py) among `runner_ids` and carry each out as
        scheduler/distkv/network.py does in one process: the cycle's runners held between steps and
        lending nothing; each debtor names up to `blocks` blocks it holds on its creditor;
        every creditor copies those blocks' KV and takes them back; every debtor puts the KV
        in blocks of its own (freed by its own debtor's take) and points its request there.
        Returns the swaps done, with the blocks each moved."""
        from scheduler.distkv.dgfm import Swap, plan_swaps

        swaps, _ = plan_swaps(self.debts(), min_swap)
        done = []
        for swap in swaps:
            if not set(swap.cycle) <= runner_ids or not set(swap.cycle) <= set(self.members):
                continue
            moved = self._swap(swap)
            if moved:
                done.append(Swap(swap.cycle, moved))
        return done

    def _swap(self, swap) -> int:
        """One cycle's swap by actor calls (the steps of scheduler/distkv/network.py's swap)."""
        import ray

        from scheduler.distkv.network import trim_picks

        actor = {rid: self.members[rid].actor for rid in swap.cycle}

        def get(refs):
            return ray.get(refs, timeout=CALL_TIMEOUT_S)

        token = uuid.uuid4().hex
        held = []  # every runner a hold was sent to: one that timed out here (a stopped
        try:  # or slow runner) would hold its engine once it runs, until released
            for rid in swap.cycle:
                held.append(rid)
                get(actor[rid].dgfm_hold.remote(token))
            edges = swap.edges()
            picks = trim_picks(get([actor[d].dgfm_pick.remote(c, swap.blocks) for d, c in edges]))
            if not picks:
                return 0
            n = sum(len(ids) for _, ids in picks[0])
            data = get([actor[c].dgfm_take.remote(d, p) for (d, c), p in zip(edges, picks)])
            for d, c in edges:
                self.gmanager.returned.remote(d, c, n)
            get([actor[d].dgfm_put.remote(c, p, kv) for (d, c), p, kv in zip(edges, picks, data)])
            return n
        finally:
            for rid in held:
                actor[rid].dgfm_release.remote(token)

    def _update(self) -> None:
        for rid, r in self.members.items():
            r.kv_capacity = self._capacity(rid)
            peers = self._peers(rid)
            addresses = {p: a for p, a in self.addresses.items() if p in peers}
            shares = {p: self._caps(self.members[p]).max_blocks for p in peers}
            r.actor.kv_peers.remote(peers, addresses, r.kv_capacity, shares)
