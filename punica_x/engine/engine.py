"""The runner's step loop: schedule -> run one batched model invocation -> postprocess."""

from __future__ import annotations

import logging
import time

from punica_x.batching.planner import BatchPlanner
from punica_x.batching.schedule import Schedule, ScheduledRequest
from punica_x.config import EngineConfig
from punica_x.core import (
    FinishReason,
    RequestOutput,
    Resume,
    SamplingParams,
    TokenLogprob,
    new_request_id,
)
from punica_x.engine import build, lamina_part, memory, overlap, report
from punica_x.engine.build import (
    build_decode_graphs,
    build_kv,
    build_sgmv,
    engine_invariance,
    lora_target,
    serving_dtypes,
    simulated_forward,
)
from punica_x.engine.checks import check_request, unschedulable
from punica_x.engine.cuda_graphs import DecodeGraphs
from punica_x.engine.distkv_part import DistKVPart
from punica_x.engine.moves import resume_into, resume_point
from punica_x.engine.outputs import OutputProcessor, emit, flush_held, tell_preempted
from punica_x.engine.step_sampling import request_error, sample_step
from punica_x.errors import InvalidRequest
from punica_x.heap import freeze_heap
from punica_x.kv.prefix import cache_key
from punica_x.kv.rmanager import PeerLost
from punica_x.lora.pool import AdapterPool
from punica_x.models.loader import LoadedModel, load_model
from punica_x.request import EngineRequest
from punica_x.runtime import Request, RequestStatus
from punica_x.sampling.detokenizer import Detokenizer
from punica_x.sampling.sampler import Sampler
from punica_x.sampling.structured import Grammars

log = logging.getLogger(__name__)


class Engine:
    """One runner: a shared backbone, an adapter pool, a paged KV cache and a batcher.

    Not thread-safe: one thread calls add_request / abort / step (AsyncEngine wraps it)."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        loaded: LoadedModel | None = None,
        probe: memory.MemoryProbe | None = None,
        attention_launcher=None,
    ) -> None:
        """probe: how memory planning (config.memory) reads the device (punica_x/engine/
        memory.py; None: the device's own probe). attention_launcher: starts the attention
        workers of config.attention_workers (engine/lamina_part.py; None: in this process)."""
        self.config = config = config or EngineConfig()
        self.attention_launcher = attention_launcher
        device, dtype, self.lora_dtype = serving_dtypes(config)  # refused before any load
        self.device, self.dtype = device, dtype  # the serving dtype (weights, KV)
        self.loaded = loaded or load_model(config.model)
        self.model, self.tokenizer = self.loaded.model, self.loaded.tokenizer
        self.max_model_len = self.loaded.max_model_len
        self.config = config = build.slotted_config(config, self.model, self.lora_dtype)
        self.memory_plan: memory.MemoryPlan | None = None
        utilization = config.memory.effective_utilization(device, config.cache.sized)
        if utilization is not None:
            self._build(memory.profiling_config(config, self.max_model_len))
            probe = probe or memory.probe_for(device)
            self.memory_plan = memory.plan_engine(self, utilization, probe)
            log.info(self.memory_plan.describe())
            self.config = config = memory.planned_config(config, self.memory_plan)
            self.max_model_len = self.memory_plan.max_model_len
        self._build(config)
        self.simulated = simulated_forward(self, config)  # None: the model runs
        self.graphs = None if self.simulated else build_decode_graphs(self, config)
        self.overlap = overlap.part_for(self, config)  # None: synchronous steps
        freeze_heap("engine built")  # steps do not walk the start-up heap (punica_x/heap.py)

    def _build(self, config: EngineConfig) -> None:
        """The engine's parts around the loaded model, sized by `config`."""
        d, device, dtype, size = self.model.dims, self.device, self.dtype, config.cache.block_size
        target = lora_target(d, self.model.edge_digests)
        self.adapters = AdapterPool(target, config.lora, device, self.lora_dtype)
        self.invariance = engine_invariance(self.loaded.invariance, config)  # ops.invariance
        attention, workers = lamina_part.attention_and_workers(self, config)
        self.cache, self.swap, self.batcher = build_kv(config, d, device, dtype, workers)
        self.planner = BatchPlanner(target, size, device, attention, keep_rows=self.swap is None)
        self.sampler = Sampler(config.seed, self.loaded.eos_token_ids)
        self.grammars: Grammars | None = None  # built on the first JSON-schema request
        self.detokenizer = Detokenizer(self.tokenizer)
        eos = self.loaded.eos_token_ids
        self.outputs = OutputProcessor(self.detokenizer, eos, self.max_model_len)
        self.sgmv = build_sgmv(config, d, device, dtype, self.lora_dtype, self.invariance.on)
        self.graphs: DecodeGraphs | None = None  # captured once the engine is built
        self.simulated = self.overlap = None  # so are these (a profiling step runs the model)
        self.requests: dict[str, Request] = {}
        # DistKV (off until engine.distkv.enable(...)): lending, borrowing, moves home
        self.distkv = DistKVPart(
            self.cache, self.batcher, self.planner, self.requests, self.swap, d, self.invariance.on
        )
        self.idle_step = False  # the last step ran nothing (requests wait for blocks)
        self.scheduled_ids: tuple[str, ...] = ()  # the last step's requests (suspects if it raised)
        self.num_aborts = 0  # requests aborted here (a client left, a cancel)
        self.attention_worker_losses = 0  # Lamina's attention workers lost and replaced

    @property
    def forward(self):
        """What a step calls: the model (whatever self.model is now), or the simulated device."""
        return self.simulated if self.simulated is not None else self.model

    def describe(self) -> report.EngineInfo:
        """What this engine is (device, model, LoRA and KV limits): punica_x/engine/report.py."""
        return report.describe(self)

    def stats(self) -> report.EngineStats:
        """Its gauges and counters now; safe to call from another thread (a snapshot)."""
        return report.stats(self)

    def limits(self) -> report.RequestLimits:
        """What check_prompt checks a prompt against now."""
        return report.limits(self)

    def unregister_adapter(self, name: str) -> None:
        """Remove an adapter (AdapterPool.unregister: running requests finish on the weights they
        hold) and its prefix-cache counters (uploads and deletes do not grow /metrics)."""
        self.adapters.unregister(name)
        if self.batcher.prefix is not None:
            self.batcher.prefix.stats.forget(name)

    # -- requests -------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        sampling: SamplingParams | None = None,
        adapter: str | None = None,
        request_id: str | None = None,
        on_output=None,
        resume: Resume | None = None,
        on_preempt=None,
        cache_salt: str | None = None,
    ) -> Request:
        """Queue a generation offline (LLM, tests): the prompt may be text (tokenized here),
        sampling None takes the defaults and request_id None a fresh id; the rest is
        EngineRequest's (see there) and submit()'s. Raises what submit() raises."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        rid = request_id if request_id is not None else new_request_id()
        request = EngineRequest(ids, sampling or SamplingParams(), adapter, rid, cache_salt, resume)
        return self.submit(request, on_output, on_preempt)

    def submit(self, request: EngineRequest, on_output=None, on_preempt=None) -> Request:
        """Queue `request`; on_output(RequestOutput) is called in the steps that produce for
        it, on_preempt(request_id) after a step that preempted it. Raises InvalidRequest,
        UnknownAdapterError, or ValueError (a duplicate id). With `resume` (see Resume) its
        generated tokens are recomputed with the prompt and generation goes on; outputs carry
        the whole request's totals (token_ids, text, logprobs), new_* only what is new."""
        ids, sampling, resume = list(request.prompt), request.sampling, request.resume
        self.check_prompt(ids, sampling)
        ref = self.adapters.acquire(request.adapter) if request.adapter is not None else None
        req = Request(
            prompt_token_ids=ids,
            sampling=sampling,
            adapter=ref,
            request_id=request.request_id,
            on_output=on_output,
            on_preempt=on_preempt,
            stream_interval=self.config.stream_interval,
        )
        if self.batcher.prefix is not None:
            req.cache_key = cache_key(ref.cache_id if ref is not None else None, request.cache_salt)
        if req.request_id in self.requests:
            if ref is not None:
                self.adapters.release(ref)
            raise ValueError(f"duplicate request id {req.request_id!r}")
        if sampling.prompt_logprobs is not None:
            req.prompt_logprobs.append(None)  # the first token has no context to score it
        try:
            if sampling.json_schema is not None:
                try:
                    req.matcher = self._grammars().matcher(sampling.json_schema)
                except ValueError as exc:
                    raise InvalidRequest(str(exc), "response_format") from None
            if resume is not None:
                vocab = self.model.dims.vocab_size
                resume_into(req, resume, self.max_model_len, vocab, self.detokenizer, self.cache)
        except ValueError:
            if ref is not None:
                self.adapters.release(ref)
            raise
        self.requests[req.request_id] = req
        if self.overlap is not None:
            self.overlap.submitted(req)
        self.batcher.add(req, front=resume is not None)  # it was admitted before the others
        return req

    def take(self, request_id: str, with_kv: bool = False) -> Resume | None:
        """Remove an unfinished request without finishing it (no final output; held ones go)
        and return where it stands, to continue it on another runner; None if it is not here
        (finished, aborted, unknown). with_kv: with a copy of its computed KV (a live copy).
        Its KV blocks and adapter are released. An overlapped step completes first."""
        self.drain()  # the request's in-flight token and KV arrive (it may finish there)
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return None
        flush_held(req)
        resume = resume_point(req, self.detokenizer, self.cache, self.swap, with_kv)
        self._release(req)
        self.detokenizer.drop(request_id)
        self.requests.pop(request_id, None)
        return resume

    def _grammars(self) -> Grammars:
        if self.grammars is None:
            self.grammars = Grammars(
                self.tokenizer, self.model.dims.vocab_size, self.loaded.eos_token_ids
            )
        return self.grammars

    def check_prompt(self, ids: list[int], sampling: SamplingParams | None = None) -> None:
        """The runner's refusals of a prompt now (engine/checks.py): InvalidRequest."""
        lends = self.distkv.peers_lend()
        holder = "the cluster's KV caches (DistKV) hold" if lends else "the KV cache holds"
        blocks, vocab = self.distkv.capacity_blocks(), self.model.dims.vocab_size
        sampling = sampling or SamplingParams()
        args = (vocab, self.max_model_len, self.cache.block_size, blocks, holder)
        check_request(ids, sampling, *args)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request: it leaves the batch and frees its KV blocks now."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return None
        self.num_aborts += 1
        out = self._finish(req, FinishReason.ABORT, new_ids=[], new_text="")
        emit(req, out)
        return out

    def fail_all(self, error: str) -> list[RequestOutput]:
        """Finish every request with ERROR (used when a step raised)."""
        reqs = list(self.requests.values())
        return [self._finish_and_emit(r, FinishReason.ERROR, error=error) for r in reqs]

    def has_unfinished(self) -> bool:
        """Requests wait or run (see in_flight for an overlapped step of finished rows)."""
        return self.batcher.num_unfinished > 0

    def in_flight(self) -> bool:
        """Whether an overlapped step is on the device, its tokens not yet known."""
        return self.overlap is not None and self.overlap.inflight is not None

    def drain(self) -> list[RequestOutput]:
        """Complete an overlapped step still on the device (its outputs emitted): quiet after."""
        return self.overlap.drain() if self.overlap is not None else []

    # -- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step: schedule -> end what cannot run -> plan and run the model -> sample ->
        emit each request's token, logprobs, grammar, stop checks and text. A failure of the
        model invocation raises (the whole step failed); a failure that belongs to one
        request (processing its logits, sampling its token, its logprobs, its grammar, its
        text) ends that request alone with ERROR and its error, and the others go on exactly
        as they would have without it."""
        self.scheduled_ids = ()
        self.adapters.poll()
        outputs = self._fail_broken_adapters()
        if self.overlap is not None:
            if self.overlap.usable():
                return outputs + self.overlap.step()
            outputs += self.overlap.drain()
        schedule = lamina_part.schedule(self)
        if schedule is None:  # an attention worker was lost in a swap between steps
            return outputs
        outputs += self._settle(schedule)
        if not schedule.rows:
            return outputs
        started = time.perf_counter()
        ran = self._run(schedule.rows)
        if ran is None:
            return outputs
        batch, ordered, logits = ran
        sampling = [s.request for s in ordered if s.samples]
        failed: dict[Request, str] = {}
        tokens, logprobs = sample_step(self.sampler, logits, sampling, batch.prompt_targets, failed)
        self.batcher.after_step(schedule.rows, time.perf_counter() - started)
        return outputs + self._postprocess(ordered, tokens, logprobs, failed)

    def _settle(self, schedule: Schedule) -> list[RequestOutput]:
        """Before its rows run: end what cannot run, tell the preempted, note scheduled_ids."""
        self.scheduled_ids = tuple(s.request.request_id for s in schedule.rows)
        outputs = self._end_unschedulable(schedule)
        tell_preempted(schedule.preempted)
        self.idle_step = not schedule.rows
        if not schedule.rows:
            self.planner.forget()  # the kept LoRA plan holds adapter tensors alive
        return outputs

    def _end_unschedulable(self, schedule: Schedule) -> list[RequestOutput]:
        """End the requests the batcher cannot run, each error logged (checks.unschedulable)."""
        ending = unschedulable(schedule, self.distkv, self.cache.block_size, self.batcher)
        return [self._finish_and_emit(r, reason, error) for r, reason, error in ending]

    def _run(self, rows: list[ScheduledRequest]):
        """Plan the batch and run the model (a CUDA graph where one fits): (batch, rows in
        the planner's order, logits), or None when a peer holding this step's borrowed KV
        was lost (its requests recompute; the others run again next step)."""
        try:
            batch, ordered = self.planner.plan(rows)
            logits = self.graphs.run(batch) if self.graphs is not None else None
            if logits is None:
                logits = self.forward(batch, self.cache.kv, self.sgmv)
        except PeerLost as exc:
            lamina_part.lost_peer(self, exc.owner)
            return None
        return batch, ordered, logits

    def _postprocess(
        self,
        ordered: list[ScheduledRequest],
        tokens: list[int | None],
        new_logprobs: list[TokenLogprob | None],
        failed: dict[Request, str],
    ) -> list[RequestOutput]:
        """Advance every scheduled request; the ones in `failed` (or failing here) end with
        ERROR, their KV blocks and adapter released."""
        outputs = []
        sampled = iter(zip(tokens, new_logprobs))
        now = time.monotonic()
        prefix = self.batcher.prefix
        for s in ordered:
            r, samples = s.request, s.samples  # before num_computed_tokens moves
            if prefix is not None:  # the blocks this step completed are cached
                prefix.computed(r, r.num_computed_tokens, s.num_new_tokens)
            r.num_computed_tokens += s.num_new_tokens
            token, logprob = next(sampled) if samples else (None, None)
            if not samples and r not in failed:
                continue
            out = None
            if r not in failed:
                out = self._advance(r, token, logprob, now, failed)
            if out is None:
                out = self._finish_and_emit(r, FinishReason.ERROR, error=failed[r])
            else:
                emit(r, out)
            outputs.append(out)
        return outputs

    def _advance(
        self,
        r: Request,
        token: int,
        logprob: TokenLogprob | None,
        now: float,
        failed: dict[Request, str],
    ) -> RequestOutput | None:
        """Append a sampled token and return the request's output (finished if it stops).
        None if its grammar, stop checks or text raise: the token is taken back and the
        error put in `failed`."""
        r.output_token_ids.append(token)
        if logprob is not None:
            r.logprobs.append(logprob)
        r.first_token_time = r.first_token_time or now
        try:
            reason, new_text = self.outputs.consume(r, token)
        except Exception as exc:
            r.output_token_ids.pop()
            if logprob is not None:
                r.logprobs.pop()
            r.stop_reason = None
            failed[r] = request_error(r, "postprocessing", exc)
            return None
        if reason is not None:
            return self._finish(r, reason, new_ids=[token], new_text=new_text)
        return self.outputs.output(r, [token], new_text)

    def _fail_broken_adapters(self) -> list[RequestOutput]:
        broken = [r for r in self.batcher.waiting if r.adapter is not None and r.adapter.error]
        return [self._finish_and_emit(r, FinishReason.ERROR, error=r.adapter.error) for r in broken]

    def _finish_and_emit(
        self, r: Request, reason: FinishReason, error: str | None = None
    ) -> RequestOutput:
        r.error = error
        out = self._finish(r, reason, new_ids=[], new_text="")
        emit(r, out)
        return out

    def _finish(
        self, r: Request, reason: FinishReason, new_ids: list[int], new_text: str
    ) -> RequestOutput:
        r.finish_reason = reason
        self._release(r)
        out = self.outputs.output(r, new_ids, new_text)
        self.detokenizer.drop(r.request_id)
        self.requests.pop(r.request_id, None)
        return out

    def _release(self, r: Request) -> None:
        """Out of the batch, KV blocks and adapter reference freed, marked finished."""
        self.batcher.remove(r)
        r.status = RequestStatus.FINISHED
        if r.adapter is not None:
            self.adapters.release(r.adapter)

    def stop_lending(self) -> None:
        """Lend no more KV blocks to peers (a runner being drained); nothing without DistKV."""
        self.distkv.stop_lending()

    def shutdown(self) -> None:
        if self.overlap is not None:
            self.overlap.shutdown()
        self.adapters.shutdown()
        lamina_part.close(self.attention_launcher)
