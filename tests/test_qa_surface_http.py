"""The HTTP surface as a vLLM user meets it, probed against a real served cluster (`moepipe serve`'s launcher: the
gateway and one stage worker, each its own process, on the tiny checkpoint with a 128-token context) through the
`openai` client and raw httpx. Each test is a bug found that way and fails without its fix."""

from __future__ import annotations

import httpx
import openai
import pytest

from conftest import OpenAI, free_port

MODEL = "moepipe"
MAX_LEN = 128
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    from gateway.launcher import Cluster, ServeOptions

    opts = ServeOptions(model=tiny_checkpoint, stages=1, port=free_port(),
                        extra={"max_model_len": MAX_LEN, "access_log": False, "ple_service": False})
    with Cluster(opts) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="x", timeout=120, max_retries=0)


def post(server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=120, **kw)


def error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    return err


def chat_prompt_tokens(server, messages) -> int:
    r = post(server, "/tokenize", {"messages": messages})
    assert r.status_code == 200, r.text
    return r.json()["count"]


# ---- prompt + max_tokens past the context: vLLM's (and OpenAI's) 400, not a silent clamp ------------------------

@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_chat_output_past_the_context_is_a_400_naming_both_numbers(server, client, field):
    """prompt + max_tokens > max_model_len was served with max_tokens lowered to what fit (llama.cpp's rule); vLLM
    answers 400 naming the field, the prompt's tokens and the context length. What fits exactly is served."""
    prompt = chat_prompt_tokens(server, HI)
    room = MAX_LEN - prompt
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=HI, **{field: room + 1})
    err = e.value.body
    assert err["param"] == field and err["code"] == "context_length_exceeded", err
    for number in (room + 1, prompt, MAX_LEN, room):
        assert str(number) in err["message"], err
    r = post(server, "/v1/chat/completions", {"messages": HI, field: room, "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == room


def test_completions_explicit_max_tokens_past_the_context_is_a_400_its_default_is_cut(server):
    ids = [100] * (MAX_LEN - 4)
    err = error(post(server, "/v1/completions", {"prompt": ids, "max_tokens": 5}), 400, "max_tokens")
    assert err["code"] == "context_length_exceeded" and str(MAX_LEN - 4) in err["message"]
    # the legacy default of 16 tokens was not asked for: cut to the 4 that fit, as before
    r = post(server, "/v1/completions", {"prompt": ids, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4 and r.json()["choices"][0]["finish_reason"] == "length"
    r = post(server, "/v1/completions", {"prompt": ids, "max_tokens": None, "ignore_eos": True})   # null: the rest
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text


def test_responses_max_output_tokens_past_the_context_names_max_output_tokens(server):
    err = error(post(server, "/v1/responses", {"input": "hi", "max_output_tokens": MAX_LEN}), 400,
                "max_output_tokens")
    assert "max_completion_tokens" not in err["message"] and "max_output_tokens" in err["message"], err


def test_truncate_prompt_tokens_minus_one_leaves_room_for_max_tokens(server):
    """vLLM's -1 keeps what the context leaves after max_tokens; it kept the whole context length, so any
    max_tokens then failed. A k that leaves no room for max_tokens is a 400 naming truncate_prompt_tokens."""
    ids = [100] * (2 * MAX_LEN)
    r = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 10, "truncate_prompt_tokens": -1,
                                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (MAX_LEN - 10, 10), usage
    error(post(server, "/v1/completions", {"prompt": ids, "max_tokens": 10, "truncate_prompt_tokens": MAX_LEN - 5}),
          400, "truncate_prompt_tokens")


# ---- routes a vLLM or OpenAI client calls ----------------------------------------------------------------------

def test_ping_answers_as_health_on_get_and_post(server):
    """vLLM serves /ping (GET and POST, SageMaker's probe) as /health; it was a 404."""
    for method in ("GET", "POST"):
        r = httpx.request(method, server.url + "/ping", timeout=30)
        assert r.status_code == 200 and r.json() == {"status": "ok"}, (method, r.text)


def test_model_cards_carry_vllm_s_fields(server, client):
    """vLLM's model card has root (the checkpoint's path), parent and permission beside max_model_len; they were
    missing."""
    for card in (httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0],
                 httpx.get(server.url + f"/v1/models/{MODEL}", timeout=30).json()):
        assert card["root"] == str(server.cluster.model) and card["parent"] is None and card["max_model_len"] == MAX_LEN, card
        perm = card["permission"]
        assert len(perm) == 1 and perm[0]["object"] == "model_permission" and perm[0]["allow_sampling"] is True
    assert client.models.list().data[0].id == MODEL


def test_responses_input_tokens_counts_the_prompt_the_response_would_get(server, client):
    """OpenAI's POST /v1/responses/input_tokens was a 405 (the retrieve route's path matched it): it counts the
    prompt /v1/responses renders (instructions and tools included), which the response's usage confirms."""
    body = {"model": MODEL, "input": "hi", "instructions": "Be brief."}
    counted = client.responses.input_tokens.count(**body)
    assert counted.object == "response.input_tokens" and counted.input_tokens > 0
    served = client.responses.create(**body, max_output_tokens=1)
    assert served.usage.input_tokens == counted.input_tokens
    plain = client.responses.input_tokens.count(model=MODEL, input="hi")
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}]
    with_tools = client.responses.input_tokens.count(**body, tools=tools)      # (past this 128-token context)
    assert plain.input_tokens < counted.input_tokens < with_tools.input_tokens
    error(post(server, "/v1/responses/input_tokens", {"input": "hi", "previous_response_id": "resp_1"}), 400,
          "previous_response_id")


@pytest.mark.parametrize("method, path", [("POST", "/v1/responses/resp_1/cancel"),
                                          ("GET", "/v1/responses/resp_1/input_items"),
                                          ("GET", "/v1/responses/resp_1"), ("DELETE", "/v1/responses/resp_1")])
def test_stored_response_routes_are_a_404_saying_nothing_is_stored(server, method, path):
    """cancel and input_items were a bare 'Not Found' (no route): they name the id and why, as retrieve does."""
    err = error(httpx.request(method, server.url + path, timeout=30), 404, "response_id")
    assert "resp_1" in err["message"] and "not stored" in err["message"] and err["code"] == "not_found"


def test_responses_compact_is_a_clear_404(server):
    """POST /v1/responses/compact was a 405 'Method Not Allowed' (as if GET would work)."""
    err = error(post(server, "/v1/responses/compact", {"input": "hi"}), 404, None)
    assert "compact" in err["message"] and err["code"] == "not_found"


# ---- structured-output errors name the field the client sent -----------------------------------------------------

BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": "x"}}}


@pytest.mark.parametrize("extra, param", [
    ({"guided_json": BAD_SCHEMA}, "guided_json"),
    ({"structured_outputs": {"json": BAD_SCHEMA}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
def test_a_constraint_the_grammar_engine_refuses_names_the_field_sent(server, path, extra, param):
    """A guided_json schema llguidance refuses was a 400 naming response_format.json_schema.schema on chat (and
    text.format.schema on /v1/responses), fields the client never sent; a structured_outputs regex was named
    guided_regex."""
    prompt = {"/v1/chat/completions": {"messages": HI}, "/v1/completions": {"prompt": "hi"},
              "/v1/responses": {"input": "hi"}}[path]
    err = error(post(server, path, {**prompt, **extra}), 400, param)
    assert "Cannot enforce" in err["message"], err


def test_a_bad_text_format_schema_still_names_text_format_schema(server):
    error(post(server, "/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "s",
                                                                            "schema": BAD_SCHEMA}}}),
          400, "text.format.schema")
    error(post(server, "/v1/chat/completions", {"messages": HI, "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": BAD_SCHEMA}}}), 400,
        "response_format.json_schema.schema")


# ---- chat request shapes ----------------------------------------------------------------------------------------

def test_audio_output_is_refused_not_silently_dropped(server):
    """modalities ["text", "audio"] (with `audio`) was answered 200 with text alone; the model writes text only."""
    err = error(post(server, "/v1/chat/completions", {"messages": HI, "max_tokens": 1,
                                                      "modalities": ["text", "audio"],
                                                      "audio": {"voice": "alloy", "format": "wav"}}), 400,
                "modalities")
    assert "'audio'" in err["message"] and "text only" in err["message"]
    error(post(server, "/v1/chat/completions", {"messages": HI, "max_tokens": 1, "audio": {"voice": "alloy"}}), 400,
          "audio")
    r = post(server, "/v1/chat/completions", {"messages": HI, "max_tokens": 1, "modalities": ["text"]})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                                  {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
                                  {"type": "file", "file": {"file_id": "file-1"}}])
def test_media_parts_are_a_400_naming_the_part_and_saying_text_only(server, part):
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}]
    err = error(post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1}), 400,
                "messages[0].content[1]")
    assert repr(part["type"]) in err["message"] and "text only" in err["message"], err


def test_openai_request_shapes_are_served(client):
    """What OpenAI's API accepts and a text model can honour: text parts, developer and named messages, an assistant
    turn of tool calls with null content and its tool result (no tools offered: a tools section would pass this
    128-token context), and the fields that need nothing of the server."""
    messages = [{"role": "developer", "content": "Be brief.", "name": "ops"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}],
                 "name": "bob"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "ok"}]}]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=2, reasoning_effort="low",
        metadata={"k": "v"}, store=False, service_tier="auto", parallel_tool_calls=False,
        prediction={"type": "content", "content": "x"}, modalities=["text"], user="u", seed=1)
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_unknown_routes_and_wrong_methods_say_which(server):
    """A typo'd path or a GET on a POST route was answered "Not Found" / "Method Not Allowed" alone: the message
    names the method and path (OpenAI's "Invalid URL (...)") and, for a wrong method, the ones the route takes."""
    err = error(httpx.get(server.url + "/v1/chat/completion", timeout=30), 404, None)
    assert "GET /v1/chat/completion" in err["message"], err
    r = httpx.get(server.url + "/v1/chat/completions", timeout=30)
    err = error(r, 405, None)
    assert "GET /v1/chat/completions" in err["message"] and "POST" in err["message"] and r.headers["allow"] == "POST"
    err = error(httpx.get(server.url + "/v1/models/nope", timeout=30), 404, "model")     # a route's own 404 stays
    assert "nope" in err["message"]


def test_min_tokens_past_max_completion_tokens_names_the_field_sent(server):
    err = error(post(server, "/v1/chat/completions", {"messages": HI, "max_completion_tokens": 2, "min_tokens": 3}),
                400, "min_tokens")
    assert "max_completion_tokens (2)" in err["message"], err
    err = error(post(server, "/v1/responses", {"input": "hi", "max_output_tokens": 2, "min_tokens": 3}), 400,
                "min_tokens")
    assert "max_output_tokens (2)" in err["message"] and "max_completion_tokens" not in err["message"], err
