"""DistKV between Ray runners (actors in their own processes).

Control plane: the gManager's ledger lives in a small actor of its own (GManagerActor), so
every runner reaches it without the scheduler; it stamps heartbeats with its own clock
(processes' monotonic clocks differ). A debtor's borrower asks its peers for heartbeats when
the ledger's are older than HEARTBEAT_S, then for suggestions, then asks the creditors in
turn (RunnerActor.kv_lend). Data plane: per step one kv_prepare call per creditor (the
MicroPlan), per layer one kv_run call carrying the query rows and new K/V and returning
(out, lse): actor calls straight from the debtor's engine thread to the creditor's actor,
never through the scheduler. A creditor whose process is gone raises PeerLost.

ray is imported on first use."""

from __future__ import annotations

import time

from punica_x.kv.rmanager import MicroPlan, PeerLost, RemoteExtent
from scheduler.gmanager import DebtLedger, Heartbeat

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


class RayBorrower:
    """A runner actor's KVBorrower: `peers` are the other runners' actor handles, `capacity`
    the blocks they could lend together (their caps), both updated as runners come and go."""

    def __init__(self, runner_id: str, gmanager, peers: dict, capacity: int) -> None:
        self.runner_id = runner_id
        self.gmanager = gmanager
        self.peers = dict(peers)
        self.capacity = capacity

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

    def peer(self, owner: str) -> RayPeer:
        handle = self.peers.get(owner)
        if handle is None:
            raise PeerLost(owner)
        return RayPeer(owner, handle, self._get)

    def capacity_blocks(self) -> int:
        return self.capacity


class RayPeer:
    def __init__(self, owner: str, handle, get) -> None:
        self.owner, self.handle, self._get = owner, handle, get

    def prepare(self, debtor: str, plan: MicroPlan) -> RayMicro:
        import ray

        try:
            self._get(self.handle.kv_prepare.remote(debtor, plan))
        except ray.exceptions.RayActorError:
            raise PeerLost(self.owner) from None
        except ray.exceptions.RayTaskError as exc:
            raise _cause(exc, self.owner) from None
        return RayMicro(self, debtor)


class RayMicro:
    def __init__(self, peer: RayPeer, debtor: str) -> None:
        self.peer, self.debtor = peer, debtor

    def run(self, layer: int, q, k, v, scale: float):
        import ray

        p = self.peer
        try:
            return p._get(p.handle.kv_run.remote(self.debtor, layer, q, k, v, scale))
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

    def __init__(self, lend_fraction: float = 0.9, overlap: bool = True) -> None:
        import ray

        self.lend_fraction, self.overlap = lend_fraction, overlap
        self.gmanager = ray.remote(GManagerActor).options(num_cpus=0).remote()
        self.members: dict[str, object] = {}  # runner id -> RayRunner

    def _caps(self, runner):
        from scheduler.distkv import default_caps

        return default_caps(runner.kv_blocks_total, self.lend_fraction)

    def _capacity(self, runner_id: str) -> int:
        return sum(self._caps(r).max_blocks for rid, r in self.members.items() if rid != runner_id)

    def _peers(self, runner_id: str) -> dict:
        return {rid: r.actor for rid, r in self.members.items() if rid != runner_id}

    def join(self, runner) -> None:
        """Blocking (Ray calls): run it off the event loop once the group exists."""
        import ray

        self.members[runner.runner_id] = runner
        rid = runner.runner_id
        ray.get(
            runner.actor.kv_enable.remote(
                self.gmanager,
                self._peers(rid),
                self._capacity(rid),
                self._caps(runner),
                self.overlap,
            ),
            timeout=CALL_TIMEOUT_S,
        )
        self._update()

    def leave(self, runner_id: str) -> None:
        """A runner left (dead or drained): its loans are freed on the others, which stop
        asking it; its blocks are gone (its debtors see PeerLost and recompute)."""
        if self.members.pop(runner_id, None) is None:
            return
        for r in self.members.values():
            r.actor.kv_reclaim_debtor.remote(runner_id)
        self.gmanager.forget.remote(runner_id)
        self._update()

    def _update(self) -> None:
        for rid, r in self.members.items():
            r.kv_capacity = self._capacity(rid)
            r.actor.kv_peers.remote(self._peers(rid), r.kv_capacity)
