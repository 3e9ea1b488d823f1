"""A sampled token's way out of the step: the grammar takes it, the stop checks, the new
text, and the RequestOutput the caller receives (deltas; totals at the end, see
core.RequestOutput); and the callbacks that hand outputs and preemptions to the caller."""

from __future__ import annotations

import logging

from punica_x.core import FinishReason, RequestOutput
from punica_x.runtime import Request, RequestStatus
from punica_x.sampling.detokenizer import Detokenizer

log = logging.getLogger(__name__)


class OutputProcessor:
    """detokenizer: the engine's (per-request text state); eos_token_ids: the model's;
    max_model_len: a request stops with LENGTH there."""

    def __init__(
        self, detokenizer: Detokenizer, eos_token_ids: frozenset[int] | set[int], max_model_len: int
    ) -> None:
        self.detokenizer, self.eos_token_ids = detokenizer, eos_token_ids
        self.max_model_len = max_model_len

    def consume(self, r: Request, token: int) -> tuple[FinishReason | None, str]:
        """The grammar takes the new token (already appended to r.output_token_ids), then
        the stop checks and the new text: (finish reason or None, text to stream)."""
        if r.matcher is not None and not r.matcher.consume_token(token):
            raise ValueError(
                f"the JSON-schema matcher refused token {token}: {r.matcher.get_error()}"
            )
        reason = self.stop_reason(r, token)
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

    def stop_reason(self, r: Request, token: int) -> FinishReason | None:
        """Why a request stops after `token` (just appended), or None. Below min_tokens eos
        and stop_token_ids were masked, so they are not stops there either."""
        sp = r.sampling
        if r.matcher is not None and r.matcher.is_stopped():
            return FinishReason.STOP  # the JSON is complete
        if len(r.output_token_ids) > sp.min_tokens:
            if token in sp.stop_token_ids:
                r.stop_reason = token
                return FinishReason.STOP
            if not sp.ignore_eos and token in self.eos_token_ids:
                return FinishReason.STOP
        if len(r.output_token_ids) >= sp.max_tokens or r.num_known_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def output(self, r: Request, new_ids: list[int], new_text: str) -> RequestOutput:
        """The step's delta for `r`; the request's totals only when it finished, its prompt on
        its first output and the final one (see RequestOutput)."""
        done, sp = r.finished, r.sampling
        if not done and r.prompt_sent and sp.logprobs is None and sp.prompt_logprobs is None:
            # a step's delta and nothing else (positional: the most common output, made
            # once per request per step)
            return RequestOutput(
                r.request_id, [], [], "", new_ids, new_text, False, r.finish_reason,
                r.stop_reason, r.error,
            )  # fmt: skip
        with_logprobs = sp.logprobs is not None
        prompt = r.prompt_token_ids if done or not r.prompt_sent else []
        r.prompt_sent = True
        new_logprobs = None
        if with_logprobs:
            new_logprobs = r.logprobs[len(r.logprobs) - len(new_ids) :] if new_ids else []
        return RequestOutput(
            request_id=r.request_id,
            prompt_token_ids=prompt,
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
            prompt_logprobs=_prompt_logprobs_out(r),
        )


def _prompt_logprobs_out(r: Request) -> list | None:
    """The prompt's logprobs, once complete: on the first output then, and the final one."""
    if r.sampling.prompt_logprobs is None or len(r.prompt_logprobs) != len(r.prompt_token_ids):
        return None
    if r.prompt_logprobs_sent and not r.finished:
        return None
    r.prompt_logprobs_sent = True
    return list(r.prompt_logprobs)


def emit(r: Request, out: RequestOutput) -> None:
    """Hand `out` to the request's callback; a consumer's failure must not stop the batch.
    With r.stream_interval N > 1 (vLLM's --stream-interval), outputs after the first with
    tokens are held and joined (RequestOutput.then) until N tokens are pending or it ends:
    fewer, larger outputs for the layers above to carry."""
    if r.on_output is None:
        return
    if r.held is not None:
        out, r.held = r.held.then(out), None
    if (
        r.stream_interval > 1
        and r.streamed
        and not out.finished
        and len(out.new_token_ids) < r.stream_interval
    ):
        r.held = out
        return
    r.streamed = r.streamed or bool(out.new_token_ids)
    _call(r, out)


def flush_held(r: Request) -> None:
    """Hand over what emit held for `r` (before it leaves without a final output: a take)."""
    if r.held is not None and r.on_output is not None:
        out, r.held = r.held, None
        _call(r, out)


def _call(r: Request, out: RequestOutput) -> None:
    try:
        r.on_output(out)
    except Exception:
        log.exception("on_output callback of %s failed", r.request_id)


def tell_preempted(preempted: list[Request]) -> None:
    """Call on_preempt(request_id) of each request the step sent back to the queue (and that
    still waits there); a consumer's failure must not stop the batch."""
    for r in preempted:
        if r.on_preempt is not None and not r.finished and r.status is RequestStatus.WAITING:
            try:
                r.on_preempt(r.request_id)
            except Exception:
                log.exception("on_preempt callback of %s failed", r.request_id)
