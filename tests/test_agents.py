"""Coding-agent features end to end: `moepipe serve --stages 2` (real processes, sockets on 127.0.0.1) on the random
tiny model, driven by the official `openai` client. Structured output and forced tool calls are enforced by token
masks on the last stage, so even random weights must produce JSON that validates; thinking splits reasoning from
content; a tool-call loop (call, tool result in the history, answer) completes."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import jsonschema
import pytest
from openai import AsyncOpenAI, BadRequestError, OpenAI

from conftest import free_port
from gateway.launcher import Cluster, ServeOptions

S = {"type": "string", "maxLength": 6}
I = {"type": "integer", "minimum": 0, "maximum": 999}
SCHEMAS = [
    {"type": "object", "properties": {"name": S, "age": I}, "required": ["name", "age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {"x": I, "y": I},
                                                "required": ["x", "y"]}}, "required": ["point"]},
    {"type": "object", "properties": {"ids": {"type": "array", "items": I, "minItems": 1, "maxItems": 4}},
     "required": ["ids"]},
    {"type": "object", "properties": {"a": S, "b": {"type": "boolean"}, "c": I}, "required": ["a", "b", "c"]},
    {"type": "object", "properties": {"status": {"enum": ["ok", "error"]}, "code": I}, "required": ["status"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": I, "roles": {"type": "array", "items": {"enum": ["admin", "dev"]}, "maxItems": 2}},
        "required": ["id", "roles"]}}, "required": ["user"]},
    {"type": "object", "properties": {"lang": {"enum": ["py", "rs", "go"]}, "lines": I}, "required": ["lang", "lines"]},
    {"type": "object", "properties": {"flag": {"type": "boolean"}, "note": {"type": ["string", "null"], "maxLength": 4}},
     "required": ["flag", "note"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2,
                                                 "items": {"type": "array", "items": I, "maxItems": 2}}},
     "required": ["matrix"]},
    {"type": "object", "properties": {"file": S, "line": I, "fix": {"type": "boolean"}}, "required": ["file", "line"]},
    {"type": "object", "properties": {"kind": {"const": "edit"}, "count": I}, "required": ["kind", "count"]},
    {"type": "object", "properties": {"choice": {"anyOf": [I, {"type": "boolean"}]}}, "required": ["choice"]},
    {"type": "object", "properties": {"deps": {"type": "array", "items": {"type": "object", "properties": {
        "name": S, "pinned": {"type": "boolean"}}, "required": ["name", "pinned"]}, "maxItems": 2}},
     "required": ["deps"]},
    {"type": "object", "properties": {"level": {"enum": [1, 2, 3]}, "msg": S}, "required": ["level", "msg"]},
    {"type": "object", "properties": {"x": I, "y": I, "z": I}, "required": ["x", "y", "z"]},
    {"type": "object", "properties": {"done": {"type": "boolean"}, "steps": {"type": "array", "items": S,
                                                                               "maxItems": 2}},
     "required": ["done", "steps"]},
    {"type": "object", "properties": {"meta": {"type": "object", "properties": {"v": I}, "required": ["v"]},
                                      "name": S}, "required": ["meta", "name"]},
]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": I, "b": I}, "required": ["a", "b"]}}}


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint) -> Path:
    return tiny_checkpoint


@pytest.fixture(scope="module")
def server(tiny):
    opts = ServeOptions(model=tiny, stages=2, port=free_port(),
                        extra={"max_num_batched_tokens": 64, "block_size": 16, "num_blocks": 512})
    with Cluster(opts) as c:
        yield c


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="x", timeout=120)


def _chat(client: OpenAI, **kw):
    return client.chat.completions.create(model="moepipe", messages=[{"role": "user", "content": "Fill it in."}],
                                          max_tokens=kw.pop("max_tokens", 160), **kw)


def test_json_schema_outputs_validate(client):
    for i, schema in enumerate(SCHEMAS):
        r = _chat(client, seed=i, response_format={"type": "json_schema",
                                                   "json_schema": {"name": f"s{i}", "schema": schema,
                                                                   "strict": True}})
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (i, choice)
        data = json.loads(choice.message.content)
        jsonschema.validate(data, schema)
        assert not choice.message.tool_calls and choice.message.reasoning_content is None


def test_json_object(client):
    r = _chat(client, seed=3, response_format={"type": "json_object"}, max_tokens=400)
    if r.choices[0].finish_reason == "stop":          # an open object can run past the budget on random weights
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_four_concurrent_structured_requests(server):
    async def run():
        c = AsyncOpenAI(base_url=server.url + "/v1", api_key="x", timeout=120)
        return await asyncio.gather(*[
            c.chat.completions.create(model="moepipe", messages=[{"role": "user", "content": f"item {i}"}],
                                      max_tokens=160, seed=100 + i,
                                      response_format={"type": "json_schema",
                                                       "json_schema": {"name": "x", "schema": SCHEMAS[i]}})
            for i in range(4)])

    for i, r in enumerate(asyncio.run(run())):
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS[i])


def test_four_concurrent_structured_streams(server):
    async def one(c, i):
        stream = await c.chat.completions.create(
            model="moepipe", messages=[{"role": "user", "content": f"item {i}"}], max_tokens=160, seed=200 + i,
            stream=True, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMAS[4 + i]}})
        text, finish = "", None
        async for ch in stream:
            if ch.choices:
                text += ch.choices[0].delta.content or ""
                finish = ch.choices[0].finish_reason or finish
        return text, finish

    async def run():
        c = AsyncOpenAI(base_url=server.url + "/v1", api_key="x", timeout=120)
        return await asyncio.gather(*[one(c, i) for i in range(4)])

    for i, (text, finish) in enumerate(asyncio.run(run())):
        assert finish == "stop"
        jsonschema.validate(json.loads(text), SCHEMAS[4 + i])


def _assemble(stream) -> tuple[dict, str, str, str | None]:
    calls: dict[int, dict] = {}
    content = reasoning = ""
    finish = None
    for ch in stream:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        reasoning += getattr(d, "reasoning_content", None) or ""
        for tc in d.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                assert call["id"] is None, "a call's id comes once, on its first delta"
                call["id"], call["name"] = tc.id, tc.function.name
            call["arguments"] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return calls, content, reasoning, finish


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_forced_tool_call_streams_into_the_same_call(client, tool_choice):
    kw = dict(tools=[WEATHER, ADD], tool_choice=tool_choice, parallel_tool_calls=False, seed=7, max_tokens=120)
    full = _chat(client, **kw)
    msg = full.choices[0].message
    assert full.choices[0].finish_reason == "tool_calls"
    assert len(msg.tool_calls) == 1 and not msg.content
    call = msg.tool_calls[0]
    schema = {"get_weather": WEATHER, "add": ADD}[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    if isinstance(tool_choice, dict):
        assert call.function.name == "add"
    calls, content, _, finish = _assemble(_chat(client, stream=True, **kw))
    assert finish == "tool_calls" and not content.strip()
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(call.function.name, call.function.arguments)]


def test_tool_loop_completes(client):
    """call -> tool result in the history -> a final answer (plain text, tools still offered)."""
    first = _chat(client, tools=[WEATHER], tool_choice="required", seed=11, max_tokens=120)
    call = first.choices[0].message.tool_calls[0]
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None,
                "tool_calls": [{"id": call.id, "type": "function",
                                "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp": 21})}]
    final = client.chat.completions.create(model="moepipe", messages=history, tools=[WEATHER], tool_choice="none",
                                           max_tokens=12, seed=12)
    assert final.choices[0].finish_reason in ("stop", "length")
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls
    # The same history with tools callable ("auto") is accepted too; whatever the model writes is returned.
    auto = client.chat.completions.create(model="moepipe", messages=history, tools=[WEATHER], max_tokens=12, seed=12)
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_thinking_off_puts_everything_in_content(client):
    kw = dict(max_tokens=16, seed=5, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    r = _chat(client, **kw)
    assert r.choices[0].message.reasoning_content is None and r.choices[0].message.content
    _, content, reasoning, _ = _assemble(_chat(client, stream=True, **kw))
    assert reasoning == "" and content == r.choices[0].message.content


@pytest.fixture(scope="module")
def thinking_server(tiny, tmp_path_factory):
    """The tiny checkpoint with a thinking template of the Qwen3-2507 kind: with thinking on, the generation prompt
    opens the think block, so the reply starts inside it and only `</think>` can end it."""
    import shutil

    from stage_worker.checkpoint.tokenizer_files import CHAT_TEMPLATE

    d = tmp_path_factory.mktemp("thinking") / "tiny"
    shutil.copytree(tiny, d)
    opening = "{%- if enable_thinking is defined and enable_thinking is false -%}"
    assert opening in CHAT_TEMPLATE
    template = CHAT_TEMPLATE.replace(opening, "{%- if enable_thinking is not defined or enable_thinking -%}"
                                     "{{- '<think>\\n' -}}{%- endif -%}" + opening)
    (d / "chat_template.jinja").write_text(template)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with Cluster(ServeOptions(model=d, stages=1, port=free_port())) as c:
        yield OpenAI(base_url=c.url + "/v1", api_key="x", timeout=120)


@pytest.mark.parametrize("thinking", [True, False])
def test_thinking_splits_reasoning_from_content(thinking_server, thinking):
    """Thinking on: the reply starts inside the think block, so (random weights never close it) all of it is
    reasoning_content and content is empty; off: the template closed an empty block, all of it is content. The
    streamed deltas assemble to the same split."""
    kw = dict(max_tokens=16, seed=4, extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
    r = _chat(thinking_server, **kw)
    msg = r.choices[0].message
    if thinking:
        assert msg.reasoning_content and not msg.content
    else:
        assert msg.content and msg.reasoning_content is None
    _, content, reasoning, _ = _assemble(_chat(thinking_server, stream=True, **kw))
    assert reasoning == (msg.reasoning_content or "") and content == (msg.content or "")


def test_thinking_reply_with_a_closed_block(thinking_server):
    """An assistant turn with reasoning in the history renders (the template keeps reasoning only after the last
    user query) and the new reply again starts inside the think block."""
    history = [{"role": "user", "content": "q1"},
               {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
               {"role": "user", "content": "q2"}]
    r = thinking_server.chat.completions.create(model="moepipe", messages=history, max_tokens=4, seed=1)
    assert r.choices[0].message.reasoning_content


@pytest.mark.parametrize("body, param", [
    ({"tools": [WEATHER], "tool_choice": "required", "extra_body": {"chat_template_kwargs": {"enable_thinking": True}}},
     "chat_template_kwargs.enable_thinking"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"},
      "extra_body": {"chat_template_kwargs": {"enable_thinking": True}}}, "chat_template_kwargs.enable_thinking"),
])
def test_unsupported_combinations_are_400_naming_the_field(client, body, param):
    extra = body.pop("extra_body", None)
    with pytest.raises(BadRequestError) as e:
        _chat(client, extra_body=extra, **body)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
