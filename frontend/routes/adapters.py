"""The adapter routes of a tenant: upload a new version, list, read, delete."""

from __future__ import annotations

import re

from starlette.requests import Request
from starlette.responses import JSONResponse

from frontend.http.errors import bad_request
from frontend.http.protocol import NAME_PATTERN, AdapterPatch, AdapterUpload
from frontend.http.request_body import read_json, validate
from frontend.routes.endpoint import Endpoint, server
from frontend.tenancy.uploads import CONFIG, WEIGHTS, read_upload

MAX_PAGE = 1000
PAGE_QUERY = (
    ("limit", {"type": "integer", "minimum": 1, "maximum": MAX_PAGE}),
    ("after", {"type": "string", "pattern": NAME_PATTERN}),
)
PATCH_BODY_BYTES = 4096
_NAME = re.compile(NAME_PATTERN)
_BINARY = {"type": "string", "format": "binary"}
UPLOAD_BODY = {
    "required": True,
    "content": {
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "required": ["name"],
                "properties": {
                    "name": {"type": "string", "pattern": NAME_PATTERN},
                    CONFIG: _BINARY,
                    WEIGHTS: _BINARY,
                    "archive": {**_BINARY, "description": ".tar.gz or .zip of the two files"},
                },
                "additionalProperties": False,
            }
        }
    },
}


async def upload(request: Request):
    state = server(request)
    manager, who = state.caller(request)
    name, files = await read_upload(request, state.config.limits)
    name = validate(AdapterUpload, {"name": name}).name
    record = await manager.upload_adapter(who, name, files)
    return JSONResponse(record.public(manager.serving_dtype), status_code=201)


async def listing(request: Request):
    manager, who = server(request).caller(request)
    return adapter_listing(manager, who.tenant, request.query_params)


def adapter_listing(manager, tenant, params) -> JSONResponse:
    """Every adapter of `tenant` by name, or with ?limit=N (1-1000) a page of them, after
    ?after=NAME (the last name of the page before); a page says has_more and its
    first_id / last_id (names), as OpenAI's paged lists do. The tenant's own route and the
    admin's (GET /admin/tenants/{name}/adapters) answer alike."""
    unknown = sorted(set(params) - {"limit", "after"})
    if unknown:
        raise bad_request("unsupported_parameter", f"unknown query parameter {unknown[0]!r}")
    if "limit" not in params:
        if "after" in params:
            raise bad_request("invalid_value", "after needs limit", "after")
        data = [a.public(manager.serving_dtype) for a in manager.adapters.list(tenant)]
        return JSONResponse({"object": "list", "data": data})
    limit, after = _limit(params.get("limit", "")), _after(params.get("after", ""))
    records, more = manager.adapters.page(tenant, after, limit)
    data = [a.public(manager.serving_dtype) for a in records]
    first, last = (records[0].name, records[-1].name) if records else (None, None)
    return JSONResponse(
        {"object": "list", "data": data, "has_more": more, "first_id": first, "last_id": last}
    )


def _limit(value: str) -> int:
    if (
        not (value.isascii() and value.isdigit() and len(value) <= 4)
        or not 1 <= int(value) <= MAX_PAGE
    ):
        raise bad_request("invalid_value", f"limit must be an integer in [1, {MAX_PAGE}]", "limit")
    return int(value)


def _after(value: str) -> str:
    if value and not _NAME.fullmatch(value):
        raise bad_request("invalid_value", "after must be an adapter name", "after")
    return value


async def adapter(request: Request):
    manager, who = server(request).caller(request)
    name = request.path_params["name"]
    if request.method == "PATCH":
        body = validate(AdapterPatch, await read_json(request, PATCH_BODY_BYTES))
        record = await manager.pin_adapter(who, name, body.pinned)
        return JSONResponse(record.public(manager.serving_dtype))
    if request.method == "DELETE":
        record = await manager.delete_adapter(who, name)
        return JSONResponse({**record.public(manager.serving_dtype), "deleted": True})
    return JSONResponse(manager.get_adapter(who, name).public(manager.serving_dtype))


ENDPOINTS = (
    Endpoint(
        "/v1/adapters",
        ("POST",),
        upload,
        "Upload a new version of an adapter (PEFT files or an archive of them)",
        raw_body=UPLOAD_BODY,
        statuses=(201,),
    ),
    Endpoint(
        "/v1/adapters",
        ("GET",),
        listing,
        "The caller's adapters (all, or a page: ?limit=N&after=NAME)",
        query=PAGE_QUERY,
    ),
    Endpoint(
        "/v1/adapters/{name}",
        ("GET", "DELETE"),
        adapter,
        "Read or delete one of the caller's adapters",
    ),
    Endpoint(
        "/v1/adapters/{name}",
        ("PATCH",),
        adapter,
        "Pin one of the caller's adapters on the runners' devices, or unpin it",
        body=AdapterPatch,
        example={"pinned": True},
    ),
)
