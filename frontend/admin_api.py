"""Admin routes for the runners (admin token): list them with the scaling advice, add some,
drain one (or the least loaded) away. The policy behind them is scheduler/placement.py.

    GET    /admin/runners              -> {"runners": [...], "advice": ..., "queued": N}
    POST   /admin/runners {"count": K} -> 201, the K new runners once they take work
    DELETE /admin/runners/{id}         -> drain that runner: its requests move, then it stops
    DELETE /admin/runners?count=K      -> drain the K least loaded runners, one at a time
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse

from frontend.errors import ApiError, bad_request
from frontend.openai_api import read_json
from scheduler.cluster import ClusterError, Scheduler


def runners_body(scheduler: Scheduler) -> dict:
    advice = scheduler.advice()
    return {
        "runners": scheduler.runners(),
        "advice": advice.action,
        "advice_reason": advice.reason,
        "advice_runner": advice.runner_id,
        "queued": scheduler.queued,
    }


async def runners(request: Request, scheduler: Scheduler):
    try:
        if request.method == "GET":
            return JSONResponse(runners_body(scheduler))
        if request.method == "POST":
            body = await read_json(request, 64 * 1024)
            count = _count(body.get("count", 1))
            added = await scheduler.add_runners(count)
            return JSONResponse({"added": added, **runners_body(scheduler)}, status_code=201)
        count = _count(request.query_params.get("count", "1"))
        drained = [await scheduler.drain() for _ in range(count)]
        return JSONResponse({"drained": drained, **runners_body(scheduler)})
    except ClusterError as exc:
        raise ApiError(exc.status, exc.code, str(exc)) from None


async def runner(request: Request, scheduler: Scheduler):
    try:
        drained = await scheduler.drain(request.path_params["runner_id"])
    except ClusterError as exc:
        raise ApiError(exc.status, exc.code, str(exc)) from None
    return JSONResponse({"drained": [drained], **runners_body(scheduler)})


def _count(value) -> int:
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 16:
        raise bad_request("invalid_value", "count must be an integer in [1, 16]", "count")
    return value
