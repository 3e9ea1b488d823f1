"""Overlapped scheduling: the host schedules and plans step N+1 while the device runs step N,
and turns step N's tokens into outputs while the device runs step N+1 (vLLM v1's async
scheduling, SGLang's overlap scheduler), so most of the host's work per step hides behind the
device's instead of adding to it.

One engine step (OverlapPart.step), with step N on the device:
1. schedule and plan N+1 (host; the device runs N). A row whose input token is N's, still
   unknown, gets a placeholder (Batch.input_fills).
2. wait for N's logits and sample them (host; the device waits: the only serial part).
3. launch N+1, its placeholders filled from N's samples (DeviceQueue: a worker thread for a
   real device; SimulatedQueue: the simulated device's timeline).
4. postprocess N: stop checks, grammar, text, outputs (host; the device runs N+1).
The host learns N's tokens while N+1 runs: a request that finished at N was already scheduled
in N+1, and that row is wasted and never emitted; a request whose in-flight token is surely its
last (max_tokens or the model's length) is not scheduled again. Sampling reads the request when
all its earlier tokens are known, as between synchronous steps.

What each feature does under overlap:
- greedy, temperature / top-k / top-p / min-p, seeds, logit_bias, penalties, min_tokens,
  logprobs, JSON schemas, stop strings, stop_token_ids, eos, max_tokens, the batch-invariant
  mode: overlapped, the same tokens as synchronous steps (sampling, grammar masks and
  penalties see every earlier token).
- prompt logprobs still to score: while such a request is in the runner, steps are synchronous
  (a prompt chunk's scores are recorded before the next chunk is planned).
- aborts and preemptions: at once; the in-flight rows of such a request are dropped when they
  arrive (a preempted request keeps its sampled token, as between synchronous steps).
- Engine.take (migration) and holding the engine: the in-flight step is completed first.
- MLFQ (KV swaps on the host at schedule time), DistKV (remote blocks), Lamina (attention
  workers): synchronous steps; the engine decides per step (OverlapPart.usable).
- CUDA graphs: a decode step's graph is chosen (a new shape captured) on the host's thread at
  launch, when the device is idle (the previous step's logits were read), and replayed on the
  device's thread (DecodeGraphs.choose / replay), never captured beside a step.
"""

from __future__ import annotations

import logging
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from punica_x.batching.schedule import Schedule, ScheduledRequest
from punica_x.core import FinishReason, RequestOutput, TokenLogprob
from punica_x.engine.outputs import emit
from punica_x.engine.step_sampling import sample_step
from punica_x.env import OVERLAP
from punica_x.host_ints import int64
from punica_x.models.simulated import SimulatedForward
from punica_x.runtime import Batch, Request, RequestStatus

log = logging.getLogger(__name__)


def decide(mode: str, simulated: bool) -> tuple[bool, str]:
    """Whether an engine overlaps its steps, and why: EngineConfig.overlap, where "auto" is
    PUNICA_X_OVERLAP's on / off when set, else on with the simulated device only (a real
    CPU's host and model share its cores; a GPU's figures are still to be measured)."""
    if mode != "auto":
        return mode == "on", f"overlap {mode}"
    env = OVERLAP.get().strip().lower()
    if env in ("on", "off"):
        return env == "on", f"auto: {env} (PUNICA_X_OVERLAP)"
    if env:
        raise ValueError(f"PUNICA_X_OVERLAP must be on or off, got {env!r}")
    if simulated:
        return True, "auto: on (the simulated device)"
    return False, "auto: off (on a real device until measured there)"


def waits_for_host(r: Request) -> bool:
    """Whether r's steps must be synchronous: prompt logprobs still to score (the planner
    reads how many were recorded)."""
    sp = r.sampling
    return sp.prompt_logprobs is not None and len(r.prompt_logprobs) < len(r.prompt_token_ids)


@dataclass
class PlannedStep:
    """A step planned for the device: its batch and rows in the planner's order, where each
    row started (num_computed_tokens before it) and the request's preemption count then, its
    sample row (-1: it does not sample), its sampling requests in sample-row order, its
    request ids, the prefix cache's blocks it completes; `logits` once launched (the device's
    future)."""

    batch: Batch
    ordered: list[ScheduledRequest]
    starts: list[int]
    preemptions: list[int]
    rows: list[int]
    sampling: list[Request]
    ids: tuple[str, ...]
    pending: set[bytes]  # the prefix cache's blocks it completes (named when postprocessed)
    logits: object = None


@dataclass
class Sampled:
    """A completed step's samples: per sampled row its token (None where its own sampling
    failed, its error in `failed`) and logprobs entry."""

    tokens: list[int | None]
    logprobs: list[TokenLogprob | None]
    failed: dict[Request, str] = field(default_factory=dict)


class DeviceQueue:
    """A real device's forwards in submission order on one worker thread (a GPU stream's
    order): launch(forward, batch, kv, sgmv) -> Future of the logits."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="punica-x-device")

    def launch(self, forward, batch: Batch, kv, sgmv) -> Future:
        return self._pool.submit(forward, batch, kv, sgmv)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=False)


class SimulatedLogits:
    """A simulated step's logits, computed at launch, readable when the device reaches
    ready_at (the reader sleeps until then, without the interpreter lock)."""

    def __init__(self, sim, logits) -> None:
        self.sim, self.logits, self.ready_at = sim, logits, sim.ready_at

    def result(self):
        self.sim.wait_until(self.ready_at)
        return self.logits


class SimulatedQueue:
    """The simulated device (models/simulated.py) as a queue: a launch puts the step on the
    device's timeline at once; no device thread, so nothing but the host wants the lock."""

    def __init__(self, sim) -> None:
        self.sim = sim

    def launch(self, forward, batch: Batch, kv, sgmv) -> SimulatedLogits:
        return SimulatedLogits(self.sim, self.sim.launch(batch, kv, sgmv))

    def shutdown(self) -> None:
        pass


def fill_inputs(batch: Batch, tokens: list[int | None]) -> None:
    """Put the previous step's samples into the batch's in-flight inputs (Batch.input_fills);
    a row whose sampling failed feeds 0 (its request ends: the row is wasted)."""
    fills = batch.input_fills
    if fills:
        ids = batch.input_ids
        values = int64([0 if t is None else t for t in tokens])
        values = values.index_select(0, fills.source)
        ids[fills.where.to(ids.device)] = values.to(ids.device, non_blocking=True)


def replaying(graphs, graph, forward):
    """forward(batch, kv, sgmv) that replays `graph` (DecodeGraphs.choose's answer for the
    batch, made on the host's thread) where it is one, else runs forward."""

    def run(batch: Batch, kv, sgmv):
        logits = graphs.replay(graph, batch)
        return forward(batch, kv, sgmv) if logits is None else logits

    return run


def part_for(engine, config) -> OverlapPart | None:
    """The engine's OverlapPart when EngineConfig.overlap decides on (decide), None
    otherwise; said in the log."""
    simulated = isinstance(engine.forward, SimulatedForward)
    on, reason = decide(config.overlap, simulated)
    if on and engine.graphs is not None:
        reason += ", decode steps replayed from CUDA graphs"
    log.info("overlapped scheduling: %s", reason)
    return OverlapPart(engine) if on else None


class OverlapPart:
    """The engine's overlapped steps (see the module). engine: the Engine it belongs to (its
    batcher, planner, forward, outputs and request bookkeeping)."""

    def __init__(self, engine) -> None:
        # a proxy, not a reference: the engine holds this part, and a cycle would keep a
        # dropped engine (its KV cache) alive past the heap's freeze (punica_x/heap.py)
        self.engine = weakref.proxy(engine)
        sim = engine.forward if isinstance(engine.forward, SimulatedForward) else None
        self.device = SimulatedQueue(sim) if sim is not None else DeviceQueue()
        self.inflight: PlannedStep | None = None
        # requests that asked for prompt logprobs, until those are scored (usable reads them)
        self.scoring: set[Request] = set()
        self.overflowed: set[Request] = set()  # too big for the cache, a token in flight
        self.steps = 0  # overlapped steps submitted (engine stats, tests)
        self.waited_s = 0.0  # the host's time blocked on the device's logits (benchmarks)

    def usable(self) -> bool:
        """Whether the next step may overlap: an FCFS batcher without DistKV or attention
        workers, and no request in the runner that waits for the host (waits_for_host)."""
        e = self.engine
        if e.swap is not None or e.batcher.borrowing is not None or e.planner.dist is not None:
            return False
        if e.config.attention_workers:
            return False
        if self.scoring:
            self.scoring = {r for r in self.scoring if not r.finished and waits_for_host(r)}
        return not self.scoring

    def submitted(self, r: Request) -> None:
        """A request joined the engine (Engine.submit)."""
        if waits_for_host(r):
            self.scoring.add(r)

    def step(self) -> list[RequestOutput]:
        """Plan step N+1, sample step N (launched by the previous call), launch N+1, then
        postprocess N: N's outputs (see the module)."""
        e = self.engine
        prev, self.inflight = self.inflight, None
        outputs: list[RequestOutput] = []
        prefix = e.batcher.prefix
        if prefix is not None:  # prev's blocks are named when it is postprocessed
            prefix.inflight_pending = prev.pending if prev is not None else set()
        try:
            nxt = self._plan(outputs)
        except BaseException:
            if prev is not None:
                _wait_quietly(prev)
            raise
        # scheduled_ids: the requests of the step whose failure would raise next
        sampled = None
        if prev is not None:
            e.scheduled_ids = prev.ids
            sampled = self._sample(prev)  # raises when prev's forward did: nxt never runs
        if nxt is not None:
            e.scheduled_ids = nxt.ids
            self._launch(nxt, sampled)
            self.inflight = nxt
        if prev is not None:
            e.scheduled_ids = prev.ids
            outputs += self._postprocess(prev, sampled)
        e.scheduled_ids = nxt.ids if nxt is not None else ()
        return outputs

    def drain(self) -> list[RequestOutput]:
        """Complete the in-flight step, if any: the device is quiet after it."""
        prev, self.inflight = self.inflight, None
        if prev is None:
            return []
        self.engine.scheduled_ids = prev.ids
        return self._postprocess(prev, self._sample(prev))

    def shutdown(self) -> None:
        if self.inflight is not None:
            _wait_quietly(self.inflight)
            self.inflight = None
        self.device.shutdown()

    # -- the parts --------------------------------------------------------------------
    def _plan(self, outputs: list) -> PlannedStep | None:
        """Schedule and plan the next step (not launched); None when nothing runs. Its rows'
        tokens count as computed and its samples as in flight from here on."""
        e = self.engine
        schedule = e.batcher.schedule()
        # a request too big for the cache with its last token still in flight ends when that
        # token arrives (with it, as between synchronous steps)
        late = [r for r in schedule.overflow if r.num_inflight]
        if late:
            self.overflowed.update(late)
            now_ending = [r for r in schedule.overflow if not r.num_inflight]
            schedule = replace(schedule, overflow=now_ending)
        outputs += e._settle(schedule)
        if not schedule.rows:
            return None
        pending = set(e.batcher.prefix.pending) if e.batcher.prefix is not None else set()
        batch, ordered = e.planner.plan(schedule.rows)
        assert not batch.prompt_targets, "prompt logprobs run in synchronous steps"
        starts = [s.request.num_computed_tokens for s in ordered]
        preemptions = [s.request.num_preemptions for s in ordered]
        rows, sampling = [], []
        max_len = e.max_model_len
        for s, start in zip(ordered, starts):
            r, n = s
            r.num_computed_tokens = end = start + n  # the device computes them in order
            if end != r.num_tokens:  # it does not sample (a prompt chunk before its last)
                rows.append(-1)
                continue
            rows.append(len(sampling))
            r.inflight_row = len(sampling)
            r.num_inflight += 1
            sampling.append(r)
            out = len(r.output_token_ids) + r.num_inflight  # its tokens, in flight included
            r.final_in_flight = out >= r.sampling.max_tokens or end + 1 >= max_len
        ids = tuple(s.request.request_id for s in ordered)
        return PlannedStep(batch, ordered, starts, preemptions, rows, sampling, ids, pending)

    def _sample(self, step: PlannedStep) -> Sampled:
        """Wait for a launched step's logits and sample them (every earlier token of its
        requests is known by now: step_sampling.sample_step, isolated per request)."""
        e = self.engine
        t0 = time.perf_counter()
        try:
            logits = step.logits.result()
        finally:
            self.waited_s += time.perf_counter() - t0
        failed: dict[Request, str] = {}
        tokens, logprobs = sample_step(e.sampler, logits, step.sampling, (), failed)
        return Sampled(tokens, logprobs, failed)

    def _launch(self, step: PlannedStep, prev: Sampled | None) -> None:
        e = self.engine
        if step.batch.input_fills:
            fill_inputs(step.batch, prev.tokens)
        forward = e.forward
        if e.graphs is not None:  # chosen (captured, if new) here: the device is idle now
            forward = replaying(e.graphs, e.graphs.choose(step.batch), forward)
        step.logits = self.device.launch(forward, step.batch, e.cache.kv, e.sgmv)
        self.steps += 1

    def _postprocess(self, step: PlannedStep, sampled: Sampled) -> list[RequestOutput]:
        """Advance a sampled step's requests (Engine._postprocess's work for rows computed
        on the device one step earlier); requests ended meanwhile are skipped."""
        e = self.engine
        prefix = e.batcher.prefix
        outputs = []
        now = time.monotonic()
        overflowed, size = self.overflowed, prefix.block_size if prefix is not None else 0
        advance, failed = e._advance, sampled.failed  # bound once: e is a proxy
        tokens, logprobs = sampled.tokens, sampled.logprobs
        rows = zip(step.ordered, step.starts, step.preemptions, step.rows)
        for (r, n), start, preemptions, row in rows:
            if row >= 0:
                r.num_inflight -= 1
            if r.status is RequestStatus.FINISHED:  # aborted, taken or ended meanwhile: its
                overflowed.discard(r)  # rows are wasted
                continue
            # its input tokens are known now: name the blocks they completed
            if size and start % size + n >= size and r.num_preemptions == preemptions:
                prefix.computed(r, start, n)
            if row < 0:
                continue
            r.final_in_flight = False
            out = None
            if r not in failed:
                out = advance(r, tokens[row], logprobs[row], now, failed)
            if out is None:
                out = e._finish_and_emit(r, FinishReason.ERROR, error=failed[r])
            elif r.on_output is not None:
                emit(r, out)
            outputs.append(out)
            if overflowed and r in overflowed:
                overflowed.discard(r)
                if not r.finished:
                    outputs += e._end_unschedulable(Schedule([], [r], [], []))
        e.batcher.after_step(step.ordered, 0.0)
        if prefix is not None:
            prefix.inflight_pending = set()
        return outputs


def _wait_quietly(step: PlannedStep) -> None:
    """Let a launched step the engine gives up on finish on the device (its blocks may be
    reused)."""
    if step.logits is None:
        return
    try:
        step.logits.result()
    except Exception:
        log.debug("an abandoned overlapped step raised", exc_info=True)
