"""The API's errors: the exception the handlers raise and OpenAI's `{"error": {...}}` body it is answered with."""

from __future__ import annotations

from pydantic import BaseModel


class APIError(Exception):
    """An error answered as OpenAI's `{"error": {...}}` body with this HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
