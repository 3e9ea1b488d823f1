"""The error every adapter check raises (re-exported by peft_checks and adapter)."""

from __future__ import annotations


class AdapterError(ValueError):
    """A refused adapter. ``code`` is stable (frontends map it to API errors)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
