"""One typed generation request, built from a validated body (completions, chat or a websocket
chat turn): the prompts as token ids, the SamplingParams of each, and how the answer is shaped.

The rules here are the ones that depend on the server's configuration: the max_tokens and n
caps (Limits) and the context left after the prompt (the model's max_model_len). Types and
ranges were checked by the protocol models; the vocabulary, a prompt longer than the context
and the JSON schema's compilation are the runner's check (punica_x.engine.check_request)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from frontend.config import Limits
from frontend.http.errors import bad_request
from frontend.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    JsonObjectFormat,
    JsonSchemaFormat,
    SamplingFields,
    WsChatFrame,
)
from punica_x.api import JSON_OBJECT, SamplingParams, canonical_schema


@dataclass(frozen=True)
class Choice:
    """One generation of a request: choice `index` of the answer."""

    index: int
    prompt: list[int]
    sampling: SamplingParams
    prompt_text: str | None  # the prompt as the client sent it (completions echo), else None


@dataclass(frozen=True)
class GenerationRequest:
    """What the scheduler runs for one API call. choices: prompt-major, n per prompt (choice
    j > 0 of a seeded prompt uses seed + j, so the n choices differ and stay reproducible).
    score_only: completions with echo and max_tokens 0 (one token is sampled and dropped)."""

    model: str
    adapter: str | None
    choices: tuple[Choice, ...]
    stream: bool = False
    include_usage: bool = True
    chat: bool = False
    echo: bool = False
    score_only: bool = False
    cache_salt: str | None = None  # the body's (frontend/tenancy/cache_scope.py adds the tenant's)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(c.prompt) for c in self.choices)


@dataclass(frozen=True)
class ModelFacts:
    """What building a request needs to know of the served model and the server."""

    model_id: str
    max_model_len: int
    tokenizer: object
    limits: Limits


class RequestBuilder:
    """Turns validated bodies into GenerationRequests. Tokenization runs on one worker thread
    (a long prompt must not stall the event loop; one thread, as the tokenizer is not
    thread-safe)."""

    def __init__(self, facts: ModelFacts) -> None:
        self.facts = facts
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="punica-x-tokenize")

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def completion(self, body: CompletionRequest, adapter: str | None) -> GenerationRequest:
        raw = _prompt_list(body.prompt)
        if any(isinstance(p, str) for p in raw):
            prompts = await self._run(self._encode_all, raw)
        else:  # token ids: nothing to tokenize, no trip to the tokenizer's thread
            prompts = self._encode_all(raw)
        echo = body.echo
        score_only = echo and body.max_tokens == 0
        choices = []
        for ids, text in zip(prompts, raw):
            sp = self.sampling(
                body,
                len(ids),
                logprobs=body.logprobs,
                prompt_logprobs=body.logprobs if echo else None,
                max_tokens=1 if score_only else body.max_tokens,
            )
            sent = text if isinstance(text, str) else None
            choices.extend(self._n(ids, sp, sent, body.n, len(choices)))
        return GenerationRequest(
            body.model,
            adapter,
            tuple(choices),
            stream=body.stream,
            include_usage=_include_usage(body),
            echo=echo,
            score_only=score_only,
            cache_salt=body.cache_salt,
        )

    async def chat(
        self, body: ChatCompletionRequest | WsChatFrame, adapter: str | None
    ) -> GenerationRequest:
        ids = await self._run(self._encode_chat, [(m.role, m.text) for m in body.messages])
        if isinstance(body, WsChatFrame):
            sp = self.sampling(body, len(ids))
            choices = (Choice(0, ids, sp, None),)
            return GenerationRequest(body.model, adapter, choices, True, cache_salt=body.cache_salt)
        wanted = bool(body.logprobs)
        sp = self.sampling(body, len(ids), logprobs=(body.top_logprobs or 0) if wanted else None)
        return GenerationRequest(
            body.model,
            adapter,
            tuple(self._n(ids, sp, None, body.n, 0)),
            stream=body.stream,
            include_usage=_include_usage(body),
            chat=True,
            cache_salt=body.cache_salt,
        )

    def _n(self, ids, sp: SamplingParams, text, n: int, start: int) -> list[Choice]:
        limit = self.facts.limits.max_n
        if n > limit:
            raise bad_request("invalid_value", f"n must be an integer in [1, {limit}]", "n")
        return [
            Choice(
                start + j,
                ids,
                sp if sp.seed is None or j == 0 else replace(sp, seed=sp.seed + j),
                text,
            )
            for j in range(n)
        ]

    def sampling(
        self,
        body: SamplingFields,
        prompt_len: int,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        max_tokens: int | None = None,
    ) -> SamplingParams:
        """SamplingParams of a validated body (defaults: vLLM's and OpenAI's)."""
        limit = self._max_tokens(max_tokens or body.max_tokens, prompt_len)
        if body.min_tokens is not None and body.min_tokens > limit:
            raise bad_request(
                "invalid_value",
                f"min_tokens exceeds this request's max_tokens ({limit})",
                "min_tokens",
            )
        return SamplingParams(
            max_tokens=limit,
            temperature=_or(body.temperature, 1.0),
            top_p=_or(body.top_p, 1.0),
            top_k=max(0, _or(body.top_k, 0)),
            min_p=_or(body.min_p, 0.0),
            seed=body.seed,
            stop=_stops(body.stop),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            min_tokens=_or(body.min_tokens, 0),
            ignore_eos=_or(body.ignore_eos, False),
            skip_special_tokens=_or(body.skip_special_tokens, True),
            include_stop_str_in_output=_or(body.include_stop_str_in_output, False),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            presence_penalty=_or(body.presence_penalty, 0.0),
            frequency_penalty=_or(body.frequency_penalty, 0.0),
            repetition_penalty=_or(body.repetition_penalty, 1.0),
            logit_bias=tuple((int(t), float(b)) for t, b in (body.logit_bias or {}).items()),
            json_schema=_json_schema(body),
        )

    def _max_tokens(self, requested: int | None, prompt_len: int) -> int:
        """The request's max_tokens: capped by Limits.max_tokens and the context left after
        the prompt (a prompt that fills the context is the runner's refusal)."""
        cap, context = self.facts.limits.max_tokens, self.facts.max_model_len
        room = context - prompt_len
        if requested is None:
            return max(1, min(room, cap))
        if requested > cap:
            raise bad_request(
                "max_tokens_too_large", f"max_tokens is capped at {cap}", "max_tokens"
            )
        if requested > room > 0:
            raise bad_request(
                "context_length_exceeded",
                f"prompt ({prompt_len} tokens) + max_tokens ({requested}) exceeds the "
                f"context of {context}",
                "max_tokens",
            )
        return requested

    # -- tokenization (on the worker thread) ---------------------------------------------------
    def _encode_all(self, prompts: list) -> list[list[int]]:
        tok = self.facts.tokenizer
        return [tok(p).input_ids if isinstance(p, str) else list(p) for p in prompts]

    def _encode_chat(self, messages: list[tuple[str, str]]) -> list[int]:
        tok = self.facts.tokenizer
        if not getattr(tok, "chat_template", None):
            raise bad_request(
                "chat_template_missing", "this model has no chat template; use /v1/completions"
            )
        clean = [{"role": role, "content": text} for role, text in messages]
        text = tok.apply_chat_template(clean, add_generation_prompt=True, tokenize=False)
        return tok(text, add_special_tokens=False).input_ids

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _or(value, default):
    return default if value is None else value


def _prompt_list(prompt) -> list:
    """One prompt (a string or token ids) or a list of them -> the list."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)


def _stops(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def _json_schema(body: SamplingFields) -> str | None:
    fmt = body.response_format
    if isinstance(fmt, JsonObjectFormat):
        return JSON_OBJECT
    if isinstance(fmt, JsonSchemaFormat):
        return canonical_schema(fmt.json_schema.schema_)
    return None


def _include_usage(body) -> bool:
    """Non-streaming answers always carry usage; streams only when stream_options ask."""
    if not body.stream:
        return True
    return bool(body.stream_options and body.stream_options.include_usage)
