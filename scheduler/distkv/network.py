"""DistKV among the runners of one process (the thread backend): their rManagers, the
gManager's ledger, and one KVBorrower per runner that borrows through them.

Data plane: runners share the address space, so a micro-attention call is a function call
on the creditor's rManager that reads the creditor's cache in place (run on a small thread
pool, so it overlaps the debtor's local attention; the kernels release the GIL). Control
plane: heartbeats are taken from each rManager at most every `heartbeat_s` seconds, when a
debtor asks, so suggestions see the loose, slightly old picture the paper's gManager has."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

from punica_x.api import LendCaps, PeerLost, RemoteExtent, RManager
from scheduler.distkv.dgfm import Swap, plan_swaps
from scheduler.distkv.ledger import DebtLedger, Heartbeat


def default_caps(num_blocks: int, lend_fraction: float = 0.9, max_requests: int = 8) -> LendCaps:
    """What a runner lends by default: `lend_fraction` of its blocks, `max_requests` debtor
    requests at once."""
    return LendCaps(int(num_blocks * lend_fraction), max_requests)


class KVNetwork:
    def __init__(self, ledger: DebtLedger | None = None, heartbeat_s: float = 0.2) -> None:
        self.ledger = ledger or DebtLedger()
        self.heartbeat_s = heartbeat_s
        self._managers: dict[str, RManager] = {}
        self._nodes: dict[str, str] = {}
        self._last: dict[str, float] = {}  # runner -> its last heartbeat
        self._lock = threading.Lock()
        self.pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="distkv")

    def add_runner(self, runner_id: str) -> Borrower:
        """The borrower a runner's engine is given (Engine.distkv.enable)."""
        return Borrower(self, runner_id)

    def attach(self, runner_id: str, rmanager: RManager, node: str = "") -> None:
        """The runner's rManager joins: it lends from now on."""
        with self._lock:
            self._managers[runner_id] = rmanager
            self._nodes[runner_id] = node
            self._beat(runner_id, time.monotonic())

    def remove(self, runner_id: str, dead: bool) -> None:
        """A runner leaves. dead: the blocks it held for others are lost (its debtors see
        PeerLost and recompute); either way what it borrowed is freed on its creditors."""
        with self._lock:
            rm = self._managers.pop(runner_id, None)
            self._nodes.pop(runner_id, None)
            self.ledger.forget(runner_id)
            others = list(self._managers.values())
        if rm is not None and dead:
            rm.stop()
        for other in others:
            other.reclaim_debtor(runner_id)

    def manager(self, runner_id: str) -> RManager:
        rm = self._managers.get(runner_id)
        if rm is None or not rm.alive:
            raise PeerLost(runner_id)
        return rm

    def capacity_blocks(self, debtor: str) -> int:
        return sum(
            min(rm.caps.max_blocks, rm.cache.allocator.num_blocks)
            for rid, rm in self._managers.items()
            if rid != debtor and rm.alive
        )

    def heartbeats(self, now: float) -> None:
        """Refresh the ledger from runners whose last heartbeat is older than heartbeat_s."""
        for rid in list(self._managers):
            if now - self._last.get(rid, float("-inf")) >= self.heartbeat_s:
                self._beat(rid, now)

    def _beat(self, rid: str, now: float) -> None:
        rm = self._managers.get(rid)
        if rm is None or not rm.alive:
            return
        self._last[rid] = now
        self.ledger.heartbeat(Heartbeat(rid, rm.lendable(), now, self._nodes.get(rid, "")))

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    # -- DGFM -------------------------------------------------------------------------------
    def defragment(self, engines: dict, min_swap: int = 4) -> list[Swap]:
        """Plan the debt-cycle swaps (scheduler/distkv/dgfm.py) and carry them out. `engines`
        (runner id -> Engine) must not be stepping meanwhile (the caller pauses them).
        Returns the swaps done, with the blocks each moved."""
        swaps, _ = plan_swaps(self.ledger.debts(), min_swap)
        done = []
        for swap in swaps:
            if all(rid in engines for rid in swap.cycle):
                moved = self.execute_swap(swap, engines)
                if moved:
                    done.append(Swap(swap.cycle, moved))
        return done

    def execute_swap(self, swap: Swap, engines: dict) -> int:
        """Around the cycle, each debtor's blocks held on its creditor move home into the
        blocks its own debtor vacates there: every runner's memory use stays, the debts on
        the cycle drop by the blocks moved, which returns. The cycle's runners lend nothing
        meanwhile. KV is copied first for every edge, then blocks are freed and taken."""
        rms = {rid: self.manager(rid) for rid in swap.cycle}
        for rm in rms.values():
            rm.frozen = True
        try:
            with self._lock:
                edges = swap.edges()
                picks = trim_picks(
                    [engines[d].distkv.remote_picks(c, swap.blocks) for d, c in edges]
                )
                if not picks:
                    return 0
                data = [rms[c].take_home(d, p) for (d, c), p in zip(edges, picks)]
                for (d, c), p in zip(edges, picks):
                    self.ledger.returned(d, c, sum(len(ids) for _, ids in p))
                for (d, c), p, kv in zip(edges, picks, data):
                    engines[d].distkv.bring_home(d, c, p, kv)
                return sum(len(ids) for _, ids in picks[0])
        finally:
            for rm in rms.values():
                rm.frozen = False


def trim_picks(picks: list[list]) -> list[list]:
    """Every edge's picks cut to the same block count n, the smallest (loans may have ended
    since the plan); [] when n is 0."""
    n = min(sum(len(ids) for _, ids in p) for p in picks)
    if n == 0:
        return []
    out = []
    for p in picks:
        cut, left = [], n
        for rid, ids in p:
            if left <= 0:
                break
            cut.append((rid, ids[len(ids) - min(left, len(ids)) :]))
            left -= min(left, len(ids))
        out.append(cut)
    return out


class Borrower:
    """One runner's KVBorrower: suggestions from the ledger, loans from peers' rManagers."""

    def __init__(self, network: KVNetwork, runner_id: str) -> None:
        self.network = network
        self.runner_id = runner_id

    def borrow(self, request_id: str, num_blocks: int) -> list[RemoteExtent] | None:
        net, ledger = self.network, self.network.ledger
        with net._lock:
            now = time.monotonic()
            net.heartbeats(now)
            got: list[RemoteExtent] = []
            left = num_blocks
            for creditor in ledger.suggest(self.runner_id, num_blocks, now):
                try:
                    ids = net.manager(creditor).lend(self.runner_id, request_id, left)
                except PeerLost:
                    ids = None
                if ids is None:
                    ledger.refused(creditor)
                    continue
                ledger.lent(self.runner_id, creditor, len(ids))
                got.append(RemoteExtent(creditor, ids))
                left -= len(ids)
                if left == 0:
                    return got
        self.give_back(request_id, got)  # not enough: all or nothing
        return None

    def give_back(self, request_id: str, extents: list[RemoteExtent]) -> None:
        net = self.network
        with net._lock:
            for e in extents:
                rm = net._managers.get(e.owner)
                if rm is None or not rm.alive:
                    continue  # its blocks went with it
                rm.reclaim(self.runner_id, request_id, e.block_ids)
                net.ledger.returned(self.runner_id, e.owner, len(e.block_ids))

    def peer(self, owner: str) -> RManager:
        return self.network.manager(owner)

    def capacity_blocks(self) -> int:
        return self.network.capacity_blocks(self.runner_id)

    def lost(self, owner: str) -> None:
        """Nothing to do: capacity_blocks counts live rManagers only."""
