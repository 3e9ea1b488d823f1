"""What a runner refuses a request for, naming the request field at fault, so that a frontend
answers with the field (OpenAI's `param`) without parsing messages."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request the runner cannot serve as asked. param: the field at fault ("prompt",
    "logit_bias", "response_format", ...), or None."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextTooLong(InvalidRequest):
    """The prompt does not fit in the model's context or in the KV memory one request can
    have (the frontend answers HTTP 400 context_length_exceeded)."""

    def __init__(self, message: str, param: str | None = "prompt") -> None:
        super().__init__(message, param)
