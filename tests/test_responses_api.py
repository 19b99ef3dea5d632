"""The Responses API (`POST /v1/responses`) end to end: `moepipe serve --stages 2` (real processes, sockets on
127.0.0.1) on the random tiny model, driven by the official `openai` client. The route is a translation around the
chat path, so a Responses request and its chat equivalent must give the same prompt tokens and, greedy, the same
text; structured output and forced calls are enforced by token masks, so even random weights produce JSON that
validates. Plus pure tests of the translation (input items -> messages, parser deltas -> events)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai import BadRequestError
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from conftest import OpenAI, small_cluster, thinking_cluster
from gateway.output_parser import Delta
from gateway.responses import ResponseBuilder, input_messages, responses_param
from gateway.schemas import ResponsesRequest
from shared.sampling import SamplingParams

I = {"type": "integer", "minimum": 0, "maximum": 999}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                           "unit": {"enum": ["c", "f"]}},
                          "required": ["city", "unit"]}, "strict": True}
ADD = {"type": "function", "name": "add",
       "parameters": {"type": "object", "properties": {"a": I, "b": I}, "required": ["a", "b"]}}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "age": I},
          "required": ["name", "age"]}
JSON_FORMAT = {"format": {"type": "json_schema", "name": "person", "schema": SCHEMA, "strict": True}}


def chat_tool(tool: dict) -> dict:
    return {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}}


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    return small_cluster(tiny_checkpoint)       # shared with the "api" group's files (conftest.SHARED_GROUPS)


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="x", timeout=120, max_retries=0)


def raw(server, **body) -> httpx.Response:
    return httpx.post(server.url + "/v1/responses", json={"model": "moepipe", **body}, timeout=120, verify=False)


def greedy_chat(client: OpenAI, messages: list, **kw):
    return client.chat.completions.create(model="moepipe", messages=messages, temperature=0, **kw)


# ---- served ---------------------------------------------------------------------------------------------------

def test_string_input_is_the_chat_answer(server, client):
    r = client.responses.create(model="moepipe", input="Hello there", max_output_tokens=8, temperature=0)
    chat = greedy_chat(client, [{"role": "user", "content": "Hello there"}], max_tokens=8)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "moepipe"
    assert [item.type for item in r.output] == ["message"]
    msg = r.output[0]
    assert msg.id.startswith("msg_") and msg.role == "assistant" and msg.content[0].type == "output_text"
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens == 8
    assert r.usage.total_tokens == r.usage.input_tokens + 8 and r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.temperature == 0 and r.parallel_tool_calls is True and r.tools == [] and r.tool_choice == "auto"
    body = raw(server, input="Hello there", max_output_tokens=8, temperature=0).json()
    Response.model_validate(body)                      # the client's pydantic model, validating (not construct)
    assert body["output"][0]["content"][0]["text"] == r.output_text


def test_list_input_with_instructions_and_developer(client):
    items = [{"role": "developer", "content": "Be brief."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]}]
    r = client.responses.create(model="moepipe", instructions="You are terse.", input=items, max_output_tokens=6,
                                temperature=0)
    chat = greedy_chat(client, [{"role": "system", "content": "You are terse."},
                                {"role": "developer", "content": "Be brief."},
                                {"role": "user", "content": "Weather in Paris?"}], max_tokens=6)
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.output_text == chat.choices[0].message.content
    assert r.instructions == "You are terse."


def _forced_call(client: OpenAI, tool_choice, seed: int):
    r = client.responses.create(model="moepipe", input="Weather in Paris?", tools=[WEATHER, ADD],
                                tool_choice=tool_choice, parallel_tool_calls=False, max_output_tokens=120,
                                extra_body={"seed": seed})
    assert r.status == "completed"
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and not r.output_text, r.output
    call = calls[0]
    assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.status == "completed"
    schema = {"get_weather": WEATHER, "add": ADD}[call.name]["parameters"]
    jsonschema.validate(json.loads(call.arguments), schema)
    return r, call


def test_forced_tool_call_is_a_function_call_item(client):
    _, call = _forced_call(client, "required", seed=7)
    assert call.name in ("get_weather", "add")
    _, named = _forced_call(client, {"type": "function", "name": "add"}, seed=7)
    assert named.name == "add"


def test_tool_round_trip(client):
    """call -> function_call + function_call_output fed back -> a message answer; the history renders as the
    chat history it stands for (same prompt tokens)."""
    first, call = _forced_call(client, {"type": "function", "name": "get_weather"}, seed=11)
    output = json.dumps({"temp": 21})
    items = [{"role": "user", "content": "Weather in Paris?"}, call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": output}]
    final = client.responses.create(model="moepipe", input=items, tools=[WEATHER], tool_choice="none",
                                    max_output_tokens=8, temperature=0)
    assert [item.type for item in final.output] == ["message"] and final.output_text
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": call.call_id, "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments}}]},
               {"role": "tool", "tool_call_id": call.call_id, "content": output}]
    chat = greedy_chat(client, history, tools=[chat_tool(WEATHER)], tool_choice="none", max_tokens=8)
    assert final.usage.input_tokens == chat.usage.prompt_tokens
    assert final.output_text == chat.choices[0].message.content
    # The first response's output items, fed back as they are (what the SDK does), work the same way.
    again = client.responses.create(model="moepipe", input=[items[0], *[o.model_dump() for o in first.output],
                                                             items[2]],
                                    tools=[WEATHER], tool_choice="none", max_output_tokens=8, temperature=0)
    assert again.output_text == final.output_text


def test_json_schema_output_validates(client):
    r = client.responses.create(model="moepipe", input="Fill it in.", text=JSON_FORMAT, max_output_tokens=80,
                                extra_body={"seed": 3})
    assert r.status == "completed" and r.incomplete_details is None
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    assert r.text.format.type == "json_schema"


def test_stream_helper_events_in_order(client):
    kw = dict(model="moepipe", input="Fill it in.", text=JSON_FORMAT, max_output_tokens=80, extra_body={"seed": 4})
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas
    head = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done",
            "response.completed"]
    assert types == head + ["response.output_text.delta"] * len(deltas) + tail
    item_id = events[2].item.id
    assert all(d.item_id == item_id and d.output_index == 0 and d.content_index == 0 for d in deltas)
    text = "".join(d.delta for d in deltas)
    assert text == events[-4].text == final.output_text
    jsonschema.validate(json.loads(text), SCHEMA)
    assert final.status == "completed" and final.output[0].id == item_id and final.usage.output_tokens > 0
    assert client.responses.create(**kw).output_text == text          # seeded: non-streamed is the same reply


def test_streamed_tool_call(client):
    kw = dict(model="moepipe", input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
              parallel_tool_calls=False, max_output_tokens=120, extra_body={"seed": 9})
    events = list(client.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == events[-3].arguments == events[-2].item.arguments
    done = events[-1].response.output[0]
    assert done.type == "function_call" and done.arguments == args and done.name == "get_weather"
    full = client.responses.create(**kw)
    assert full.output[0].arguments == args


def test_raw_stream_is_typed_sse(server):
    """Every SSE event is `event: <type>` + `data: <json>` of that type, and validates (strictly) as the client's
    ResponseStreamEvent union; there is no [DONE] line (the Responses stream ends with its terminal event)."""
    adapter = TypeAdapter(ResponseStreamEvent)
    body = {"model": "moepipe", "input": "Weather?", "tools": [WEATHER], "tool_choice": "required", "stream": True,
            "max_output_tokens": 120, "seed": 2}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=120, verify=False) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert len(lines) % 2 == 0 and "[DONE]" not in "".join(lines)
    for kind, data in zip(lines[::2], lines[1::2]):
        event = adapter.validate_python(json.loads(data.removeprefix("data: ")))
        assert kind == f"event: {event.type}"
    assert event.type == "response.completed" and event.response.output[0].type == "function_call"


def test_max_output_tokens_is_incomplete(client):
    r = client.responses.create(model="moepipe", input="Tell me a story.", max_output_tokens=5, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5 and r.output[0].status == "incomplete" and r.max_output_tokens == 5
    events = list(client.responses.create(model="moepipe", input="Tell me a story.", max_output_tokens=5,
                                          temperature=0, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text


def test_harmless_sdk_fields_are_accepted(server):
    """What the openai-agents SDK and other clients send alongside (store, include, truncation, metadata, ...)."""
    r = raw(server, input="hi", max_output_tokens=3, store=True, include=["reasoning.encrypted_content"],
            truncation="disabled", metadata={"k": "v"}, user="u", service_tier="auto", prompt_cache_key="p",
            reasoning={"effort": "medium"}, stream_options={"include_obfuscation": False}, top_k=5, min_p=0.1,
            text={"format": {"type": "text"}, "verbosity": "low"})
    assert r.status_code == 200, r.text
    assert r.json()["metadata"] == {"k": "v"} and r.json()["status"] == "incomplete"


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [WEATHER, {"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[1].type"),
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"input": [{"type": "function_call", "name": "add", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]}, "input[0].output"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"type": "sparkle"}]}, "input[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0].type"),
    ({"input": []}, "input"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
     "text.format.schema"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}}, "tool_choice.type"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"extra_body": {"max_tokens": 5}}, "max_tokens"),
    ({"extra_body": {"n": 2}}, "n"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"include": ["reasoning.encrypted_content", "bogus.value"]}, "include"),
    # a chat field the client never sent was named (messages[1].tool_calls[0].function.name)
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c", "name": "",
                                                      "arguments": "{}"}]}, "input[1].name"),
    # values the response echoes, which the client's Response model then could not validate
    ({"reasoning": {"effort": "ultra"}}, "reasoning.effort"),
    ({"reasoning": {"effort": "low", "summary": "verbose"}}, "reasoning.summary"),
    ({"reasoning": {"mode": 5}}, "reasoning.mode"),
    ({"text": {"format": {"type": "text"}, "verbosity": "loud"}}, "text.verbosity"),
    ({"tools": [{"type": "function", "name": "f", "description": 5}]}, "tools[0].description"),
    ({"tools": [{"type": "function", "name": "f", "strict": "yes"}]}, "tools[0].strict"),
    ({"text": {"format": {"type": "json_schema", "name": 5, "schema": SCHEMA}}}, "text.format.name"),
    ({"text": {"format": {"type": "json_schema", "name": "p", "description": 5, "schema": SCHEMA}}},
     "text.format.description"),
    ({"text": {"format": {"type": "json_schema", "name": "p", "strict": "maybe", "schema": SCHEMA}}},
     "text.format.strict"),
])
def test_bad_inputs_are_400_naming_the_param(client, body, param):
    body.setdefault("input", "hi")
    with pytest.raises(BadRequestError) as e:
        client.responses.create(model="moepipe", **body)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body


def test_chat_path_errors_name_the_responses_budget(client):
    """min_tokens beyond the budget: the message names max_output_tokens (max_tokens is refused on this route)."""
    with pytest.raises(BadRequestError) as e:
        client.responses.create(model="moepipe", input="hi", max_output_tokens=3, extra_body={"min_tokens": 5})
    err = e.value.body
    assert err["param"] == "min_tokens" and "max_output_tokens (3)" in err["message"], err
    assert "max_tokens" not in err["message"].replace("max_output_tokens", ""), err


def test_vllm_structured_output_extras_are_enforced(client):
    """vLLM's guided_* / structured_outputs (extra body) constrain the reply as on chat; they were ignored here
    (a 200 with free text). Beside a text.format other than text they are a 400 naming text.format."""
    for extra, allowed in (({"guided_choice": ["yes", "no"]}, {"yes", "no"}),
                           ({"structured_outputs": {"choice": ["left", "right"]}}, {"left", "right"})):
        r = client.responses.create(model="moepipe", input="Pick one.", max_output_tokens=20,
                                    extra_body={"seed": 5, **extra})
        assert r.status == "completed" and r.output_text in allowed, (extra, r.output_text)
    r = client.responses.create(model="moepipe", input="Fill it in.", max_output_tokens=80,
                                extra_body={"seed": 3, "guided_json": SCHEMA})
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    with pytest.raises(BadRequestError) as e:
        client.responses.create(model="moepipe", input="hi", text={"format": {"type": "json_object"}},
                                extra_body={"guided_regex": "[0-9]+"})
    assert e.value.body["param"] == "text.format", e.value.body


def test_vllm_output_extras_as_on_chat(client):
    """vLLM's output extras were silently dropped here while chat honours or refuses them: include_stop_str_in_output
    keeps the stop string at the end of the text; beam search, bad_words and allowed_token_ids are a 400 naming
    the field."""
    full = client.responses.create(model="moepipe", input="Hello there", max_output_tokens=8, temperature=0)
    text = full.output_text
    stop = text[3:6]
    assert len(stop) == 3
    cut = client.responses.create(model="moepipe", input="Hello there", max_output_tokens=8, temperature=0,
                                  extra_body={"stop": [stop], "include_stop_str_in_output": True})
    assert cut.output_text == text[:text.find(stop) + 3]
    for extra in ({"use_beam_search": True}, {"bad_words": ["x"]}, {"allowed_token_ids": [1, 2]}):
        with pytest.raises(BadRequestError) as e:
            client.responses.create(model="moepipe", input="hi", max_output_tokens=4, extra_body=extra)
        assert e.value.body["param"] == next(iter(extra)), e.value.body


def test_json_schema_without_name_echoes_a_valid_format(server):
    """text.format json_schema without a name is served under "response"; the echo says so, so the body validates
    as the client's Response (whose json_schema format requires a name)."""
    body = raw(server, input="Fill it in.", text={"format": {"type": "json_schema", "schema": SCHEMA}},
               max_output_tokens=40, seed=3).json()
    r = Response.model_validate(body)
    assert r.text.format.type == "json_schema" and r.text.format.name == "response"
    jsonschema.validate(json.loads(r.output_text), SCHEMA)


def test_unknown_model_is_404(server):
    r = raw(server, model="gpt-4o", input="hi")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


@pytest.fixture(scope="module")
def thinking(tiny_checkpoint, tmp_path_factory) -> OpenAI:
    """The tiny checkpoint with a Qwen3-2507-style thinking template (the generation prompt opens the think block,
    so the reply starts inside it; random weights never close it): conftest.thinking_cluster, the one
    tests/test_agents.py uses (shared within the "api" group)."""
    c = thinking_cluster(tiny_checkpoint, tmp_path_factory.mktemp("thinking"))
    return OpenAI(base_url=c.url + "/v1", api_key="x", timeout=120, max_retries=0)


def test_reasoning_item(thinking):
    """Thinking on: the reply is a reasoning item (cut by max_output_tokens: incomplete, no message), its text the
    chat route's reasoning_content, every token a reasoning token; streamed, the reasoning_text deltas make the same
    text. reasoning.effort "none" switches thinking off: the same prompt as enable_thinking false, all content."""
    kw = dict(model="moepipe", input="Why?", max_output_tokens=12, extra_body={"seed": 4})
    r = thinking.responses.create(**kw)
    chat = thinking.chat.completions.create(model="moepipe", messages=[{"role": "user", "content": "Why?"}],
                                            max_tokens=12, seed=4)
    assert r.status == "incomplete" and [o.type for o in r.output] == ["reasoning"]
    item = r.output[0]
    assert item.id.startswith("rs_") and item.status == "incomplete" and item.summary == []
    assert item.content[0].text == chat.choices[0].message.reasoning_content
    assert r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens == 12
    events = list(thinking.responses.create(stream=True, **kw))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == item.content[0].text
    assert events[-1].type == "response.incomplete"
    off = thinking.responses.create(reasoning={"effort": "none"}, **kw)
    plain = thinking.chat.completions.create(model="moepipe", messages=[{"role": "user", "content": "Why?"}],
                                             max_tokens=12, seed=4,
                                             extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert [o.type for o in off.output] == ["message"] and off.output_text == plain.choices[0].message.content
    assert off.usage.input_tokens == plain.usage.prompt_tokens and off.usage.output_tokens_details.reasoning_tokens == 0


# ---- translation, without a server ------------------------------------------------------------------------------

def test_items_render_as_chat_history():
    items = [{"role": "user", "content": "q"},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "r"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a",
                                                                    "annotations": []}]},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "1"}]},
             {"type": "function_call_output", "call_id": "c2", "output": "2"},
             {"role": "assistant", "content": "done"}, {"role": "assistant", "content": "again"}]
    msgs = input_messages(items, "sys")
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "tool", "assistant", "assistant"]
    turn = msgs[2]
    assert turn["reasoning_content"] == "r" and turn["content"] == [{"type": "text", "text": "a"}]
    assert [c["id"] for c in turn["tool_calls"]] == ["c1", "c2"]
    assert msgs[3] == {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "1"}]}
    assert msgs[5]["content"] == "done" and msgs[6]["content"] == "again"


def test_builder_reasoning_then_message_events():
    req = ResponsesRequest.model_validate({"input": "x"})
    b = ResponseBuilder("resp_x", "m", req, SamplingParams(temperature=1.0, top_p=1.0))
    events = b.start() + b.feed([Delta(reasoning="think"), Delta(content="hi")])
    events += b.finish("stop", {"input_tokens": 1, "output_tokens": 2, "total_tokens": 3,
                                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                                "output_tokens_details": {"reasoning_tokens": 1}})
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    final = Response.model_validate(events[-1]["response"])
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == "think" and final.output_text == "hi"


def test_param_renames():
    assert responses_param("tools[2].function.name") == "tools[2].name"
    assert responses_param("response_format.json_schema.schema") == "text.format.schema"
    assert responses_param("tool_choice.allowed_tools.tools[0]") == "tool_choice.tools[0]"
    assert responses_param("messages") == "input"


def test_builder_empty_and_cut_replies():
    """A completed reply with no text and no calls still has a (empty) message; a reply cut while thinking is the
    reasoning item alone, incomplete."""
    req = ResponsesRequest.model_validate({"input": "x"})
    usage = {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2,
             "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
             "output_tokens_details": {"reasoning_tokens": 0}}
    empty = ResponseBuilder("resp_e", "m", req, SamplingParams())
    empty.finish("stop", usage)
    out = Response.model_validate(empty.response())
    assert out.status == "completed" and [o.type for o in out.output] == ["message"] and out.output_text == ""
    cut = ResponseBuilder("resp_c", "m", req, SamplingParams())
    cut.feed([Delta(reasoning="hmm")])
    cut.finish("length", usage)
    out = Response.model_validate(cut.response())
    assert out.status == "incomplete" and [(o.type, o.status) for o in out.output] == [("reasoning", "incomplete")]


class _FailingEngine:
    """Fails with `fail` after `after` tokens (0: before the first one)."""

    max_model_len = 256

    def __init__(self, fail: BaseException, after: int) -> None:
        self.fail, self.after = fail, after

    async def generate(self, request):
        from shared.engine_core import TokenEvent

        for i in range(request.params.max_tokens):
            if i == self.after:
                raise self.fail
            yield TokenEvent(token_id=100 + i, finish_reason=None)

    closing = None                       # the Engine protocol's: not stopping

    def health(self) -> list[str]:
        return []


def _stub_client(tiny_checkpoint, engine):
    from fastapi.testclient import TestClient

    from gateway.api import create_app
    from gateway.metrics import Metrics
    from shared.tokenizer import Tokenizer
    from shared.sampling import read_generation_config

    app = create_app(engine, Tokenizer.from_dir(tiny_checkpoint), model_name="moepipe",
                     generation_config=read_generation_config(tiny_checkpoint), metrics=Metrics())
    return TestClient(app, raise_server_exceptions=False)


def test_engine_errors(tiny_checkpoint):
    """Before the first token: plain HTTP errors (429, 503), streamed or not; after it, a stream ends with
    response.failed carrying the error and the items so far."""
    from shared.engine_core import EngineFailed, EngineOverloaded, EngineUnavailable

    body = {"model": "moepipe", "input": "hi", "max_output_tokens": 8, "stream": True}
    for fail, status in ((EngineOverloaded("queue full"), 429), (EngineUnavailable("stage-1"), 503)):
        r = _stub_client(tiny_checkpoint, _FailingEngine(fail, 0)).post("/v1/responses", json=body)
        assert r.status_code == status and r.json()["error"]["type"] in ("rate_limit_error",
                                                                         "service_unavailable_error")
    r = _stub_client(tiny_checkpoint, _FailingEngine(EngineFailed("stage 2 died"), 3)).post("/v1/responses",
                                                                                          json=body)
    data = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    last = TypeAdapter(ResponseStreamEvent).validate_python(data[-1])
    assert last.type == "response.failed" and last.response.status == "failed"
    assert "stage 2 died" in last.response.error.message and last.response.error.code == "server_error"
    assert [e["sequence_number"] for e in data] == list(range(len(data)))
    assert last.response.output and last.response.output[-1].status == "incomplete"


def test_retrieving_a_response_is_a_404_saying_none_are_stored(server):
    """GET / DELETE /v1/responses/{id} (the SDK's retrieve and delete): nothing is stored, so an OpenAI-style 404
    that says so, not a bare "Not Found"."""
    for method in ("GET", "DELETE"):
        r = httpx.request(method, server.url + "/v1/responses/resp_123", timeout=30, verify=False)
        assert r.status_code == 404
        err = r.json()["error"]
        assert "not stored" in err["message"] and err["param"] == "response_id"
