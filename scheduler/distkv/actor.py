"""A Ray runner actor's DistKV and DGFM methods (RunnerActor inherits them): lending within
caps, borrowing through the ledger actor, serving micro-attention of its loans on a channel
server, and the DGFM swap steps that RayKVGroup.defragment (ray_group.py) drives. The actor
provides `runner_id`, `engine`, `async_engine` and `info_`."""

from __future__ import annotations


class KVActorMethods:
    def kv_enable(
        self,
        gmanager,
        peers: dict,
        capacity: int,
        caps,
        overlap: bool,
        transport: str,
        authkey: bytes,
    ):
        """Lend within `caps`, borrow through the ledger actor from `peers` (runner id ->
        actor handle); serve the micro-attention of this runner's loans on a channel server
        (transport "socket"). Returns the server's ChannelAddress (None with "ray")."""
        from concurrent.futures import ThreadPoolExecutor

        import ray

        from scheduler.distkv.channel import KVChannelServer
        from scheduler.distkv.ray_group import DataPlane, RayBorrower

        plane = DataPlane(transport, authkey, self.info_.node)
        self.borrower = RayBorrower(self.runner_id, gmanager, peers, capacity, plane)
        self.kv_pool = ThreadPoolExecutor(4, thread_name_prefix="distkv")
        self.rm = self.engine.distkv.enable(
            self.runner_id, self.borrower, caps, overlap, pool=self.kv_pool
        )
        self.borrower.local = self.rm
        self.micro: dict[tuple[str, int], object] = {}  # (debtor, slot) -> prepared plan
        # DGFM: the release of each swap's hold (by token), and tokens released before their
        # hold ran (it must not hold then)
        self._dgfm_holds: dict[str, object] = {}
        self._dgfm_cancelled: set[str] = set()
        self.kv_server = None
        if transport == "socket":
            host = ray.util.get_node_ip_address()
            self.kv_server = KVChannelServer(self.rm, authkey, self.info_.node, host)
            return self.kv_server.address
        return None

    def kv_peers(self, peers: dict, addresses: dict, capacity: int, shares=None) -> None:
        self.borrower.set_peers(peers, addresses, capacity, shares)

    def kv_counts(self) -> dict[str, int]:
        """Now: blocks this runner lends (`lent`), micro-attention calls its rManager ran
        (`calls`) and frames its channel server received (`frames`)."""
        frames = self.kv_server.frames if self.kv_server is not None else 0
        return {"lent": self.rm.lent_blocks, "calls": self.rm.calls, "frames": frames}

    def kv_heartbeat(self):
        from scheduler.distkv.ledger import Heartbeat

        return Heartbeat(self.runner_id, self.rm.lendable(), 0.0, self.info_.node)

    def kv_lend(self, debtor: str, request_id: str, num_blocks: int):
        return self.rm.lend(debtor, request_id, num_blocks)

    def kv_reclaim(self, debtor: str, request_id: str, block_ids: tuple[int, ...]) -> None:
        self.rm.reclaim(debtor, request_id, block_ids)

    def kv_reclaim_debtor(self, debtor: str) -> int:
        for key in [k for k in self.micro if k[0] == debtor]:
            del self.micro[key]
        return self.rm.reclaim_debtor(debtor)

    def kv_prepare(self, debtor: str, plan, slot: int = 0) -> None:
        """A debtor's plan over blocks lent to it, in `slot` (a debtor may prepare several
        in a step: channel.py; the newest KEPT_PLANS are kept)."""
        from scheduler.distkv.channel import KEPT_PLANS

        self.micro.pop((debtor, slot), None)
        self.micro[debtor, slot] = self.rm.prepare(debtor, plan)
        while len(self.micro) > KEPT_PLANS:
            del self.micro[next(iter(self.micro))]

    def kv_run(self, debtor: str, layer: int, q, k, v, scale: float, state=None, slot: int = 0):
        """MicroAttention.run of the debtor's plan in `slot` (state: the chained order)."""
        return self.micro[debtor, slot].run(layer, q, k, v, scale, state=state)

    # -- DGFM (scheduler/distkv/ray_group.py RayKVGroup.defragment drives these) -------------
    def dgfm_hold(self, token: str, timeout: float = 30.0) -> bool:
        """Hold the engine thread between two steps (a command that waits for the release
        of `token`) and lend nothing meanwhile; returns once it is held: True, or False when
        `token` was released before this ran (its swap gave up on this runner: an actor's
        calls need not run in the order they were sent)."""
        if token in self._dgfm_cancelled:
            self._dgfm_cancelled.discard(token)
            return False
        try:  # (held 120 s at most: a scheduler that died mid-swap does not hold it forever)
            self._dgfm_holds[token] = self.async_engine.hold(timeout, limit=120.0)
        except TimeoutError as exc:
            raise TimeoutError(f"runner {self.runner_id}: {exc}") from None
        self.rm.frozen = True
        return True

    def dgfm_release(self, token: str) -> None:
        """End the hold of `token` (or, when it has not run yet, make sure it never holds)."""
        release = self._dgfm_holds.pop(token, None)
        if release is None:
            self._dgfm_cancelled.add(token)
            return
        release()
        self.rm.frozen = bool(self._dgfm_holds)

    def dgfm_pick(self, creditor: str, blocks: int) -> list[tuple[str, tuple[int, ...]]]:
        return self.engine.distkv.remote_picks(creditor, blocks)

    def dgfm_take(self, debtor: str, picks: list) -> list:
        return [kv.cpu() for kv in self.rm.take_home(debtor, picks)]  # to another process

    def dgfm_put(self, creditor: str, picks: list, data: list) -> None:
        self.engine.distkv.bring_home(self.runner_id, creditor, picks, data)
