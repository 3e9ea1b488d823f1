"""The request bodies of the OpenAI-compatible API and the websocket chat, as pydantic models.

One owner per rule: these models own the TYPES and RANGES of every field (strict: no "8" for
8, no true for 1, no 8.0 for an int; finite numbers only; the ranges OpenAI and vLLM
document). What depends on the server's configuration (max_tokens and n caps, the context
left after the prompt) is checked where the generation request is built
(frontend/openai/generation.py); what only the model knows (vocabulary, context length, a JSON
schema the grammar engine cannot compile) is the runner's check (punica_x.engine.check_request).

Every field is either supported or refused: an unknown field is 400 `unsupported_parameter`,
and so is a known OpenAI field punica-x does not implement (`suffix`, `tools`, `functions`,
`tool_choice`, ...) unless it is null / empty. `user` is accepted for OpenAI compatibility
and not used: callers are identified by their API key."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from punica_x.api import MAX_LOGPROBS

MAX_PROMPTS = 16  # prompts of one completions request (each may have n choices)
MAX_STOP = 4  # OpenAI's cap on stop strings
MAX_STOP_CHARS = 512
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300  # OpenAI's cap on logit_bias entries
MAX_MESSAGES = 1024
MAX_TOKEN_ID = 2**31 - 1  # type bound; the vocabulary is the runner's check
MAX_INT = 2**31 - 1  # bound of counts (max_tokens, n, ...); the server's caps are lower
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # any signed or unsigned 64-bit integer

TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Count = Annotated[int, Field(ge=0, le=MAX_INT)]

# Fields of OpenAI's API that punica-x does not implement: refused unless null / empty.
UNSUPPORTED = (
    "suffix",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "parallel_tool_calls",
    "audio",
    "modalities",
    "prediction",
    "web_search_options",
)


class Strict(BaseModel):
    """Strict types, finite numbers, no unknown fields."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


def refuse(param: str, message: str, code: str = "invalid_value") -> PydanticCustomError:
    """A validation error about `param` (a rule across fields names the field it refuses);
    frontend/http/request_body.py turns it into 400 `code`."""
    return PydanticCustomError(code, message, {"param": param})


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaSpec(Strict):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: Annotated[str, Field(max_length=4096)] | None = None
    schema_: Annotated[dict[str, Any], Field(alias="schema")]
    strict: bool | None = None

    model_config = ConfigDict(populate_by_name=False)


class TextFormat(Strict):
    type: Literal["text"]


class JsonObjectFormat(Strict):
    type: Literal["json_object"]


class JsonSchemaFormat(Strict):
    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")
]


class SamplingFields(Strict):
    """Sampling fields shared by completions, chat and the websocket chat. Semantics:
    punica_x.core.SamplingParams. top_k: 0 or -1 disable it. seed: any 64-bit integer
    (signed or unsigned). min_tokens: eos and stop_token_ids are not sampled, nor do stop
    strings end the output, before this many tokens. cache_salt (vLLM's): the request
    reuses only prefix-cached KV of its tenant's requests with the same salt
    (frontend/tenancy/cache_scope.py)."""

    max_tokens: Count | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=MAX_INT)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] | None = None
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    stop: (
        Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
        | Annotated[
            list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]],
            Field(max_length=MAX_STOP),
        ]
        | None
    ) = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    min_tokens: Count | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    logit_bias: (
        Annotated[
            dict[str, Annotated[float, Field(ge=-100, le=100)]],
            Field(max_length=MAX_LOGIT_BIAS),
        ]
        | None
    ) = None
    response_format: ResponseFormat | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not (key.isascii() and key.isdigit()) or len(key) > 10:
                raise refuse(
                    "logit_bias", f"logit_bias keys are token ids (decimal integers), got {key!r}"
                )
        return value

    @model_validator(mode="after")
    def _min_tokens(self):
        if (
            self.min_tokens is not None
            and self.max_tokens is not None
            and self.min_tokens > self.max_tokens
        ):
            raise refuse("min_tokens", "min_tokens must not exceed max_tokens")
        return self


class OpenAIFields(SamplingFields):
    """What completions and chat share beyond sampling."""

    model: Annotated[str, Field(min_length=1, max_length=256)]
    n: Annotated[int, Field(ge=1, le=128)] = 1
    best_of: Annotated[int, Field(ge=1, le=128)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data):
        """Known OpenAI fields punica-x does not implement: refused unless null or empty."""
        if isinstance(data, dict):
            for name in UNSUPPORTED:
                if data.get(name, None) not in (None, False, [], {}, ""):
                    raise refuse(name, f"`{name}` is not supported", "unsupported_parameter")
            data = {k: v for k, v in data.items() if k not in UNSUPPORTED}
        return data

    @model_validator(mode="after")
    def _stream_and_best_of(self):
        if self.stream_options is not None and not self.stream:
            raise refuse("stream_options", "stream_options is only allowed with stream: true")
        if self.best_of is not None and self.best_of != self.n:
            raise refuse(
                "best_of", "best_of other than n is not supported", "unsupported_parameter"
            )
        return self


Prompt = (
    Annotated[str, Field(max_length=8 * 2**20)]
    | TokenIds
    | Annotated[list[Annotated[str, Field(max_length=8 * 2**20)]], Field(min_length=1)]
    | Annotated[list[TokenIds], Field(min_length=1)]
)


class CompletionRequest(OpenAIFields):
    """POST /v1/completions. prompt: a string, a list of token ids, or a list (up to 16) of
    either. logprobs: 0-20 alternatives per token. echo: the prompt is returned before the
    output (with max_tokens 0, only scored)."""

    prompt: Prompt
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _prompt_count(cls, value):
        several = isinstance(value, list) and value and not isinstance(value[0], int)
        if several and len(value) > MAX_PROMPTS:
            raise refuse("prompt", f"at most {MAX_PROMPTS} prompts per request")
        return value

    @model_validator(mode="after")
    def _zero_max_tokens(self):
        if self.max_tokens == 0 and not self.echo:
            raise refuse("max_tokens", "max_tokens 0 needs echo: true (scoring the prompt)")
        return self


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant"]
    content: str | Annotated[list[TextPart], Field(max_length=256)]

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


Messages = Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]


class ChatCompletionRequest(OpenAIFields):
    """POST /v1/chat/completions. logprobs: whether to return them, top_logprobs: 0-20
    alternatives (needs logprobs: true). max_completion_tokens is OpenAI's newer name of
    max_tokens (give one of them)."""

    messages: Messages
    max_completion_tokens: Count | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None

    @model_validator(mode="after")
    def _chat_rules(self):
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise refuse(
                    "max_completion_tokens", "give max_tokens or max_completion_tokens, not both"
                )
            self.max_tokens = self.max_completion_tokens
        if self.max_tokens == 0:
            raise refuse("max_tokens", "max_tokens must be at least 1")
        if self.top_logprobs is not None and not self.logprobs:
            raise refuse("top_logprobs", "top_logprobs needs logprobs: true")
        return self


class WsChatFrame(SamplingFields):
    """A websocket chat turn: {"type": "chat", "model", "messages", sampling fields...}."""

    type: Literal["chat"]
    model: Annotated[str, Field(min_length=1, max_length=256)]
    messages: Messages

    @model_validator(mode="after")
    def _positive(self):
        if self.max_tokens == 0:
            raise refuse("max_tokens", "max_tokens must be at least 1")
        return self


class WsCancelFrame(Strict):
    """Cancel the reply that is streaming: {"type": "cancel"}."""

    type: Literal["cancel"]


WsFrame = Annotated[WsChatFrame | WsCancelFrame, Field(discriminator="type")]
