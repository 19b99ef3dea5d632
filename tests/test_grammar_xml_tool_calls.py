"""Forced tool calls in the XML form (Qwen3-Coder, Qwen3.5): with a chat template whose calls are
`<tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>\\n</function>\\n</tool_call>`, the grammar of
tool_choice "required" / a named function (and of allowed_tools, and "a call or the JSON answer") makes the model
write calls in that form, the one the template teaches, not the hermes JSON form (`{"name": ..., "arguments": ...}`)
such models never saw. Names come from the tools, parameter names from the schema's properties, values by the
schema (text for strings, JSON for the rest); the reply comes back as typed `tool_calls`.

The grammar is checked on exact texts (the template's own instruction example, a hand-written equivalent, typed
calls, and the texts it must refuse), by random walks whose every text must parse into arguments valid under the
tool's schema, and end to end: the tiny model's in-process engine sampling under the mask through the gateway, with
a hand-written XML template and, where the fixtures are present, the real Qwen3-Coder / Qwen3.5 templates
(tests/fixtures/chat_templates/README.md)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

jsonschema = pytest.importorskip("jsonschema")

from gateway.api import create_app  # noqa: E402
from gateway.engine import AsyncEngine  # noqa: E402
from gateway.grammar import GrammarCompiler, GrammarError, mask_to_bool  # noqa: E402
from gateway.metrics import Metrics  # noqa: E402
from gateway.output_parser import parse_complete  # noqa: E402
from shared.sampling import read_generation_config  # noqa: E402
from shared.tokenizer import Tokenizer  # noqa: E402
from test_real_chat_templates import DEMO, TEMPLATES, instructed_example, template_file, xml_call  # noqa: E402

# What Qwen3-Coder's and Qwen3.5's templates show the model ("If you choose to call a function ONLY reply in the
# following format with NO suffix:"), byte for byte
INSTRUCTED = ("<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
              "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple "
              "lines\n</parameter>\n</function>\n</tool_call>")

# A template of the same kind, written here: the tools, the instruction with its example, the calls of the history
XML_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{%- for tool in tools %}\n<function><name>{{ tool.function.name }}</name></function>{%- endfor %}\n</tools>"
    "\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n" + INSTRUCTED
    + "<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}\n<|im_start|>{{ m.role }}\n{{ m.content if m.content is string else '' }}"
    "{%- for tc in m.tool_calls or [] %}\n<tool_call>\n<function={{ tc.function.name }}>\n"
    "{%- for k, v in tc.function.arguments|items %}<parameter={{ k }}>\n"
    "{{ v | tojson if v is mapping or (v is sequence and v is not string) else v | string }}\n</parameter>\n"
    "{%- endfor %}</function>\n</tool_call>{%- endfor %}<|im_end|>{%- endfor %}"
    "{%- if add_generation_prompt %}\n<|im_start|>assistant\n{%- endif %}"
)

S = {"type": "string"}
EXAMPLE = {"type": "function", "function": {"name": "example_function_name", "parameters": {
    "type": "object", "properties": {"example_parameter_1": S, "example_parameter_2": S},
    "required": ["example_parameter_1", "example_parameter_2"]}}}
EDIT = {"type": "function", "function": {"name": "edit_file", "description": "Edit a file.", "parameters": {
    "type": "object", "required": ["path", "line"], "properties": {
        "path": S, "line": {"type": "integer", "minimum": 1, "maximum": 9999}, "ratio": {"type": "number"},
        "dry_run": {"type": "boolean"}, "mode": {"type": "string", "enum": ["append", "replace"]},
        "tags": {"type": "array", "items": S, "maxItems": 3},
        "options": {"type": "object", "properties": {"overwrite": {"type": "boolean"}}},
        "note": {"type": ["string", "null"]}, "limit": {"type": ["integer", "null"]}}}}}
PING = {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [EXAMPLE, EDIT, PING]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters") for t in TOOLS}
NAMED = {"type": "function", "function": {"name": "edit_file"}}

EDIT_CALL = xml_call("edit_file", {
    "line": "12", "path": "src/a.py", "dry_run": "True", "ratio": "0.5", "mode": "append", "tags": '["a", "b c"]',
    "options": '{"overwrite": false}', "note": "two\nlines, <b>and</b> </param", "limit": "None"})
EDIT_ARGS = {"line": 12, "path": "src/a.py", "dry_run": True, "ratio": 0.5, "mode": "append", "tags": ["a", "b c"],
             "options": {"overwrite": False}, "note": "two\nlines, <b>and</b> </param", "limit": None}
PING_CALL = xml_call("ping", {})


@pytest.fixture(scope="module")
def xml_template(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("xml_template") / "xml_calls.jinja"
    path.write_text(XML_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def tok(xml_template) -> Tokenizer:
    return Tokenizer.from_dir(DEMO, xml_template)


@pytest.fixture(scope="module")
def compiler(tok) -> GrammarCompiler:
    return GrammarCompiler.for_tokenizer(tok)


def accepts(compiler: GrammarCompiler, spec: str, tok: Tokenizer, text: str) -> bool:
    """The whole text is accepted and the grammar may end there."""
    state = compiler.new_matcher(spec)
    return all(state.accept(i) for i in tok.encode(text)) and state.is_accepting()


def typed(text: str, names=None) -> list[tuple[str, dict]]:
    parsed = parse_complete(text, "off", names or set(SCHEMAS), call_form="xml", tool_params=SCHEMAS)
    assert parsed.content is None and not parsed.cut_call, parsed
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


# ---- the form and the exact texts -------------------------------------------------------------------------------

def test_the_compiler_writes_the_template_form(tok, compiler):
    assert tok.tool_call_form == "xml" and compiler.call_form == "xml"
    hermes = GrammarCompiler.for_tokenizer(Tokenizer.from_dir(DEMO))
    assert hermes.call_form == "hermes"
    # the hermes grammar is the one it was: the same spec whichever compiler makes it
    for choice, parallel in (("required", True), (NAMED, False)):
        assert compiler.tool_calls(TOOLS, choice, parallel, form="hermes") == hermes.tool_calls(TOOLS, choice, parallel)
    with pytest.raises(ValueError, match="call_form"):
        GrammarCompiler.for_tokenizer(tok, call_form="pythonic")


def test_the_instructed_example_is_accepted(tok, compiler):
    """The example block the template shows the model, read off the rendered prompt, is exactly a call the grammar
    accepts (its parameters declared as strings): the format taught is the format enforced."""
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=[EXAMPLE], add_generation_prompt=True)
    example = instructed_example(prompt, "xml")
    assert example == INSTRUCTED == xml_call("example_function_name", {
        "example_parameter_1": "value_1",
        "example_parameter_2": "This is the value for the second parameter\nthat can span\nmultiple lines"})
    for choice in ("required", {"type": "function", "function": {"name": "example_function_name"}}):
        assert accepts(compiler, compiler.tool_calls(TOOLS, choice, parallel=False), tok, example), choice
    assert typed(example) == [("example_function_name", {
        "example_parameter_1": "value_1",
        "example_parameter_2": "This is the value for the second parameter\nthat can span\nmultiple lines"})]


@pytest.mark.parametrize("name", [n for n, (form, _) in TEMPLATES.items() if form == "xml"])
def test_the_real_templates_example_is_accepted(name):
    tok = Tokenizer.from_dir(DEMO, template_file(name))
    compiler = GrammarCompiler.for_tokenizer(tok)
    assert compiler.call_form == "xml"
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=TOOLS, add_generation_prompt=True,
                                     enable_thinking=False)
    example = instructed_example(prompt, "xml")
    assert example == INSTRUCTED
    spec = compiler.tool_calls(TOOLS, "required", parallel=True)
    assert accepts(compiler, spec, tok, example)
    assert accepts(compiler, spec, tok, EDIT_CALL + "\n" + example)
    assert not accepts(compiler, spec, tok, '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>')


def test_typed_values_any_order(tok, compiler):
    spec = compiler.tool_calls(TOOLS, NAMED, parallel=False)
    assert accepts(compiler, spec, tok, EDIT_CALL) and typed(EDIT_CALL) == [("edit_file", EDIT_ARGS)]
    jsonschema.validate(EDIT_ARGS, SCHEMAS["edit_file"])
    # required only, in either order; an empty string; booleans and null as the templates write history values
    for params, args in (({"path": "a", "line": "1"}, {"path": "a", "line": 1}),
                         ({"line": "7", "path": ""}, {"line": 7, "path": ""}),
                         ({"path": "b", "line": "2", "dry_run": "False", "limit": "None", "note": "None"},
                          {"path": "b", "line": 2, "dry_run": False, "limit": None, "note": None})):
        text = xml_call("edit_file", params)
        assert accepts(compiler, spec, tok, text), text
        assert typed(text) == [("edit_file", args)]


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "edit_file", "arguments": {"path": "a", "line": 1}}\n</tool_call>',   # hermes JSON form
    "<tool_call>\n" + '{"name": "ping", "arguments": {}}' + "\n</tool_call>",
    xml_call("delete_file", {"path": "a", "line": "1"}),                                           # unknown function
    xml_call("ping", {"path": "a"}),                                                                # ping has none
    xml_call("edit_file", {"path": "a", "line": "1", "colour": "red"}),                             # unknown parameter
    xml_call("edit_file", {"path": "a", "line": "1", "Path": "b"}),
    xml_call("edit_file", {"path": "a"}),                                                           # required missing
    xml_call("edit_file", {"path": "a", "line": "1", "path ": "b"}),
    xml_call("edit_file", {"path": "a", "line": "twelve"}),                                        # not an integer
    xml_call("edit_file", {"path": "a", "line": "0"}),                                             # below minimum
    xml_call("edit_file", {"path": "a", "line": '"1"'}),
    xml_call("edit_file", {"path": "a", "line": "1", "mode": "insert"}),                           # not in the enum
    xml_call("edit_file", {"path": "a", "line": "1", "dry_run": "yes"}),
    xml_call("edit_file", {"path": "a", "line": "1", "options": '{"force": true}'}),              # closed object
    xml_call("edit_file", {"path": "a", "line": "1", "tags": '["a", "b", "c", "d"]'}),             # maxItems
    xml_call("edit_file", {"path": "a</parameter>b", "line": "1"}),                                # a value's end
    xml_call("edit_file", {"path": "a", "line": "1"}).replace("<parameter=line>\n1\n</parameter>\n",
                                                                 "<parameter=line>\n1\n</parameter>\n" * 2),
    xml_call("edit_file", {"path": "a", "line": "1"}).replace("\n</function>", "</function>"),     # layout
    xml_call("edit_file", {"path": "a", "line": "1"}).replace("<function=edit_file>\n", "<function=edit_file>"),
    "Sure. " + PING_CALL,                                                                           # text first
])
def test_refused(tok, compiler, text):
    for choice in ("required", NAMED if "ping" not in text else {"type": "function", "function": {"name": "ping"}}):
        assert not accepts(compiler, compiler.tool_calls(TOOLS, choice, parallel=True), tok, text), (choice, text)


def test_required_named_parallel_and_allowed(tok, compiler):
    required = compiler.tool_calls(TOOLS, "required", parallel=True)
    assert accepts(compiler, required, tok, EDIT_CALL + "\n" + PING_CALL + "\n" + INSTRUCTED)
    assert [n for n, _ in typed(EDIT_CALL + "\n" + PING_CALL)] == ["edit_file", "ping"]
    single = compiler.tool_calls(TOOLS, "required", parallel=False)
    state = compiler.new_matcher(single)
    ids = tok.encode(EDIT_CALL + "\n" + PING_CALL)
    first = ids.index(tok.token_to_id("</tool_call>")) + 1
    assert all(state.accept(i) for i in ids[:first]) and state.is_finished()       # one call, then nothing
    named = compiler.tool_calls(TOOLS, NAMED, parallel=True)
    assert accepts(compiler, named, tok, EDIT_CALL + "\n" + EDIT_CALL)
    assert not accepts(compiler, named, tok, PING_CALL)
    assert not accepts(compiler, named, tok, EDIT_CALL + "\n" + PING_CALL)
    allowed = compiler.tool_calls(TOOLS, "required", parallel=False, allowed=["ping"])
    assert accepts(compiler, allowed, tok, PING_CALL) and not accepts(compiler, allowed, tok, EDIT_CALL)
    auto = compiler.tool_calls(TOOLS, "auto", parallel=False, allowed=["ping"])
    assert accepts(compiler, auto, tok, "Pinging. " + PING_CALL) and accepts(compiler, auto, tok, "no call")
    assert not accepts(compiler, auto, tok, 'Pinging. <tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>')
    answer = compiler.tool_calls(TOOLS, "auto", parallel=True, answer={
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})
    assert accepts(compiler, answer, tok, '{"ok": true}') and accepts(compiler, answer, tok, PING_CALL)
    assert not accepts(compiler, answer, tok, '{"ok": true}' + PING_CALL)


def test_undeclared_parameters_follow_additional_properties(tok, compiler):
    def tool(params):
        return [{"type": "function", "function": {"name": "f", "parameters": params}}]

    base = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    closed = compiler.tool_calls(tool(base), "required", parallel=False)
    assert accepts(compiler, closed, tok, xml_call("f", {"a": "1"}))
    assert not accepts(compiler, closed, tok, xml_call("f", {"a": "1", "b": "x"}))
    open_ = compiler.tool_calls(tool({**base, "additionalProperties": True}), "required", parallel=False)
    assert accepts(compiler, open_, tok, xml_call("f", {"b": "x y", "a": "1", "c": "[1]"}))
    assert not accepts(compiler, open_, tok, xml_call("f", {"b": "x"}))                 # a is still required
    typed_extra = compiler.tool_calls(tool({**base, "additionalProperties": {"type": "integer"}}), "required", False)
    assert accepts(compiler, typed_extra, tok, xml_call("f", {"a": "1", "b": "2"}))
    assert not accepts(compiler, typed_extra, tok, xml_call("f", {"a": "1", "b": "two"}))


def test_a_pattern_compiles_once_and_a_huge_one_is_not_kept(tok, compiler, monkeypatch):
    """A tool list resent with every turn compiles each string pattern once (`_checked_pattern_terminal`, kept per
    pattern); one past `_CACHED_PATTERN_CHARS` is compiled each time and never kept (a client's huge unique
    patterns must not pin gateway memory), with the same grammar either way."""
    import gateway.grammar as G

    compiled: list[str] = []
    real = G._pattern_terminal
    monkeypatch.setattr(G, "_pattern_terminal", lambda p: compiled.append(p) or real(p))
    G._checked_pattern_terminal.cache_clear()

    def spec(pattern):
        return compiler.tool_calls([{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}, "required": ["s"]}}}],
            "required", False)

    small, huge = "^[a-z]+$", "^" + "ab" * (G._CACHED_PATTERN_CHARS // 2) + "$"
    for _ in range(3):
        grammar = spec(small)
    assert compiled == [small]
    assert accepts(compiler, grammar, tok, xml_call("f", {"s": "abc"}))
    assert not accepts(compiler, grammar, tok, xml_call("f", {"s": "ab1"}))
    for _ in range(2):
        grammar = spec(huge)
    assert compiled == [small, huge, huge] and G._checked_pattern_terminal.cache_info().currsize == 1
    assert accepts(compiler, grammar, tok, xml_call("f", {"s": "ab" * (G._CACHED_PATTERN_CHARS // 2)}))
    assert not accepts(compiler, grammar, tok, xml_call("f", {"s": "ab"}))

def test_string_constraints_refs_and_names(tok, compiler):
    def spec(params, strict=False):
        return compiler.tool_calls([{"type": "function", "function": {"name": "f", "parameters": params,
                                                                      "strict": strict}}], "required", False)

    short = spec({"type": "object", "properties": {"s": {"type": "string", "maxLength": 3, "pattern": "^[a-z]+$"}},
                  "required": ["s"]})
    assert accepts(compiler, short, tok, xml_call("f", {"s": "abc"}))
    for bad in ("abcd", "ab1", ""):
        assert not accepts(compiler, short, tok, xml_call("f", {"s": bad})), bad
    refs = spec({"type": "object", "$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer"}},
                                                   "required": ["x"]}, "C": {"enum": ["red", "blue"]}},
                 "properties": {"p": {"$ref": "#/$defs/P"}, "c": {"$ref": "#/$defs/C"}}, "required": ["p", "c"]})
    assert accepts(compiler, refs, tok, xml_call("f", {"c": "red", "p": '{"x": 1}'}))
    assert not accepts(compiler, refs, tok, xml_call("f", {"c": "green", "p": '{"x": 1}'}))
    assert not accepts(compiler, refs, tok, xml_call("f", {"c": "red", "p": '{"y": 1}'}))
    # a pattern llguidance cannot enforce: refused, as in the hermes form (test_malformed_schemas_refused_alike)
    lookahead = {"type": "object", "properties": {"s": {"type": "string", "pattern": "(?=a)a"}}, "required": ["s"]}
    for strict in (False, True):
        with pytest.raises(GrammarError, match="look-around"):
            spec(lookahead, strict=strict)
    # a name <parameter=NAME> cannot carry: left out when optional, refused when required
    odd = {"type": "object", "properties": {"a>b": S, "c": S}}
    assert accepts(compiler, spec(odd), tok, xml_call("f", {"c": "1"}))
    with pytest.raises(GrammarError, match="a>b"):
        spec({**odd, "required": ["a>b"]})


# ---- booleans and null as the templates write them ------------------------------------------------------------

SPELLED = {"type": "object", "$defs": {"B": {"type": "boolean"}}, "properties": {
    "flag": {"type": "boolean"}, "ref": {"$ref": "#/$defs/B"}, "n": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
    "on": {"enum": [True, None]}, "off": {"const": False},
    "opts": {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "null"}}},
    "both": {"anyOf": [{"type": "boolean"}, {"type": "array", "items": {"type": "boolean"}}]},
    "unsure": {"type": ["boolean", "null"], "not": {"const": None}}}}


@pytest.mark.parametrize("name,text,ok", [
    ("flag", "True", True), ("flag", "False", True), ("flag", "true", False), ("flag", "false", False),
    ("ref", "False", True), ("ref", "false", False), ("n", "None", True), ("n", "null", False), ("n", "3", True),
    ("on", "True", True), ("on", "None", True), ("on", "False", False), ("on", "true", False),
    ("off", "False", True), ("off", "True", False), ("off", "false", False),
    ("opts", '{"a": true, "b": null}', True), ("opts", "{'a': True}", False),         # nested: JSON, as tojson
    ("both", "True", True), ("both", "[true]", True), ("both", "true", False), ("both", "[True]", False),
    ("unsure", "true", True), ("unsure", "False", False),   # `not`: cannot tell which ones, JSON as before
])
def test_top_level_booleans_and_null_in_the_templates_spelling(tok, compiler, name, text, ok):
    """The XML templates write an earlier call's top-level booleans and null with Jinja's `| string`: `True`,
    `False`, `None`. A forced call writes them so (not `true` / `null`), so the next turn's prompt, which re-renders
    the call, holds the tokens generated (the prefix cache keeps them) and the model sees its own spelling; the
    parser reads both spellings."""
    spec = compiler.tool_calls(_tool(SPELLED), "required", False)
    call = xml_call("f", {name: text})
    assert accepts(compiler, spec, tok, call) == ok
    if ok:
        jsonschema.validate(json.loads(parse_complete(call, "off", {"f"}, call_form="xml", tool_params={
            "f": SPELLED}).tool_calls[0].arguments), SPELLED)


@pytest.mark.parametrize("name", [n for n, (form, _) in TEMPLATES.items() if form == "xml"])
def test_a_forced_call_is_re_rendered_as_generated(name):
    """With the real templates, a call the grammar accepts, parsed and sent back as history, renders to exactly the
    text generated (booleans and null included)."""
    t = Tokenizer.from_dir(DEMO, template_file(name))
    c = GrammarCompiler.for_tokenizer(t)
    call = xml_call("edit_file", {"path": "src/a.py", "line": "12", "dry_run": "False", "limit": "None",
                                  "note": "None", "ratio": "0.5", "mode": "append"})
    assert accepts(c, c.tool_calls(TOOLS, NAMED, False), t, call)
    args = json.loads(parse_complete(call, "off", set(SCHEMAS), call_form="xml", tool_params=SCHEMAS)
                      .tool_calls[0].arguments)
    assert args == {"path": "src/a.py", "line": 12, "dry_run": False, "limit": None, "note": None, "ratio": 0.5,
                    "mode": "append"}
    history = [{"role": "user", "content": "edit"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "edit_file", "arguments": args}}]}]
    assert call in t.apply_chat_template(history, tools=TOOLS, add_generation_prompt=False)


# ---- a schema is checked alike in both forms --------------------------------------------------------------------

def _string_param(**kw) -> dict:
    return {"type": "object", "properties": {"v": {"type": "string", **kw}}, "required": ["v"]}


MALFORMED = {
    "required a string": {"type": "object", "properties": {"city": {"type": "string"}}, "required": "city"},
    "properties a list": {"type": "object", "properties": [1, 2]},
    "allOf an object": {"type": "object", "allOf": {"a": 1}},
    "type a number": {"type": "object", "properties": {"v": {"type": 7}}},
    "type a list of numbers": {"type": "object", "properties": {"v": {"type": [1, 2]}}},
    "external $ref": {"type": "object", "properties": {"v": {"$ref": "http://x/y.json"}}},
    "minLength a fraction": _string_param(minLength=1.5),
    "pattern unbalanced": _string_param(pattern="("),
    "pattern lookbehind": _string_param(pattern="(?<=a)b"),
    "pattern anchor inside": _string_param(pattern="a^b"),
    "oneOf overlapping": {"type": "object", "properties": {"v": {"oneOf": [{"type": "string"},
                                                                             {"type": "string", "maxLength": 3}]}}},
}


@pytest.mark.parametrize("name", list(MALFORMED))
@pytest.mark.parametrize("strict", [False, True])
def test_malformed_schemas_refused_alike(tok, compiler, name, strict):
    """A tool schema the hermes form refuses (llguidance's JSON compiler) the XML form refuses too, with the same
    message: the XML grammar holds the schema piecemeal and passed `"required": "city"` (read a character at a time:
    c, i, t, y required), `properties` a list, an external `$ref`, ..."""
    hermes = GrammarCompiler.for_tokenizer(Tokenizer.from_dir(DEMO))
    tools = _tool(MALFORMED[name], strict)
    errors = []
    for c in (hermes, compiler):
        with pytest.raises(GrammarError) as e:
            c.tool_calls(tools, "required", False)
        errors.append(str(e.value))
    assert errors[0] == errors[1], errors
    with pytest.raises(GrammarError) as again:          # the check's answer is kept: refused again, the same way
        compiler.tool_calls(tools, "required", False)
    assert str(again.value) == errors[0]


def test_malformed_schema_is_the_same_400_in_both_forms(tok):
    from test_real_chat_templates import MODEL, client_for

    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "tools": _tool(MALFORMED["required a string"]), "tool_choice": "required"}
    answers = []
    for t in (tok, Tokenizer.from_dir(DEMO)):
        client, _ = client_for(t, "unused")
        r = client.post("/v1/chat/completions", json=body)
        answers.append((r.status_code, r.json()))
    assert answers[0] == answers[1] and answers[0][0] == 400, answers
    assert answers[0][1]["error"]["param"] == "tools" and "required" in answers[0][1]["error"]["message"]


# ---- a pattern is an unanchored search ---------------------------------------------------------------------------

PATTERNS = ["^ab|cd$", "ab|cd", "x|^y", "^(ab|cd)$", "(^a|b)c", "(a|(^b|c))d", "((^a))", "^a$|^b$", "(?:a$|b)",
            "a\\$", "[|^]x|y", "a|", "^$", "^(a|b)+$", "(?<n>^a|b)$", "b($|a)"]
TEXTS = ["", "a", "b", "ab", "abxx", "xxab", "cd", "xxcd", "cdxx", "ac", "xac", "bc", "xbcx", "y", "zy", "x", "zxz",
         "a$", "bd", "xbd", "xad", "xb", "ba", "aab", "|x"]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_pattern_is_an_unanchored_search(tok, compiler, pattern):
    """JSON Schema's `pattern` is an unanchored (ECMAScript) search, `^` / `$` anchoring to the text's start / end:
    a text is accepted exactly when `re.search` finds the pattern in it, as in the hermes form. (`^ab|cd$` had its
    anchors stripped as if they covered the whole alternation: "abxx" and "xxcd" were refused.)"""
    hermes = GrammarCompiler.for_tokenizer(Tokenizer.from_dir(DEMO))
    tools = _tool(_string_param(pattern=pattern), strict=True)
    spec, hermes_spec = compiler.tool_calls(tools, "required", False), hermes.tool_calls(tools, "required", False)
    python = re.compile(pattern.replace("(?<n>", "(?P<n>"))
    for text in TEXTS:
        want = python.search(text) is not None
        assert accepts(compiler, spec, tok, xml_call("f", {"v": text})) == want, (pattern, text)
        hermes_text = '<tool_call>\n{"name": "f", "arguments": %s}\n</tool_call>' % json.dumps({"v": text})
        assert accepts(hermes, hermes_spec, tok, hermes_text) == want, (pattern, text)


# ---- random walks: every text the grammar allows parses into valid arguments --------------------------------------

WALK_TOOLS = [
    {"type": "function", "function": {"name": "edit_file", "parameters": {
        "type": "object", "required": ["path", "line"], "properties": {
            "path": {"type": "string", "maxLength": 8}, "line": {"type": "integer", "minimum": 1, "maximum": 999},
            "dry_run": {"type": "boolean"}, "mode": {"enum": ["append", "replace"]},
            "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
            "limit": {"type": ["integer", "null"], "minimum": 0, "maximum": 9},
            "options": {"type": "object", "properties": {"overwrite": {"type": "boolean"}},
                        "required": ["overwrite"]}}}}},
    PING,
    # types said without a direct `type`: through $ref, anyOf (pydantic's Optional[...]), enum, allOf, a root $ref
    {"type": "function", "function": {"name": "configure", "parameters": {
        "$ref": "#/$defs/Config", "$defs": {
            "Config": {"type": "object", "required": ["version", "mode"], "properties": {
                "version": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "mode": {"$ref": "#/$defs/Mode"}, "level": {"$ref": "#/$defs/Level"},
                "flag": {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
                "answer": {"enum": ["1", "2.5", "true", "null"]}, "code": {"$ref": "#/$defs/Code"},
                "scale": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": [None, 0.5]}]},
                "seen": {"type": "array", "items": {"$ref": "#/$defs/Mode"}, "maxItems": 2}},
                "allOf": [{"properties": {"tag": {"type": "string", "enum": ["007", "None"]}}}]},
            "Mode": {"enum": ["42", "fast", "False"]}, "Level": {"type": "integer", "minimum": 0, "maximum": 3},
            "Code": {"type": "string", "maxLength": 3}}}}},
]
WALK_SCHEMAS = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in WALK_TOOLS}
VALUE_END = "\n</parameter>\n"


@pytest.mark.parametrize("seed", range(10))
def test_random_walks_parse_into_valid_calls(tok, compiler, seed):
    """Random texts the grammar allows (a token drawn uniformly from the mask; now and then a free-text value is
    ended, else it would run on) parse into arguments valid under the tool's schema, whichever way the schema says
    a parameter's type."""
    rng = np.random.default_rng(seed)
    spec = compiler.tool_calls(WALK_TOOLS, "required" if seed % 3 else {"type": "function", "function": {
        "name": "configure"}}, parallel=seed % 2 == 1)
    state = compiler.new_matcher(spec)
    ids: list[int] = []
    end = tok.encode(VALUE_END)
    for _ in range(800):
        if state.is_finished():
            break
        if len(ids) > 8 and rng.random() < 0.15 and state.matcher.validate_tokens(end) == len(end):
            assert all(state.accept(t) for t in end), state.error
            ids += end
            continue
        allowed = np.flatnonzero(mask_to_bool(state.mask(), compiler.vocab_size))
        assert allowed.size, "empty mask"
        eos = np.isin(allowed, tok.eos_token_ids)
        w = np.where(eos, 50.0 if len(ids) > 40 else 0.0, 1.0)
        token = int(rng.choice(allowed, p=w / w.sum()) if w.sum() else rng.choice(allowed))
        assert state.accept(token), state.error
        ids.append(token)
    assert state.is_finished() and state.error is None
    text = tok.decode([i for i in ids if i not in tok.eos_token_ids], skip_special_tokens=False)
    assert text.startswith("<tool_call>\n<function=") and '{"name"' not in text, text
    parsed = parse_complete(text, "off", set(WALK_SCHEMAS), call_form="xml", tool_params=WALK_SCHEMAS)
    assert parsed.content is None and parsed.tool_calls and not parsed.cut_call, (text, parsed)
    for call in parsed.tool_calls:
        jsonschema.validate(json.loads(call.arguments), WALK_SCHEMAS[call.name])


# ---- the grammar and the parser read a parameter's type alike ----------------------------------------------------

def _tool(params: dict, strict: bool = False) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", "parameters": params, "strict": strict}}]


def _obj(**props) -> dict:
    return {"type": "object", "properties": props, "required": list(props)}


STR_OR_NULL = {"anyOf": [{"type": "string"}, {"type": "null"}]}        # pydantic's Optional[str] (openai-agents)


@pytest.mark.parametrize("params,text,value", [
    (_obj(v=STR_OR_NULL), "3.10", "3.10"), (_obj(v=STR_OR_NULL), "None", None), (_obj(v=STR_OR_NULL), "x y", "x y"),
    ({"type": "object", "$defs": {"S": {"type": "string"}}, "properties": {"v": {"$ref": "#/$defs/S"}},
      "required": ["v"]}, "42", "42"),
    (_obj(v={"enum": ["1", "2"]}), "1", "1"),
    ({"type": "object", "allOf": [{"properties": {"v": {"type": "string"}}}], "required": ["v"]}, "true", "true"),
    (_obj(v={"type": ["string", "null"]}), "007", "007"), (_obj(v={"type": ["string", "null"]}), "3.10", "3.10"),
    (_obj(v={"type": ["string", "null"]}), "True", "True"), (_obj(v={"type": ["string", "null"]}), "None", None),
    ({"$ref": "#/$defs/P", "$defs": {"P": {"type": "object", "properties": {"v": {"type": "integer"}},
                                           "required": ["v"]}}}, "5", 5),
    ({"type": "object", "$defs": {"B": {"type": "boolean"}}, "properties": {"v": {"$ref": "#/$defs/B"}},
      "required": ["v"]}, "False", False),
    (_obj(v={"anyOf": [{"type": "integer"}, {"type": "null"}]}), "None", None),
    (_obj(v={"anyOf": [{"type": "integer"}, {"type": "null"}]}), "7", 7),
    (_obj(v={"enum": [1, None]}), "1", 1),
    # pointers that are no $defs entry (zod-to-json-schema's default): followed, as the hermes form follows them
    ({"type": "object", "properties": {"n": {"type": "integer"}, "v": {"$ref": "#/properties/n"}},
      "required": ["v"]}, "12", 12),
    ({"type": "object", "$defs": {"P": {"type": "object", "properties": {"b": {"type": "boolean"}}}},
      "properties": {"v": {"$ref": "#/$defs/P/properties/b"}}, "required": ["v"]}, "True", True),
])
def test_the_grammar_and_the_parser_agree_on_types(tok, compiler, params, text, value):
    """A text the grammar accepts for a parameter parses into a value valid under the schema: the grammar and the
    parser read the parameter's admitted types alike (they did not: the grammar followed $ref / anyOf / enum / allOf,
    the parser only a direct `type`, so a `$ref` to a string gave 42 for "42", Optional[str] 3.1 for "3.10")."""
    spec = compiler.tool_calls(_tool(params, strict=True), {"type": "function", "function": {"name": "f"}}, False)
    call = xml_call("f", {"v": text})
    assert accepts(compiler, spec, tok, call)
    parsed = parse_complete(call, "off", {"f"}, call_form="xml", tool_params={"f": params})
    args = json.loads(parsed.tool_calls[0].arguments)
    assert args == {"v": value} and type(args["v"]) is type(value), args
    jsonschema.validate(args, params)


def test_a_pointer_ref_constrains_the_value(tok, compiler):
    """`{"$ref": "#/properties/n"}` (zod's way to reuse a property) was not followed in the XML form: the parameter
    was free text, so a call whose value is not the integer the schema names was allowed. Now refused; and a
    recursive pointer (`#`, the root) compiles."""
    params = {"type": "object", "properties": {"n": {"type": "integer"}, "v": {"$ref": "#/properties/n"}},
              "required": ["v"]}
    spec = compiler.tool_calls(_tool(params, strict=True), {"type": "function", "function": {"name": "f"}}, False)
    assert accepts(compiler, spec, tok, xml_call("f", {"v": "12"}))
    assert not accepts(compiler, spec, tok, xml_call("f", {"v": "twelve"}))
    tree = {"type": "object", "properties": {"name": {"type": "string"},
                                             "children": {"type": "array", "items": {"$ref": "#"}}},
            "required": ["name"], "additionalProperties": False}
    spec = compiler.tool_calls(_tool(tree, strict=True), {"type": "function", "function": {"name": "f"}}, False)
    call = xml_call("f", {"name": "root", "children": '[{"name": "a", "children": []}]'})
    assert accepts(compiler, spec, tok, call)
    args = json.loads(parse_complete(call, "off", {"f"}, call_form="xml", tool_params={"f": tree})
                      .tool_calls[0].arguments)
    jsonschema.validate(args, tree)
    assert args["children"] == [{"name": "a", "children": []}]


def test_optional_str_end_to_end(tok):
    """The openai-agents SDK's strict schema for `set_version(version: str | None)`: a forced call's "3.10" comes
    back the string "3.10" (it came back 3.1, which the schema refuses)."""
    from test_real_chat_templates import MODEL, client_for

    params = {"type": "object", "properties": {"version": {**STR_OR_NULL, "title": "Version"}},
              "required": ["version"], "additionalProperties": False}
    tool = {"type": "function", "function": {"name": "set_version", "parameters": params, "strict": True}}
    for text, value in (("3.10", "3.10"), ("None", None)):
        client, engine = client_for(tok, xml_call("set_version", {"version": text}))
        r = client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "pin python 3.10"}], "tools": [tool],
            "tool_choice": "required"})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and engine.last.grammar is not None
        assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"version": value}


# ---- end to end: the tiny model's engine samples under the mask, the gateway returns the calls ----------------------

PICK = {"type": "function", "function": {"name": "pick", "description": "Pick one.", "parameters": {
    "type": "object", "required": ["color", "count", "label"], "properties": {
        "color": {"type": "string", "enum": ["red", "blue"]}, "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "label": {"type": "string", "maxLength": 6}, "exact": {"type": "boolean"},
        "sizes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 2}}}}}
NOTE = {"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "required": ["text"], "properties": {"text": {"type": "string", "maxLength": 5}}}}}


@pytest.fixture(scope="module")
def engine_core(tiny_checkpoint):
    from stage_worker.inprocess_executor import local_engine_core

    core = local_engine_core(tiny_checkpoint, max_model_len=2048, max_num_seqs=2)
    yield core
    core.stop()


def _client(core, model_dir: Path, tok: Tokenizer) -> TestClient:
    app = create_app(AsyncEngine(core), tok, model_name="m", generation_config=read_generation_config(model_dir),
                     metrics=Metrics())
    return TestClient(app, raise_server_exceptions=False)


def _forced(client: TestClient, tool_choice, **extra) -> tuple[dict, str]:
    body = {"model": "m", "messages": [{"role": "user", "content": "Pick a colour."}], "tools": [PICK, NOTE],
            "tool_choice": tool_choice, "max_tokens": 400, "temperature": 0, "logprobs": True, **extra}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice, "".join(t["token"] for t in choice["logprobs"]["content"])


def _check_forced(client: TestClient, tool_choice) -> None:
    choice, raw = _forced(client, tool_choice, parallel_tool_calls=False)
    assert raw.startswith("<tool_call>\n<function=") and "</function>\n</tool_call>" in raw, raw   # the XML form
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
    (call,) = choice["message"]["tool_calls"]
    name, args = call["function"]["name"], json.loads(call["function"]["arguments"])
    if isinstance(tool_choice, dict):
        assert name == tool_choice["function"]["name"]
    schema = {"pick": PICK, "note": NOTE}[name]["function"]["parameters"]
    jsonschema.validate(args, schema)                  # typed: count an integer, exact a boolean, sizes a list
    if name == "pick":
        assert isinstance(args["count"], int) and args["color"] in ("red", "blue")
    # streamed: the same call
    body = {"model": "m", "messages": [{"role": "user", "content": "Pick a colour."}], "tools": [PICK, NOTE],
            "tool_choice": tool_choice, "max_tokens": 400, "temperature": 0, "parallel_tool_calls": False,
            "stream": True}
    lines = [ln.removeprefix("data: ") for ln in client.post("/v1/chat/completions", json=body).text.splitlines()
             if ln.startswith("data: {")]
    chunks = [c["choices"][0] for c in map(json.loads, lines) if c["choices"]]
    streamed = {"name": None, "arguments": ""}
    for c in chunks:
        for tc in c["delta"].get("tool_calls") or []:
            streamed["name"] = streamed["name"] or tc["function"].get("name")
            streamed["arguments"] += tc["function"].get("arguments") or ""
    assert (streamed["name"], json.loads(streamed["arguments"])) == (name, args)
    assert [c["finish_reason"] for c in chunks if c["finish_reason"]] == ["tool_calls"]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "pick"}}])
def test_forced_call_end_to_end_in_the_xml_form(engine_core, tiny_checkpoint, xml_template, tool_choice):
    tok = Tokenizer.from_dir(tiny_checkpoint, xml_template)
    assert tok.tool_call_form == "xml"
    _check_forced(_client(engine_core, tiny_checkpoint, tok), tool_choice)


@pytest.mark.parametrize("name", [n for n, (form, _) in TEMPLATES.items() if form == "xml"])
def test_forced_call_end_to_end_with_the_real_templates(engine_core, tiny_checkpoint, name):
    tok = Tokenizer.from_dir(tiny_checkpoint, template_file(name))
    _check_forced(_client(engine_core, tiny_checkpoint, tok), {"type": "function", "function": {"name": "pick"}})


def test_forced_calls_of_a_hermes_template_stay_hermes(engine_core, tiny_checkpoint):
    tok = Tokenizer.from_dir(tiny_checkpoint)            # the tiny model's own template: the hermes JSON form
    assert tok.tool_call_form == "hermes"
    choice, raw = _forced(_client(engine_core, tiny_checkpoint, tok), "required", parallel_tool_calls=False)
    assert re.match(r'<tool_call>\n\{"name": "(pick|note)", "arguments": \{', raw), raw
    assert choice["finish_reason"] == "tool_calls" and len(choice["message"]["tool_calls"]) == 1
