"""Request bodies of the adapter and admin routes, as pydantic models (the OpenAI API's are in
frontend/openai/protocol.py): strict types, bounded values, no unknown fields."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from frontend.openai.protocol import Strict, refuse

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
Name = Annotated[str, Field(pattern=NAME_PATTERN, description="1-64 of [A-Za-z0-9._-]")]
Weight = Annotated[float, Field(gt=0, le=1000)]


class TenantCreate(Strict):
    """POST /admin/tenants. max_concurrent, tokens_per_minute: the tenant's own caps (None:
    the server's). weight: its share of the runners while tenants wait, relative to the
    others' (scheduler/policy/fairness.py; default 1). share_prefix_cache: its base-model requests
    share prefix-cached KV with the other tenants that allow it (frontend/tenancy/cache_scope.py;
    default false: a tenant only reuses what its own requests computed)."""

    name: Name
    max_concurrent: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    tokens_per_minute: Annotated[int, Field(ge=1, le=10**12)] | None = None
    weight: Weight = 1.0
    share_prefix_cache: bool = False


class TenantUpdate(Strict):
    """PATCH /admin/tenants/{name}: the tenant's fair-share weight, whether its base-model
    requests share prefix-cached KV with other tenants, its own adapter source (an
    object-store URI, "" for the server's --lora-source-root: frontend/tenancy/
    tenant_sources.py, which checks it), or several (at least one)."""

    weight: Weight | None = None
    share_prefix_cache: bool | None = None
    lora_source: Annotated[str, Field(max_length=1024)] | None = None

    @model_validator(mode="after")
    def _something(self):
        if self.weight is None and self.share_prefix_cache is None and self.lora_source is None:
            raise refuse("weight", "give weight, share_prefix_cache, lora_source or several")
        return self


class RunnersAdd(Strict):
    """POST /admin/runners: start `count` runners."""

    count: Annotated[int, Field(ge=1, le=16)] = 1


class AdapterUpload(Strict):
    """The `name` field of POST /v1/adapters (multipart; the files are checked by
    frontend/tenancy/uploads.py)."""

    name: Name


class LoadLoraAdapter(Strict):
    """POST /v1/load_lora_adapter (vLLM's dynamic LoRA API). lora_name: the adapter's name
    among the caller's; lora_path: where in the caller's source folder its PEFT files are
    (frontend/tenancy/lora_sources.py); load_inplace: replace an adapter of that name with a
    new version (false: 400 if the name is taken, as vLLM answers)."""

    lora_name: Name
    lora_path: Annotated[str, Field(min_length=1, max_length=4096)]
    load_inplace: bool = False


class AdapterPatch(Strict):
    """PATCH /v1/adapters/{name}: pinned keeps the adapter on every runner's device (true) or
    lets it be evicted again (false)."""

    pinned: bool


class UnloadLoraAdapter(Strict):
    """POST /v1/unload_lora_adapter. lora_int_id: vLLM's field, accepted and not used (an
    adapter is named by lora_name here)."""

    lora_name: Name
    lora_int_id: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None
