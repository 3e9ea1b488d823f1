"""Errors the scheduler's operations raise (the admin API maps ClusterError to its status)."""

from __future__ import annotations


class ClusterError(Exception):
    """A refused cluster operation; `status` is the HTTP status the admin API answers."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


class NoRunner(RuntimeError):
    """No runner is active or starting: nothing can take a request now."""
