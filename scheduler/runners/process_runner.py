"""A runner whose engine steps in a process of its own on this machine (vLLM v1's
EngineCore process, SGLang's scheduler process): the scheduler's process keeps HTTP,
tokenization and streaming, and no longer shares an interpreter lock with the step loop.

The engine process is scheduler/runners/process_main.py; the channel ZeroMQ with pickled
messages (process_wire.py); the calls and the polled events are those of a Ray runner (the
RunnerCore in the engine process, EventStreams here): one protocol for both. Adapters go by
path (the same machine). A process that exits or is killed is seen within POLL_S: every
open stream ends with RunnerLost and the scheduler continues its requests elsewhere, or on
the runner the restart policy starts in its place (scheduler/fleet.py)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import zmq
import zmq.asyncio

from punica_x.api import AdapterInfo, EngineConfig, EngineStats
from scheduler.runners import process_wire as wire
from scheduler.runners.event_streams import EventStreams, RemoteRunnerLost

log = logging.getLogger(__name__)
POLL_S = 0.2  # how often a waiting channel checks that the process still runs
SHUTDOWN_S = 30.0  # a shutdown waits this long for the process to exit, then kills it
_ROOT = str(Path(__file__).resolve().parents[2])  # where `scheduler` and `punica_x` are


class ProcessRunner(EventStreams):
    """The scheduler's side of an engine process. Building one blocks until the process has
    loaded the model (run it on a worker thread); a failed build raises its error here."""

    backend = "process"
    lamina = None  # attention workers (if any) live and die with the engine process

    def __init__(self, config: EngineConfig, runner_id: str) -> None:
        self.runner_id = runner_id
        self.address, self._folder = wire.new_address(runner_id)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "scheduler.runners.process_main",
                self.address,
                str(os.getpid()),
            ],
            env=env,
        )
        self._ids = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sock = None
        self._pending: dict[bytes, asyncio.Future] = {}
        self._outbox: list[tuple[bytes, bytes]] = []  # calls to send on the loop's next turn
        self._init_streams()
        try:
            self.info = self._blocking("start", config, runner_id)
            _, self._snapshot = self._blocking("poll", 0, 0)  # its stats as it starts
        except BaseException:
            self._stop_process(0)
            raise

    @property
    def pid(self) -> int:
        return self.process.pid

    # -- the channel --------------------------------------------------------------------------
    def _exited(self) -> str | None:
        code = self.process.poll()
        return None if code is None else f"engine process exited (code {code})"

    def _blocking(self, method: str, *args, timeout: float | None = None):
        """A call from a thread with no event loop (building, shutting down): its result, or
        its error raised; RemoteRunnerLost when the process exits before answering."""
        ctx = zmq.Context.instance()
        with ctx.socket(zmq.DEALER) as sock:
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.address)
            sock.send_multipart([b"sync", wire.encode((method, args))])
            deadline = None if timeout is None else time.monotonic() + timeout
            while not sock.poll(int(POLL_S * 1000)):
                gone = self._exited()
                if gone is not None:
                    raise RemoteRunnerLost(gone)
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"{method} took over {timeout:g} s")
            _, body = sock.recv_multipart()
        return _result(body)

    def _channel(self):
        """This event loop's socket, and the task reading its replies (made on first use)."""
        loop = asyncio.get_running_loop()
        if self._sock is None or self._loop is not loop:  # (a new loop: a new socket)
            self._loop = loop
            self._sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.connect(self.address)
            self._outbox = []
            self._reader = self._loop.create_task(self._read())
        return self._sock

    async def _read(self) -> None:
        """Resolve each call's future with its reply; fail them all once the process is gone."""
        sock = self._sock
        try:
            while (gone := self._exited()) is None:
                if await sock.poll(int(POLL_S * 1000)):
                    for call_id, body in wire.pairs(*await sock.recv_multipart()):
                        future = self._pending.pop(call_id, None)
                        if future is not None and not future.done():
                            future.set_result(body)
        except Exception as exc:  # the socket itself failed
            gone = f"engine process unreachable: {exc}"
        finally:
            pending, self._pending = self._pending, {}
            for future in pending.values():
                if not future.done():
                    future.set_exception(RemoteRunnerLost(gone or "engine channel closed"))
            sock.close()

    async def _remote(self, method: str, *args):
        self._channel()
        gone = self._exited()
        if gone is not None or self._reader.done():
            raise RemoteRunnerLost(gone or self.error or "engine channel closed")
        call_id = next(self._ids).to_bytes(8, "little")
        future = self._loop.create_future()
        self._pending[call_id] = future
        self._queue(call_id, wire.encode((method, args)))
        return _result(await future)

    def _queue(self, call_id: bytes, body: bytes) -> None:
        """Send the call on this loop's next turn, in one message with every other call made
        on this turn (process_wire.py's batches), in the order they were made."""
        self._outbox.append((call_id, body))
        if len(self._outbox) == 1:
            self._loop.call_soon(self._flush_calls)

    def _flush_calls(self) -> None:
        calls, self._outbox = self._outbox, []
        if not calls:
            return
        try:
            if self._sock.closed:
                raise RuntimeError("the channel is closed")
            self._sock.send_multipart(wire.frames(calls))
        except Exception as exc:  # what waits on these calls learns it now
            for call_id, _ in calls:
                future = self._pending.pop(call_id, None)
                if future is not None and not future.done():
                    future.set_exception(RemoteRunnerLost(f"engine channel failed: {exc}"))

    def _send(self, method: str, *args) -> None:
        """Fire and forget, from any thread (after the calls made before it)."""
        body = wire.encode((method, args))
        loop = self._loop
        if loop is None or loop.is_closed():
            with contextlib.suppress(Exception), zmq.Context.instance().socket(zmq.DEALER) as s:
                s.setsockopt(zmq.LINGER, 1000)
                s.connect(self.address)
                s.send_multipart([b"", body])
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody to tell
            loop.call_soon_threadsafe(self._queue, b"", body)

    # -- adapters -----------------------------------------------------------------------------
    async def register_adapter(
        self,
        name: str,
        path: Path,
        sha256: str | None = None,
        version: int | None = None,
        pinned: bool | None = None,
    ) -> AdapterInfo:
        info = await self._call("register_adapter", name, str(path), sha256, version, pinned)
        self._names.add(name)
        return info

    async def unregister_adapter(self, name: str) -> None:
        self._names.discard(name)
        await self._call("unregister_adapter", name)

    # -- the rest of RunnerHandle ---------------------------------------------------------------
    def stop_lending(self) -> None:
        if self.error is None:
            self._send("stop_lending")

    def stats(self) -> EngineStats:
        with contextlib.suppress(RuntimeError):  # no running event loop here
            self._ensure_pump()
        return self._snapshot.stats

    def shutdown(self) -> None:
        self.error = self.error or "shut down"
        self._stop_process(SHUTDOWN_S)

    def _stop_process(self, wait_s: float) -> None:
        """Ask the process to shut down (up to wait_s), then kill it; its folder goes."""
        if wait_s and self.process.poll() is None:
            with contextlib.suppress(Exception):
                self._blocking("shutdown", timeout=wait_s)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(wait_s)
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self._folder, ignore_errors=True)


def _result(body: bytes):
    ok, value = wire.decode(body)
    if ok:
        return value
    raise value.rebuild()
