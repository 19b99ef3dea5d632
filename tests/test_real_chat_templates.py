"""Tool calls against real Qwen chat templates (tests/fixtures/chat_templates/README.md: Qwen3-Coder, its first
revision, Qwen3.5, and Qwen3's hermes template as the negative case), through the gateway: the prompt a multi-turn
tool conversation renders to (tools listed, the history's calls and results written back the way the template
writes them), the call form read off the template, and replies written exactly as the template instructs parsed into
typed calls, streamed and not. The templates are not committed: a test needing one that is absent skips.

Hand-written templates in the same shapes (`|items` over a call's arguments, content concatenated as a string) run
always: they pin what the real ones exposed (arguments passed as JSON text, null content, text-part lists)."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

import shared
from gateway.api import create_app
from gateway.metrics import Metrics
from gateway.output_parser import OutputParser, assemble, parse_complete
from shared.engine_core import TokenEvent
from shared.sampling import read_generation_config
from shared.tokenizer import Tokenizer

DEMO = Path(shared.__file__).parent / "demo_model"      # a Qwen-style tokenizer (the templates bring their own text)
FIXTURES = Path(__file__).parent / "fixtures" / "chat_templates"
MODEL = "real-templates"

# name -> (the call form the gateway must read replies in, SHA-256 of the fixture)
TEMPLATES = {
    "qwen3_coder": ("xml", "5a38bfa05833266240066aedc497decc9b00cc0d3e3b8cceea98cf530196ab06"),
    "qwen3_coder_original": ("xml", "c7925083b941a7a89fe342f7657f132c74a3586dfcbc18644c1fb1bbd9392773"),
    "qwen3_5": ("xml", "f64d291f5518e8e31d6e2b8510c36315f25fa46ed4459c769bde60cf6ec781e2"),
    "qwen3": ("hermes", "87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5"),
}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "City name"}, "days": {"type": "integer"},
        "metric": {"type": "boolean"}}}}}
WRITE = {"type": "function", "function": {
    "name": "write_file", "description": "Write a text file.",
    "parameters": {"type": "object", "required": ["path", "content"], "properties": {
        "path": {"type": "string"}, "content": {"type": "string", "description": "The whole file"},
        "mode": {"type": "number"}, "options": {"type": "object"},
        "tags": {"type": "array", "items": {"type": "string"}}, "note": {"type": ["string", "null"]}}}}}
TOOLS = [WEATHER, WRITE]
NAMES = {"get_weather", "write_file"}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

# the history's calls, sent as OpenAI sends them: arguments as JSON text, content null
W_ARGS = {"city": "東京", "days": 3, "metric": True}
F_ARGS = {"path": "src/a.py", "content": "def f():\n    return 1\n", "mode": 0.5,
          "options": {"overwrite": True, "encoding": "utf-8"}, "tags": ["x", "y z"], "note": None}
HISTORY = [
    {"role": "system", "content": "You are a careful assistant."},
    {"role": "user", "content": "Weather in Tokyo, then save a script."},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "type": "function",
         "function": {"name": "get_weather", "arguments": json.dumps(W_ARGS, ensure_ascii=False)}},
        {"id": "call_b", "type": "function", "function": {"name": "write_file", "arguments": json.dumps(F_ARGS)}}]},
    {"role": "tool", "tool_call_id": "call_a", "content": "sunny, 21 C"},
    {"role": "tool", "tool_call_id": "call_b",
     "content": [{"type": "text", "text": "wrote 2 lines"}, {"type": "text", "text": "ok"}]},
    {"role": "assistant", "content": "Sunny; the file is written."},
    {"role": "user", "content": "Now Paris for 2 days, and Lyon."},
]

# the reply's calls: values written as a model imitating the templates writes them (text), and what they must become
REPLY_CALLS = [
    ("get_weather", {"city": "Paris", "days": "2", "metric": "False"}, {"city": "Paris", "days": 2, "metric": False}),
    ("write_file", {"path": "notes/paris.md", "content": "# Paris\n\n- day 1: rain\n- day 2: sun\n", "mode": "0.75",
                    "options": '{"overwrite": false, "depth": [1, 2]}', "tags": '["trip", "fr"]', "note": "None"},
     {"path": "notes/paris.md", "content": "# Paris\n\n- day 1: rain\n- day 2: sun\n", "mode": 0.75,
      "options": {"overwrite": False, "depth": [1, 2]}, "tags": ["trip", "fr"], "note": None}),
    ("get_weather", {"city": "Lyon", "days": "1", "metric": "true"}, {"city": "Lyon", "days": 1, "metric": True}),
]
CONTENT = "I'll check Paris and Lyon, and save notes."
REASONING = "The user wants two cities.\nThen a file."


def template_file(name: str) -> Path:
    path = FIXTURES / f"{name}.jinja"
    if not path.is_file():
        pytest.skip(f"{path.name} is not in {FIXTURES} (its README.md says where it comes from)")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == TEMPLATES[name][1], f"{path} is not the pinned copy (README.md there)"
    return path


class Scripted:
    """Replies with the given token ids, then stops; records the request (its prompt ids)."""

    max_model_len = 1 << 15

    def __init__(self, ids: list[int]) -> None:
        self.ids, self.last = ids, None

    async def generate(self, request):
        self.last = request
        for i, t in enumerate(self.ids):
            yield TokenEvent(token_id=t, finish_reason="stop" if i + 1 == len(self.ids) else None)

    closing = None                       # the Engine protocol's: not stopping

    def health(self) -> list[str]:
        return []


def client_for(tok: Tokenizer, reply: str) -> tuple[TestClient, Scripted]:
    engine = Scripted(tok.encode(reply))
    app = create_app(engine, tok, model_name=MODEL, generation_config=read_generation_config(DEMO), metrics=Metrics())
    return TestClient(app, raise_server_exceptions=False), engine


def xml_call(name: str, params: dict[str, str]) -> str:
    """A call in the XML form, laid out exactly as the templates' instructions show it."""
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def hermes_call(name_json: str, args_json: str) -> str:
    """A call in the hermes form, laid out exactly as the Qwen3 template's instructions show it."""
    return f'<tool_call>\n{{"name": {name_json}, "arguments": {args_json}}}\n</tool_call>'


def instructed_example(prompt: str, form: str) -> str:
    """The call format the rendered tools section tells the model to write."""
    pattern = (r"<tool_call>\n<function=example_function_name>\n.*?</tool_call>" if form == "xml" else
               r"<tool_call>\n\{\"name\": <function-name>.*?</tool_call>")
    found = re.search(pattern, prompt, re.DOTALL)
    assert found, prompt
    return found.group(0)


def reply_for(name: str, prompt: str) -> str:
    """The model's reply in the form the rendered prompt instructs, checked against the prompt's own example: the
    calls of REPLY_CALLS after some content (and reasoning, where the prompt opened the think block)."""
    form = TEMPLATES[name][0]
    example = instructed_example(prompt, form)
    if form == "xml":
        assert example == xml_call("example_function_name", {
            "example_parameter_1": "value_1",
            "example_parameter_2": "This is the value for the second parameter\nthat can span\nmultiple lines"})
        calls = [xml_call(fn, written) for fn, written, _ in REPLY_CALLS]
    else:
        assert example == hermes_call("<function-name>", "<args-json-object>")
        calls = [hermes_call(json.dumps(fn), json.dumps(typed, ensure_ascii=False)) for fn, _, typed in REPLY_CALLS]
    # laid out as the templates write an assistant turn's calls: content, a blank line, the calls a newline apart
    text = CONTENT + "\n\n" + "\n".join(calls)
    return (REASONING + "\n</think>\n\n" + text) if prompt.endswith("<think>\n") else text


def first_assistant_turn(prompt: str) -> str:
    turn = next(c for c in prompt.split("<|im_start|>") if c.startswith("assistant\n"))
    return turn.removeprefix("assistant\n").split("<|im_end|>")[0]


# ---- the real templates ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_call_form_read_off_the_template(name, tmp_path):
    source = template_file(name).read_text(encoding="utf-8")
    form = TEMPLATES[name][0]
    assert Tokenizer.from_dir(DEMO, template_file(name)).tool_call_form == form       # --chat-template FILE
    # shipped in the checkpoint: tokenizer_config.json's chat_template, or chat_template.jinja beside it
    config = json.loads((DEMO / "tokenizer_config.json").read_text())
    for where in ("config", "file"):
        d = tmp_path / where
        d.mkdir()
        (d / "tokenizer.json").write_bytes((DEMO / "tokenizer.json").read_bytes())
        (d / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": source if where == "config"
                                                             else "{{ messages }}"}))
        if where == "file":
            (d / "chat_template.jinja").write_text(source, encoding="utf-8")
        assert Tokenizer.from_dir(d).tool_call_form == form, where


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_multi_turn_tool_conversation_through_the_gateway(name):
    """A conversation with two earlier calls (arguments as JSON text, content null) and their results (a string, a
    list of text parts) renders; the history's calls, read back from the prompt in the template's own form, are the
    calls sent; the reply, written as the prompt instructs, comes back as typed calls, streamed and not."""
    form = TEMPLATES[name][0]
    tok = Tokenizer.from_dir(DEMO, template_file(name))
    client, engine = client_for(tok, "ok")
    body = {"model": MODEL, "messages": HISTORY, "tools": TOOLS}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    prompt = tok.decode(engine.last.prompt_ids, skip_special_tokens=False)

    system = prompt.split("<|im_end|>")[0]
    assert "You are a careful assistant." in system and all(n in system for n in NAMES)
    if name in ("qwen3_coder", "qwen3_coder_original"):
        assert "<name>write_file</name>" in system and "<type>boolean</type>" in system
    else:
        assert json.dumps(WRITE, ensure_ascii=False) in system
    # the earlier calls, as the template wrote them, parse back to the arguments sent
    turn = first_assistant_turn(prompt)
    back = parse_complete(turn, "off", NAMES, call_form=form, tool_params=SCHEMAS)
    assert back.content is None and [(c.name, json.loads(c.arguments)) for c in back.tool_calls] == \
        [("get_weather", W_ARGS), ("write_file", F_ARGS)], turn
    # the results: in <tool_response> blocks of a user turn, text parts as text (never a list's repr)
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt
    assert "wrote 2 lines" in prompt and "'type'" not in prompt
    assert "<|im_start|>assistant\nSunny; the file is written.<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n" + ("<think>\n" if name == "qwen3_5" else ""))
    assert tok.tool_call_form == form

    reply = reply_for(name, prompt)
    client, engine = client_for(tok, reply)
    msg = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    assert msg["finish_reason"] == "tool_calls"
    want = [(fn, typed) for fn, _, typed in REPLY_CALLS]
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["message"]["tool_calls"]]
    assert got == want and msg["message"]["content"] == CONTENT
    assert msg["message"].get("reasoning_content") == (REASONING if name == "qwen3_5" else None)
    # streamed
    lines = [ln.removeprefix("data: ") for ln in
             client.post("/v1/chat/completions", json={**body, "stream": True}).text.splitlines()
             if ln.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in map(json.loads, lines) if c["choices"]]
    args: dict[int, str] = {}
    names: dict[int, str] = {}
    for d in deltas:
        for tc in d.get("tool_calls") or []:
            names[tc["index"]] = names.get(tc["index"]) or tc["function"].get("name")
            args[tc["index"]] = args.get(tc["index"], "") + (tc["function"].get("arguments") or "")
    assert [(names[i], json.loads(args[i])) for i in sorted(args)] == want
    assert "".join(d.get("content") or "" for d in deltas) == CONTENT


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_instructed_reply_parses_split_at_every_character(name):
    """The reply in the instructed form, fed to the parser in one piece, one character at a time, and in two pieces
    split at every position: the same typed calls each time."""
    form = TEMPLATES[name][0]
    tok = Tokenizer.from_dir(DEMO, template_file(name))
    prompt = tok.apply_chat_template([{"role": "user", "content": "Paris?"}], tools=TOOLS)
    reply = reply_for(name, prompt)
    reasoning = "inside" if prompt.endswith("<think>\n") else "auto"
    whole = parse_complete(reply, reasoning, NAMES, call_form=form, tool_params=SCHEMAS)
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == [(fn, t) for fn, _, t in REPLY_CALLS]
    assert whole.content == CONTENT and not whole.cut_call

    def streamed(pieces: list[str]):
        parser = OutputParser(reasoning, NAMES, call_form=form, tool_params=SCHEMAS)
        out = assemble([d for p in pieces for d in parser.feed(p)] + parser.finish())
        return out.reasoning_content, out.content, [(c.name, c.arguments) for c in out.tool_calls]

    expected = (whole.reasoning_content, whole.content, [(c.name, c.arguments) for c in whole.tool_calls])
    assert streamed(list(reply)) == expected
    for i in range(1, len(reply)):
        assert streamed([reply[:i], reply[i:]]) == expected, i


# ---- hand-written templates of the same shapes (no fixture needed) -----------------------------------------------

# Qwen3-Coder's shape: content concatenated as a string, a call's arguments iterated with |items
CODER_SHAPED = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ '' + m.content }}"
    "{%- for tc in m.tool_calls or [] %}\n<tool_call>\n<function={{ tc.function.name }}>\n"
    "{%- for k, v in tc.function.arguments|items %}\n<parameter={{ k }}>\n"
    "{{ v | tojson if v is mapping or (v is sequence and v is not string) else v | string }}\n</parameter>"
    "{%- endfor %}\n</function>\n</tool_call>{%- endfor %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    "{#- <function=NAME> #}"
)


def test_arguments_reach_the_template_as_an_object_and_content_as_text(tmp_path):
    template = tmp_path / "coder_shaped.jinja"
    template.write_text(CODER_SHAPED)
    tok = Tokenizer.from_dir(DEMO, template)
    assert tok.tool_call_form == "xml"
    client, engine = client_for(tok, "ok")
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": HISTORY, "tools": TOOLS})
    assert r.status_code == 200, r.text
    prompt = tok.decode(engine.last.prompt_ids, skip_special_tokens=False)
    back = parse_complete(first_assistant_turn(prompt), "off", NAMES, call_form="xml", tool_params=SCHEMAS)
    assert [(c.name, json.loads(c.arguments)) for c in back.tool_calls] == \
        [("get_weather", W_ARGS), ("write_file", F_ARGS)]
    assert "<|im_start|>tool\nwrote 2 lines\nok<|im_end|>" in prompt       # text parts joined, as vLLM joins them
    # arguments "" are {}; text that is no JSON object stays text, which this template cannot read: a 400, not a 500
    for arguments, status in (("", 200), ("  ", 200), ("[1, 2]", 400), ("not json", 400)):
        messages = [HISTORY[1], {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "c", "content": "x"}]
        r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "tools": TOOLS})
        assert r.status_code == status, (arguments, r.text)
        if status == 400:
            assert r.json()["error"]["param"] == "messages"
