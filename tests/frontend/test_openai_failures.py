"""What a client gets for each way a generation ends (frontend/openai/failures.py)."""

from __future__ import annotations

import pytest

from frontend.openai.failures import failure, first_failure
from frontend.openai.responses import finish_reason
from punica_x.api import RequestOutput
from punica_x.core import FinishReason


def final(reason: FinishReason | None, error: str | None = None, retryable: bool = False):
    return RequestOutput(
        "r", [1], [5, 6], "ab", [], "", True, reason, error=error, retryable=retryable
    )


@pytest.mark.parametrize(
    ("reason", "expected"),
    [(FinishReason.STOP, "stop"), (FinishReason.LENGTH, "length"), (None, "stop")],
)
def test_a_choice_that_succeeded_has_an_openai_finish_reason(reason, expected):
    out = final(reason)
    assert failure(out) is None and finish_reason(out) == expected


def test_a_runner_failure_is_503_with_retry_after():
    error = failure(final(FinishReason.ERROR, "no runner is left", retryable=True))
    assert (error.status, error.code) == (503, "generation_unavailable")
    response = error.response()
    assert response.headers["Retry-After"] == "5"
    assert "no runner is left" in error.body()["error"]["message"]


@pytest.mark.parametrize(
    "out",
    [
        final(FinishReason.ERROR, "this request was in 2 engine steps that failed"),
        final(FinishReason.ABORT),
        None,  # a stream that ended without its final output
    ],
)
def test_other_failures_are_500(out):
    error = failure(out)
    assert (error.status, error.code) == (500, "generation_failed")
    assert error.body()["error"]["type"] == "server_error"


def test_one_failed_choice_fails_the_request():
    ok = final(FinishReason.STOP)
    assert first_failure([ok, ok]) is None
    assert first_failure([ok, final(FinishReason.ERROR, "x", retryable=True)]).status == 503
