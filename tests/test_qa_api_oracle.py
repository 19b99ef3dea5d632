"""Oracles over the OpenAI routes of one real cluster (the built-in demo model, 2 stages, its own processes): the
same request asked different ways must give the same content.

* streamed vs non-streamed, greedy or seeded: the deltas of every choice (content, reasoning, tool-call names and
  arguments, legacy function_call) concatenate to the non-streamed message, with the same finish_reason, usage
  (prompt, completion and cached tokens) and logprobs, on /v1/chat/completions, /v1/completions and /v1/responses;
  every body and every chunk validates as the `openai` client's own types;
* /v1/completions given the prompt /tokenize renders for chat messages generates the chat reply's tokens;
* `client.chat.completions.parse` / `client.responses.parse` (and their stream helpers) with a pydantic model.

The demo model writes real words, so the stop strings are cut out of its own greedy output: across token
boundaries, inside multi-byte characters' tokens, emoji and CJK text.
"""

from __future__ import annotations

import json
import shutil
from typing import Annotated, Any, Literal

import httpx
import openai
import pydantic
import pytest
from openai._models import construct_type
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.responses import Response

from conftest import OpenAI, free_port

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                             "parameters": {"type": "object", "required": ["city"],
                                                            "properties": {"city": {"type": "string"},
                                                                           "days": {"type": "integer"}}}}}
SEARCH = {"type": "function", "function": {"name": "search", "description": "Search the web",
                                            "parameters": {"type": "object", "required": ["q"],
                                                           "properties": {"q": {"type": "string"}}}}}
TOOLS = [WEATHER, SEARCH]
ASK = [{"role": "user", "content": "What is the weather in Berlin and Paris?"}]
STORY = [{"role": "user", "content": "Tell me about dogs."}]
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "admin"],
          "properties": {"name": {"type": "string", "maxLength": 10}, "admin": {"type": "boolean"}}}
EOS = 4072          # <|im_end|> in the demo tokenizer (checked in the fixture)
TOOL_CALL = 4084    # <tool_call>


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    """The built-in demo model (a copy: loading writes its PLE table beside it) served by a 2-stage cluster."""
    from gateway.launcher import Cluster, ServeOptions
    from shared.cli import _bundled_files
    from shared.tokenizer import Tokenizer

    model = tmp_path_factory.mktemp("demo") / "demo"
    model.mkdir()
    for f in _bundled_files():
        shutil.copyfile(f, model / f.name)
    tok = Tokenizer.from_dir(model)
    assert tok.token_to_id("<|im_end|>") == EOS and tok.token_to_id("<tool_call>") == TOOL_CALL
    with Cluster(ServeOptions(model=model, stages=2, port=free_port(), extra={"ple_service": False})) as c:
        yield c.url


def _post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url + path, json=body, timeout=120, verify=False)
    assert r.status_code == 200, r.text
    return r.json()


def _events(url: str, path: str, body: dict) -> list[str]:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120, verify=False) as r:
        assert r.status_code == 200, r.read()
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


def _warm(url: str, path: str, body: dict) -> None:
    """One token of the same prompt first, so both answers find it in the prefix cache (equal cached_tokens)."""
    drop = ("n", "max_completion_tokens", "min_tokens", "stream_options", "echo", "logprobs", "top_logprobs")
    key = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
    _post(url, path, {**{k: v for k, v in body.items() if k not in drop}, key: 16 if key != "max_tokens" else 1})


def _close(a: Any, b: Any) -> bool:
    """Equal, floats within 1e-3 (choices of one request run batched: their logprobs differ in the last bits)."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) < 1e-3
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return a == b


# ---- chat --------------------------------------------------------------------------------------------------------

def _chat_full(body: dict) -> tuple[dict[int, dict], dict]:
    ChatCompletion.model_validate(body)
    out = {}
    for ch in body["choices"]:
        m = ch["message"]
        calls = [(t["function"]["name"], t["function"]["arguments"]) for t in m.get("tool_calls") or []]
        assert all(t["id"] and t["type"] == "function" for t in m.get("tool_calls") or [])
        fc = m.get("function_call")
        lps = ch["logprobs"] if ch["logprobs"] is None else {"refusal": None, **ch["logprobs"]}   # (as folded)
        out[ch["index"]] = {"content": m.get("content"), "reasoning": m.get("reasoning_content"), "calls": calls,
                            "function_call": fc and (fc["name"], fc["arguments"]), "finish": ch["finish_reason"],
                            "logprobs": lps}
    return out, body["usage"]


def _chat_streamed(events: list[str]) -> tuple[dict[int, dict], dict | None]:
    """The stream folded as a client folds it: a field no delta carried stays None."""
    assert events[-1] == "[DONE]"
    out: dict[int, dict] = {}
    usage = None
    for e in events[:-1]:
        chunk = json.loads(e)
        ChatCompletionChunk.model_validate(chunk)
        assert chunk["object"] == "chat.completion.chunk"
        if chunk.get("usage"):
            assert usage is None and not chunk["choices"], "usage comes once, in the last chunk"
            usage = chunk["usage"]
        for ch in chunk["choices"]:
            st = out.setdefault(ch["index"], {"content": None, "reasoning": None, "calls": {}, "function_call": None,
                                              "finish": None, "logprobs": None})
            assert st["finish"] is None, "nothing after a choice's finish_reason"
            d = ch["delta"]
            for key, field in (("content", "content"), ("reasoning", "reasoning_content")):
                if d.get(field) is not None:
                    st[key] = (st[key] or "") + d[field]
            for tc in d.get("tool_calls") or []:
                if tc.get("id"):
                    assert tc["index"] not in st["calls"] and tc["type"] == "function"
                    st["calls"][tc["index"]] = [tc["function"]["name"], ""]
                st["calls"][tc["index"]][1] += tc["function"].get("arguments") or ""
            if d.get("function_call"):
                f = d["function_call"]
                if st["function_call"] is None:
                    st["function_call"] = (f["name"], "")
                st["function_call"] = (st["function_call"][0], st["function_call"][1] + (f.get("arguments") or ""))
            if ch.get("logprobs") is not None:
                st["logprobs"] = {"content": (st["logprobs"] or {"content": []})["content"] +
                                  (ch["logprobs"]["content"] or []), "refusal": None}
            st["finish"] = ch["finish_reason"]
    for st in out.values():
        st["calls"] = [tuple(st["calls"][i]) for i in sorted(st["calls"])]
        if st["logprobs"] is not None:
            st["logprobs"]["refusal"] = None
    return out, usage


def _pair(url: str, path: str, body: dict, fold_full, fold_streamed) -> tuple[dict, dict]:
    """The same request non-streamed and streamed (after `_warm`), each folded per choice: equal but for logprobs,
    which agree to `_close`, and usage (`_same_usage`). The non-streamed choices and usage."""
    _warm(url, path, body)
    full, usage = fold_full(_post(url, path, body))
    streamed, s_usage = fold_streamed(_events(url, path, {**body, "stream_options": {"include_usage": True}}))
    assert sorted(streamed) == sorted(full)
    for i in full:
        a, b = full[i], streamed[i]
        assert {k: v for k, v in a.items() if k != "logprobs"} == {k: v for k, v in b.items() if k != "logprobs"}, i
        assert _close(a["logprobs"], b["logprobs"]), (i, a["logprobs"], b["logprobs"])
    _same_usage(s_usage, usage)
    return full, usage


def _chat_pair(url: str, body: dict) -> tuple[dict, dict]:
    full, usage = _pair(url, "/v1/chat/completions", body, _chat_full, _chat_streamed)
    assert sorted(full) == list(range(body.get("n", 1)))
    return full, usage


def _same_usage(streamed: dict | None, full: dict) -> None:
    """Equal usage; cached_tokens only bounded: what the prefix cache serves depends on what ran before (a repeat
    of a warmed prompt was seen to find fewer cached tokens than the request before it, see the module's report)."""
    assert streamed is not None
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in (streamed, full)]
    assert all(0 <= c < full["prompt_tokens"] for c in cached)
    strip = lambda u: {k: v for k, v in u.items() if k != "prompt_tokens_details"}   # noqa: E731
    assert strip(streamed) == strip(full)


CHAT_SHAPES = {
    "plain-max_completion_tokens": dict(messages=STORY, max_completion_tokens=9),
    "n3-seeded-top_logprobs-20": dict(messages=STORY, max_tokens=8, n=3, temperature=1.0, seed=11, logprobs=True,
                                      top_logprobs=20),
    "top_logprobs-0-penalties-bias": dict(messages=STORY, max_tokens=12, logprobs=True, top_logprobs=0,
                                          presence_penalty=1.5, frequency_penalty=0.7, logit_bias={"198": -100}),
    "stop-strings": dict(messages=STORY, max_tokens=40, stop=[" avail", "ted l"], logprobs=True, top_logprobs=2),
    "eos-first-with-logprobs": dict(messages=STORY, max_tokens=5, logit_bias={str(EOS): 100}, logprobs=True),
    "json_schema": dict(messages=ASK, max_tokens=30, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}),
    "json_object-cut": dict(messages=ASK, max_tokens=6, response_format={"type": "json_object"}),
    "tools-auto": dict(messages=ASK, max_tokens=40, tools=TOOLS, logprobs=True, top_logprobs=1),
    "tools-auto-n2-sequential": dict(messages=ASK, max_tokens=50, tools=TOOLS, n=2, temperature=1.0, seed=5,
                                     parallel_tool_calls=False, logit_bias={str(TOOL_CALL): 5}),
    "tools-required-cut-in-arguments": dict(messages=ASK, max_tokens=22, tools=TOOLS, tool_choice="required"),
    "tools-required-cut-in-header": dict(messages=ASK, max_tokens=8, tools=TOOLS, tool_choice="required"),
    "tools-named-stop-in-arguments": dict(messages=ASK, max_tokens=40, tools=TOOLS, stop=['"}'],
                                          tool_choice={"type": "function", "function": {"name": "search"}}),
    "tools-none": dict(messages=ASK, max_tokens=10, tools=TOOLS, tool_choice="none"),
    "legacy-function_call": dict(messages=ASK, max_tokens=40, functions=[WEATHER["function"]],
                                 function_call={"name": "get_weather"}),
    "reasoning-echo-continued": dict(messages=STORY + [{"role": "assistant", "content": "<think>"}], max_tokens=24,
                                     continue_final_message=True, add_generation_prompt=False, echo=True,
                                     logit_bias={"4095": 2}, tools=TOOLS, logprobs=True, top_logprobs=1),
}


@pytest.mark.parametrize("shape", sorted(CHAT_SHAPES))
def test_chat_stream_equals_full(url, shape):
    _chat_pair(url, {"temperature": 0, **CHAT_SHAPES[shape]})


# ---- completions -------------------------------------------------------------------------------------------------

def _sdk_completion(body: dict) -> None:
    """The openai client's reading of a completions body or chunk (lenient, as it reads them: its `Completion`
    type has no null for a streamed chunk's finish_reason or an echoed first token's logprob, which OpenAI sends)."""
    c = construct_type(type_=Completion, value=body)
    assert isinstance(c, Completion) and all(ch.finish_reason in (None, "stop", "length") for ch in c.choices)


def _completion_full(body: dict) -> tuple[dict[int, dict], dict]:
    _sdk_completion(body)
    return {c["index"]: {"text": c["text"], "finish": c["finish_reason"], "logprobs": c["logprobs"]}
            for c in body["choices"]}, body["usage"]


def _completion_streamed(events: list[str]) -> tuple[dict[int, dict], dict | None]:
    assert events[-1] == "[DONE]"
    out: dict[int, dict] = {}
    usage = None
    for e in events[:-1]:
        chunk = json.loads(e)
        _sdk_completion(chunk)
        if chunk.get("usage"):
            assert usage is None and not chunk["choices"]
            usage = chunk["usage"]
        for ch in chunk["choices"]:
            st = out.setdefault(ch["index"], {"text": "", "finish": None, "logprobs": None})
            assert st["finish"] is None
            st["text"] += ch["text"]
            if ch.get("logprobs") is not None:
                lp = st["logprobs"] = st["logprobs"] or {k: [] for k in ch["logprobs"]}
                for k, v in ch["logprobs"].items():
                    lp[k] += v
            st["finish"] = ch["finish_reason"]
    return out, usage


def _completion_pair(url: str, body: dict) -> tuple[dict, dict]:
    return _pair(url, "/v1/completions", body, _completion_full, _completion_streamed)


PROSE = "Der Hund läuft über die Straße und"
CJK = "日本語 日本語 日本語 日本語"        # the demo model answers with "❄" (three byte tokens) in it


@pytest.mark.parametrize("prompt", [PROSE, CJK])
def test_completion_stop_strings_cut_the_greedy_text_streamed_or_not(url, prompt):
    """Stop strings taken from the greedy text itself (within a token, across two or three tokens, a multi-byte
    character made of byte tokens): the text ends right before the first match (or after it, with
    include_stop_str_in_output), streamed or not, with the same logprobs."""
    base = _post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 24, "temperature": 0, "logprobs": 0})
    text, tokens = base["choices"][0]["text"], base["choices"][0]["logprobs"]["tokens"]
    stops = [text[3:5], text[8:15], text[16:17], text[-7:]]
    if "❄" in text:
        stops += ["❄", "=> ❄N"]
    for i, stop in enumerate(stops):
        assert stop and stop in text, (stop, text, tokens)
        include = i % 2 == 1
        body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "stop": [stop, "\x00never"],
                "include_stop_str_in_output": include, "logprobs": i % 3}
        full, _ = _completion_pair(url, body)
        cut = text.find(stop) + (len(stop) if include else 0)
        assert full[0]["text"] == text[:cut] and full[0]["finish"] == "stop", (stop, full[0]["text"])


COMPLETION_SHAPES = {
    "echo-logprobs-n2": dict(prompt=PROSE, max_tokens=6, echo=True, logprobs=3, n=2, temperature=1.0, seed=3),
    "echo-only": dict(prompt=PROSE, max_tokens=0, echo=True, logprobs=1),
    "prompt-list-n2": dict(prompt=[PROSE, CJK], max_tokens=6, n=2, logprobs=20),
    "suffix": dict(prompt="def area(r):\n    return ", suffix="\n\nprint(area(2))\n", max_tokens=12, logprobs=1),
    "eos-first-with-logprobs": dict(prompt=PROSE, max_tokens=5, logit_bias={str(EOS): 100}, logprobs=2),
    "eos-first-echo": dict(prompt=PROSE, max_tokens=5, logit_bias={str(EOS): 100}, logprobs=2, echo=True),
    "json_object": dict(prompt="A user as JSON:", max_tokens=20, response_format={"type": "json_object"}),
    "penalties-seed": dict(prompt=PROSE, max_tokens=16, temperature=0.9, seed=7, presence_penalty=1.0,
                           frequency_penalty=0.5),
}


@pytest.mark.parametrize("shape", sorted(COMPLETION_SHAPES))
def test_completion_stream_equals_full(url, shape):
    _completion_pair(url, {"temperature": 0, **COMPLETION_SHAPES[shape]})


# ---- responses ---------------------------------------------------------------------------------------------------

def _without_ids(r: dict) -> dict:
    r = {k: v for k, v in r.items() if k not in ("id", "created_at", "completed_at")}
    r["output"] = [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in r["output"]]
    return r


RESPONSE_SHAPES = {
    "text-stop": dict(input=STORY, max_output_tokens=30, stop=["ail"]),
    "tools-required": dict(input=ASK, max_output_tokens=40, tools=[{"type": "function", **WEATHER["function"]}],
                           tool_choice="required"),
    "tools-auto-cut": dict(input=ASK, max_output_tokens=20, tools=[{"type": "function", **t["function"]}
                                                                   for t in TOOLS]),
    "json_schema": dict(input=ASK, max_output_tokens=30, text={"format": {"type": "json_schema", "name": "person",
                                                                          "schema": PERSON, "strict": True}}),
}


@pytest.mark.parametrize("shape", sorted(RESPONSE_SHAPES))
def test_responses_stream_equals_full(url, shape):
    body = {"temperature": 0, **RESPONSE_SHAPES[shape]}
    _warm(url, "/v1/responses", body)
    full = _post(url, "/v1/responses", body)
    Response.model_validate(full)
    events = [json.loads(e) for e in _events(url, "/v1/responses", body)]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    Response.model_validate(final)
    for r in (final, full):
        r["usage"]["input_tokens_details"]["cached_tokens"] = 0         # (see `_same_usage`)
    assert _without_ids(final) == _without_ids(full)
    texts: dict[int, str] = {}
    for e in events:
        if e["type"].endswith(".delta"):
            texts[e["output_index"]] = texts.get(e["output_index"], "") + e["delta"]
    for i, item in enumerate(full["output"]):
        want = item["arguments"] if item["type"] == "function_call" else "".join(
            p["text"] for p in item.get("content") or [])
        assert texts.get(i, "") == want


# ---- chat vs completions on the rendered prompt ------------------------------------------------------------------

@pytest.mark.parametrize("case", ["plain", "tools-history", "continue_final_message"])
def test_completions_on_the_tokenized_chat_prompt_generate_the_chat_tokens(url, case):
    """/tokenize renders messages as the chat route does (tools, continue_final_message included): /v1/completions
    on those ids, and on their text, generates the chat reply's tokens."""
    messages, extra = STORY, {}
    if case == "tools-history":
        messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Berlin"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"}]
        extra = {"tools": TOOLS}
    elif case == "continue_final_message":
        messages = STORY + [{"role": "assistant", "content": "Dogs are"}]
        extra = {"continue_final_message": True, "add_generation_prompt": False}
    ids = _post(url, "/tokenize", {"messages": messages, **extra})["tokens"]
    chat = _post(url, "/v1/chat/completions", {"messages": messages, **extra, "max_tokens": 12, "temperature": 0,
                                                "logprobs": True})
    assert chat["usage"]["prompt_tokens"] == len(ids)
    want = [t["token"] for t in chat["choices"][0]["logprobs"]["content"]]
    text = _post(url, "/detokenize", {"tokens": ids})["prompt"]
    for prompt in (ids, text):
        got = _post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 0})
        assert got["usage"]["prompt_tokens"] == len(ids)
        assert got["choices"][0]["logprobs"]["tokens"] == want


# ---- the openai client's parse helpers ---------------------------------------------------------------------------

class Person(pydantic.BaseModel):
    name: Annotated[str, pydantic.StringConstraints(max_length=12)]
    age: Annotated[int, pydantic.Field(ge=0, le=120)]
    role: Literal["dev", "ops"]


class GetWeather(pydantic.BaseModel):
    city: Annotated[str, pydantic.StringConstraints(max_length=12)]
    unit: Literal["c", "f"]


def test_openai_parse_helpers(url):
    """chat.completions.parse / responses.parse with a pydantic model (response_format and a strict function tool),
    and the SDK's stream helpers: the same parsed objects and content, streamed or not."""
    client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    ask = [{"role": "user", "content": "Give me a person as JSON."}]
    common = dict(model="moepipe", temperature=0)
    full = client.chat.completions.parse(messages=ask, response_format=Person, max_tokens=60, **common)
    with client.chat.completions.stream(messages=ask, response_format=Person, max_tokens=60, **common) as s:
        for _ in s:
            pass
        streamed = s.get_final_completion()
    assert full.choices[0].finish_reason == "stop" and isinstance(full.choices[0].message.parsed, Person)
    assert streamed.choices[0].message.parsed == full.choices[0].message.parsed
    assert streamed.choices[0].message.content == full.choices[0].message.content

    r = client.responses.parse(input=ask, text_format=Person, max_output_tokens=60, **common)
    with client.responses.stream(input=ask, text_format=Person, max_output_tokens=60, **common) as s:
        for _ in s:
            pass
        rs = s.get_final_response()
    assert r.status == "completed" and r.output_parsed == full.choices[0].message.parsed == rs.output_parsed

    tool = openai.pydantic_function_tool(GetWeather)
    full = client.chat.completions.parse(messages=ASK, tools=[tool], tool_choice="required", max_tokens=60, **common)
    with client.chat.completions.stream(messages=ASK, tools=[tool], tool_choice="required", max_tokens=60,
                                        **common) as s:
        for _ in s:
            pass
        streamed = s.get_final_completion()
    calls = [c.function.parsed_arguments for c in full.choices[0].message.tool_calls]
    assert calls and all(isinstance(c, GetWeather) for c in calls)
    assert [c.function.parsed_arguments for c in streamed.choices[0].message.tool_calls] == calls
    assert full.choices[0].message.content is None and streamed.choices[0].message.content is None
    # (not compared with the chat call: the client writes this tool's keys in another order for each route, and
    # the chat template writes them into the prompt in the order given, as transformers does)
    r = client.responses.parse(input=ASK, tools=[tool], tool_choice="required", max_output_tokens=60, **common)
    with client.responses.stream(input=ASK, tools=[tool], tool_choice="required", max_output_tokens=60,
                                 **common) as s:
        for _ in s:
            pass
        rs = s.get_final_response()
    calls = [o.parsed_arguments for o in r.output if o.type == "function_call"]
    assert calls and all(isinstance(c, GetWeather) for c in calls)
    assert [o.parsed_arguments for o in rs.output if o.type == "function_call"] == calls
