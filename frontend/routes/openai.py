"""The OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions."""

from __future__ import annotations

from starlette.requests import Request

from frontend.openai import serving
from frontend.openai.protocol import ChatCompletionRequest, CompletionRequest
from frontend.routes.endpoint import Endpoint, server


async def models(request: Request):
    return serving.list_models(*server(request).caller(request))


async def completions(request: Request):
    manager, who = server(request).caller(request)
    return await serving.completions(manager, who, request, chat=False)


async def chat_completions(request: Request):
    manager, who = server(request).caller(request)
    return await serving.completions(manager, who, request, chat=True)


ENDPOINTS = (
    Endpoint("/v1/models", ("GET",), models, "The base model and the caller's adapters"),
    Endpoint(
        "/v1/completions",
        ("POST",),
        completions,
        "Text completions (OpenAI)",
        body=CompletionRequest,
        statuses=(200, 500),
        streams=True,
        example={"model": "{model}", "prompt": "Hello", "max_tokens": 8, "temperature": 0},
    ),
    Endpoint(
        "/v1/chat/completions",
        ("POST",),
        chat_completions,
        "Chat completions (OpenAI)",
        body=ChatCompletionRequest,
        statuses=(200, 500),
        streams=True,
        example={
            "model": "{model}",
            "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 8,
        },
    ),
)
