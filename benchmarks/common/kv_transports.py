"""The data-plane options bench_kv_transport times: ways for a runner to ship a decode
query's rows to a peer runner and get its micro-attention result (out, lse) back, each a
context manager that sets the transport up for at most `max_rows` rows, yields a call
(q, k, v) -> (out, lse) and stops whatever it started (processes joined, then terminated).

The messages have SmolLM2-135M's shapes (q [R, 9, 64] and k, v [R, 3, 64] out; out [R, 9, 64]
and lse [R, 9] back), and the peer's attention is a fixed tiny op (peer_compute), so only
the transport costs. OPTIONS maps the script's --options names to them: a call in the
caller's thread, a thread pool, shared memory + a Pipe, torch.distributed gloo, the runners'
KVChannel (Unix socket or TCP on 127.0.0.1) and a Ray actor. Server processes (spawned: they
import this module with the parent's sys.path) use one torch thread."""

from __future__ import annotations

import datetime
import os
import socket
import struct
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager, suppress

import torch
import torch.multiprocessing as mp
from torch import Tensor

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M
Q_SIZE, KV_SIZE = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
REQUEST_SIZE = Q_SIZE + 2 * KV_SIZE  # floats per row sent
REPLY_SIZE = Q_SIZE + HEADS  # floats per row returned
JOIN_TIMEOUT_S = 10.0
STARTUP_TIMEOUT_S = 120.0

Call = Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
Option = Callable[[int], AbstractContextManager[Call]]


def peer_compute(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor | None = None, lse: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The peer's stand-in for micro-attention: a fixed tiny op (k, v are only received)."""
    return torch.mul(q, 2, out=out), torch.sum(q, -1, out=lse)


def make_inputs(rows: int, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, HEADS, HEAD_DIM, generator=g)
    k = torch.randn(rows, KV_HEADS, HEAD_DIM, generator=g)
    v = torch.randn(rows, KV_HEADS, HEAD_DIM, generator=g)
    return q, k, v


def stop_process(proc: mp.Process) -> None:
    """Join a child, terminating (then killing) it if it does not exit in time."""
    proc.join(JOIN_TIMEOUT_S)
    if proc.is_alive():
        proc.terminate()
        proc.join(JOIN_TIMEOUT_S)
    if proc.is_alive():
        proc.kill()
        proc.join()


@contextmanager
def inprocess(max_rows: int) -> Iterator[Call]:
    """A direct Python call in the caller's thread: the floor (thread runners in one process)."""
    yield peer_compute


@contextmanager
def threadpool(max_rows: int) -> Iterator[Call]:
    """A handoff to a serving thread in the same process and back: submit(...).result()."""
    pool = ThreadPoolExecutor(1)
    try:
        yield lambda q, k, v: pool.submit(peer_compute, q, k, v).result()
    finally:
        pool.shutdown(wait=True)


def shm_server(conn, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor) -> None:
    """Child of shm_pipe: wait for a row count, compute into the shared buffers, answer."""
    torch.set_num_threads(1)
    conn.send_bytes(b"ready")
    while rows := struct.unpack("<H", conn.recv_bytes())[0]:
        peer_compute(q[:rows], k[:rows], v[:rows], out[:rows], lse[:rows])
        conn.send_bytes(b"\x01")


@contextmanager
def shm_pipe(max_rows: int) -> Iterator[Call]:
    """Two processes: q, k, v, out, lse in shared memory (allocated once for max_rows); per
    call the caller copies q, k, v in, sends the row count down a multiprocessing Pipe (a
    Unix socketpair), waits for the one-byte answer and copies out, lse back out."""
    ctx = mp.get_context("spawn")
    q, k, v = (
        torch.zeros(max_rows, h, HEAD_DIM).share_memory_() for h in (HEADS,) + 2 * (KV_HEADS,)
    )
    out = torch.zeros(max_rows, HEADS, HEAD_DIM).share_memory_()
    lse = torch.zeros(max_rows, HEADS).share_memory_()
    mine, theirs = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=shm_server, args=(theirs, q, k, v, out, lse), daemon=True)
    proc.start()
    try:
        if not mine.poll(STARTUP_TIMEOUT_S):
            raise TimeoutError("shm_pipe server did not start")
        mine.recv_bytes()

        def call(qi: Tensor, ki: Tensor, vi: Tensor) -> tuple[Tensor, Tensor]:
            rows = qi.shape[0]
            q[:rows].copy_(qi)
            k[:rows].copy_(ki)
            v[:rows].copy_(vi)
            mine.send_bytes(struct.pack("<H", rows))
            mine.recv_bytes()
            return out[:rows].clone(), lse[:rows].clone()

        yield call
    finally:
        if proc.is_alive():
            with suppress(OSError):
                mine.send_bytes(struct.pack("<H", 0))
        stop_process(proc)
        mine.close()


def gloo_init(store_port: int, rank: int, listen_fd: int | None = None) -> None:
    """Join the 2-rank gloo group. The TCPStore is what init_method="tcp://127.0.0.1:port"
    would build, except that rank 0 hands it a socket already bound to 127.0.0.1 (tcp://
    listens on every interface); gloo's own pairs use the loopback device."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    timeout = datetime.timedelta(seconds=STARTUP_TIMEOUT_S)
    store = torch.distributed.TCPStore(
        "127.0.0.1", store_port, 2, rank == 0, timeout, master_listen_fd=listen_fd
    )
    torch.distributed.init_process_group(
        "gloo", store=store, rank=rank, world_size=2, timeout=timeout
    )


def gloo_server(store_port: int, max_rows: int) -> None:
    """Rank 1 of gloo: recv a packed request, compute, send the packed reply; rows = 0 stops.
    The request buffer is sized for max_rows: gloo accepts a shorter message into it."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    gloo_init(store_port, rank=1)
    request = torch.zeros(1 + max_rows * REQUEST_SIZE)
    reply = torch.zeros(max_rows * REPLY_SIZE)
    try:
        while True:
            dist.recv(request, src=0)
            rows = int(request[0])
            if rows == 0:
                break
            q, k, v = unpack_request(request, rows)
            out, lse = unpack_reply(reply, rows)
            peer_compute(q, k, v, out, lse)
            dist.send(reply[: rows * REPLY_SIZE], dst=0)
    finally:
        dist.destroy_process_group()


def unpack_request(buf: Tensor, rows: int) -> tuple[Tensor, Tensor, Tensor]:
    """Views of q, k, v in a packed request [rows, q..., k..., v...]."""
    q_end = 1 + rows * Q_SIZE
    k_end = q_end + rows * KV_SIZE
    return (
        buf[1:q_end].view(rows, HEADS, HEAD_DIM),
        buf[q_end:k_end].view(rows, KV_HEADS, HEAD_DIM),
        buf[k_end : k_end + rows * KV_SIZE].view(rows, KV_HEADS, HEAD_DIM),
    )


def unpack_reply(buf: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    """Views of out, lse in a packed reply [out..., lse...]."""
    q_end = rows * Q_SIZE
    out = buf[:q_end].view(rows, HEADS, HEAD_DIM)
    return out, buf[q_end : q_end + rows * HEADS].view(rows, HEADS)


@contextmanager
def gloo(max_rows: int) -> Iterator[Call]:
    """Two processes joined by torch.distributed (gloo over loopback TCP): per call the caller
    packs [rows, q, k, v] into one tensor, dist.send, then dist.recv of the packed
    [out, lse] reply and copies them out; the server loops recv -> compute -> send."""
    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    proc = ctx.Process(target=gloo_server, args=(port, max_rows), daemon=True)
    proc.start()
    request = torch.zeros(1 + max_rows * REQUEST_SIZE)
    reply = torch.zeros(max_rows * REPLY_SIZE)
    try:
        gloo_init(port, rank=0, listen_fd=listener.detach())  # the store owns it now

        def call(qi: Tensor, ki: Tensor, vi: Tensor) -> tuple[Tensor, Tensor]:
            rows = qi.shape[0]
            request[0] = rows
            for dst, src in zip(unpack_request(request, rows), (qi, ki, vi)):
                dst.copy_(src)
            dist.send(request[: 1 + rows * REQUEST_SIZE], dst=1)
            dist.recv(reply[: rows * REPLY_SIZE], src=1)
            out, lse = unpack_reply(reply, rows)
            return out.clone(), lse.clone()

        yield call
    finally:
        if dist.is_initialized():
            if proc.is_alive():
                request[0] = 0
                dist.send(request[:1], dst=1)
            dist.destroy_process_group()
        stop_process(proc)
        listener.close()  # a no-op once detached


class _StandIn:
    """A creditor's rManager for kv_channel_server: prepare -> itself, run -> peer_compute."""

    def prepare(self, debtor, plan):
        return self

    def run(self, layer, q, k, v, scale):
        return peer_compute(q, k, v)


def kv_channel_server(conn, authkey: bytes) -> None:
    """Child of kv_channel: the runners' KVChannelServer over the stand-in, until told."""
    from scheduler.distkv.channel import KVChannelServer

    torch.set_num_threads(1)
    server = KVChannelServer(_StandIn(), authkey, node="this")
    conn.send(server.address)
    conn.recv()  # stop
    server.close()


@contextmanager
def kv_channel(max_rows: int, family: str = "unix") -> Iterator[Call]:
    """What Ray runners use (scheduler/distkv/channel.py): a KVChannelServer in another process,
    a KVChannel to it (one authenticated socket, one frame each way per call: the query
    and K/V rows out, (out, lse) back), over its Unix socket or its TCP port on 127.0.0.1."""
    from punica_x.kv.rmanager import MicroPlan
    from scheduler.distkv.channel import KVChannel

    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    key = os.urandom(32)
    proc = ctx.Process(target=kv_channel_server, args=(theirs, key), daemon=True)
    proc.start()
    ch = None
    try:
        if not mine.poll(STARTUP_TIMEOUT_S):
            raise TimeoutError("kv_channel server did not start")
        address = mine.recv()
        ch = KVChannel("peer", address, "me", "this" if family == "unix" else "other", key)
        micro = ch.prepare("me", MicroPlan((), (), (), ()))
        yield lambda q, k, v: micro.run(0, q, k, v, 1.0)
    finally:
        if ch is not None:
            ch.close()
        with suppress(OSError):
            mine.send(None)
        stop_process(proc)


class RayPeer:
    """The Ray actor: one torch thread, returns peer_compute's tensors (pickled back)."""

    def __init__(self) -> None:
        torch.set_num_threads(1)

    def ready(self) -> bool:
        return True

    def run(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return peer_compute(q, k, v)


@contextmanager
def ray_actor(max_rows: int) -> Iterator[Call]:
    """A Ray actor on a fresh local Ray (2 CPUs, node IP 127.0.0.1): per call
    ray.get(actor.run.remote(q, k, v)), the tensors pickled through Ray's object transport.
    Ray's servers listen on every interface (not configurable in this Ray version)."""
    import ray

    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
    )
    try:
        actor = ray.remote(num_cpus=1)(RayPeer).remote()
        ray.get(actor.ready.remote(), timeout=STARTUP_TIMEOUT_S)
        yield lambda q, k, v: ray.get(actor.run.remote(q, k, v))
    finally:
        ray.shutdown()


OPTIONS: dict[str, Option] = {
    "inprocess": inprocess,
    "threadpool": threadpool,
    "shm_pipe": shm_pipe,
    "gloo": gloo,
    "kv_channel_unix": kv_channel,
    "kv_channel_tcp": lambda rows: kv_channel(rows, "tcp"),
    "ray": ray_actor,
}
