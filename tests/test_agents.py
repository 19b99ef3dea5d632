"""Coding-agent features end to end: `moepipe serve --stages 2` (real processes, sockets on 127.0.0.1) on the random
tiny model, driven by the official `openai` client. Structured output and forced tool calls are enforced by token
masks on the last stage, so even random weights must produce JSON that validates; thinking splits reasoning from
content; a tool-call loop (call, tool result in the history, answer) completes."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import pytest
from openai import BadRequestError

from conftest import AsyncOpenAI, OpenAI, small_cluster, thinking_cluster
from shared.tokenizer import Tokenizer

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
    return small_cluster(tiny)          # shared with the other files of the "api" group (conftest.SHARED_GROUPS)


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="x", timeout=120)


def _chat(client: OpenAI, **kw):
    return client.chat.completions.create(model="moepipe", messages=[{"role": "user", "content": "Fill it in."}],
                                          max_tokens=kw.pop("max_tokens", 160), **kw)


def test_json_schema_outputs_validate(client):
    """Every schema's reply is JSON that validates. The requests go at once, sharing steps (a quarter of the time
    one after the other took): each reply is the one it gets alone, seeded draws not depending on the batch."""
    def ask(i):
        return _chat(client, seed=i, response_format={"type": "json_schema",
                                                      "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i],
                                                                      "strict": True}})

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        replies = list(pool.map(ask, range(len(SCHEMAS))))
    for i, (schema, r) in enumerate(zip(SCHEMAS, replies)):
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
    opens the think block, so the reply starts inside it and only `</think>` can end it (conftest.thinking_cluster,
    shared with the other files of the "api" group)."""
    c = thinking_cluster(tiny, tmp_path_factory.mktemp("thinking"))
    return OpenAI(base_url=c.url + "/v1", api_key="x", timeout=120)


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


# ---- issue 13: shapes captured from qwen-code, aider and the openai-agents SDK ----------------------------------

BOOL = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.fixture(scope="module")
def tok(tiny) -> Tokenizer:
    return Tokenizer.from_dir(tiny)


def _greedy(client: OpenAI, messages, **kw):
    return client.chat.completions.create(model="moepipe", messages=messages, temperature=0,
                                          max_tokens=kw.pop("max_tokens", 4), **kw)


def test_developer_messages_render_as_system(client):
    """developer == system (same prompt tokens, same greedy answer); a leading run of system/developer messages is
    one system message joined by a blank line. With tools the system text sits inside the tools section, so a
    developer message taken for a user turn would cost extra tokens."""
    user = {"role": "user", "content": "Weather in Paris?"}
    as_system = _greedy(client, [{"role": "system", "content": "Be brief."}, user], tools=[WEATHER])
    as_developer = _greedy(client, [{"role": "developer", "content": "Be brief."}, user], tools=[WEATHER])
    as_user = _greedy(client, [{"role": "user", "content": "Be brief."}, user], tools=[WEATHER])
    assert as_developer.usage.prompt_tokens == as_system.usage.prompt_tokens != as_user.usage.prompt_tokens
    assert as_developer.choices[0].message.content == as_system.choices[0].message.content
    merged = _greedy(client, [{"role": "system", "content": "Be brief.\n\nUse metric units."}, user])
    two = _greedy(client, [{"role": "system", "content": "Be brief."},
                           {"role": "developer", "content": [{"type": "text", "text": "Use metric units."}]}, user])
    assert two.usage.prompt_tokens == merged.usage.prompt_tokens
    assert two.choices[0].message.content == merged.choices[0].message.content


def test_refusal_part_and_legacy_history_render(client):
    """An assistant refusal part renders as its text; a legacy function_call / function-role history renders as
    the tool-call history it stands for."""
    q = {"role": "user", "content": "Weather?"}
    plain = _greedy(client, [q, {"role": "assistant", "content": "I can't."}, q])
    refusal = _greedy(client, [q, {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]}, q])
    field = _greedy(client, [q, {"role": "assistant", "content": None, "refusal": "I can't."}, q])
    assert refusal.usage.prompt_tokens == field.usage.prompt_tokens == plain.usage.prompt_tokens
    args = '{"city": "Paris", "unit": "c"}'
    modern = [q, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "21"}]
    legacy = [q, {"role": "assistant", "content": None, "function_call": {"name": "get_weather", "arguments": args}},
              {"role": "function", "name": "get_weather", "content": "21"}]
    a = _greedy(client, modern, tools=[WEATHER])
    b = _greedy(client, legacy, functions=[WEATHER["function"]])
    assert a.usage.prompt_tokens == b.usage.prompt_tokens
    assert a.choices[0].message.content == b.choices[0].message.content


def test_no_tool_calls_key_without_calls(server):
    body = {"model": "moepipe", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0,
            "tools": [WEATHER], "tool_choice": "none"}
    for extra in ({}, {"tools": [WEATHER], "tool_choice": "auto"}):
        r = httpx.post(server.url + "/v1/chat/completions", json={**body, **extra}, timeout=60, verify=False).json()
        assert r["choices"][0]["finish_reason"] == "length"
        assert "tool_calls" not in r["choices"][0]["message"] and "function_call" not in r["choices"][0]["message"]
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60,
                      verify=False) as r:
        deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.iter_lines()
                  if line.startswith("data: {")]
    assert deltas and all("tool_calls" not in d and "function_call" not in d for d in deltas)


def test_logit_bias_bans_and_forces_tokens(client, tok):
    """Cluster path (SamplingSpec to the last stage): -100 on the greedy token changes the greedy answer and the
    token never appears; +100 on a token makes it the answer. Logprobs stay those of the raw logits."""
    prompt = "def add(a, b):"
    base = client.completions.create(model="moepipe", prompt=prompt, max_tokens=8, temperature=0, logprobs=0)
    first = tok.encode(prompt + base.choices[0].text)[len(tok.encode(prompt))]
    banned_text = tok.token_bytes(first).decode("utf-8", "backslashreplace")
    assert base.choices[0].logprobs.tokens[0] == banned_text
    ban = client.completions.create(model="moepipe", prompt=prompt, max_tokens=8, temperature=0, logprobs=0,
                                    logit_bias={str(first): -100})
    assert ban.choices[0].text != base.choices[0].text and banned_text not in ban.choices[0].logprobs.tokens
    forced = client.completions.create(model="moepipe", prompt=prompt, max_tokens=3, temperature=0, logprobs=0,
                                       logit_bias={"289": 100})
    assert forced.choices[0].text == tok.decode([289] * 3)
    assert forced.choices[0].logprobs.token_logprobs[0] < -0.01       # raw: the bias is not in the logprob


def test_logit_bias_under_structured_output(client, tok):
    """The grammar mask wins: +100 on "f" cannot open the reply (only "{" may), but inside the allowed set the bias
    decides true/false (the bias goes on every token that can start that value, with or without the space)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "b", "schema": BOOL}}
    starts = {False: ("f", " f"), True: ("t", "tr", " t", " tr", " true")}
    for value, texts in starts.items():
        ids = [tok.encode(t) for t in texts]
        assert all(len(i) == 1 for i in ids), ids
        bias = {str(i[0]): 100 for i in ids}
        r = _greedy(client, [{"role": "user", "content": "ok?"}], max_tokens=20, response_format=fmt,
                    logit_bias=bias)
        assert r.choices[0].finish_reason == "stop"
        assert json.loads(r.choices[0].message.content) == {"ok": value}


def _call_or_json(choice, schema) -> str:
    """Either a valid call (content empty, finish tool_calls) or schema-valid JSON content (finish stop)."""
    msg = choice.message
    if msg.tool_calls:
        assert choice.finish_reason == "tool_calls" and not msg.content
        for call in msg.tool_calls:
            params = {"get_weather": WEATHER, "add": ADD}[call.function.name]["function"]["parameters"]
            jsonschema.validate(json.loads(call.function.arguments), params)
        return "call"
    assert choice.finish_reason == "stop" and msg.tool_calls is None
    jsonschema.validate(json.loads(msg.content), schema)
    return "json"


def test_response_format_with_tools_is_a_call_or_the_json(client, tok):
    """The openai-agents SDK's typed final answer in a tool loop: tools callable and a json_schema. The bias on the
    call tag steers which branch the grammar takes, so both are exercised; streamed equals non-streamed."""
    tag = str(tok.token_to_id("<tool_call>"))
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMAS[0], "strict": True}}
    kw = dict(tools=[WEATHER, ADD], response_format=fmt, max_tokens=80, seed=21)
    asks = {"call": dict(logit_bias={tag: 100}), "json": dict(logit_bias={tag: -100}),
            "streamed": dict(logit_bias={tag: -100}, stream=True),
            "seed0": dict(seed=0), "seed1": dict(seed=1),                       # unsteered
            "forced": dict(tool_choice="required", logit_bias={tag: -100})}     # the grammar overrides the bias

    def ask(extra):
        r = _chat(client, **{**kw, **extra})
        return _assemble(r) if extra.get("stream") else r.choices[0]

    with ThreadPoolExecutor(len(asks)) as pool:          # at once: they share steps
        got = dict(zip(asks, pool.map(ask, asks.values())))
    assert _call_or_json(got["call"], SCHEMAS[0]) == "call"
    assert _call_or_json(got["json"], SCHEMAS[0]) == "json"
    calls, content, _, finish = got["streamed"]
    assert not calls and finish == "stop" and content == got["json"].message.content
    for seed in ("seed0", "seed1"):                      # whichever branch, it is well-formed
        _call_or_json(got[seed], SCHEMAS[0])
    assert _call_or_json(got["forced"], SCHEMAS[0]) == "call"


def test_allowed_tools(client, tok):
    tag = str(tok.token_to_id("<tool_call>"))
    only_add = {"type": "function", "function": {"name": "add"}}
    for mode in ("required", "auto"):
        choice = {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": [only_add]}}
        for seed in range(2 if mode == "required" else 1):
            r = _chat(client, tools=[WEATHER, ADD], tool_choice=choice, seed=seed, max_tokens=80,
                      logit_bias={tag: 100} if mode == "auto" else None)
            assert r.choices[0].finish_reason == "tool_calls"
            assert {c.function.name for c in r.choices[0].message.tool_calls} == {"add"}
    choice = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [only_add]}}
    r = _chat(client, tools=[WEATHER, ADD], tool_choice=choice, seed=3, max_tokens=12, logit_bias={tag: -100})
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None


def test_legacy_functions_are_tools(client):
    kw = dict(functions=[WEATHER["function"], ADD["function"]], function_call={"name": "get_weather"}, seed=8,
              max_tokens=80)
    r = _chat(client, **kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "function_call" and msg.tool_calls is None and not msg.content
    assert msg.function_call.name == "get_weather"
    jsonschema.validate(json.loads(msg.function_call.arguments), WEATHER["function"]["parameters"])
    name, args, finish = None, "", None
    for ch in _chat(client, stream=True, **kw):
        if ch.choices:
            d = ch.choices[0].delta
            assert not d.tool_calls
            if d.function_call:
                name = name or d.function_call.name
                args += d.function_call.arguments or ""
            finish = ch.choices[0].finish_reason or finish
    assert (name, args, finish) == ("get_weather", msg.function_call.arguments, "function_call")
    plain = _chat(client, functions=[WEATHER["function"]], function_call="none", max_tokens=4, seed=1)
    assert plain.choices[0].message.content and plain.choices[0].message.function_call is None


def test_disjoint_one_of_is_honoured(client):
    schema = {"type": "object", "properties": {"v": {"oneOf": [I, {"type": "string", "maxLength": 4}]}},
              "required": ["v"]}
    for seed in range(3):
        r = _chat(client, seed=seed, response_format={"type": "json_schema",
                                                      "json_schema": {"name": "o", "schema": schema}})
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)   # jsonschema checks oneOf exactly


def test_n_choices(client):
    kw = dict(messages=[{"role": "user", "content": "Say something."}], max_tokens=8, n=3)
    hot = client.chat.completions.create(model="moepipe", temperature=1.0, seed=42, **kw)
    assert [c.index for c in hot.choices] == [0, 1, 2]
    texts = [c.message.content for c in hot.choices]
    assert len(set(texts)) == 3
    assert hot.usage.completion_tokens == 3 * 8
    one = client.chat.completions.create(model="moepipe", temperature=1.0, seed=42,
                                         **{**kw, "n": 1})
    assert one.choices[0].message.content == texts[0]                 # choice j draws with seed + j
    assert one.usage.prompt_tokens == hot.usage.prompt_tokens        # the prompt counts once
    again = client.chat.completions.create(model="moepipe", temperature=1.0, seed=42, **kw)
    assert [c.message.content for c in again.choices] == texts
    cold = client.chat.completions.create(model="moepipe", temperature=0, **kw)
    assert len({c.message.content for c in cold.choices}) == 1
    streamed: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for ch in client.chat.completions.create(model="moepipe", temperature=1.0, seed=42, stream=True,
                                             stream_options={"include_usage": True}, **kw):
        for c in ch.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
        if ch.usage:
            assert ch.usage.completion_tokens == 24
    assert [streamed[i] for i in range(3)] == texts and set(finishes) == {0, 1, 2}


def test_completions_prompt_list_with_n(client, tok):
    prompts = ["def add(a, b):", "The quick brown fox"]
    alone = [client.completions.create(model="moepipe", prompt=p, max_tokens=6, temperature=0) for p in prompts]
    singles = [a.choices[0].text for a in alone]
    r = client.completions.create(model="moepipe", prompt=prompts, n=2, max_tokens=6, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]                # prompt_i * n + j
    assert [c.text for c in r.choices] == [singles[0]] * 2 + [singles[1]] * 2
    assert r.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts) == sum(a.usage.prompt_tokens
                                                                                   for a in alone)
    assert r.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
    ids = client.completions.create(model="moepipe", prompt=[tok.encode(p) for p in prompts], max_tokens=6,
                                    temperature=0, stream=True)
    texts: dict[int, str] = {}
    for ch in ids:
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[0], texts[1]] == singles


def _gauge(url: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(url + "/metrics", verify=False).text.splitlines()
               if line.startswith(name + " "))


def test_n_stream_disconnect_cancels_every_choice(server):
    """All three choices run (three slots held) until the client leaves; then every one is freed at once, long
    before 3 x 1500 tokens could have been generated."""
    body = {"model": "moepipe", "messages": [{"role": "user", "content": "go"}], "max_tokens": 1500, "n": 3,
            "stream": True, "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60, verify=False) as r:
        lines = r.iter_lines()
        seen: set[int] = set()
        for _ in range(300):           # chunks interleave as the choices' micro-batches run (plan-ahead: unevenly)
            line = next(lines)
            if line.startswith("data: {"):
                seen.add(json.loads(line[6:])["choices"][0]["index"])
            if seen == {0, 1, 2}:
                break
        assert seen == {0, 1, 2}
        assert _gauge(server.url, "moepipe_state_slots_used") == 3
    deadline = time.time() + 3
    while time.time() < deadline and (_gauge(server.url, "moepipe_state_slots_used")
                                      or _gauge(server.url, "moepipe_kv_blocks_used")):
        time.sleep(0.05)
    assert _gauge(server.url, "moepipe_state_slots_used") == 0 == _gauge(server.url, "moepipe_kv_blocks_used")


def test_a_stop_string_inside_call_arguments_is_no_finished_call(server, client):
    """A stop string that cuts a forced call's arguments: the call is returned as far as it got, but the finish
    reason is "stop", never "tool_calls" (which promises arguments that parse), streamed or not; on /v1/responses
    the function_call item is "incomplete"."""
    tool = {"type": "function", "function": {"name": "run", "parameters": {
        "type": "object", "properties": {"cmd": {"enum": ["ls", "pwd"]}}, "required": ["cmd"],
        "additionalProperties": False}}}
    kw = dict(model="moepipe", messages=[{"role": "user", "content": "ls"}], tools=[tool], tool_choice="required",
              max_tokens=60, temperature=0)
    whole = client.chat.completions.create(**kw, stop=["cmd"])
    calls = whole.choices[0].message.tool_calls or []
    assert whole.choices[0].finish_reason == "stop" and len(calls) == 1 and "cmd" not in calls[0].function.arguments
    with pytest.raises(json.JSONDecodeError):
        json.loads(calls[0].function.arguments)
    chunks = list(client.chat.completions.create(**kw, stop=["cmd"], stream=True))
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    intact = client.chat.completions.create(**kw)     # without the stop string the same call's arguments close
    assert json.loads(intact.choices[0].message.tool_calls[0].function.arguments)["cmd"] in ("ls", "pwd")
    r = httpx.post(server.url + "/v1/responses", timeout=60, verify=False, json={
        "model": "moepipe", "input": "ls", "tools": [{"type": "function", **tool["function"]}], "tool_choice": "required",
        "max_output_tokens": 60, "temperature": 0, "stop": ["cmd"]}).json()
    assert [(o["type"], o["status"]) for o in r["output"]] == [("function_call", "incomplete")]


def test_reasoning_effort_none_switches_thinking_off(thinking_server):
    """Chat's `reasoning_effort: "none"` is the same switch as on /v1/responses: the prompt of enable_thinking
    false, all content; another effort keeps the template's default (thinking on here); "none" with
    enable_thinking true is a 400 naming reasoning_effort."""
    off = _chat(thinking_server, max_tokens=8, seed=4, reasoning_effort="none")
    plain = _chat(thinking_server, max_tokens=8, seed=4,
                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    default = _chat(thinking_server, max_tokens=8, seed=4, reasoning_effort="high")
    assert off.usage.prompt_tokens == plain.usage.prompt_tokens != default.usage.prompt_tokens
    assert off.choices[0].message.content == plain.choices[0].message.content
    assert default.choices[0].message.reasoning_content and not default.choices[0].message.content
    with pytest.raises(BadRequestError) as e:
        _chat(thinking_server, max_tokens=8, reasoning_effort="none",
              extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert e.value.body["param"] == "reasoning_effort"


@pytest.mark.parametrize("sampled", [False, True])
def test_min_tokens_holds_back_stop_tokens_and_strings(client, tok, sampled):
    """vLLM's min_tokens: with +100 on EOS every reply would end at once; with min_tokens 3 the stop ids are not
    sampled before the third token, so EOS comes fourth (usage counts it); a stop string is not matched in those
    tokens either. min_tokens above max_tokens is a 400 naming it. (It was accepted and silently ignored.)"""
    eos = str(tok.eos_token_ids[0])
    kw = dict(model="moepipe", prompt="def add(a, b):", max_tokens=12, logit_bias={eos: 100},
              **({"temperature": 0.9, "seed": 3} if sampled else {"temperature": 0}))
    assert client.completions.create(**kw).usage.completion_tokens == 1
    held = client.completions.create(**kw, extra_body={"min_tokens": 3})
    assert held.usage.completion_tokens == 4 and held.choices[0].finish_reason == "stop"
    plain = dict(kw, logit_bias=None)
    first = client.completions.create(**plain).choices[0].text[:1]        # a stop string the first token holds
    assert first
    assert client.completions.create(**plain, stop=[first]).usage.completion_tokens == 1
    assert client.completions.create(**plain, stop=[first], extra_body={"min_tokens": 3}).usage.completion_tokens >= 4
    with pytest.raises(BadRequestError) as e:
        client.completions.create(**kw, extra_body={"min_tokens": 13})
    assert e.value.body["param"] == "min_tokens"
    with pytest.raises(BadRequestError) as e:       # more than the context leaves (no max_tokens: it was lowered)
        client.chat.completions.create(model="moepipe", messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"min_tokens": 10**6})
    assert e.value.body["param"] == "min_tokens"
