"""Reading a JSON request body and validating it against its pydantic model.

The body is refused before it reaches any handler when it is larger than the route's cap
(413), not JSON, JSON with NaN / Infinity (Python's parser accepts them; JSON does not),
numbers beyond a double's range (1e400 would become inf), integers of more than 4300
digits, nested deeper than MAX_DEPTH, or not an object (400).
Validation errors become one OpenAI-shaped 400 naming the first offending field."""

from __future__ import annotations

import json
import math
from typing import TypeVar

from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.requests import Request

from frontend.http.errors import ApiError, bad_request

MAX_DEPTH = 32  # arrays / objects nested in a body (a JSON schema in response_format included)
# 400 codes of fields whose errors have a name of their own (else invalid_value)
FIELD_CODES = {"messages": "invalid_messages", "prompt": "invalid_prompt", "name": "invalid_name"}
# fields whose type is a union: pydantic's message per branch says less than one sentence
FIXED_MESSAGES = {
    "prompt": "prompt must be a string, a list of token ids, or a list (up to 16) of those",
    "stop": "stop must be a string or up to 4 non-empty strings",
    "name": "names are 1-64 of [A-Za-z0-9._-], starting with a letter or a digit",
}

M = TypeVar("M", bound=BaseModel)


async def read_json(request: Request, limit: int) -> dict:
    """The body as a JSON object, at most `limit` bytes."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ApiError(413, "payload_too_large", f"the request body exceeds {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, "payload_too_large", f"the request body exceeds {limit} bytes")
        chunks.append(chunk)
    return parse_json(b"".join(chunks))


def parse_json(raw: bytes | str) -> dict:
    """A JSON object from `raw`, or 400 invalid_json saying what is wrong."""
    try:
        data = json.loads(raw, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise _too_deep() from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, huge integers
        raise bad_request("invalid_json", f"the body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise bad_request("invalid_json", "the body must be a JSON object")
    if depth(data) > MAX_DEPTH:
        raise _too_deep()
    return data


def _too_deep():
    return bad_request("invalid_json", f"the body nests deeper than {MAX_DEPTH} levels")


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:32]} is out of range")
    return value


def depth(value, limit: int = MAX_DEPTH) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0, [] is 1), counted up to limit + 1
    (breadth first: no recursion)."""
    level, frontier = 0, [value] if isinstance(value, (dict, list)) else []
    while frontier:
        level += 1
        if level > limit:
            return limit + 1
        nested = []
        for v in frontier:
            children = v.values() if isinstance(v, dict) else v
            nested.extend(c for c in children if isinstance(c, (dict, list)))
        frontier = nested
    return level


def validate(model: type[M] | TypeAdapter, data: dict, strip_tag: bool = False) -> M:
    """`data` as `model`, or 400 naming the first field that is wrong. strip_tag: the
    model is a union tagged by a field (the websocket frames): drop the tag from paths."""
    try:
        if isinstance(model, TypeAdapter):
            return model.validate_python(data)
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc, strip_tag) from None


def validation_error(exc: ValidationError, strip_tag: bool = False) -> ApiError:
    """The first error of `exc` as the API's 400: code, message and the top-level param."""
    error = exc.errors(include_url=False, include_input=False)[0]
    loc = [str(p) for p in error["loc"]]
    if strip_tag and loc:
        loc = loc[1:]
    kind = error["type"]
    ctx = error.get("ctx") or {}
    param = ctx.get("param") if isinstance(ctx.get("param"), str) else None
    param = param or (loc[0] if loc else None)
    if kind == "extra_forbidden":
        return bad_request("unsupported_parameter", f"`{'.'.join(loc)}` is not supported", param)
    if kind in ("union_tag_invalid", "union_tag_not_found") and not loc:
        return bad_request("unknown_type", error["msg"], "type")
    code = kind if kind == "unsupported_parameter" else FIELD_CODES.get(param, "invalid_value")
    if param in FIXED_MESSAGES and "param" not in ctx:
        return bad_request(code, FIXED_MESSAGES[param], param)
    where = ".".join(p for p in loc if p.isidentifier() or p.isdigit())
    message = f"{where}: {error['msg']}" if where and "param" not in ctx else error["msg"]
    return bad_request(code, message, param)
