"""The runner's public vocabulary: sampling parameters, the outputs streamed back to callers,
where a moved request stands (Resume) and DistKV's extents. What a request is while it runs
and one step's batch are the engine's own (punica_x/runtime.py)."""

from __future__ import annotations

import enum
import functools
import itertools
import math
import numbers
import operator
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (annotations only: a live copy's KV blocks)
    import torch


MAX_LOGPROBS = 20


@dataclass(frozen=True)
class RemoteExtent:
    """Blocks of one request lent by runner `owner`: its physical ids there, in the order
    of the request's logical blocks. An extent whose owner is the request's own runner holds
    local blocks that came home (DGFM swaps) after the request had begun borrowing."""

    owner: str
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model (the raw distribution: log_softmax of the
    logits, before temperature and top-k/top-p), and the `top` most likely tokens at that
    position as (token id, logprob), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 (or below SAMPLING_EPS, 1e-5, as vLLM) is greedy. top_k <= 0 and
    top_p = 1 disable those filters. Generation stops at max_tokens, at eos (unless
    ignore_eos), at any of stop_token_ids, or when the text contains one of `stop` (the stop
    string is cut from the text unless include_stop_str_in_output).

    min_tokens (vLLM's): until this many tokens are generated, the eos token ids (unless
    ignore_eos) and stop_token_ids are not sampled (greedy included) and stop strings do not
    end the generation (a stop string counts only when it ends in text of later tokens). It
    depends only on the number of tokens generated, so a resumed request goes on as it would
    have. 0 <= min_tokens <= max_tokens.

    Before sampling (greedy included), in this order: logit_bias ((token id, bias) pairs,
    bias in [-100, 100], added to the logits), repetition_penalty (vLLM's: logits of tokens
    in the prompt or the output divided by it when positive, multiplied when negative),
    frequency_penalty and presence_penalty (OpenAI's, over the output tokens: minus
    frequency * count, minus presence if present); after temperature, min_p drops tokens less
    likely than min_p times the most likely one.

    seed: any integer (negative, or beyond 64 bits), taken modulo 2**64: -1 and 2**64 - 1
    draw the same tokens (see sampler.step_seed). None: the engine's generator.

    json_schema: a JSON schema (text, see punica_x.sampling.structured): the output is JSON valid
    against it, and generation stops when the JSON is complete.

    logprobs: None, or return each generated token's logprob with this many (0..20) top
    alternatives. prompt_logprobs: likewise for every prompt token after the first (computed
    from the prefill's own forward pass, only for requests that ask).

    This is the engine's own contract (library users of punica_x.engine.llm / Engine): ValueError,
    naming the field, for a float field that is not a finite number (NaN, inf, a bool, a
    string), an int field that is not an integer (a bool, a float), or a value out of range.
    Integer floats (temperature=1) are taken as floats."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    json_schema: str | None = None
    min_tokens: int = 0

    def __post_init__(self) -> None:
        self._coerce_types()
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if any(not -100 <= b <= 100 for _, b in self.logit_bias):
            raise ValueError("logit_bias values must be in [-100, 100]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")

    def _coerce_types(self) -> None:
        """Check every field's type and store it in its canonical form (tuples, int, float)."""
        set_ = functools.partial(object.__setattr__, self)
        for name in _FLOAT_FIELDS:
            set_(name, _finite(name, getattr(self, name)))
        for name in _INT_FIELDS:
            set_(name, _integer(name, getattr(self, name)))
        for name in _OPTIONAL_INT_FIELDS:
            value = getattr(self, name)
            set_(name, None if value is None else _integer(name, value))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) for s in stop):
            raise ValueError("stop must be a string or a sequence of strings")
        set_("stop", stop)
        set_("stop_token_ids", tuple(_integer("stop_token_ids", t) for t in self.stop_token_ids))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        set_("logit_bias", tuple((int(t), _finite("logit_bias", b)) for t, b in bias))

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @property
    def plain(self) -> bool:
        """Greedy with nothing to do for the token beyond the argmax of the model's logits:
        no logit_bias, penalties, min_tokens, JSON schema or logprobs (the sampler's fast
        path; a Request keeps it, runtime.Request.plain)."""
        plain = self.greedy and not self.logit_bias and self.min_tokens == 0
        plain = plain and self.json_schema is None and self.logprobs is None
        plain = plain and self.repetition_penalty == 1 and not self.frequency_penalty
        return plain and not self.presence_penalty


SAMPLING_EPS = 1e-5  # a temperature below it is greedy (vLLM's _SAMPLING_EPS)
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
)
_INT_FIELDS = ("max_tokens", "top_k", "min_tokens")
_OPTIONAL_INT_FIELDS = ("seed", "logprobs", "prompt_logprobs")


def _finite(name: str, value) -> float:
    """`value` as a float; ValueError naming the field unless it is a finite real number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    return value


def _integer(name: str, value) -> int:
    """`value` as an int; ValueError naming the field unless it is an integer (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled by the caller (or a disconnect)
    ERROR = "error"  # the request could not be served (e.g. its adapter failed to load)


_ids = itertools.count()


def new_request_id() -> str:
    """A request id unique in this process ("req-N"), for callers that give none."""
    return f"req-{next(_ids)}"


@dataclass(frozen=True)
class KVSnapshot:
    """A request's KV for a live copy (Llumnix-style migration): the first num_tokens tokens'
    keys and values, blocks [n, L, 2, N_kv, P, D] in the KVCache layout, on the CPU."""

    num_tokens: int
    blocks: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.blocks.numel() * self.blocks.element_size()


@dataclass(frozen=True)
class Resume:
    """Where a request stands when it moves to another runner (migration by recomputation,
    Punica sec. 5.3): the tokens generated so far (their KV is recomputed on the target with
    the prompt), their logprobs, the prompt logprobs once complete, and how many characters
    of text the caller has already been sent. Seeded sampling depends only on the seed and
    the number of tokens generated (Sampler), so the output continues exactly as it would
    have on the source. With `kv` (a live copy), the target takes the source's KV instead of
    recomputing it."""

    output_token_ids: tuple[int, ...]
    emitted_chars: int = 0
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    num_preemptions: int = 0
    kv: KVSnapshot | None = None  # with a live copy: the target computes only what is not in it


@dataclass
class RequestOutput:
    """What a caller sees after each step that produced something for the request. Not
    frozen (as vLLM's): the engine makes one per request per step, and a frozen dataclass's
    constructor costs 1.4 us against 0.4; nothing changes an output once it is handed over.

    Every output carries the delta: new_token_ids, new_text, new_logprobs (the tokens of
    this step). The totals of the whole request (token_ids, text, logprobs) are on the final
    output only (finished=True); on the others they are empty ([], "", and [] for logprobs
    when they were asked for, None when not), so a step costs O(new tokens), not O(tokens so
    far), and a Ray runner sends only what is new. A consumer that needs running totals keeps
    them (scheduler/stream.py does, to resume a request elsewhere). prompt_token_ids: on a
    runner's first output of the request and on the final one, [] on the others (a prompt of
    thousands of tokens is not sent again with every token). prompt_logprobs: on the first
    output after the prompt is computed and on the final one; None on the others."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    # with SamplingParams.logprobs: of every generated token (final output), and of the new ones
    logprobs: list[TokenLogprob] | None = None
    new_logprobs: list[TokenLogprob] | None = None
    # with SamplingParams.prompt_logprobs, on the first output once the prompt is computed
    # and on the final one: entry i for prompt token i, None for the first
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # with finish_reason ERROR: True when the same request may succeed if sent again (the
    # runners serving it died, or none is left); False when a retry would fail the same way
    retryable: bool = False

    def __reduce__(self):
        """Pickled as its constructor's arguments (Ray and engine-process runners send one
        per request per step): 40% smaller, and read back in 0.27 ms for 256 instead of 0.44."""
        return (RequestOutput, _output_fields(self))

    def then(self, later: RequestOutput) -> RequestOutput:
        """This output and the `later` one of the same request as one (a reader that fell
        behind takes every queued delta at once): the deltas joined, the rest from `later`
        (the totals and the finish are the last output's), prompt_token_ids and
        prompt_logprobs from whichever carries them."""
        new_logprobs = later.new_logprobs
        if self.new_logprobs is not None:
            new_logprobs = self.new_logprobs + (later.new_logprobs or [])
        prompt_logprobs = later.prompt_logprobs
        if prompt_logprobs is None:
            prompt_logprobs = self.prompt_logprobs
        values = list(_output_fields(later))  # positionally: 2.5x cheaper than replace()
        values[_AT["prompt_token_ids"]] = later.prompt_token_ids or self.prompt_token_ids
        values[_AT["new_token_ids"]] = self.new_token_ids + later.new_token_ids
        values[_AT["new_text"]] = self.new_text + later.new_text
        values[_AT["new_logprobs"]] = new_logprobs
        values[_AT["prompt_logprobs"]] = prompt_logprobs
        return RequestOutput(*values)


_output_fields = operator.attrgetter(*(f.name for f in fields(RequestOutput)))
_AT = {f.name: i for i, f in enumerate(fields(RequestOutput))}  # a field's place in them
