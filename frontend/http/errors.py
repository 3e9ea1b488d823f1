"""API errors in the OpenAI format: {"error": {"message", "type", "param", "code"}}.

Every refusal carries a stable `code` (clients branch on it) and the matching HTTP status."""

from __future__ import annotations

from starlette.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
}


def _default_type(status: int) -> str:
    return "invalid_request_error" if 400 <= status < 500 else "server_error"


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        param: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param
        self.retry_after = retry_after

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, _default_type(self.status)),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        headers = {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, int(self.retry_after + 0.999)))
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(code: str, message: str, param: str | None = None) -> ApiError:
    return ApiError(400, code, message, param)


def not_found(code: str, message: str) -> ApiError:
    return ApiError(404, code, message)
