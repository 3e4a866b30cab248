"""Every refusal as OpenAI's error body: {"error": {"message", "type", "param", "code"}}, 401s included.

Which status means what (docs/reliability.md):
- 400: the request is wrong (validation, a value the engine refuses, a bound passed, a template that
  refuses the messages); 404: an unknown model or path; 401: no or a wrong API key; 413: the body is
  over --max-body-bytes.
- 503 with Retry-After: the engine cannot take it now (queue full, memory released, paused for a
  weight update, shutting down) or is gone (its worker died: /health fails too).
Anything else is a bug in the server: a 500 with the same shape, so clients parse every error alike.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollout.fronts.async_front import QueueFullError

log = logging.getLogger("rollout")

RETRY_AFTER_S = 1  # what a 503 tells the client to wait before trying again


class ApiError(Exception):
    """A refusal with its status, OpenAI error type and the client's field it is about."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type = type or _TYPES.get(status, "invalid_request_error")
        self.code = code
        self.headers = headers


class EngineUnavailable(ApiError):
    """503: the engine cannot serve now (the message says why); the client may retry later."""

    def __init__(self, message: str, code: str = "engine_unavailable"):
        super().__init__(503, message, code=code, headers={"Retry-After": str(RETRY_AFTER_S)})


_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    503: "service_unavailable",
}


def body(status: int, message: str, *, param: str | None = None, type: str | None = None, code: Any = None):
    """The JSON body of an error (also used by the ASGI guards, outside FastAPI's handlers)."""
    kind = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def respond(e: ApiError) -> JSONResponse:
    return JSONResponse(
        body(e.status, e.message, param=e.param, type=e.type, code=e.code), e.status, e.headers
    )


def install(app: FastAPI, alive: Any = lambda: True) -> None:
    """The exception handlers that turn every refusal into `body`'s shape. `alive()`: whether the
    engine still runs; a RuntimeError while it does not is a dead engine's 503."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return respond(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        parts, params = [], []
        for e in errors:
            loc = _field(e["loc"])
            params.append(_field([x for x in e["loc"] if not isinstance(x, int)]))  # the field, not its item
            parts.append(f"{loc or 'body'}: {e['msg']}")
        return respond(ApiError(400, "; ".join(dict.fromkeys(parts)), param=params[0] if params else None))

    @app.exception_handler(ValueError)
    @app.exception_handler(TypeError)
    async def bad_value(request: Request, exc: Exception) -> JSONResponse:
        return respond(ApiError(400, str(exc), param=_leading_field(str(exc))))

    @app.exception_handler(QueueFullError)
    async def full(request: Request, exc: QueueFullError) -> JSONResponse:
        return respond(EngineUnavailable(str(exc), code="queue_full"))

    @app.exception_handler(RuntimeError)
    async def unavailable(request: Request, exc: RuntimeError) -> JSONResponse:
        # the engine refuses work in its present state (memory released, shut down) or is dead
        code = "engine_unavailable" if alive() else "engine_dead"
        return respond(EngineUnavailable(str(exc), code=code))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return respond(ApiError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None)))

    @app.exception_handler(Exception)
    async def bug(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error serving %s", request.url.path)
        return respond(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error"))


def _field(loc: tuple | list) -> str:
    """A validation error's location as the client's field path; the union branches pydantic adds
    ("list[int]", "str") are not fields."""
    parts = [
        str(x) for x in loc if x != "body" and not (isinstance(x, str) and ("[" in x or x in _TYPE_NAMES))
    ]
    return ".".join(parts)


_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "function-after", "literal"}


def _leading_field(message: str) -> str | None:
    """`field: ...` messages name their field first."""
    head, sep, _ = message.partition(":")
    return head if sep and head and " " not in head.strip() and len(head) < 64 else None


def rename_fields(exc: Exception, names: dict[str, str]) -> Exception:
    """The engine's message with its SamplingParams field names replaced by the client's (a client
    sent `max_tokens`, not `SamplingParams.max_new_tokens`)."""
    message = str(exc)
    param = None
    for ours, theirs in names.items():
        token = f"SamplingParams.{ours}"
        if token in message:
            message = message.replace(token, theirs)
            param = param or theirs
    message = message.replace("SamplingParams.", "")
    return ApiError(400, message, param=param or _leading_field(message))
