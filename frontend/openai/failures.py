"""A generation that failed, as a client sees it: an error it can retry on, never a success.

A request whose generation ends with ERROR (its runners died, it made engine steps fail, its
adapter could not be loaded) or ABORT (cancelled by the server) is not answered 200 with
partial text and a finish reason OpenAI's API does not define: a non-streaming answer is 503
with `Retry-After` when the same request may succeed if sent again (`retryable`: the runners
serving it died or none is left), else 500; a stream ends with an error event
`data: {"error": {...}}` (which OpenAI's SDKs raise) and `data: [DONE]`. finish_reason then
only takes OpenAI's values: "stop" or "length"."""

from __future__ import annotations

from frontend.http.errors import ApiError
from punica_x.api import FinishReason, RequestOutput

FAILED = (FinishReason.ERROR, FinishReason.ABORT)
RETRY_AFTER_S = 5.0


def failure(out: RequestOutput | None) -> ApiError | None:
    """The error a client gets for a final output, or None when it succeeded (a stream that
    ended without a final output failed too)."""
    if out is None:
        return ApiError(500, "generation_failed", "the generation ended without a result")
    if out.finish_reason not in FAILED:
        return None
    cause = out.error or "the server aborted it"
    if out.retryable:
        message = f"the generation failed: {cause}; it may succeed if sent again"
        return ApiError(503, "generation_unavailable", message, retry_after=RETRY_AFTER_S)
    return ApiError(500, "generation_failed", f"the generation failed: {cause}")


def first_failure(finals: list[RequestOutput | None]) -> ApiError | None:
    """The error of the first failed choice (one failed choice fails the request)."""
    for out in finals:
        error = failure(out)
        if error is not None:
            return error
    return None
