"""The engine process: `python -m scheduler.runners.process_main ADDRESS PARENT_PID`, started
by ProcessRunner (process_runner.py). It binds ADDRESS (a ZeroMQ ROUTER, process_wire.py),
waits for the "start" call with the EngineConfig and runner id, builds the engine and from
then on only steps it (its AsyncEngine thread) and answers the scheduler's calls: a
RunnerCore (runner_core.py), the same calls and events a Ray runner's actor answers. HTTP,
tokenization and streaming stay in the scheduler's process, with an interpreter lock of their
own. It exits on "shutdown", or when its parent is gone (checked every second)."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import sys

import zmq
import zmq.asyncio

from scheduler.runners import process_wire as wire
from scheduler.runners.runner_core import RunnerCore

log = logging.getLogger("punica_x.engine_process")
PARENT_CHECK_S = 1.0


class EngineProcess(RunnerCore):
    """A RunnerCore built by the "start" call; adapters are registered from their path (the
    scheduler's process and this one share the machine)."""

    engine = None

    def start(self, config, runner_id: str):
        import torch

        from punica_x.api import Engine
        from scheduler.lamina.launcher import attention_launcher

        threads = int(os.environ.get("PUNICA_X_RUNNER_THREADS", 0))
        if threads:
            torch.set_num_threads(threads)
        self._start(
            Engine(config, attention_launcher=attention_launcher(config, runner_id)), runner_id
        )
        return self.info_

    async def register_adapter(self, name: str, path: str, sha256, version, pinned=None):
        pool = self.engine.adapters  # reading the files: a worker thread (the pool is thread-safe)
        return await asyncio.to_thread(pool.register, name, path, sha256, version, pinned)

    def shutdown(self) -> None:
        if self.engine is not None:
            self.async_engine.shutdown()


CALLS = frozenset(
    {
        "start",
        "open",
        "take",
        "abort",
        "poll",
        "register_adapter",
        "unregister_adapter",
        "stop_lending",
        "alive",
        "info",
        "shutdown",
    }
)
BLOCKING = frozenset({"start"})  # run on a worker thread: the loop keeps answering


class Replies:
    """Replies sent on the loop's next turn, one message per peer with every reply of this
    turn (process_wire's batches); a blocking caller's (call id "sync") alone: it reads one."""

    def __init__(self, sock) -> None:
        self.sock = sock
        self.queued: list[tuple[bytes, bytes, bytes]] = []

    def add(self, peer: bytes, call_id: bytes, reply: bytes) -> None:
        self.queued.append((peer, call_id, reply))
        if len(self.queued) == 1:
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        by_peer: dict[bytes, list[tuple[bytes, bytes]]] = {}
        for peer, call_id, reply in self.queued:
            if call_id == b"sync":
                self.sock.send_multipart([peer, call_id, reply])
            else:
                by_peer.setdefault(peer, []).append((call_id, reply))
        self.queued = []
        for peer, pairs in by_peer.items():
            self.sock.send_multipart([peer, *wire.frames(pairs)])


async def serve(address: str, parent_pid: int) -> None:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.bind(address)
    core = EngineProcess()
    replies = Replies(sock)
    done = asyncio.Event()
    tasks: set[asyncio.Task] = set()

    async def answer(peer: bytes, call_id: bytes, body: bytes) -> None:
        try:
            method, args = wire.decode(body)
            if method not in CALLS:
                raise ValueError(f"no such call {method!r}")
            fn = getattr(core, method)
            if method in BLOCKING:
                result = await asyncio.to_thread(fn, *args)
            else:
                result = fn(*args)
                if asyncio.iscoroutine(result):
                    result = await result
            reply = wire.encode_reply(True, result)
            if method == "shutdown":
                done.set()
        except Exception as exc:
            reply = wire.encode_reply(False, exc)
        if call_id:
            replies.add(peer, call_id, reply)

    async def watch_parent() -> None:
        while os.getppid() == parent_pid:
            await asyncio.sleep(PARENT_CHECK_S)
        log.warning("the scheduler's process is gone; the engine process exits")
        done.set()

    async def receive() -> None:
        while True:
            peer, call_id, body = await sock.recv_multipart()
            for one_id, one_body in wire.pairs(call_id, body):
                task = asyncio.get_running_loop().create_task(answer(peer, one_id, one_body))
                tasks.add(task)
                task.add_done_callback(tasks.discard)

    workers = [asyncio.create_task(receive()), asyncio.create_task(watch_parent())]
    await done.wait()
    await asyncio.sleep(0.05)  # the shutdown's reply leaves
    for w in workers:
        w.cancel()
    core.shutdown()
    sock.close()
    ctx.term()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    address, parent_pid = sys.argv[1], int(sys.argv[2])
    try:
        asyncio.run(serve(address, parent_pid))
    finally:
        shutil.rmtree(os.path.dirname(address.removeprefix("ipc://")), ignore_errors=True)
    os._exit(0)  # the engine's non-daemon threads (if any are stuck) do not hold the exit


if __name__ == "__main__":
    main()
