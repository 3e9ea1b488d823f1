"""Request bodies of the adapter and admin routes, as pydantic models (the OpenAI API's are in
frontend/openai/protocol.py): strict types, bounded values, no unknown fields."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from frontend.openai.protocol import Strict

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
Name = Annotated[str, Field(pattern=NAME_PATTERN, description="1-64 of [A-Za-z0-9._-]")]
Weight = Annotated[float, Field(gt=0, le=1000)]


class TenantCreate(Strict):
    """POST /admin/tenants. max_concurrent, tokens_per_minute: the tenant's own caps (None:
    the server's). weight: its share of the runners while tenants wait, relative to the
    others' (scheduler/fairness.py; default 1)."""

    name: Name
    max_concurrent: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    tokens_per_minute: Annotated[int, Field(ge=1, le=10**12)] | None = None
    weight: Weight = 1.0


class TenantUpdate(Strict):
    """PATCH /admin/tenants/{name}: the tenant's fair-share weight."""

    weight: Weight


class RunnersAdd(Strict):
    """POST /admin/runners: start `count` runners."""

    count: Annotated[int, Field(ge=1, le=16)] = 1


class AdapterUpload(Strict):
    """The `name` field of POST /v1/adapters (multipart; the files are checked by
    frontend/uploads.py)."""

    name: Name
