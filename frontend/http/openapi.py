"""The OpenAPI 3.1 document of the server, built from its Endpoints and their pydantic body
models (GET /openapi.json). Error answers share one schema, OpenAI's error object."""

from __future__ import annotations

from collections.abc import Sequence

from pydantic.json_schema import models_json_schema

from frontend.routes.endpoint import Endpoint

REF = "#/components/schemas/{model}"
ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": "string"},
            },
        }
    },
}
# what any route may answer besides its own statuses (auth, bad input, overload, not ready)
COMMON = {
    "tenant": (400, 401, 404, 413, 429, 503),
    "admin": (400, 401, 404, 409, 413, 503),
    "none": (),
}
DESCRIPTIONS = {
    200: "OK",
    201: "Created",
    400: "Bad request",
    401: "Missing or invalid credentials",
    404: "Not found",
    409: "Conflict",
    413: "Body too large",
    429: "Over a limit (Retry-After)",
    500: "The generation failed; a retry would fail the same way",
    503: "Not ready, overloaded, or the generation's runners died (Retry-After)",
    507: "Out of disk space",
}


def build_openapi(
    endpoints: Sequence[Endpoint], model_id: str | None = None, version: str = "0.1.0"
) -> dict:
    """The document; with model_id (once the model is loaded) bodies carry a valid example
    naming it, so a client (or a fuzzer) can start from a request the server serves."""
    models = sorted({e.body for e in endpoints if e.body is not None}, key=lambda m: m.__name__)
    refs, defs = models_json_schema([(m, "validation") for m in models], ref_template=REF)
    paths: dict[str, dict] = {}
    for e in endpoints:
        for method in e.methods:
            paths.setdefault(e.path, {})[method.lower()] = _operation(e, method, refs, model_id)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "punica-x",
            "version": version,
            "description": "Multi-tenant LoRA serving: an OpenAI-compatible API over many "
            "adapters of one base model, adapter uploads and admin routes.",
        },
        "paths": paths,
        "components": {
            "schemas": {**defs.get("$defs", {}), "Error": ERROR},
            "securitySchemes": {
                "tenant": {"type": "http", "scheme": "bearer", "description": "a tenant's key"},
                "admin": {"type": "http", "scheme": "bearer", "description": "the admin token"},
            },
        },
    }


def _operation(e: Endpoint, method: str, refs: dict, model_id: str | None) -> dict:
    op: dict = {
        "summary": e.summary,
        "operationId": f"{method.lower()}_{e.path.strip('/').replace('/', '_') or 'index'}",
        "responses": _responses(e),
    }
    if e.auth != "none":
        op["security"] = [{e.auth: []}]
    params = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name in _path_params(e.path)
    ]
    params += [{"name": n, "in": "query", "required": False, "schema": s} for n, s in e.query]
    if params:
        op["parameters"] = params
    if e.body is not None and method in ("POST", "PUT", "PATCH"):
        media: dict = {"schema": refs[(e.body, "validation")]}
        if e.example is not None and model_id is not None:
            media["example"] = _with_model(e.example, model_id)
        op["requestBody"] = {"required": True, "content": {"application/json": media}}
    elif e.raw_body is not None:
        op["requestBody"] = e.raw_body
    return op


def _responses(e: Endpoint) -> dict:
    content = {"application/json": {"schema": {"type": "object"}}}
    if e.streams:
        content["text/event-stream"] = {"schema": {"type": "string"}}
    out = {str(s): {"description": DESCRIPTIONS[s], "content": content} for s in e.statuses}
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    for status in COMMON[e.auth]:
        out.setdefault(str(status), {"description": DESCRIPTIONS[status], "content": error})
    return out


def _with_model(example: dict, model_id: str) -> dict:
    return {k: model_id if v == "{model}" else v for k, v in example.items()}


def _path_params(path: str) -> list[str]:
    return [part[1:-1].split(":")[0] for part in path.split("/") if part.startswith("{")]
