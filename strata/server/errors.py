"""Errors in OpenAI's JSON shape, for every failure the server can answer: bad bodies,
unknown routes, wrong methods, refused requests, and its own faults.

Request bodies are parsed here (`parse_json`) with the limits a hostile body needs: nesting
depth, lone UTF-16 surrogates (not valid Unicode, and unencodable), NaN/Infinity literals
and numbers too long to convert are all a 400, never a 500 or a dropped connection.
"""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

log = logging.getLogger("strata.server")

MAX_DEPTH = 64  # JSON nesting accepted in a body (a chat body needs about 6)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error",
          413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"),
                      "param": param, "code": status}}


def error_bytes(status: int, message: str, param: str | None = None) -> bytes:
    # NOTE: ASCII-escaped, so text the client sent (even invalid Unicode) cannot break it
    return json.dumps(error_body(status, message, param), ensure_ascii=True).encode()


class ErrorResponse(JSONResponse):
    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True).encode()


def error_response(err: APIError) -> JSONResponse:
    return ErrorResponse(error_body(err.status, err.message, err.param), status_code=err.status,
                         headers=err.headers)


async def send_error(send, status: int, message: str, headers: list | None = None) -> None:
    """An OpenAI-shaped error straight on an ASGI `send` (for middleware)."""
    body = error_bytes(status, message)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


def install_error_handlers(app: FastAPI, on_refused=None) -> None:
    """Every error the app answers is OpenAI-shaped: APIError, unknown routes (404), wrong
    methods (405), anything else (500, logged with its traceback)."""

    @app.exception_handler(APIError)
    async def _api_error(_request, err: APIError):
        if on_refused is not None and err.status in (429, 503):
            on_refused(err.status)
        return error_response(err)

    @app.exception_handler(HTTPException)
    async def _http_error(request, err: HTTPException):
        if err.status_code == 404:
            message = (f"no route {request.method} {request.url.path}; the API is "
                       "POST /v1/chat/completions, POST /v1/completions, GET /v1/models")
        elif err.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}"
            allowed = (err.headers or {}).get("Allow")
            message += f"; use {allowed}" if allowed else ""
        else:
            message = str(err.detail)
        return error_response(APIError(err.status_code, message, headers=err.headers))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {"loc": (), "msg": "invalid request"}
        where = ".".join(str(p) for p in first["loc"])
        return error_response(APIError(400, f"{where}: {first['msg']}" if where else
                                       first["msg"]))

    @app.exception_handler(Exception)
    async def _internal(request, err: Exception):
        log.exception("%s %s failed", request.method, request.url.path, exc_info=err)
        return error_response(APIError(500, f"internal error ({type(err).__name__}); the "
                                            "server log has the details"))


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def validation_message(err: ValidationError) -> tuple[str, str | None]:
    """(message, param) of the most specific error: for a union (a string or a list of
    parts) the member that got furthest, with pydantic's union tags left out."""
    best = max(err.errors(), key=lambda e: len(e["loc"]))
    path = [str(p) for p in best["loc"] if isinstance(p, int) or (
        p not in _UNION_TAGS and "[" not in p and "-" not in p and not p[:1].isupper())]
    where = ".".join(path) or None
    message = best["msg"].removeprefix("Value error, ")
    return (f"{where}: {message}" if where else message), where


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse_json(body: bytes) -> dict:
    """The body as a JSON object, checked for what no request may contain."""
    try:
        data = json.loads(body, parse_constant=_no_constant)
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, too many digits, NaN
        raise APIError(400, f"the request body is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    _check_tree(data)
    return data


def _check_tree(data) -> None:
    """No nesting deeper than MAX_DEPTH, no string (key or value) that is not valid
    Unicode (a lone surrogate written as \\udXXX)."""
    stack = [(data, ())]
    while stack:
        value, path = stack.pop()
        if len(path) >= MAX_DEPTH:
            raise APIError(400, f"the request body is nested more than {MAX_DEPTH} levels deep")
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(item, (dict, list)) and _valid_unicode(key):
                stack.append((item, (*path, key)))
            elif not (_valid_unicode(item) and _valid_unicode(key)):
                where = _ascii(".".join(map(str, (*path, key))))
                raise APIError(400, f"{where}: the text contains a lone UTF-16 surrogate, "
                                    "which is not valid Unicode; send UTF-8 text", where)


def _valid_unicode(text) -> bool:
    if not isinstance(text, str):
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _ascii(text: str) -> str:
    return text.encode("ascii", "backslashreplace").decode()
