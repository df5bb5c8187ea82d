"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}.

Every failure a client can cause ends here with a 4xx status: FastAPI's validation
errors (malformed JSON, wrong types), unknown routes, and the APIErrors raised by the
handlers. The `openai` client maps the status to its exception classes
(BadRequestError, AuthenticationError, NotFoundError, RateLimitError, ...).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("alphallama.server")


@dataclass(frozen=True)
class ErrorKind:
    status: int
    type: str


# Kinds as llama-server names them; the status is what the openai client keys on.
KINDS: dict[str, ErrorKind] = {
    "invalid_request": ErrorKind(400, "invalid_request_error"),
    "context_length": ErrorKind(400, "exceed_context_size_error"),
    "authentication": ErrorKind(401, "authentication_error"),
    "not_found": ErrorKind(404, "not_found_error"),
    "method_not_allowed": ErrorKind(405, "invalid_request_error"),
    "too_large": ErrorKind(413, "invalid_request_error"),
    "rate_limit": ErrorKind(429, "rate_limit_error"),
    "server": ErrorKind(500, "server_error"),
    "unavailable": ErrorKind(503, "unavailable_error"),
}
_BY_STATUS = {k.status: k for k in reversed(KINDS.values())}


class APIError(Exception):
    def __init__(self, kind: str, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.kind = KINDS[kind]
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    @property
    def status(self) -> int:
        return self.kind.status

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind.type,
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


_UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _loc(loc: tuple) -> str:
    """('body', 'messages', 0, 'role') -> 'messages[0].role'. Pydantic also names the
    member of a union it tried ('list[str]', 'function-after[...]'): those are dropped."""
    out = ""
    for part in loc:
        if part == "body" and not out:
            continue
        if isinstance(part, str) and (part in _UNION_TAGS or "[" in part or "-" in part):
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable line per problem; the first problem's field is the `param`."""
    errors = exc.errors()
    lines, param = [], None
    for e in errors[:5]:
        where = _loc(tuple(e.get("loc", ())))
        if e.get("type") == "json_invalid":
            ctx = e.get("ctx") or {}
            lines.append(f"the request body is not valid JSON ({ctx.get('error', 'parse error')})")
            continue
        if not where:   # the body as a whole: empty, or JSON that is not an object
            lines.append("the request body is empty; a JSON object is expected" if e.get("type") == "missing"
                         else "the request body must be a JSON object")
            continue
        param = param or where
        lines.append(f"{where}: {e.get('msg', 'invalid value')}")
    if len(errors) > 5:
        lines.append(f"... and {len(errors) - 5} more")
    return "; ".join(dict.fromkeys(lines)) or "invalid request", param


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return APIError("invalid_request", message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = _BY_STATUS.get(exc.status_code, ErrorKind(exc.status_code, "invalid_request_error"))
        message = "no such endpoint: " + request.url.path if exc.status_code == 404 else str(exc.detail)
        body = {"error": {"message": message, "type": kind.type, "param": None, "code": None}}
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        # A bug of ours, never a client's mistake: log it whole, answer in the API's shape.
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return APIError("server", f"internal error: {type(exc).__name__}: {exc}").response()
