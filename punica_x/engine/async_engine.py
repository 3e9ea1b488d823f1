"""Streaming API: an Engine stepping on its own thread, per-request async iterators.

    async for out in engine.generate(prompt, sampling, adapter="x"):
        print(out.new_text, end="")

Requests are added and aborted on the engine thread between steps (the Engine itself is
single-threaded). A consumer that stops iterating, is cancelled or disconnects aborts its
request: it leaves the batch at the next step and its KV blocks are freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import queue
import threading
import weakref
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any

from punica_x.core import RequestOutput, Resume, SamplingParams, new_request_id
from punica_x.engine import Engine
from punica_x.request import EngineRequest

log = logging.getLogger(__name__)

_IDLE_WAIT = 0.005  # seconds to wait for commands while requests wait on adapter loads


class RunnerLost(RuntimeError):
    """The engine stopped (a step raised, with on_step_error="stop") while the request was
    unfinished; the outputs delivered before this are all it produced. in_failed_step: the
    request was in the step that raised (the batcher had scheduled it), so it may be the
    cause; False for the requests that only waited there, and when nobody knows (a runner
    process that died)."""

    def __init__(self, message: str = "", in_failed_step: bool = False) -> None:
        super().__init__(message)
        self.in_failed_step = in_failed_step

    def __reduce__(self):  # pickled with its field (Ray carries it between processes)
        return type(self), (str(self), self.in_failed_step)


class StreamMoved(Exception):
    """The request was taken off this engine (Engine.take); every output it produced here came
    before this."""


_MOVED = object()


class AsyncEngine:
    """on_step_error: "fail" finishes the batch with ERROR and keeps stepping (one engine on
    its own); "stop" stops the engine and ends every open stream with RunnerLost, so a
    scheduler can continue the requests elsewhere. `failed_step` names the requests that were
    in the step that raised (see RunnerLost.in_failed_step)."""

    def __init__(self, engine: Engine, on_step_error: str = "fail") -> None:
        if on_step_error not in ("fail", "stop"):
            raise ValueError(f"on_step_error must be fail or stop, got {on_step_error!r}")
        self.engine = engine
        self.on_step_error = on_step_error
        self.error: str | None = None  # why the engine stopped, if a step raised
        self.failed_step: frozenset[str] = frozenset()  # the requests of the step that raised
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
        self._stop = threading.Event()
        # what the current step produced (outputs, preemption notices), handed to the event
        # loops in one wake-up per loop
        self._outbox: list[tuple[asyncio.AbstractEventLoop, Callable[[], None]]] = []
        self._open: dict[str, tuple[asyncio.AbstractEventLoop, Callable]] = {}
        self._thread = threading.Thread(target=self._loop, name="punica-x-engine", daemon=True)
        self._thread.start()

    # -- API ------------------------------------------------------------------------------
    async def open(
        self, request: EngineRequest, on_preempt: Callable[[], None] | None = None
    ) -> RequestStream:
        """Add a request (raising ValueError / UnknownAdapterError at once if it is refused)
        and return the stream of its outputs (Engine.submit). on_preempt is called on this
        event loop after a step that preempted the request for KV memory."""
        outputs: asyncio.Queue[RequestOutput | RunnerLost] = asyncio.Queue()
        rid = await self.add(request, outputs.put_nowait, on_preempt)
        return RequestStream(rid, outputs, functools.partial(_abort, weakref.ref(self), rid))

    async def add(
        self,
        request: EngineRequest,
        deliver: Callable[[RequestOutput | RunnerLost], None],
        on_preempt: Callable[[], None] | None = None,
    ) -> str:
        """open() without a stream object: deliver(output) is called on this event loop for
        each output (all of one step's outputs in one wake-up of the loop), and
        deliver(RunnerLost) if the engine stops under the request. Returns the request id."""
        loop = asyncio.get_running_loop()

        def on_output(out: RequestOutput) -> None:  # on the engine thread, during a step
            self._outbox.append((loop, functools.partial(deliver, out)))
            if out.finished:
                self._open.pop(out.request_id, None)

        def preempted(rid: str) -> None:  # on the engine thread, during a step
            if on_preempt is not None:
                self._outbox.append((loop, on_preempt))

        def add():
            req = self.engine.submit(request, on_output, preempted)
            self._open[req.request_id] = (loop, deliver)
            return req

        req = await self.call(add)
        return req.request_id

    async def take(self, request_id: str, with_kv: bool = False) -> Resume | None:
        """Engine.take on the engine thread: the request leaves without an output. Every
        output it produced before is already in its stream's queue when this returns."""
        resume = await self.call(lambda: self.engine.take(request_id, with_kv))
        self._open.pop(request_id, None)
        return resume

    async def generate(
        self,
        prompt: str | list[int],
        sampling: SamplingParams | None = None,
        adapter: str | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield a RequestOutput per step that produced tokens for this request (the steps a
        slow reader missed joined into one, RequestStream), the last one with finished=True.
        Raises ValueError / UnknownAdapterError before the first item when the request is
        refused."""
        ids = self.engine.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        rid = request_id if request_id is not None else new_request_id()
        stream = await self.open(EngineRequest(ids, sampling or SamplingParams(), adapter, rid))
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the engine thread between steps and return its result."""
        return await asyncio.wrap_future(self.submit(fn))

    def submit(self, fn: Callable[[], Any]) -> Future:
        future: Future = Future()
        if self._stop.is_set():
            future.set_exception(RunnerLost(self.error or "the engine is shut down"))
            return future
        self._commands.put((fn, future))
        return future

    def hold(self, timeout: float = 30.0, limit: float = 120.0) -> Callable[[], None]:
        """Hold the engine thread between two steps: a command that waits until the returned
        release() is called, or `limit` seconds pass (a holder that died does not hold it for
        ever). Returns once it is held; TimeoutError when the thread did not get there within
        `timeout` (a long step, another holder, a stopped engine)."""
        entered, done = threading.Event(), threading.Event()

        def wait() -> None:
            self.engine.drain()  # an overlapped step still on the device completes first
            self._flush()
            entered.set()
            done.wait(limit)

        self.submit(wait)
        if not entered.wait(timeout):
            done.set()
            raise TimeoutError(f"the engine was not held within {timeout:g} s")
        return done.set

    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put((lambda: None, Future()))
        self._thread.join(timeout)
        self.engine.shutdown()

    # -- the engine thread ----------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            # idle: nothing running, or the last step ran nothing (requests wait for blocks
            # their peers refused): wait a little for commands instead of spinning
            in_flight = self.engine.in_flight()  # an overlapped step to complete
            idle = not self.engine.batcher.running or self.engine.idle_step
            idle = idle and not in_flight
            if not self.engine.has_unfinished() and not in_flight:
                self._run_commands(block=None)  # nothing to do: sleep until a command arrives
            else:
                self._run_commands(block=_IDLE_WAIT if idle else 0)
            if self._stop.is_set():
                break
            if self.engine.has_unfinished() or self.engine.in_flight():
                self._step()
            self._flush()
        if self.error is not None:  # stopped by a failed step: the streams end with RunnerLost
            for rid, (loop, deliver) in self._open.items():
                lost = RunnerLost(self.error, in_failed_step=rid in self.failed_step)
                self._outbox.append((loop, functools.partial(deliver, lost)))
            self._open.clear()
        else:
            for rid in list(self.engine.requests):
                self.engine.abort(rid)
        self._flush()
        while True:  # commands that raced the stop get an answer instead of waiting forever
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                break
            if future.set_running_or_notify_cancel():
                future.set_exception(RunnerLost(self.error or "the engine is shut down"))

    def _flush(self) -> None:
        if not self._outbox:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for loop, fn in self._outbox:
            by_loop.setdefault(loop, []).append(fn)
        self._outbox = []
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening
                loop.call_soon_threadsafe(_deliver, items)

    def _run_commands(self, block: float | None) -> None:
        try:
            fn, future = (
                self._commands.get(timeout=block) if block != 0 else self._commands.get_nowait()
            )
        except queue.Empty:
            return
        while True:
            if future.set_running_or_notify_cancel():
                # outputs the command produced (an abort's, a take's drained step) reach their
                # streams before its caller goes on
                try:
                    result = fn()
                except BaseException as exc:  # delivered to the caller
                    self._flush()
                    future.set_exception(exc)
                else:
                    self._flush()
                    future.set_result(result)
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return

    def _step(self) -> None:
        try:
            self.engine.step()
        except Exception as exc:  # never leave callers waiting on a dead loop
            if self.on_step_error == "stop":
                log.exception("engine step failed; stopping this engine")
                self.error = f"engine step failed: {type(exc).__name__}: {exc}"
                self.failed_step = frozenset(self.engine.scheduled_ids)
                self._stop.set()
            else:
                log.exception("engine step failed; failing the batch")
                self.engine.fail_all(f"engine step failed: {exc}")


class RequestStream:
    """Async iterator over one request's outputs (fed into `outputs` by whoever runs the
    engine); aclose() (or leaving early) aborts it through `abort`. A reader that fell behind
    gets every output queued for it at once, joined (RequestOutput.then): one chunk to send
    instead of one per step, so a busy server's streams cost it per wakeup, not per token."""

    def __init__(
        self, request_id: str, outputs: asyncio.Queue, abort: Callable[[], object]
    ) -> None:
        self._abort = abort
        self.request_id = request_id
        self._outputs = outputs
        self._done = False
        self._held: object | None = None  # an end (lost, moved) found while joining outputs

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        out, self._held = self._held, None
        if out is None:
            try:
                out = await self._outputs.get()
            except BaseException:  # cancelled while waiting: the consumer is gone
                await self.aclose()
                raise
            out = self._join_queued(out)
        if isinstance(out, RunnerLost):
            self._done = True
            raise out
        if out is _MOVED:
            self._done = True
            raise StreamMoved(self.request_id)
        self._done = out.finished
        return out

    def _join_queued(self, out):
        """`out` joined with the outputs already queued behind it; an end found among them
        is held for the next read."""
        while isinstance(out, RequestOutput) and not out.finished and not self._outputs.empty():
            later = self._outputs.get_nowait()
            if not isinstance(later, RequestOutput):
                self._held = later
                break
            out = out.then(later)
        return out

    def moved(self) -> None:
        """Mark the end of this engine's outputs after a take: a reader gets the outputs
        already queued, then StreamMoved."""
        self._outputs.put_nowait(_MOVED)

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            self._abort()


def _abort(engine: weakref.ref[AsyncEngine], request_id: str) -> None:
    """A stream's abort: it does not keep its engine alive (a dead runner's engine, with its
    KV cache, is freed once its runner is let go, even while streams are still being read)."""
    e = engine()
    if e is not None:
        e.submit(lambda: e.engine.abort(request_id))


def _deliver(items: list[Callable[[], None]]) -> None:
    for fn in items:
        fn()
