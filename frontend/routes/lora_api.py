"""vLLM's dynamic LoRA API, so that orchestrators that drive vLLM (AIBrix's LoRA controller,
the vLLM production stack, llm-d, KServe) drive punica-x unchanged: load an adapter by name
from a path, generate with that name as the model, unload it. Their answers are vLLM's (a
200 with its plain-text success line; 400 for a name already loaded, 404 for one that is not,
or a path with no adapter); errors carry this server's JSON error body.

A caller loads and unloads only its own tenant's adapters, from its own source folder
(frontend/tenancy/lora_sources.py); a loaded adapter is stored and served as an uploaded one
is (the same checks, versions and crash consistency), and lists with its `source`. Unloading
deletes it: new requests naming it get 404 at once, requests already running finish on the
version they started with, and its files go when the last of them ends. The routes answer
404 unless the server runs with --lora-source-root or the caller's tenant has a source of
its own (frontend/tenancy/tenant_sources.py)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import PlainTextResponse

from frontend.http.errors import ApiError, bad_request, not_found
from frontend.http.protocol import LoadLoraAdapter, UnloadLoraAdapter
from frontend.http.request_body import read_json, validate
from frontend.routes.endpoint import Endpoint, server

BODY_LIMIT = 64 << 10  # a name and a path


async def load_lora_adapter(request: Request):
    state = server(request)
    manager, who = state.caller(request)
    body = validate(LoadLoraAdapter, await read_json(request, BODY_LIMIT))
    _source(manager, who)
    name, path = body.lora_name, body.lora_path
    if await manager.load_adapter(who, name, path, replace=body.load_inplace) is None:
        raise bad_request(
            "adapter_exists", f"The lora adapter '{name}' has already been loaded.", "lora_name"
        )
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: Request):
    state = server(request)
    manager, who = state.caller(request)
    body = validate(UnloadLoraAdapter, await read_json(request, BODY_LIMIT))
    _source(manager, who)
    name = body.lora_name
    try:
        await manager.delete_adapter(who, name)
    except ApiError as exc:
        if exc.status != 404:
            raise
        raise not_found(
            "adapter_not_found", f"The lora adapter '{name}' cannot be found."
        ) from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def _source(manager, who):
    source = manager.source_for(who)
    if source is None:
        raise not_found(
            "lora_loading_off",
            "loading adapters by path is off on this server (serve --lora-source-root DIR "
            "turns it on, or a source of your own the operator sets); upload them with "
            "POST /v1/adapters",
        )
    return source


ENDPOINTS = (
    Endpoint(
        "/v1/load_lora_adapter",
        ("POST",),
        load_lora_adapter,
        "Load an adapter from your source folder by name (vLLM's dynamic LoRA API)",
        body=LoadLoraAdapter,
        example={"lora_name": "sql", "lora_path": "sql-lora"},
    ),
    Endpoint(
        "/v1/unload_lora_adapter",
        ("POST",),
        unload_lora_adapter,
        "Unload (delete) one of your adapters by name (vLLM's dynamic LoRA API)",
        body=UnloadLoraAdapter,
        example={"lora_name": "sql"},
    ),
)
