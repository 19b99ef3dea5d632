"""Request shapes real OpenAI clients send that the other API tests do not: each test is a bug found by probing the
served cluster (conftest.small_cluster: gateway and two stage workers, each its own process, on the tiny model)
with the official `openai` client and raw httpx, and fails without its fix."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from conftest import OpenAI, small_cluster

MODEL = "moepipe"
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    return small_cluster(tiny_checkpoint)


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="x", timeout=120, max_retries=0)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=120, verify=False)


# ---- structured output ----------------------------------------------------------------------------------------

# zod-to-json-schema's form of `A.and(B)` (TypeScript clients: the Vercel AI SDK's generateObject, Mastra): the
# members are open and the intersection is closed by unevaluatedProperties. Every member sees the whole object, so
# closing each member to its own keys (as plain objects are closed) admitted no object at all: a 400 "unsatisfiable".
INTERSECTION = {"allOf": [{"type": "object", "properties": {"a": DIGIT}, "required": ["a"]},
                          {"type": "object", "properties": {"b": {"enum": ["x", "y"]}}, "required": ["b"]}],
                "unevaluatedProperties": False}


@pytest.mark.parametrize("strict", [False, True])
def test_json_schema_intersection_is_served_and_followed(client, strict):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "ab", "schema": INTERSECTION,
                                                                "strict": strict}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    value = json.loads(choice.message.content)
    jsonschema.Draft202012Validator(INTERSECTION).validate(value)
    assert set(value) == {"a", "b"}


def test_tool_parameters_intersection_is_a_valid_call(client):
    tool = {"type": "function", "function": {"name": "f", "parameters": INTERSECTION}}
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=40,
                                       temperature=0, tools=[tool], tool_choice="required")
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls and calls[0].function.name == "f"
    jsonschema.Draft202012Validator(INTERSECTION).validate(json.loads(calls[0].function.arguments))


def test_json_object_with_tools_is_any_object(server, tiny_checkpoint):
    """response_format json_object beside callable tools (tool_choice auto: a call or the JSON answer) allows any
    object, as json_object alone does; it allowed only `{}` (the answer schema was closed to no properties). A
    bias towards '"' makes the masked sampler open a key wherever one is allowed."""
    from shared.tokenizer import Tokenizer

    quote = Tokenizer.from_dir(tiny_checkpoint).encode('"')
    assert len(quote) == 1
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                          "properties": {"a": DIGIT}}}}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0,
            "response_format": {"type": "json_object"}, "logit_bias": {str(quote[0]): 100}}
    for extra in ({}, {"tools": [tool]}):
        r = post(server, "/v1/chat/completions", {**body, **extra})
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]
        assert "tool_calls" not in message and message["content"].startswith('{"'), (extra, message)


# ---- client mistakes ------------------------------------------------------------------------------------------

def test_deeply_nested_tools_are_a_400(server):
    """A tool schema (or an extra field) nested hundreds of levels deep parses as JSON, but rendering the prompt
    recursed past Python's limit: that was a 500 internal_error; it is the client's mistake, a 400."""
    depth = 300
    schema = '{"type": "object", "properties": {"a": ' * depth + '{"type": "integer"}' + "}}" * depth
    raw = ('{"model": "moepipe", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": '
           '[{"type": "function", "function": {"name": "f", "parameters": %s}}]}' % schema)
    r = httpx.post(server.url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"},
                   timeout=120, verify=False)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert "nested too deeply" in err["message"]
    ok = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_a_prompt_id_past_the_model_s_embedding_is_a_400_and_other_requests_are_served(tiny_checkpoint):
    """A tokenizer that knows more ids than the checkpoint's embedding has rows (`create_app(vocab_size=...)`, the
    served model's config): such an id is refused with the numbers, before a step it would fail for every request
    in it; the server goes on."""
    from conftest import InProcessServer
    from gateway.api import create_app
    from gateway.engine import AsyncEngine
    from gateway.metrics import Metrics
    from shared.sampling import read_generation_config
    from shared.tokenizer import Tokenizer
    from stage_worker.inprocess_executor import local_engine_core

    tok = Tokenizer.from_dir(tiny_checkpoint)
    rows = tok.vocab_size - 40
    core = local_engine_core(tiny_checkpoint, max_model_len=256, max_num_seqs=4)
    app = create_app(AsyncEngine(core), tok, model_name=MODEL, generation_config=read_generation_config(tiny_checkpoint),
                     metrics=Metrics(), vocab_size=rows)
    with InProcessServer(app, core) as url:
        r = httpx.post(url + "/v1/completions", timeout=60, json={"model": MODEL, "prompt": [5, rows + 3],
                                                                  "max_tokens": 2})
        assert r.status_code == 400, r.text
        assert f"Token id {rows + 3} is out of the model's vocabulary (its embedding has {rows} rows" in \
            r.json()["error"]["message"]
        r = httpx.post(url + "/v1/completions", timeout=60, json={"model": MODEL, "prompt": [5, rows - 1],
                                                                  "max_tokens": 2})
        assert r.status_code == 200, r.text


def test_tokenize_detokenize_and_version_as_vllm_serves_them(server, tiny_checkpoint):
    """vLLM's /tokenize (a prompt, or messages rendered as the chat route renders them: the count is the chat's
    prompt_tokens), /detokenize and /version."""
    from shared.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_checkpoint)
    r = post(server, "/tokenize", {"prompt": "Hello pipelines", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tok.encode("Hello pipelines") and body["count"] == len(body["tokens"])
    assert "".join(body["token_strs"]) == "Hello pipelines" and body["max_model_len"] > 0
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a number?"}]
    counted = post(server, "/tokenize", {"messages": messages}).json()["count"]
    chat = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert counted == chat.json()["usage"]["prompt_tokens"]
    assert post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()["count"] < counted
    r = post(server, "/detokenize", {"tokens": body["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": "Hello pipelines"}
    for path, payload, param in (("/tokenize", {"prompt": "x", "messages": messages}, "prompt"),
                                 ("/tokenize", {}, "prompt"), ("/detokenize", {"tokens": [10 ** 9]}, "tokens")):
        r = post(server, path, payload)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    from importlib.metadata import version
    assert httpx.get(server.url + "/version").json() == {"version": version("moepipe")}


# ---- vLLM's structured-output extras ---------------------------------------------------------------------------

def test_vllm_guided_fields_constrain_chat_and_completions(server, client):
    """vLLM clients send guided_choice / guided_regex / guided_json / guided_grammar (or `structured_outputs`)
    through extra_body; they were ignored (200 with free text). Each now constrains the reply; /v1/completions
    takes them and response_format too."""
    import re

    msgs = [{"role": "user", "content": "Pick one."}]

    def reply(**extra):
        r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=24, temperature=0,
                                           extra_body=extra)
        return r.choices[0].message.content

    assert reply(guided_choice=["alpha", "beta gamma"]) in ("alpha", "beta gamma")
    assert reply(structured_outputs={"choice": ["left", "right"]}) in ("left", "right")
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", reply(guided_regex=r"[0-9]{3}-[a-z]{2}"))
    assert reply(guided_grammar='start: "x" ("y" | "yy") "z"') in ("xyz", "xyyz")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    for extra in ({"guided_json": schema}, {"guided_json": json.dumps(schema)}, {"structured_outputs": {"json": schema}}):
        jsonschema.validate(json.loads(reply(**extra)), schema)
    r = client.completions.create(model=MODEL, prompt="The answer:", max_tokens=12, temperature=0,
                                  extra_body={"guided_choice": [" yes", " no"]})
    assert r.choices[0].text in (" yes", " no")
    r = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=16, temperature=0,
                                  extra_body={"response_format": {"type": "json_schema",
                                                                  "json_schema": {"name": "s", "schema": schema}}})
    jsonschema.validate(json.loads(r.choices[0].text), schema)


@pytest.mark.parametrize("extra,param", [
    ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"structured_outputs": {"jsonn": {}}}, "structured_outputs.jsonn"),
    ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "response_format"),
    ({"stop": ["ok", "x" * 16385]}, "stop"),                 # MAX_STOP_CHARS: its matcher is built per request
])
def test_vllm_guided_fields_that_cannot_be_honoured_are_a_400(server, extra, param):
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                                              **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ---- vLLM's output extras ----------------------------------------------------------------------------------------

def _stream_text(server, path: str, body: dict) -> tuple[str, list[dict]]:
    """The text a stream carried (choice 0) and its chunks."""
    chunks = []
    with httpx.stream("POST", server.url + path, json={"model": MODEL, **body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    text = "".join(c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content") or ""
                   for c in chunks if c["choices"])
    return text, chunks


def test_continue_final_message_and_add_generation_prompt_shape_the_prompt(server, client):
    """vLLM's chat extras `add_generation_prompt: false` and `continue_final_message: true` (a prefilled assistant
    reply) were ignored: the prompt always closed the last message and opened a new assistant turn. Now the prompt
    ends where the final message's text ends (the same tokens as that text sent to /v1/completions), and `echo`
    starts the reply with the prefill."""
    prefill = "Sure, here"
    msgs = [{"role": "user", "content": "x"}, {"role": "assistant", "content": prefill}]
    rendered = "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n" + prefill
    want = client.completions.create(model=MODEL, prompt=rendered, max_tokens=4, temperature=0)
    for extra in ({"continue_final_message": True}, {"continue_final_message": True, "add_generation_prompt": False}):
        r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0, extra_body=extra)
        assert r.usage.prompt_tokens == want.usage.prompt_tokens, extra
        assert r.choices[0].message.content == want.choices[0].text, extra
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0,
                                       extra_body={"continue_final_message": True, "echo": True})
    assert r.choices[0].message.content == prefill + want.choices[0].text
    text, _ = _stream_text(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 4, "temperature": 0,
                                                            "continue_final_message": True, "echo": True})
    assert text == prefill + want.choices[0].text
    # without the generation prompt the template closes the assistant turn and opens none
    closed = client.completions.create(model=MODEL, prompt=rendered + "<|im_end|>\n", max_tokens=1, temperature=0)
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1, temperature=0,
                                       extra_body={"add_generation_prompt": False})
    assert r.usage.prompt_tokens == closed.usage.prompt_tokens
    r = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1, "continue_final_message": True,
                                              "add_generation_prompt": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text


def test_continue_final_message_cuts_where_transformers_cuts():
    """transformers' rule for a final message with surrounding whitespace: the rendered text is kept up to the end
    of the left-trimmed message only if the template kept it untrimmed; a leading space fails that test, so the
    trailing space is cut too (`_continued` compared the trimmed text and kept it)."""
    from gateway.api import _continued
    from gateway.schemas import ChatMessage

    for content, cut in (("Hello  ", "Hello  "), ("  Hello  ", "Hello"), ("Hello", "Hello")):
        prompt = f"<|im_start|>assistant\n{content}<|im_end|>\n"
        msg = ChatMessage(role="assistant", content=content)
        start = prompt.index("Hello")
        assert _continued(prompt, msg) == prompt[:start + len(cut)], content


def test_include_stop_str_in_output(server, client):
    """vLLM's `include_stop_str_in_output` was ignored: the stop string was cut off. Now the text ends with it,
    streamed or not, on both routes."""
    msgs = [{"role": "user", "content": "Hello there"}]
    base = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    full = base.choices[0].message.content
    stop = full[3:6]                 # ends inside the text, after a few tokens
    assert len(stop) == 3 and full.find(stop) == 3
    body = {"messages": msgs, "max_tokens": 8, "temperature": 0, "stop": [stop], "include_stop_str_in_output": True}
    r = post(server, "/v1/chat/completions", body).json()["choices"][0]
    assert (r["message"]["content"], r["finish_reason"]) == (full[:6], "stop")
    assert _stream_text(server, "/v1/chat/completions", body)[0] == full[:6]
    comp = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=8, temperature=0).choices[0].text
    stop = comp[2:5]
    body = {"prompt": "Hello there", "max_tokens": 8, "temperature": 0, "stop": stop,
            "include_stop_str_in_output": True}
    cut = comp[:comp.find(stop) + 3]
    assert post(server, "/v1/completions", body).json()["choices"][0]["text"] == cut
    assert _stream_text(server, "/v1/completions", body)[0] == cut


def test_more_stop_strings_than_openai_takes_are_served_as_vllm_serves_them(server, client):
    """A code-evaluation harness's eight stop strings (HumanEval's) were a 400 (OpenAI's limit of 4); vLLM takes any
    number, so up to 64 are served, and the one that occurs stops the text."""
    msgs = [{"role": "user", "content": "Hello there"}]
    full = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    text = full.choices[0].message.content
    stops = ["\nclass", "\ndef", "\n#", "\nif", "\nprint", "\n```", "<|none|>", text[3:6]]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0, stop=stops)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (text[:text.find(text[3:6])], "stop")


def test_skip_special_tokens_false_keeps_special_tokens(server, tiny_checkpoint):
    """vLLM's `skip_special_tokens: false` was ignored: a special token the model wrote (here <|im_start|>, pushed
    by logit_bias) vanished from the text. It is now in it; the stop token (EOS) still ends the text unwritten."""
    from shared.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_checkpoint)
    start, eos = tok.token_to_id("<|im_start|>"), tok.eos_token_ids[0]
    for path, extra in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                        ("/v1/completions", {"prompt": "hi"})):
        body = {**extra, "max_tokens": 2, "temperature": 0, "logit_bias": {str(start): 100}}
        texts = []
        for skip in (True, False):
            choice = post(server, path, {**body, "skip_special_tokens": skip}).json()["choices"][0]
            texts.append(choice.get("text", (choice.get("message") or {}).get("content")))
        assert texts == ["", "<|im_start|><|im_start|>"], (path, texts)
        choice = post(server, path, {**body, "logit_bias": {str(eos): 100}, "skip_special_tokens": False}).json()
        assert choice["choices"][0]["finish_reason"] == "stop" and choice["usage"]["completion_tokens"] == 1


@pytest.mark.parametrize("path,extra", [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                                        ("/v1/completions", {"prompt": "hi"})])
def test_continuous_usage_stats(server, path, extra):
    """vLLM's `stream_options.continuous_usage_stats` was ignored (usage null on every chunk but the last): now each
    chunk carries its choice's prompt tokens and the tokens generated so far, and the last chunk the sums."""
    _, chunks = _stream_text(server, path, {**extra, "max_tokens": 3, "n": 2, "temperature": 1, "seed": 1,
                                            "stream_options": {"include_usage": True,
                                                               "continuous_usage_stats": True}})
    *per_choice, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    prompt = last["usage"]["prompt_tokens"]
    seen = {0: [], 1: []}
    for c in per_choice:
        u = c["usage"]
        assert u["prompt_tokens"] == prompt and u["total_tokens"] == prompt + u["completion_tokens"], c
        seen[c["choices"][0]["index"]].append(u["completion_tokens"])
    for counts in seen.values():
        assert counts == sorted(counts) and counts[-1] == 3, seen


def test_top_logprobs_zero_without_logprobs_is_served(server):
    """`top_logprobs: 0` asks for no alternatives: vLLM serves it without `logprobs` (only a count > 0 needs the
    flag); it was a 400. A count > 0 without the flag stays a 400."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    r = post(server, "/v1/chat/completions", {**body, "top_logprobs": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None, r.text
    r = post(server, "/v1/chat/completions", {**body, "top_logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs", r.text


def test_truncate_prompt_tokens_keeps_the_prompt_s_end(server, client):
    """vLLM's `truncate_prompt_tokens` was ignored (the whole prompt was computed): the prompt is now its last k
    tokens (left truncation, as vLLM's), -1 the context length, more than the context length a 400."""
    ids = [40, 41, 42, 43, 44, 45]
    want = client.completions.create(model=MODEL, prompt=ids[-3:], max_tokens=3, temperature=0, echo=True)
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, temperature=0, echo=True,
                                  extra_body={"truncate_prompt_tokens": 3})
    assert (r.choices[0].text, r.usage.prompt_tokens) == (want.choices[0].text, 3)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                       extra_body={"truncate_prompt_tokens": 4})
    assert r.usage.prompt_tokens == 4
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, extra_body={"truncate_prompt_tokens": -1})
    assert r.usage.prompt_tokens == len(ids)
    r = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": 10 ** 7})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("extra", [{"use_beam_search": True}, {"bad_words": ["x"]}, {"allowed_token_ids": [5]}])
def test_vllm_extras_that_cannot_be_honoured_are_a_400(server, path, extra):
    """vLLM's beam search, bad_words and allowed_token_ids change what is generated; they were ignored (200 with
    unconstrained text): now a 400 naming the field."""
    body = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    r = post(server, path, {**body, "max_tokens": 2, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(extra)), r.text
