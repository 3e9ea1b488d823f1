"""One request's stream as its client sees it, across moves between runners.

A ClusterStream holds the request (prompt, sampling, adapter, tenant) and everything it has
delivered, so the request can be recomputed elsewhere from where the client stands
(resume_point). It reads the outputs of the runner stream it is placed on (`inner`), then of
the streams of runners it left (`retired`), and tells its owner (the Scheduler, through the
StreamOwner methods) what happens: tokens served, a runner lost under it, its end."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import ClassVar, Protocol

from punica_x.api import (
    EngineRequest,
    FinishReason,
    RequestOutput,
    RequestStream,
    Resume,
    RunnerLost,
    SamplingParams,
    StreamMoved,
)
from scheduler.policy.placement import Demand

log = logging.getLogger(__name__)


class StreamOwner(Protocol):
    """What a ClusterStream tells the scheduler that placed it."""

    async def stream_lost(
        self, stream: ClusterStream, error: str, in_failed_step: bool = False
    ) -> None:
        """The runner under `stream` is gone (its step failed when in_failed_step)."""

    def stream_served(self, stream: ClusterStream, tokens: int) -> None:
        """`stream` delivered `tokens` new tokens (fair share counts them)."""

    def stream_done(self, stream: ClusterStream) -> None:
        """`stream` ended (finished, failed or closed by its client)."""

    def kick(self) -> None:
        """Room may have appeared: place what waits."""


class ClusterStream:
    """One request's outputs as its client sees them, across moves between runners."""

    # changed whenever any stream's num_tokens may have (tokens delivered, a resume set): a
    # sum over streams kept by increments (StreamTable.committed) is summed again after it
    tokens_epoch: ClassVar[int] = 0

    def __init__(self, owner: StreamOwner, request: EngineRequest, tenant: str = "") -> None:
        self.owner = owner
        self.request = request  # as its caller made it; each runner gets it with `resume`
        self.tenant = tenant  # whose request (fair share)
        self.prefix_names: tuple[int, list[bytes]] | None = None  # (block size, its prompt's)
        self.arrival = 0  # its place in the order requests arrived (the scheduler sets it)
        self.created = time.monotonic()
        self.queue_wait: float | None = None  # seconds until it was first placed
        self.slot = None  # the RunnerSlot it is on (scheduler/cluster.py), None while queued
        self.inner: RequestStream | None = None
        self.on_runner = asyncio.Event()  # set while it is on a runner (or failed)
        self._resume: Resume | None = None
        self.moving = False
        self.yielding = False  # giving its slot to another tenant's request (fair share)
        self.closed = False
        self.failures = 0  # runners that died under it
        # failed steps it was in since its last token (QUARANTINE_STEPS of them end it)
        self.failed_steps = 0
        self.runners_seen: list[str] = []  # every runner it was placed on, in order
        self.retired: list[RequestStream] = []  # streams of runners it left, not yet read out
        self._done = False
        self._final: RequestOutput | None = None
        # what it delivered so far (outputs carry deltas: see RequestOutput)
        self.token_ids: list[int] = []
        self.logprobs: list = []
        self.prompt_logprobs: list | None = None
        self._text: list[str] = []
        self._emitted_chars = 0

    @property
    def resume(self) -> Resume | None:
        """Where a runner takes the request up (None: from its prompt)."""
        return self._resume

    @resume.setter
    def resume(self, value: Resume | None) -> None:
        self._resume = value
        ClusterStream.tokens_epoch += 1

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.request.prompt

    @property
    def sampling(self) -> SamplingParams:
        return self.request.sampling

    @property
    def adapter(self) -> str | None:
        return self.request.adapter

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def cache_salt(self) -> str | None:
        """Whose prefix-cached KV it may reuse (on every runner)."""
        return self.request.cache_salt

    @property
    def suspect(self) -> bool:
        """It was in a step that failed and has produced no token since: it may be what made
        the step fail, so it is retried on a runner holding no other suspect."""
        return self.failed_steps > 0

    @property
    def num_tokens(self) -> int:
        generated = len(self.token_ids)
        if self.resume is not None:
            generated = max(generated, len(self.resume.output_token_ids))
        return len(self.prompt) + generated

    def demand(self) -> Demand:
        return Demand(self.adapter, self.num_tokens)

    def resume_point(self) -> Resume | None:
        """Where the client stands: what to recompute after a runner failure."""
        if not self.token_ids:
            return self.resume
        return Resume(
            output_token_ids=tuple(self.token_ids),
            emitted_chars=self._emitted_chars,
            logprobs=tuple(self.logprobs),
            prompt_logprobs=tuple(self.prompt_logprobs) if self.prompt_logprobs else None,
        )

    def fail(self, error: str, retryable: bool = True) -> None:
        """End the stream with an ERROR output carrying what was generated. retryable: the
        same request may succeed if sent again (False for a request that made steps fail)."""
        if self._done or self._final is not None:
            return
        self._final = RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=list(self.prompt),
            token_ids=list(self.token_ids),
            text="".join(self._text),
            new_token_ids=[],
            new_text="",
            finished=True,
            finish_reason=FinishReason.ERROR,
            error=error,
            retryable=retryable,
        )
        self.on_runner.set()

    def __aiter__(self) -> ClusterStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            if self._final is not None:
                out, self._final = self._final, None
                self._finish()
                return out
            if self._done:
                raise StopAsyncIteration
            if self.retired:
                try:
                    out = await self.retired[0].__anext__()
                except (StreamMoved, StopAsyncIteration):
                    self.retired.pop(0)
                    continue
                return self._deliver(out)
            inner = self.inner
            if inner is None:
                try:
                    await self.on_runner.wait()
                except BaseException:
                    await self.aclose()
                    raise
                continue
            try:
                out = await inner.__anext__()
            except StreamMoved:  # its outputs from the old runner are all read
                if inner in self.retired:
                    self.retired.remove(inner)
                continue
            except RunnerLost as exc:
                if self.inner is inner:
                    await self._lost(str(exc), exc.in_failed_step)
                continue
            except StopAsyncIteration:
                continue
            return self._deliver(out)

    async def _lost(self, error: str, in_failed_step: bool) -> None:
        """Its runner is gone: the scheduler moves it on. Should that raise (a fault of the
        scheduler's own), this request ends with a visible error rather than the exception
        reaching whoever reads it (an HTTP handler: a broken stream, a bare 500)."""
        try:
            await self.owner.stream_lost(self, error, in_failed_step)
        except Exception as bug:
            log.exception("request %s could not be moved on after %s", self.request_id, error)
            self.fail(f"the request could not be moved on after its runner failed: {bug!r}")

    def _deliver(self, out: RequestOutput) -> RequestOutput:
        self.token_ids += out.new_token_ids
        self.logprobs += out.new_logprobs or ()
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self._text.append(out.new_text)
        self._emitted_chars += len(out.new_text)
        if out.new_token_ids:
            ClusterStream.tokens_epoch += 1
            self.owner.stream_served(self, len(out.new_token_ids))
        if out.finished:
            self._finish()
        elif self.suspect and out.new_token_ids:  # it got past the step that failed
            self.failed_steps = 0
            self.owner.kick()  # the next suspect may go where it is
        return out

    def _finish(self) -> None:
        self._done = True
        self.owner.stream_done(self)

    async def aclose(self) -> None:
        if self._done:
            return
        self.closed = True
        self._done = True
        inner = self.inner
        if inner is not None:
            await inner.aclose()
        self.owner.stream_done(self)
