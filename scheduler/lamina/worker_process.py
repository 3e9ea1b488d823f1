"""An attention worker's process: an AttentionWorker (punica_x/kv/attention_worker.py)
behind a KVChannelServer, serving one model worker's frames (prepare, run, get and set
blocks) over an authenticated Unix or TCP socket until its parent closes the pipe it was
started with, or dies."""

from __future__ import annotations

import multiprocessing as mp
import os
import platform
from dataclasses import dataclass
from multiprocessing.connection import Connection

from punica_x.api import WorkerSpec
from scheduler.distkv.channel import ChannelAddress

START_TIMEOUT_S = 120.0  # a fresh process imports torch and allocates its KV slice


@dataclass
class WorkerProcess:
    """A started attention worker: its process, the address its server listens on, and the
    pipe whose closing stops it."""

    process: mp.process.BaseProcess
    address: ChannelAddress
    pipe: Connection

    @property
    def pid(self) -> int:
        return int(self.process.pid or 0)

    def stop(self, timeout: float = 10.0) -> None:
        """Close the pipe (the worker exits), then wait; killed if it does not."""
        self.pipe.close()
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout)


def start_worker(spec: WorkerSpec, authkey: bytes, threads: int = 1) -> WorkerProcess:
    """Start an attention worker for `spec` in a fresh (spawned) process with `threads`
    torch threads; returns once its server listens. RuntimeError when it fails to start
    (its error included) or does not within START_TIMEOUT_S."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(
        target=_main,
        args=(spec, authkey, child, threads),
        name=f"attention-worker-{spec.heads.index}",
        daemon=True,
    )
    process.start()
    child.close()
    if not parent.poll(START_TIMEOUT_S):
        process.kill()
        raise RuntimeError(f"attention worker {spec.heads.index} did not start")
    kind, value = parent.recv()
    if kind != "ok":
        process.join(10)
        raise RuntimeError(f"attention worker {spec.heads.index} failed to start: {value}")
    return WorkerProcess(process, value, parent)


def _main(spec: WorkerSpec, authkey: bytes, pipe: Connection, threads: int) -> None:
    """The worker process: serve until the parent's end of `pipe` closes."""
    import torch

    from punica_x.api import AttentionWorker
    from scheduler.distkv.channel import KVChannelServer

    try:
        torch.set_num_threads(max(1, threads))
        worker = AttentionWorker(spec)
        server = KVChannelServer(worker, authkey, platform.node())
    except Exception as exc:
        pipe.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    pipe.send(("ok", server.address))
    try:
        pipe.recv()  # returns or raises when the parent closes its end
    except (EOFError, OSError):
        pass
    finally:
        worker.stop()
        server.close()
        os._exit(0)  # the serving threads are daemons; leave without waiting on torch's
