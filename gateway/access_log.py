"""The access log: one line per HTTP request, written when the response has ended, whichever way it ended.

An ASGI middleware around the whole app (outside the error handlers, so it sees the 500 they send) owns an
`AccessRecord` per request and exposes it through a context variable; the API layer's `RequestTimer`
(gateway/metrics.py) fills in what only it knows (request id, token counts, first-token time, finish reason), so the
routes need no logging code of their own. A line looks like

    POST /v1/chat/completions 200 request_id=chatcmpl-1f0c... prompt_tokens=31 completion_tokens=12 ttft=0.041
    total=0.187 finish_reason=stop client=127.0.0.1:50412

(one line; `-` for what a request never had, e.g. tokens of a 400). `request_id` is the client's `X-Request-Id`
header when it sent one, else the response's `id` (else, for a reply that has none, an error before generation, a
generated `req-<hex>`); the response carries it back in `X-Request-Id` (the `openai`
client shows that header as `_request_id`). Status 499 means the client went away before the response was complete
(nginx's convention), also for a stream whose 200 had already been sent. `/health`, `/ping` and `/metrics` are not logged:
probes, scrapers and the launcher's start-up polling would drown the requests (`/health` says what is down).
"""

from __future__ import annotations

import logging
import sys
import time
import uuid
from contextvars import ContextVar
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["AccessRecord", "AccessLogMiddleware", "current", "configure_logger", "LOGGER_NAME"]

LOGGER_NAME = "moepipe.access"
CLIENT_GONE = 499
_QUIET_PATHS = ("/health", "/ping", "/metrics")       # /ping: vLLM's probe, /health's answer
_MAX_CLIENT_ID = 128               # a client's X-Request-Id is echoed and logged; bound what it can make us write

_current: ContextVar[AccessRecord | None] = ContextVar("moepipe_access_record", default=None)


@dataclass
class AccessRecord:
    """What one request's log line says; written by the middleware and the request's timer(s)."""
    method: str
    path: str
    client: str
    start: float = field(default_factory=time.monotonic)
    client_request_id: str | None = None
    response_id: str | None = None
    status: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    first_token: float | None = None
    finish_reasons: list[str] = field(default_factory=list)
    complete: bool = False              # the last body chunk went out
    client_gone: bool = False           # the client disconnected before that
    tool_calls: bool = False            # the reply called tools (`note_tool_calls`)

    @property
    def request_id(self) -> str | None:
        return self.client_request_id or self.response_id

    def generation_created(self, request_id: str | None) -> None:
        if self.response_id is None:
            self.response_id = request_id

    def generation_started(self, prompt_tokens: int) -> None:
        self.prompt_tokens = (self.prompt_tokens or 0) + prompt_tokens

    def tokens(self, count: int) -> None:
        if self.first_token is None:
            self.first_token = time.monotonic()
        self.completion_tokens = (self.completion_tokens or 0) + count

    def finished(self, reason: str) -> None:
        if reason not in self.finish_reasons:
            self.finish_reasons.append(reason)

    def line(self) -> str:
        now = time.monotonic()
        status = CLIENT_GONE if self.client_gone else (self.status or 500)
        ttft = None if self.first_token is None else f"{self.first_token - self.start:.3f}"
        reasons = list(self.finish_reasons)
        if self.tool_calls:
            reasons = ["tool_calls"] if reasons == ["stop"] else reasons + ["tool_calls"]
        fields = {"request_id": self.request_id, "prompt_tokens": self.prompt_tokens,
                  "completion_tokens": self.completion_tokens, "ttft": ttft, "total": f"{now - self.start:.3f}",
                  "finish_reason": ",".join(reasons) or None, "client": self.client}
        return f"{self.method} {self.path} {status} " + " ".join(
            f"{k}={'-' if v is None else v}" for k, v in fields.items())


def current() -> AccessRecord | None:
    """The record of the request being served in this context (None outside a request or with the log off)."""
    return _current.get()


def note_tool_calls() -> None:
    """The reply being built calls tools. The engine finishes such a reply with "stop"; only the API layer, which
    parses the output (chat, legacy functions or Responses), knows it is a call, so it says so here."""
    rec = _current.get()
    if rec is not None:
        rec.tool_calls = True


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers") or []:
        if key.lower() == name:
            text = value.decode("latin-1").strip()
            return text[:_MAX_CLIENT_ID] if text and text.isprintable() and " " not in text else None
    return None


class AccessLogMiddleware:
    """Wraps the app; writes one INFO line to `logger` per HTTP request when the request is over."""

    def __init__(self, app: ASGIApp, logger: logging.Logger | None = None) -> None:
        self.app = app
        self.log = logger or logging.getLogger(LOGGER_NAME)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        host, port = scope.get("client") or ("-", 0)
        rec = AccessRecord(method=scope.get("method", "-"), path=scope.get("path", "-"), client=f"{host}:{port}",
                           client_request_id=_header(scope, b"x-request-id"))

        async def logging_receive() -> Message:
            message = await receive()
            if message["type"] == "http.disconnect" and not rec.complete:
                rec.client_gone = True
            return message

        async def logging_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                rec.status = message["status"]
                if rec.request_id is None and rec.path not in _QUIET_PATHS:
                    rec.response_id = f"req-{uuid.uuid4().hex}"     # an error before any id: still one to quote
                if rec.request_id is not None:
                    headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                    message = {**message, "headers": [*headers, (b"x-request-id", rec.request_id.encode("latin-1"))]}
            elif message["type"] == "http.response.body":
                rec.complete = rec.complete or not message.get("more_body", False)
            await send(message)

        token = _current.set(rec)
        try:
            await self.app(scope, logging_receive, logging_send)
        finally:
            _current.reset(token)
            if rec.path not in _QUIET_PATHS:
                self.log.info("%s", rec.line())


def configure_logger(enabled: bool) -> logging.Logger:
    """The access logger writes INFO lines to stderr on its own handler, whatever level the process logs at
    (the gateway runs at WARNING unless -v); disabled, it writes nothing."""
    logger = logging.getLogger(LOGGER_NAME)
    logger.propagate = False
    logger.handlers.clear()
    if enabled:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s moepipe.access %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    else:
        logger.setLevel(logging.CRITICAL + 1)
    return logger
