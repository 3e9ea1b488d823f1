"""Admin routes (admin token): tenants, and the runners with the scaling advice
(scheduler/policy/placement.py is the policy behind it).

    GET    /admin/tenants                 -> every tenant
    POST   /admin/tenants {"name", ...}   -> 201, the tenant and its API key (shown once)
    PATCH  /admin/tenants/{name} {"weight", "share_prefix_cache", "lora_source"} -> its
                                      fair-share weight, whether its base-model requests
                                      share prefix-cached KV, its own adapter source
                                      (frontend/tenancy/tenant_sources.py)
    DELETE /admin/tenants/{name}          -> revoke the tenant and its keys
    GET    /admin/tenants/{name}/adapters -> its adapters (all, or ?limit=N&after=NAME pages)
    GET    /admin/runners                 -> {"runners": [...], "advice": ..., "queued": N}
    POST   /admin/runners {"count": K}    -> 201, the K new runners once they take work
    DELETE /admin/runners/{id}            -> drain that runner: its requests move, then it stops
    DELETE /admin/runners?count=K         -> drain the K least loaded runners, one at a time
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse

from frontend.http.errors import ApiError, bad_request, not_found
from frontend.http.protocol import RunnersAdd, TenantCreate, TenantUpdate
from frontend.http.request_body import read_json, validate
from frontend.routes.adapters import PAGE_QUERY, adapter_listing
from frontend.routes.endpoint import Endpoint, server
from frontend.tenancy.records import Tenant
from scheduler.cluster import ClusterError, Scheduler

ADMIN_BODY_BYTES = 64 * 1024
COUNT_QUERY = ("count", {"type": "integer", "minimum": 1, "maximum": 16})


async def tenants(request: Request):
    state = server(request)
    manager = state.admin(request)
    if request.method == "POST":
        body = validate(TenantCreate, await read_json(request, ADMIN_BODY_BYTES))
        tenant, key = manager.create_tenant(body)
        return JSONResponse({**tenant_json(tenant), "api_key": key}, status_code=201)
    return JSONResponse({"object": "list", "data": [tenant_json(t) for t in state.store.tenants()]})


async def tenant(request: Request):
    manager, name = server(request).admin(request), request.path_params["name"]
    if request.method == "PATCH":
        body = validate(TenantUpdate, await read_json(request, ADMIN_BODY_BYTES))
        return JSONResponse(tenant_json(manager.update_tenant(name, body)))
    return JSONResponse(tenant_json(manager.revoke_tenant(name)))


async def tenant_adapters(request: Request):
    state = server(request)
    manager, name = state.admin(request), request.path_params["name"]
    tenant = state.store.tenant_by_name(name)
    if tenant is None:
        raise not_found("tenant_not_found", f"tenant {name!r} does not exist")
    return adapter_listing(manager, tenant, request.query_params)


async def runners(request: Request):
    state = server(request)
    scheduler = state.admin(request).scheduler
    with _cluster_errors():
        if request.method == "GET":
            return JSONResponse(runners_body(scheduler))
        if request.method == "POST":
            body = validate(RunnersAdd, await read_json(request, ADMIN_BODY_BYTES))
            _check_fleet(scheduler, body.count, state.config.limits.max_runners)
            added = await scheduler.add_runners(body.count)
            return JSONResponse({"added": added, **runners_body(scheduler)}, status_code=201)
        count = _count(request.query_params.get("count", "1"))
        drained = [await scheduler.drain() for _ in range(count)]
        return JSONResponse({"drained": drained, **runners_body(scheduler)})


async def runner(request: Request):
    scheduler = server(request).admin(request).scheduler
    with _cluster_errors():
        drained = await scheduler.drain(request.path_params["runner_id"])
    return JSONResponse({"drained": [drained], **runners_body(scheduler)})


ENDPOINTS = (
    Endpoint("/admin/tenants", ("GET",), tenants, "Every tenant", auth="admin"),
    Endpoint(
        "/admin/tenants",
        ("POST",),
        tenants,
        "Create a tenant (its API key is in the answer, once)",
        body=TenantCreate,
        auth="admin",
        statuses=(201,),
    ),
    Endpoint(
        "/admin/tenants/{name}",
        ("PATCH",),
        tenant,
        "Set a tenant's fair-share weight, prefix-cache sharing or own adapter source",
        body=TenantUpdate,
        auth="admin",
    ),
    Endpoint("/admin/tenants/{name}", ("DELETE",), tenant, "Revoke a tenant", auth="admin"),
    Endpoint(
        "/admin/tenants/{name}/adapters",
        ("GET",),
        tenant_adapters,
        "A tenant's adapters (all, or a page: ?limit=N&after=NAME)",
        auth="admin",
        query=PAGE_QUERY,
    ),
    Endpoint("/admin/runners", ("GET",), runners, "Runners and the advice", auth="admin"),
    Endpoint(
        "/admin/runners",
        ("POST",),
        runners,
        "Start runners",
        body=RunnersAdd,
        auth="admin",
        statuses=(201,),
    ),
    Endpoint(
        "/admin/runners",
        ("DELETE",),
        runners,
        "Drain the least loaded runners",
        auth="admin",
        query=(COUNT_QUERY,),
    ),
    Endpoint("/admin/runners/{runner_id}", ("DELETE",), runner, "Drain a runner", auth="admin"),
)


def runners_body(scheduler: Scheduler) -> dict:
    advice = scheduler.advice()
    model = scheduler.info.model
    return {
        "model": {
            "name": model.name,
            "family": model.family,
            "dtype": model.dtype,
            "weight_format": model.weight_format,
            "weight_bytes": model.weight_bytes,
        },
        "runners": [row.as_json() for row in scheduler.runners()],
        "advice": advice.action,
        "advice_reason": advice.reason,
        "advice_runner": advice.runner_id,
        "queued": scheduler.queued,
    }


def tenant_json(t: Tenant) -> dict:
    return {
        "id": t.id,
        "name": t.name,
        "created": int(t.created),
        "revoked": t.revoked,
        "max_concurrent": t.max_concurrent,
        "tokens_per_minute": t.tokens_per_minute,
        "weight": t.weight,
        "share_prefix_cache": t.share_prefix_cache,
        "lora_source": t.lora_source,
    }


class _cluster_errors:
    """A refused cluster operation answers its own status and code."""

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if isinstance(exc, ClusterError):
            raise ApiError(exc.status, exc.code, str(exc)) from None
        return False


def _check_fleet(scheduler: Scheduler, count: int, cap: int) -> None:
    live = sum(1 for row in scheduler.runners() if row.state != "dead")
    if live + count > cap:
        raise ApiError(
            409,
            "too_many_runners",
            f"{live} runners exist and the server runs at most {cap} (--limit max_runners)",
            "count",
        )


def _count(value: str) -> int:
    if not (value.isascii() and value.isdigit() and len(value) <= 2) or not 1 <= int(value) <= 16:
        raise bad_request("invalid_value", "count must be an integer in [1, 16]", "count")
    return int(value)
