"""An adapter loaded the first time a request names it (vLLM's filesystem LoRA resolver):
with serve --lora-source-root DIR (or s3://BUCKET/PREFIX), a request whose model is none of
the caller's adapters but names a folder DIR/<tenant>/<model> (an object
PREFIX/<tenant>/<model>/adapter_config.json) has that folder loaded as the adapter `model`
(POST /v1/load_lora_adapter's checks and store, frontend/tenancy/lora_sources.py), then
served. Requests racing for one new name load it once (TenantAdapters.load's lock).

The request waits for the load at most LOAD_WAIT_S: past that it gets 504
adapter_load_timeout while the load goes on, so the next request finds the adapter. The
step loop never waits (the files are read on a worker thread and registered as an
upload's are), and nobody else waits for it. A folder that is refused (a NaN weight, a
FIFO, a link out of the folder) fails the request with that 4xx, and nothing is served."""

from __future__ import annotations

import asyncio
import logging
import re

from frontend.http.errors import ApiError
from frontend.http.protocol import NAME_PATTERN

log = logging.getLogger(__name__)
LOAD_WAIT_S = 60.0
_NAME = re.compile(NAME_PATTERN)


async def load_on_request(manager, caller, model: str) -> bool:
    """True once `model` is the caller's adapter (loaded now, or by a racing request); False
    when its source holds no such folder (the load's first read says so: one look at the
    source). ApiError when the folder is refused, the store fails, or the wait runs out.
    manager: the FrontendManager, a source on for the caller (source_for: a LocalSource or
    an ObjectSource)."""
    if not isinstance(model, str) or not _NAME.fullmatch(model):
        return False
    load = asyncio.ensure_future(manager.load_adapter(caller, model, model, replace=False))
    load.add_done_callback(_quietly)
    try:
        await asyncio.wait_for(asyncio.shield(load), LOAD_WAIT_S)
    except asyncio.TimeoutError:
        raise ApiError(
            504,
            "adapter_load_timeout",
            f"adapter {model!r} is still loading from your source folder; retry shortly",
            "model",
            retry_after=5,
        ) from None
    except ApiError as exc:
        if exc.code == "lora_path_not_found":  # no such folder: not a model of the caller's
            return False
        raise
    return True


def _quietly(task: asyncio.Task) -> None:
    """A load nobody waits for any more (its request timed out or went away): its refusal
    is the next request's to see; anything else is logged."""
    if task.cancelled():
        return
    exc = task.exception()
    if exc is not None and not isinstance(exc, ApiError):
        log.error("loading an adapter on request failed: %r", exc)
