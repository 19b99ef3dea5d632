"""Who may use the server: an API key on the OpenAI routes, and a Host header from an allowed list.

As vLLM's `--api-key`: every `/v1/...` request must carry `Authorization: Bearer <key>` with one of the keys given
(each compared in constant time), while `/health` and `/metrics` stay open for probes and scrapers. The Host check
defeats DNS rebinding: a web page on evil.example that re-points its name at 127.0.0.1 can reach a local server, but
its requests still say `Host: evil.example`. `/health` (and `/ping`, vLLM's probe) is exempt from both checks (the
launcher and load balancers probe it). By default a server bound to a loopback address answers only loopback names; bound to anything else it
takes any Host (say which with `allowed_hosts`). Written here rather than with Starlette's TrustedHostMiddleware so
that refusals have the OpenAI error body every client parses.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import APIError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


def default_allowed_hosts(bind_host: str) -> list[str]:
    """Loopback names when bound to loopback, else any ("*")."""
    try:
        loopback = bind_host == "localhost" or ipaddress.ip_address(bind_host).is_loopback
    except ValueError:
        loopback = False
    return list(LOOPBACK_NAMES) if loopback else ["*"]


def _hostname(header: str) -> str:
    """`Host` without its port: "[::1]:8000" -> "::1", "example.com:80" -> "example.com"."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class AccessControl:
    """ASGI middleware: 421 for a Host not allowed, 401 for a missing or wrong API key on `/v1` routes."""

    def __init__(self, app: ASGIApp, *, api_key: str | Sequence[str] = "",
                 allowed_hosts: list[str] | None = None) -> None:
        """`api_key`: one key or several, any of which authenticates (vLLM's `--api-key A B`); empty ones count as
        none, as there."""
        self.app = app
        self.keys = [k.encode() for k in ([api_key] if isinstance(api_key, str) else api_key) if k]
        self.hosts = {h.lower().strip("[]") for h in (allowed_hosts or ["*"])}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in ("/health", "/ping"):   # probes (the launcher's too)
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if "*" not in self.hosts and _hostname(headers.get("host", "")) not in self.hosts:
            await APIError(421, "This server does not answer for that Host header (allowed_hosts).",
                           type="invalid_request_error", code="misdirected_request").response()(scope, receive, send)
            return
        if self.keys and scope.get("path", "").startswith("/v1"):
            given = headers.get("authorization", "")
            token = given[7:].strip().encode() if given[:7].lower() == "bearer " else b""
            if not any([hmac.compare_digest(token, k) for k in self.keys]):     # all compared: no early exit
                await APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                               type="invalid_request_error", code="invalid_api_key").response()(scope, receive,
                                                                                              send)
                return
        await self.app(scope, receive, send)
