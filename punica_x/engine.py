"""The runner's step loop: schedule -> run one batched model invocation -> postprocess."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable

from punica_x.attention import choose_attention
from punica_x.attention.dist import DistContext
from punica_x.batcher import Batcher
from punica_x.batcher_mlfq import MLFQBatcher
from punica_x.config import EngineConfig, dtype_name
from punica_x.core import (
    FinishReason,
    KVSnapshot,
    Request,
    RequestOutput,
    RequestStatus,
    Resume,
    SamplingParams,
    TokenLogprob,
)
from punica_x.detokenizer import Detokenizer
from punica_x.errors import ContextTooLong, InvalidRequest
from punica_x.heap import freeze_heap
from punica_x.kv.blocks import KVCache, KVCacheSpec, blocks_needed
from punica_x.kv.rmanager import KVBorrower, LendCaps, PeerLost, RManager
from punica_x.kv.swap import SwapPool
from punica_x.logprobs import record_prompt_logprobs, sampled_logprobs
from punica_x.lora.adapter import LoraTarget
from punica_x.lora.pool import AdapterPool
from punica_x.models.loader import LoadedModel, load_model
from punica_x.ops.sgmv import choose_sgmv
from punica_x.planner import BatchPlanner, ScheduledRequest
from punica_x.sampler import NoTokenAllowed, Sampler
from punica_x.structured import Grammars

log = logging.getLogger(__name__)


def check_request(
    ids: list[int],
    sampling: SamplingParams,
    vocab_size: int,
    max_model_len: int,
    block_size: int,
    num_blocks: int,
    holder: str = "the KV cache holds",
) -> None:
    """The refusals of a request that depend only on the model and the KV pool's size
    (num_blocks: the most one request can hold; `holder` names it in the error), and an
    uncompilable JSON schema: InvalidRequest (ContextTooLong) naming the problem and the
    field; shared by runners and the control plane in front."""
    if not ids:
        raise InvalidRequest("the prompt is empty", "prompt")
    if len(ids) >= max_model_len:
        raise ContextTooLong(
            f"the prompt has {len(ids)} tokens; the model's context is "
            f"{max_model_len} (room for at least one new token is needed)"
        )
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(
            f"token id {bad} is outside the vocabulary (size {vocab_size})", "prompt"
        )
    if blocks_needed(len(ids) + 1, block_size) > num_blocks:
        raise ContextTooLong(
            f"the prompt has {len(ids)} tokens; {holder} {num_blocks * block_size}"
        )
    bad = next((t for t, _ in sampling.logit_bias if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(
            f"logit_bias token id {bad} is outside the vocabulary (size {vocab_size})",
            "logit_bias",
        )
    if sampling.json_schema is not None:
        from punica_x.structured import compile_json_schema

        try:
            compile_json_schema(sampling.json_schema)  # cached: the matcher reuses it
        except ValueError as exc:
            raise InvalidRequest(str(exc), "response_format") from None


def _auto_reason(device) -> str:
    if device.type != "cpu":
        return ""
    from punica_x.ops import isa

    has = "has" if isa.native_bf16() else "lacks"
    return f": this CPU {has} AVX512-BF16 / AMX-BF16"


class Engine:
    """One runner: a shared backbone, an adapter pool, a paged KV cache and a batcher.

    Not thread-safe: one thread calls add_request / abort / step (AsyncEngine wraps it)."""

    def __init__(
        self, config: EngineConfig | None = None, loaded: LoadedModel | None = None
    ) -> None:
        self.config = config = config or EngineConfig()
        self.loaded = loaded or load_model(config.model)
        self.model, self.tokenizer = self.loaded.model, self.loaded.tokenizer
        d = self.model.dims
        device, dtype = config.model.torch_device(), config.model.torch_dtype()
        self.device, self.dtype = device, dtype  # the serving dtype (weights, KV, adapters)
        self.max_model_len = self.loaded.max_model_len
        log.info(
            "serving dtype %s on %s (dtype=%s%s)",
            dtype_name(dtype),
            device,
            config.model.dtype,
            _auto_reason(device) if config.model.dtype == "auto" else "",
        )
        target = LoraTarget(d.num_layers, d.lora_shapes())
        self.adapters = AdapterPool(target, config.lora, device, dtype)
        spec = KVCacheSpec(d.num_layers, d.num_kv_heads, d.head_dim, config.cache.block_size, dtype)
        num_blocks = config.cache.num_blocks or max(
            1, config.cache.kv_cache_bytes // spec.bytes_per_block
        )
        self.cache = KVCache(spec, num_blocks, device)
        self.swap: SwapPool | None = None
        if config.batch.policy == "mlfq":
            swap_blocks = config.cache.swap_blocks
            if swap_blocks is None:
                swap_blocks = config.cache.swap_bytes // spec.bytes_per_block
            self.swap = SwapPool(spec, swap_blocks, device)
            self.batcher: Batcher = MLFQBatcher(self.cache, config.batch, self.swap)
        else:
            self.batcher = Batcher(self.cache, config.batch)
        attention = choose_attention(
            device,
            dtype,
            d.num_heads,
            d.num_kv_heads,
            d.head_dim,
            config.cache.block_size,
            config.attention_backend,
        )
        if hasattr(attention, "configure"):  # backends that plan with head counts (flashinfer)
            attention = attention.configure(d.num_heads, d.num_kv_heads, d.head_dim, dtype)
        self.planner = BatchPlanner(target, config.cache.block_size, device, attention)
        self.sampler = Sampler(config.seed, self.loaded.eos_token_ids)
        self.grammars: Grammars | None = None  # built on the first JSON-schema request
        self.detokenizer = Detokenizer(self.tokenizer)
        self.sgmv = choose_sgmv(device, dtype, d.lora_shapes(), config.sgmv_backend)
        self.requests: dict[str, Request] = {}
        self.rmanager: RManager | None = None  # DistKV (enable_distkv)
        self.idle_step = False  # the last step ran nothing (requests wait for blocks)
        # the requests the current (or last) step runs: the ones to suspect when it raises
        self.scheduled_ids: tuple[str, ...] = ()
        self.peer_losses = 0
        self.num_aborts = 0  # requests aborted here (a client left, a cancel)
        freeze_heap("engine built")  # steps do not walk the start-up heap (punica_x/heap.py)

    def enable_distkv(
        self,
        runner_id: str,
        borrower: KVBorrower,
        caps: LendCaps,
        overlap: bool = False,
        pool=None,
    ) -> RManager:
        """Take part in DistKV: lend blocks to peers within `caps` (the returned rManager
        serves them) and let requests too long for this runner borrow through `borrower`.
        overlap: remote micro-attention runs on `pool` while the local part runs (else in
        the step's thread after it: where runners share the cores, that is faster)."""
        if self.swap is not None:
            raise ValueError(
                "DistKV runs with the fcfs policy: the mlfq policy's KV swapping does not "
                "move borrowed blocks"
            )
        self.rmanager = RManager(runner_id, self.cache, self.planner.attention, caps)
        self.batcher.borrower = borrower
        self.planner.dist = DistContext(runner_id, borrower, pool, overlap)
        return self.rmanager

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
    ) -> Request:
        """Queue a generation. Raises ValueError (bad prompt) or UnknownAdapterError.

        resume: continue a request that ran elsewhere (see Resume): its generated tokens are
        recomputed with the prompt and generation goes on from there; outputs carry the
        totals (token_ids, text, logprobs) of the whole request, and new_* only what is new."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        sampling = sampling or SamplingParams()
        self.check_prompt(ids, sampling)
        ref = self.adapters.acquire(adapter) if adapter is not None else None
        req = Request(
            prompt_token_ids=ids,
            sampling=sampling,
            adapter=ref,
            on_output=on_output,
            on_preempt=on_preempt,
        )
        if request_id is not None:
            req.request_id = request_id
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
                self._resume(req, resume)
        except ValueError:
            if ref is not None:
                self.adapters.release(ref)
            raise
        self.requests[req.request_id] = req
        self.batcher.add(req, front=resume is not None)  # it was admitted before the others
        return req

    def _resume(self, req: Request, resume: Resume) -> None:
        tokens = list(resume.output_token_ids)
        if len(tokens) >= req.sampling.max_tokens:
            raise ValueError("a resumed request has no tokens left to generate")
        if len(req.prompt_token_ids) + len(tokens) >= self.max_model_len:
            raise ValueError("a resumed request has no room left in the model's context")
        vocab = self.model.dims.vocab_size
        if any(not 0 <= t < vocab for t in tokens):
            raise ValueError("a resumed request has token ids outside the vocabulary")
        req.output_token_ids = tokens
        req.num_preemptions = resume.num_preemptions
        if req.sampling.logprobs is not None:
            req.logprobs = list(resume.logprobs)
        if req.sampling.prompt_logprobs is not None and resume.prompt_logprobs is not None:
            req.prompt_logprobs = list(resume.prompt_logprobs)
        if req.matcher is not None:
            for t in tokens:
                req.matcher.consume_token(t)
        sp = req.sampling
        self.detokenizer.prime(req.request_id, tokens, sp.skip_special_tokens, resume.emitted_chars)
        if resume.kv is not None:  # last: nothing after it can refuse the request
            self._import_kv(req, resume.kv)

    def _import_kv(self, req: Request, kv: KVSnapshot) -> None:
        """Take a live copy's KV. Without room for it, the request recomputes instead, as if
        no KV had come (the scheduler placed it where there was room, so this is rare)."""
        data = kv.blocks
        if tuple(data.shape[1:]) != tuple(self.cache.kv.shape[1:]):
            raise ValueError(
                f"the KV copy has blocks of shape {tuple(data.shape[1:])}; this runner's are "
                f"{tuple(self.cache.kv.shape[1:])}"
            )
        n = min(kv.num_tokens, req.num_tokens - 1)  # at least one token left to compute
        if n <= 0 or data.shape[0] < blocks_needed(n, self.cache.block_size):
            return
        if not self.cache.ensure_capacity(req.block_ids, n):
            log.info("no KV room for %s's copy: it recomputes", req.request_id)
            return
        self.cache.import_blocks(req.block_ids, data)
        req.num_computed_tokens = n

    def take(self, request_id: str, with_kv: bool = False) -> Resume | None:
        """Remove an unfinished request without finishing it (no output is emitted) and return
        where it stands, to continue it on another runner; None if it is not here (finished,
        aborted, unknown). with_kv: include a copy of its computed KV (a live copy). Its KV
        blocks and adapter reference are released."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return None
        kv = None
        partial_prompt_logprobs = req.sampling.prompt_logprobs is not None and len(
            req.prompt_logprobs
        ) < len(req.prompt_token_ids)
        local = not req.remote  # borrowed blocks stay where they are: it recomputes
        if with_kv and local and req.num_computed_tokens > 0 and not partial_prompt_logprobs:
            n = req.num_computed_tokens
            if req.host_block_ids:  # swapped out by the MLFQ batcher
                kv = KVSnapshot(n, self.swap.export(req))
            else:
                kv = KVSnapshot(n, self.cache.export_blocks(req.block_ids, n))
        resume = Resume(
            output_token_ids=tuple(req.output_token_ids),
            emitted_chars=self.detokenizer.emitted(request_id),
            logprobs=tuple(req.logprobs),
            prompt_logprobs=(
                tuple(req.prompt_logprobs)
                if len(req.prompt_logprobs) == len(req.prompt_token_ids)
                else None
            ),
            num_preemptions=req.num_preemptions,
            kv=kv,
        )
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
        check_request(
            ids,
            sampling or SamplingParams(),
            self.model.dims.vocab_size,
            self.max_model_len,
            self.cache.block_size,
            self.capacity_blocks(),
            "the cluster's KV caches (DistKV) hold" if self._peers_lend() else "the KV cache holds",
        )

    def _peers_lend(self) -> bool:
        borrower = self.batcher.borrower
        return borrower is not None and borrower.capacity_blocks() > 0

    def capacity_blocks(self) -> int:
        """The most KV blocks one request can hold: this runner's cache, plus what its peers
        could lend under DistKV."""
        borrower = self.batcher.borrower
        extra = borrower.capacity_blocks() if borrower is not None else 0
        return self.cache.allocator.num_blocks + extra

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a request: it leaves the batch and frees its KV blocks now."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return None
        self.num_aborts += 1
        out = self._finish(req, FinishReason.ABORT, new_ids=[], new_text="")
        self._emit(req, out)
        return out

    def fail_all(self, error: str) -> list[RequestOutput]:
        """Finish every request with ERROR (used when a step raised)."""
        return [
            self._finish_and_emit(r, FinishReason.ERROR, error=error)
            for r in list(self.requests.values())
        ]

    def has_unfinished(self) -> bool:
        return self.batcher.num_unfinished > 0

    # -- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One step: schedule, one model invocation, then per request its token, logprobs,
        grammar, stop checks and text. A failure of the model invocation raises (the whole
        step failed); a failure that belongs to one request (processing its logits, sampling
        its token, its logprobs, its grammar, its text) ends that request alone with ERROR
        and its error, and the others go on exactly as they would have without it."""
        self.scheduled_ids = ()
        self.adapters.poll()
        outputs = self._fail_broken_adapters()
        scheduled, overflow = self.batcher.schedule()
        self.scheduled_ids = tuple(s.request.request_id for s in scheduled)
        for r in overflow:
            outputs.append(self._finish_and_emit(r, FinishReason.LENGTH, error=self._too_big(r)))
        starved, self.batcher.starved = self.batcher.starved, []
        for r in starved:
            outputs.append(self._finish_and_emit(r, FinishReason.ERROR, error=self._starved(r)))
        self._tell_preempted()
        self.idle_step = not scheduled
        if not scheduled:
            return outputs
        started = time.perf_counter()
        try:
            batch, ordered = self.planner.plan(scheduled)
            logits = self.model(batch, self.cache.kv, self.sgmv)
        except PeerLost as exc:
            self._lost_peer(exc.owner)
            return outputs
        sampling = [s.request for s in ordered if s.samples]
        failed: dict[Request, str] = {}
        tokens, new_logprobs = self._sample(logits, sampling, batch.prompt_targets, failed)
        self.batcher.after_step(scheduled, time.perf_counter() - started)
        return outputs + self._postprocess(ordered, tokens, new_logprobs, failed)

    def _sample(
        self,
        logits,
        sampling: list[Request],
        prompt_targets: tuple[tuple[Request, tuple[int, ...]], ...],
        failed: dict[Request, str],
    ) -> tuple[list[int | None], list[TokenLogprob | None]]:
        """The tokens and logprobs of the `sampling` requests (logits' first rows), and the
        prompt logprobs of `prompt_targets` (the rows after) recorded. A request whose own
        part fails gets None and its error in `failed` (see _isolate)."""
        n = len(sampling)
        sample_logits = logits[:n]

        def sample(rows: list[int]) -> list[int]:
            return self.sampler(_rows(sample_logits, rows), [sampling[i] for i in rows])

        tokens = self._isolate("sampling", sampling, failed, sample)

        def score(rows: list[int]) -> list[TokenLogprob | None]:
            picked = [sampling[i] for i in rows]
            return sampled_logprobs(_rows(sample_logits, rows), picked, [tokens[i] for i in rows])

        new_logprobs = self._isolate("logprobs", sampling, failed, score)
        if prompt_targets:
            self._record_prompt_logprobs(logits[n:], prompt_targets, failed)
        return tokens, new_logprobs

    def _record_prompt_logprobs(
        self,
        logits,
        targets: tuple[tuple[Request, tuple[int, ...]], ...],
        failed: dict[Request, str],
    ) -> None:
        """Prompt logprobs of `targets` (request, prompt positions), scored from logits' rows
        in order; a request whose own scoring fails goes in `failed` (see _isolate)."""
        starts = list(itertools.accumulate((len(p) for _, p in targets), initial=0))

        def record(rows: list[int]) -> list[None]:
            picked = tuple(targets[i] for i in rows)
            if len(picked) == len(targets):
                record_prompt_logprobs(logits, picked)
            else:
                lines = [j for i in rows for j in range(starts[i], starts[i + 1])]
                record_prompt_logprobs(logits[lines], picked)
            return [None] * len(rows)

        self._isolate("prompt logprobs", [r for r, _ in targets], failed, record)

    def _isolate(
        self,
        stage: str,
        requests: list[Request],
        failed: dict[Request, str],
        run: Callable[[list[int]], list],
    ) -> list:
        """run(rows) -> one result per row (indices into `requests`; it must change nothing
        when it raises), over the requests not in `failed`. All at once (the normal step
        costs nothing more); when that raises, one request at a time, so that an error that
        belongs to one request ends that request alone: it goes in `failed` with its error.
        Returns one result per request, None for the failed ones."""
        results: list = [None] * len(requests)
        rows = [i for i, r in enumerate(requests) if r not in failed]
        if not rows:
            return results
        try:
            values = run(rows)
        except Exception as exc:
            log.warning("%s of a batch raised (%r): redone request by request", stage, exc)
            values = [self._run_one(stage, requests[i], i, failed, run) for i in rows]
        for i, value in zip(rows, values):
            results[i] = value
        return results

    def _run_one(
        self,
        stage: str,
        r: Request,
        row: int,
        failed: dict[Request, str],
        run: Callable[[list[int]], list],
    ):
        try:
            return run([row])[0]
        except Exception as exc:
            failed[r] = self._request_error(r, stage, exc)
            return None

    @staticmethod
    def _request_error(r: Request, stage: str, exc: Exception) -> str:
        """The error a request ends with when its own part of a step raised (logged)."""
        if isinstance(exc, NoTokenAllowed):
            log.warning("request %s: %s", r.request_id, exc)
            return str(exc)
        error = f"{stage} failed: {type(exc).__name__}: {exc}"
        log.error("request %s: %s", r.request_id, error, exc_info=exc)
        return error

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
        for s in ordered:
            r, samples = s.request, s.samples  # before num_computed_tokens moves
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
                self._emit(r, out)
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
            reason, new_text = self._consume(r, token)
        except Exception as exc:
            r.output_token_ids.pop()
            if logprob is not None:
                r.logprobs.pop()
            r.stop_reason = None
            failed[r] = self._request_error(r, "postprocessing", exc)
            return None
        if reason is not None:
            return self._finish(r, reason, new_ids=[token], new_text=new_text)
        return self._output(r, [token], new_text)

    def _consume(self, r: Request, token: int) -> tuple[FinishReason | None, str]:
        """The grammar takes the new token, then the stop checks and the new text: (finish
        reason or None, text to stream)."""
        if r.matcher is not None and not r.matcher.consume_token(token):
            raise ValueError(
                f"the JSON-schema matcher refused token {token}: {r.matcher.get_error()}"
            )
        reason = self._stop_reason(r, token)
        sp = r.sampling
        new_text, matched = self.detokenizer.update(
            r.request_id,
            r.output_token_ids,
            sp.stop,
            sp.include_stop_str_in_output,
            sp.skip_special_tokens,
            final=reason is not None,
            check_stop=len(r.output_token_ids) >= sp.min_tokens,
        )
        if matched is not None:
            reason, r.stop_reason = FinishReason.STOP, matched
        return reason, new_text

    def _stop_reason(self, r: Request, token: int) -> FinishReason | None:
        """Why a request stops after `token` (just appended), or None. Below min_tokens eos
        and stop_token_ids were masked, so they are not stops there either."""
        sp = r.sampling
        if r.matcher is not None and r.matcher.is_stopped():
            return FinishReason.STOP  # the JSON is complete
        if len(r.output_token_ids) > sp.min_tokens:
            if token in sp.stop_token_ids:
                r.stop_reason = token
                return FinishReason.STOP
            if not sp.ignore_eos and token in self.loaded.eos_token_ids:
                return FinishReason.STOP
        if len(r.output_token_ids) >= sp.max_tokens or r.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _lost_peer(self, owner: str) -> None:
        """A runner holding borrowed blocks is gone: the requests with blocks there lose
        them and recompute from their tokens (borrowing again elsewhere); this step's other
        requests run again next step (what it wrote is rewritten identically)."""
        self.peer_losses += 1
        log.warning("runner %s holding borrowed KV blocks is gone", owner)
        for r in list(self.batcher.running):
            if any(e.owner == owner for e in r.remote):
                r.remote = [e for e in r.remote if e.owner != owner]
                self.batcher.preempt(r)

    def _starved(self, r: Request) -> str:
        """The error of a request whose peers lent it no KV block for Batcher.give_up_s."""
        error = (
            f"no peer runner lent the KV blocks this request needs ({r.num_tokens} tokens) for "
            f"{self.batcher.give_up_s:g} s: the cluster's free blocks are held by other "
            f"requests; it ends here after {len(r.output_token_ids)} generated tokens"
        )
        log.warning("request %s: %s", r.request_id, error)
        return error

    def _too_big(self, r: Request) -> str:
        """The error of a request that outgrew the whole KV cache (running alone, nothing left
        to preempt) or, under DistKV, all the blocks the cluster can give one request: it ends
        with LENGTH where it stands."""
        capacity = self.capacity_blocks() * self.cache.block_size
        where = "cluster's KV caches hold" if self._peers_lend() else "whole cache holds"
        error = (
            f"the KV cache is full: the request needs room for {r.num_tokens} tokens and the "
            f"{where} {capacity} tokens, so it cannot fit even alone; it ends here "
            f"after {len(r.output_token_ids)} generated tokens"
        )
        log.warning("request %s: %s", r.request_id, error)
        return error

    def _tell_preempted(self) -> None:
        preempted, self.batcher.preempted = self.batcher.preempted, []
        for r in preempted:
            if r.on_preempt is not None and not r.finished and r.status is RequestStatus.WAITING:
                try:
                    r.on_preempt(r.request_id)
                except Exception:
                    log.exception("on_preempt callback of %s failed", r.request_id)

    def _fail_broken_adapters(self) -> list[RequestOutput]:
        broken = [r for r in self.batcher.waiting if r.adapter is not None and r.adapter.error]
        return [self._finish_and_emit(r, FinishReason.ERROR, error=r.adapter.error) for r in broken]

    def _finish_and_emit(
        self, r: Request, reason: FinishReason, error: str | None = None
    ) -> RequestOutput:
        r.error = error
        out = self._finish(r, reason, new_ids=[], new_text="")
        self._emit(r, out)
        return out

    def _finish(
        self, r: Request, reason: FinishReason, new_ids: list[int], new_text: str
    ) -> RequestOutput:
        r.finish_reason = reason
        self._release(r)
        out = self._output(r, new_ids, new_text)
        self.detokenizer.drop(r.request_id)
        self.requests.pop(r.request_id, None)
        return out

    def _release(self, r: Request) -> None:
        """Out of the batch, KV blocks and adapter reference freed, marked finished."""
        self.batcher.remove(r)
        r.status = RequestStatus.FINISHED
        if r.adapter is not None:
            self.adapters.release(r.adapter)

    def _output(self, r: Request, new_ids: list[int], new_text: str) -> RequestOutput:
        """The step's delta for `r`; the request's totals only when it finished (see
        RequestOutput)."""
        done, with_logprobs = r.finished, r.sampling.logprobs is not None
        new_logprobs = None
        if with_logprobs:
            new_logprobs = r.logprobs[len(r.logprobs) - len(new_ids) :] if new_ids else []
        return RequestOutput(
            request_id=r.request_id,
            prompt_token_ids=r.prompt_token_ids,
            token_ids=list(r.output_token_ids) if done else [],
            text=self.detokenizer.text(r.request_id) if done else "",
            new_token_ids=new_ids,
            new_text=new_text,
            finished=done,
            finish_reason=r.finish_reason,
            stop_reason=r.stop_reason,
            error=r.error,
            logprobs=(list(r.logprobs) if done else []) if with_logprobs else None,
            new_logprobs=new_logprobs,
            prompt_logprobs=self._prompt_logprobs_out(r),
        )

    @staticmethod
    def _prompt_logprobs_out(r: Request) -> list | None:
        """The prompt's logprobs, once complete: on the first output then and the final one."""
        if r.sampling.prompt_logprobs is None or len(r.prompt_logprobs) != len(r.prompt_token_ids):
            return None
        if r.prompt_logprobs_sent and not r.finished:
            return None
        r.prompt_logprobs_sent = True
        return list(r.prompt_logprobs)

    @staticmethod
    def _emit(r: Request, out: RequestOutput) -> None:
        if r.on_output is not None:
            try:
                r.on_output(out)
            except Exception:  # a consumer's failure must not stop the batch
                log.exception("on_output callback of %s failed", r.request_id)

    def shutdown(self) -> None:
        self.adapters.shutdown()


def _rows(logits, rows: list[int]):
    """The rows `rows` (increasing indices) of logits: logits itself when that is all of them."""
    return logits if len(rows) == logits.shape[0] else logits[rows]
