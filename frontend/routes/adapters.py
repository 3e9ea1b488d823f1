"""The adapter routes of a tenant: upload a new version, list, read, delete."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse

from frontend.http.protocol import NAME_PATTERN, AdapterUpload
from frontend.http.request_body import validate
from frontend.routes.endpoint import Endpoint, server
from frontend.tenancy.uploads import CONFIG, WEIGHTS, read_upload

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
    data = [a.public(manager.serving_dtype) for a in manager.list_adapters(who)]
    return JSONResponse({"object": "list", "data": data})


async def adapter(request: Request):
    manager, who = server(request).caller(request)
    name = request.path_params["name"]
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
    Endpoint("/v1/adapters", ("GET",), listing, "The caller's adapters"),
    Endpoint(
        "/v1/adapters/{name}",
        ("GET", "DELETE"),
        adapter,
        "Read or delete one of the caller's adapters",
    ),
)
