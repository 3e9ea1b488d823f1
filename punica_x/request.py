"""EngineRequest: one request as the runner takes it, built once by its caller (the frontend,
or LLM / Engine.add_request offline) and passed unchanged through the scheduler and a runner
backend (thread or Ray) to the engine. Callbacks (outputs, preemption) travel beside it."""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass

from punica_x.core import Resume, SamplingParams
from punica_x.errors import InvalidRequest


@dataclass(frozen=True)
class EngineRequest:
    """prompt: the prompt's token ids. sampling: how to generate. adapter: the adapter's name
    (None: the base model). request_id: unique among the runner's requests. cache_salt: with
    prefix caching on, the request reuses only KV cached by requests with the same salt (and
    model or adapter version); None or "" shares with others that give none (the server always
    gives one: the tenant's, frontend/tenancy/cache_scope.py). resume: where a request that ran
    elsewhere stands (a move: Resume); None for a new request.

    The fields' types are checked here (InvalidRequest naming the field); what they may hold
    for a given runner (prompt length, token ids in the vocabulary, a known adapter) is the
    runner's check (Engine.check_prompt)."""

    prompt: tuple[int, ...]
    sampling: SamplingParams
    adapter: str | None
    request_id: str
    cache_salt: str | None = None
    resume: Resume | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt", _token_ids(self.prompt))
        if not isinstance(self.sampling, SamplingParams):
            raise InvalidRequest(f"sampling must be SamplingParams, got {self.sampling!r}")
        if self.adapter is not None and not isinstance(self.adapter, str):
            raise InvalidRequest(f"adapter must be a name or None, got {self.adapter!r}", "model")
        if not isinstance(self.request_id, str) or not self.request_id:
            raise InvalidRequest(f"request_id must be a non-empty string, got {self.request_id!r}")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise InvalidRequest(
                f"cache_salt must be a string, got {self.cache_salt!r}", "cache_salt"
            )
        if self.resume is not None and not isinstance(self.resume, Resume):
            raise InvalidRequest(f"resume must be a Resume, got {type(self.resume).__name__}")

    def resumed(self, resume: Resume | None) -> EngineRequest:
        """The same request continuing from `resume` (a move to another runner); itself when
        `resume` is what it holds already."""
        return self if resume is self.resume else dataclasses.replace(self, resume=resume)


def _token_ids(prompt) -> tuple[int, ...]:
    """prompt as a tuple of ints (numpy / torch integers taken by value); InvalidRequest for a
    string, a non-sequence, a bool, a float or anything else that is not an integer."""
    if isinstance(prompt, tuple) and all(type(t) is int for t in prompt):
        return prompt
    if isinstance(prompt, str | bytes | dict) or not hasattr(prompt, "__iter__"):
        raise InvalidRequest(f"prompt must be token ids, got {type(prompt).__name__}", "prompt")
    ids = []
    for t in prompt:
        if isinstance(t, bool):
            raise InvalidRequest(f"prompt token ids must be integers, got {t!r}", "prompt")
        try:
            ids.append(operator.index(t))
        except TypeError:
            raise InvalidRequest(
                f"prompt token ids must be integers, got {t!r}", "prompt"
            ) from None
    return tuple(ids)
