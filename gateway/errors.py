"""OpenAI-shaped errors, `{"error": {"message", "type", "param", "code"}}`, and the handlers that produce them.

Every failure a client can cause is a 4xx naming the offending field; engine back-pressure and outages map to 429/503;
anything unexpected is logged with its traceback and answered 500 with a generic message (never a dropped
connection, never internals in the body).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared.engine_core import EngineFailed, EngineOverloaded, EngineUnavailable

__all__ = [
    "APIError", "error_body", "invalid_request", "context_length_exceeded", "output_exceeds_context", "model_not_found",
    "from_validation", "parse_json_body", "read_body", "require_json", "engine_error", "internal_error",
    "install_error_handlers", "validate",
]

log = logging.getLogger("moepipe.gateway")

_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "tuple", "bytes"}


class APIError(Exception):
    """An error the client should see as-is."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.retry_after = retry_after          # seconds: the Retry-After header (429, 503)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def context_length_exceeded(max_model_len: int, prompt_tokens: int | None, param: str) -> APIError:
    got = f"{prompt_tokens} tokens" if prompt_tokens is not None else "more tokens than that"
    return APIError(400, f"This model's maximum context length is {max_model_len} tokens, and at least one token "
                         f"must be generated. However, your {param} resulted in {got}.",
                    param=param, code="context_length_exceeded")


def output_exceeds_context(param: str, requested: int, prompt_tokens: int, max_model_len: int,
                           prompt_param: str) -> APIError:
    """`param` (max_tokens, max_completion_tokens, max_output_tokens) asks for more tokens than the context leaves
    after the prompt: vLLM's and OpenAI's 400, with both numbers and the most that fits."""
    return APIError(400, f"{param} is too large: {requested} tokens were asked for, but this model's maximum context "
                         f"length is {max_model_len} tokens and {prompt_tokens} of them hold the {prompt_param} "
                         f"({prompt_tokens} + {requested} > {max_model_len}). Ask for at most "
                         f"{max_model_len - prompt_tokens} tokens, or shorten the {prompt_param}.",
                    param=param, code="context_length_exceeded")


def model_not_found(name: str | None) -> APIError:
    return APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")


def _param_path(loc: tuple[Any, ...]) -> str | None:
    """("messages", 0, "content", "str") -> "messages[0].content": stop at pydantic's union-member tags."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        part = str(part)
        if part in _TYPE_TAGS or "[" in part or part.startswith("function-") or part == "body":
            if out:
                break
            continue
        out += f".{part}" if out else part
    return out or None


def from_validation(exc: ValidationError | RequestValidationError) -> APIError:
    """The first validation problem, with its field path in `param`."""
    errors = exc.errors()
    if not errors:
        return invalid_request("invalid request")
    first = errors[0]
    param = _param_path(tuple(first.get("loc", ())))
    msg = str(first.get("msg", "invalid value"))
    return invalid_request(f"{param}: {msg}" if param else msg, param=param)


def validate(model: type[BaseModel], data: Any) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation(e) from None


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """Strict UTF-8 JSON object, or a 400 saying what is wrong with it."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise invalid_request(f"The request body is not valid UTF-8 (byte {e.start}).") from None
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise invalid_request(f"The request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise invalid_request("The request body must be a JSON object.")
    return data


def require_json(request: Request) -> None:
    """415 for a body declared as anything but JSON. A browser page can POST text/plain, form or multipart bodies
    to any origin without asking (no CORS preflight); refusing them keeps a web page from driving a local server
    (issue 15). A request with no Content-Type at all is read as JSON (raw sockets, some scripts)."""
    declared = request.headers.get("content-type")
    if declared is None:
        return
    media = declared.split(";", 1)[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise APIError(415, f"The request body must be JSON (Content-Type: application/json), not {media or '?'}.",
                       code="unsupported_media_type")


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refusing (413) as soon as it is known to exceed `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"The request body exceeds the limit of {limit} bytes.", code="request_too_large")


# Retry-After on the answers a client should retry: the openai SDKs wait that long before their automatic retries
# (429 and 5xx) instead of their own backoff. The queue drains in about a second; a dead component is back in a few
# (a restart: 2.5-4 s measured, docs/architecture.md "self-healing").
RETRY_OVERLOADED_S = 1
RETRY_UNAVAILABLE_S = 5


def engine_error(exc: Exception) -> APIError:
    """APIError for EngineOverloaded (429), EngineUnavailable (503) or EngineFailed (500)."""
    if isinstance(exc, EngineOverloaded):
        return APIError(429, f"The server is overloaded, try again later ({exc}).", type="rate_limit_error",
                        code="overloaded", retry_after=RETRY_OVERLOADED_S)
    if isinstance(exc, EngineUnavailable):
        return APIError(503, f"A serving component is unavailable: {exc}", type="service_unavailable_error",
                        code="component_unavailable", retry_after=RETRY_UNAVAILABLE_S)
    return APIError(500, f"The request failed while generating: {exc}", type="server_error", code="engine_failed")


def internal_error() -> APIError:
    return APIError(500, "The server had an internal error while processing the request.", type="server_error",
                    code="internal_error")


def install_error_handlers(app: FastAPI) -> None:
    """Map every exception type to an OpenAI-shaped response; unexpected ones are logged and become 500."""

    async def on_api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return exc.response()

    async def on_validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, (ValidationError, RequestValidationError))
        return from_validation(exc).response()

    async def on_engine(_: Request, exc: Exception) -> JSONResponse:
        return engine_error(exc).response()

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        headers = getattr(exc, "headers", None)
        message = str(exc.detail)
        where = f"{request.method} {request.url.path}"
        if exc.status_code == 404 and message == "Not Found":       # no such route (OpenAI: "Invalid URL")
            message = f"Invalid URL ({where}): this server has no such route."
        elif exc.status_code == 405:                                 # the route exists for other methods
            allowed = _allowed_methods(request)
            if allowed:      # every route of this path, not only the one that matched (/ping GET and POST)
                headers = {**{k: v for k, v in (headers or {}).items() if k.lower() != "allow"}, "Allow": allowed}
            else:
                allowed = (headers or {}).get("allow") or (headers or {}).get("Allow")
            message = f"Method not allowed ({where})" + (f": use {allowed}." if allowed else ".")
        return JSONResponse(error_body(message, kind, None, None), status_code=exc.status_code, headers=headers)

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(ValidationError, on_validation)
    for cls in (EngineOverloaded, EngineUnavailable, EngineFailed):
        app.add_exception_handler(cls, on_engine)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_middleware(CatchAllMiddleware)


def _allowed_methods(request: Request) -> str:
    """The methods some route of the app takes at this request's path, as an Allow header: Starlette's 405 names
    only the methods of the one route whose path matched first, and a path served by two routes (GET and DELETE
    of /v1/responses/{id}, each its own operation) then told clients a method was missing."""
    matched = [route for route in getattr(request.app, "routes", ())
               if getattr(route, "methods", None) and getattr(route, "path_regex", None) is not None
               and route.path_regex.match(request.url.path)]
    # a literal path (/v1/responses/input_tokens) is its own resource, not an id of /v1/responses/{response_id}
    literal = [route for route in matched if not getattr(route, "param_convertors", None)]
    return ", ".join(sorted({m for route in (literal or matched) for m in route.methods}))


class CatchAllMiddleware:
    """Last line of defence: log an unexpected exception and answer 500 (if no response has started yet).

    Starlette's own handler for `Exception` re-raises after answering, which servers report as a crashed request.
    A client gone before its body was read (`ClientDisconnect` out of the read: cancelled while uploading a prompt)
    is no error: nobody is left to answer, and the access log shows it as 499 (it was logged as an unhandled error
    with its traceback, and answered 500).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except ClientDisconnect:
            log.debug("client gone while sending %s %s", scope.get("method"), scope.get("path"))
        except Exception:
            log.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if not started:
                await internal_error().response()(scope, receive, send)
