"""What is the per-layer round trip of shipping a decode query to another runner and getting
its micro-attention result back, for several data-plane options, on this machine?

    python benchmarks/bench_kv_transport.py [--calls 2000] [--rows 1,16]
                                            [--options inprocess,threadpool,shm_pipe,gloo,
                                                       kv_channel_unix,kv_channel_tcp,ray]
                                            [--budget 15]

In DistKV (Infinite-LLM) a runner sends, at every transformer layer, the query rows of a
request to a peer runner that holds part of its KV cache; the peer attends over its blocks
and returns (out, lse). The messages here have SmolLM2-135M's shapes: q float32 [R, 9, 64]
and the new token's k, v [R, 3, 64] go out; out [R, 9, 64] and lse [R, 9] come back. The
peer's attention is replaced by a fixed tiny op (out = 2 q, lse = q.sum(-1)), so only the
transport is timed. R = 1 is a decode step of one request, R = 16 a small batch.

Per option and R: a warm-up, one checked call, then --calls timed round trips (fewer once
they pass --budget / len(rows) seconds); the median and p90 of the per-call wall time, and
what 30 layers x 1 peer would add to every decode token (30 x median). Server processes use
one torch thread; the sockets this script opens listen on 127.0.0.1 only (Ray's own gRPC
servers listen on every interface whatever the node IP; its traffic here stays on loopback);
child processes are always stopped."""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import struct
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager, suppress
from pathlib import Path

import torch
import torch.multiprocessing as mp
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.report import describe_machine, print_table, pyplot, save_plot, write_json  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M
LAYERS = 30
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


# --- options ---------------------------------------------------------------------------------


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

# --- measurement -----------------------------------------------------------------------------


def check(call: Call, rows: int) -> None:
    """One call must return the peer's answer (transport bugs would otherwise look fast)."""
    q, k, v = make_inputs(rows, seed=1)
    out, lse = call(q, k, v)
    want_out, want_lse = peer_compute(q, k, v)
    if not (torch.equal(out, want_out) and torch.allclose(lse, want_lse)):
        raise AssertionError(f"wrong reply for {rows} rows")


def time_calls(call: Call, rows: int, calls: int, budget_s: float) -> list[float]:
    """Seconds per round trip: warm-up, a checked call, then up to `calls` timed ones (fewer
    once budget_s has passed)."""
    q, k, v = make_inputs(rows)
    for _ in range(max(10, min(200, calls // 10))):
        call(q, k, v)
    check(call, rows)
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    for _ in range(calls):
        t0 = time.perf_counter()
        call(q, k, v)
        t1 = time.perf_counter()
        times.append(t1 - t0)
        if t1 > deadline:
            break
    return times


def summarize(name: str, rows: int, times: list[float]) -> dict:
    """Median and p90 in microseconds, and 30 layers x 1 peer x median in ms per token."""
    times = sorted(times)
    median_us = 1e6 * statistics.median(times)
    return {
        "option": name,
        "rows": rows,
        "calls": len(times),
        "median_us": median_us,
        "p90_us": 1e6 * times[(len(times) * 9) // 10],
        "per_token_ms_30_layers": LAYERS * median_us / 1e3,
    }


def add_ratios(results: list[dict]) -> None:
    """vs_inprocess: each median over the in-process call's at the same R (when measured)."""
    base = {r["rows"]: r["median_us"] for r in results if r["option"] == "inprocess"}
    for r in results:
        if r["rows"] in base:
            r["vs_inprocess"] = r["median_us"] / base[r["rows"]]


def run_option(name: str, args: argparse.Namespace) -> list[dict]:
    """All row counts of one option, on one transport set up for the largest."""
    t0 = time.perf_counter()
    results = []
    with OPTIONS[name](max(args.rows)) as call:
        setup_s = time.perf_counter() - t0
        for rows in args.rows:
            times = time_calls(call, rows, args.calls, args.budget / len(args.rows))
            r = summarize(name, rows, times) | {"setup_s": setup_s}
            results.append(r)
            print(
                f"  {name} R={rows}: median {r['median_us']:.1f} us, p90 {r['p90_us']:.1f} us "
                f"({r['calls']} calls; setup {setup_s:.1f} s)",
                flush=True,
            )
    return results


def plot(results: list[dict], rows: list[int]) -> None:
    plt = pyplot()
    names = list(dict.fromkeys(r["option"] for r in results))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        pts = {r["rows"]: r for r in results if r["option"] == name}
        xs = [j + (i - (len(names) - 1) / 2) * width for j, n in enumerate(rows) if n in pts]
        med = [pts[n]["median_us"] for n in rows if n in pts]
        up = [pts[n]["p90_us"] - pts[n]["median_us"] for n in rows if n in pts]
        ax.bar(xs, med, width, yerr=[[0] * len(up), up], capsize=3, label=name)
    ax.set_xticks(range(len(rows)), [f"R = {n}" for n in rows])
    ax.set_yscale("log")
    ax.set_ylabel("round trip per layer (us; bar = median, whisker = p90)")
    ax.set_title("decode query -> peer -> (out, lse), SmolLM2-135M shapes")
    ax.legend()
    ax.grid(True, axis="y", which="both", alpha=0.3)
    save_plot("bench_kv_transport", fig)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--options", default=",".join(OPTIONS))
    ap.add_argument("--budget", type=float, default=15.0, help="seconds of timed calls per option")
    args = ap.parse_args()
    args.rows = [int(x) for x in args.rows.split(",")]
    args.options = args.options.split(",")
    unknown = set(args.options) - set(OPTIONS)
    if unknown:
        ap.error(f"unknown options: {sorted(unknown)}")
    machine_line = describe_machine()
    print(machine_line)
    started = time.perf_counter()
    results: list[dict] = []
    errors: dict[str, str] = {}
    for name in args.options:
        try:
            results += run_option(name, args)
        except Exception as exc:  # one broken transport must not sink the others
            errors[name] = f"{type(exc).__name__}: {exc}"
            print(f"  {name}: FAILED ({errors[name]})", flush=True)
    add_ratios(results)
    columns = ["option", "rows", "calls", "median_us", "p90_us", "per_token_ms_30_layers"]
    title = f"round trip per layer; per_token_ms_30_layers = {LAYERS} layers x 1 peer x median"
    print_table(results, columns + ["vs_inprocess"], title)
    for name, err in errors.items():
        print(f"{name}: skipped ({err})")
    elapsed = time.perf_counter() - started
    print(f"total {elapsed:.1f} s; load average {os.getloadavg()[0]:.2f}")
    payload = {
        "machine_line": machine_line,
        "args": vars(args),
        "results": results,
        "errors": errors,
        "elapsed_s": elapsed,
        "loadavg_1m": os.getloadavg()[0],
    }
    write_json("bench_kv_transport", payload)
    if results:
        plot(results, args.rows)


if __name__ == "__main__":
    main()
