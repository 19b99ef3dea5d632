"""`/openapi.json` with the request and response bodies of the OpenAI routes.

The POST routes read their bodies themselves (size limit, strict UTF-8, errors naming the field), so FastAPI does not
see a body parameter and would document none. This adds each route's request model and response model, the same
pydantic classes the server validates with, as `components/schemas`, so generated clients and fuzzers
(schemathesis) see what the server accepts.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

REF = "#/components/schemas/{model}"
ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}


def _add(components: dict[str, Any], model: type[BaseModel]) -> dict[str, str]:
    """Put `model` and the models it uses into `components`; returns a $ref to it."""
    schema = model.model_json_schema(ref_template=REF)
    for name, sub in schema.pop("$defs", {}).items():
        components.setdefault(name, sub)
    components.setdefault(model.__name__, schema)
    return {"$ref": REF.format(model=model.__name__)}


def _errors(op: dict[str, Any], components: dict[str, Any]) -> None:
    """Every failure has the OpenAI error body (gateway/errors.py): 4XX for the client's, 5XX for the server's."""
    components.setdefault("ErrorResponse", ERROR)
    ref = {"$ref": REF.format(model="ErrorResponse")}
    op["responses"].pop("422", None)          # FastAPI's own validation shape: never sent, errors.py maps it
    for status, what in (("4XX", "the request cannot be served (the message and param say why)"),
                         ("5XX", "the server failed (503: a component is down)")):
        op["responses"][status] = {"description": what, "content": {"application/json": {"schema": ref}}}


def install_openapi(app: FastAPI, bodies: dict[str, tuple[type[BaseModel], type[BaseModel] | None]],
                    responses: dict[str, type[BaseModel]] | None = None) -> None:
    """`bodies`: POST path -> (request model, JSON response model or None); `responses`: GET path -> model. A POST
    route also answers `text/event-stream` (with `stream: true`)."""
    plain = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        doc = plain()
        components = doc.setdefault("components", {}).setdefault("schemas", {})
        for path, (request, response) in bodies.items():
            op = doc["paths"][path]["post"]
            op["requestBody"] = {"required": True, "content": {"application/json": {"schema": _add(components,
                                                                                                   request)}}}
            # One server-sent event (OpenAPI 3.0/3.1 put the per-event schema under `schema`): its `data` is a JSON
            # chunk as a string, or "[DONE]"; schemathesis parses the stream and checks every event against this.
            ok: dict[str, Any] = {"text/event-stream": {"schema": {
                "type": "object", "required": ["data"],
                "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}}}}}
            # (no pydantic model of the Responses API's answer: gateway/responses.py builds it as items)
            ok["application/json"] = {"schema": _add(components, response) if response else {"type": "object"}}
            op.setdefault("responses", {})["200"] = {"description": "the answer, or its SSE stream", "content": ok}
            _errors(op, components)
        for path, model in (responses or {}).items():
            op = doc["paths"][path]["get"]
            op.setdefault("responses", {})["200"] = {
                "description": "OK", "content": {"application/json": {"schema": _add(components, model)}}}
            _errors(op, components)
        for path in ("/v1/responses/{response_id}", "/v1/responses/{response_id}/cancel",
                     "/v1/responses/{response_id}/input_items", "/v1/responses/compact"):
            for op in doc["paths"].get(path, {}).values():
                op["responses"] = {}          # nothing is stored (and nothing compacts): every call is a 404
                _errors(op, components)
        if "/metrics" in doc["paths"]:
            doc["paths"]["/metrics"]["get"]["responses"] = {"200": {
                "description": "Prometheus text exposition", "content": {"text/plain": {"schema": {"type": "string"}}}}}
        for op in [*doc["paths"].get("/health", {}).values(), *doc["paths"].get("/ping", {}).values()]:
            components.setdefault("ErrorResponse", ERROR)
            op["responses"] = {
                "200": {"description": "every component heartbeats", "content": {"application/json": {"schema": {
                    "type": "object", "properties": {"status": {"const": "ok"}}, "required": ["status"]}}}},
                "503": {"description": "a component missed its heartbeat deadline (the message names it)",
                        "content": {"application/json": {"schema": {"$ref": REF.format(model="ErrorResponse")}}}}}
        app.openapi_schema = doc
        return doc

    app.openapi = openapi
