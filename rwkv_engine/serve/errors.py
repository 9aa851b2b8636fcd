"""Error answers: `APIError` (raised anywhere in a route) and its JSON response."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from . import protocol as p
from .engine import Finished


class APIError(Exception):
    """An error answer: HTTP status + OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


def error_response(status: int, message: str, param=None, code=None, headers=None) -> JSONResponse:
    return JSONResponse(p.error_body(status, message, param, code).model_dump(), status_code=status, headers=headers)


def failure_status(event: Finished) -> int:
    """The HTTP status of a request the engine ended with an error: 503 when it was cut by a
    shutdown, 500 when a model step failed."""
    return 503 if event.message and "shutting down" in event.message else 500
