"""Who may reuse whose prefix-cached KV: the salt the frontend gives every request
(punica_x/kv/prefix.py names cached blocks by it, beside the model or adapter version).

A shared prefix cache is a timing side channel: a request whose prompt starts like another
tenant's answers faster, so a tenant could probe other tenants' prompts (vLLM added
`cache_salt` for this). By default a tenant's requests reuse only KV its own requests
computed. The admin may let a tenant's BASE-MODEL requests share with every other tenant
that allows it too (`share_prefix_cache`, PATCH /admin/tenants/{name}): public system
prompts, few-shot examples. Adapter requests never share across tenants (an adapter is its
tenant's). A request's own `cache_salt` narrows its scope further: it reuses only KV of
requests of its scope that gave the same salt (e.g. one per end user of a tenant's app)."""

from __future__ import annotations

from frontend.tenancy.records import Tenant

SHARED = "shared"


def cache_salt(tenant: Tenant, adapter: str | None, request_salt: str | None) -> str:
    """The salt of a request of `tenant` for `adapter` (None: the base model) with the
    body's `cache_salt` (None: none given)."""
    scope = SHARED if adapter is None and tenant.share_prefix_cache else f"tenant:{tenant.id}"
    return scope if request_salt is None else f"{scope}\0salt:{request_salt}"
