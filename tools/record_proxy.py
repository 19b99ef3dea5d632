"""A recording HTTP proxy for finding out what a client (a coding agent, an SDK) really sends: it forwards every
request to the server unchanged, streams the answer back unchanged, and appends one JSON line per exchange to a file
(method, path, status, the request's JSON body, the response's text, cut at --max-response-chars).

    python tools/record_proxy.py --upstream http://127.0.0.1:8000 --port 8001 --out /tmp/agent.jsonl
    OPENAI_BASE_URL=http://127.0.0.1:8001/v1 some-agent ...

Binds 127.0.0.1 only. `--force-tool NAME` sets `tool_choice` to that function on the first chat request that offers
it (the server then constrains the model to a well-formed call): a way to see what an agent does with a tool call
and sends back when the model would not call one by itself.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

_HOP = {"host", "content-length", "transfer-encoding", "connection", "accept-encoding"}


def _force(body: bytes, tool: str) -> bytes | None:
    """The request with tool_choice forcing `tool`, if it is a chat request offering that tool."""
    try:
        req = json.loads(body)
    except ValueError:
        return None
    names = [t.get("function", {}).get("name") for t in req.get("tools") or [] if isinstance(t, dict)]
    if tool not in names:
        return None
    req["tool_choice"] = {"type": "function", "function": {"name": tool}}
    return json.dumps(req).encode()


def make_app(upstream: str, out: Path, max_chars: int, force_tool: str | None = None) -> Starlette:
    client = httpx.AsyncClient(base_url=upstream, timeout=None)
    pending_force = [force_tool] if force_tool else []

    async def forward(request: Request) -> StreamingResponse:
        body = await request.body()
        forced = _force(body, pending_force[0]) if pending_force and request.url.path.endswith("/chat/completions") \
            else None
        if forced is not None:
            body = forced
            pending_force.clear()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        url = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        upstream_req = client.build_request(request.method, url, content=body, headers=headers)
        resp = await client.send(upstream_req, stream=True)
        record = {"t": time.time(), "method": request.method, "path": url, "status": resp.status_code,
                  "request_headers": {k: v for k, v in headers.items() if k.lower() != "authorization"},
                  "forced_tool": forced is not None}
        try:
            record["request"] = json.loads(body) if body else None
        except ValueError:
            record["request"] = body.decode("utf-8", "replace")[:max_chars]

        async def relay():
            seen = []
            try:
                async for chunk in resp.aiter_raw():
                    seen.append(chunk)
                    yield chunk
            finally:
                await resp.aclose()
                record["response"] = b"".join(seen).decode("utf-8", "replace")[:max_chars]
                with out.open("a") as f:
                    f.write(json.dumps(record) + "\n")

        kept = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP | {"content-encoding"}}
        return StreamingResponse(relay(), status_code=resp.status_code, headers=kept)

    methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]
    return Starlette(routes=[Route("/{path:path}", forward, methods=methods)])


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--upstream", default="http://127.0.0.1:8000")
    ap.add_argument("--port", type=int, default=8001)
    ap.add_argument("--out", required=True, help="JSON lines file, appended to")
    ap.add_argument("--max-response-chars", type=int, default=20000)
    ap.add_argument("--force-tool", default=None, metavar="NAME", help="force a call of this tool, once")
    args = ap.parse_args(argv)
    uvicorn.run(make_app(args.upstream, Path(args.out), args.max_response_chars, args.force_tool), host="127.0.0.1", port=args.port,
                log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
