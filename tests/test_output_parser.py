"""OutputParser: streamed deltas, under any chunking, assemble to exactly the non-streamed parse."""

from __future__ import annotations

import itertools
import dataclasses
import json
import random

import pytest

from gateway.output_parser import Delta, OutputParser, ParsedOutput, ToolCall, assemble, parse_complete

TOOLS = {"get_weather", "search"}


def ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def call(name: str, args: str) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


NESTED_ARGS = (
    r'{"q": {"a": [1, {"b": "}{]["}, [], {}], "s": "say \"hi\" {"}, "t": "</tool_call>", '
    r'"u": "back\\slash\\", "v": "<tool_call>", "w": null}'
)
CALL_W = call("get_weather", '{"city": "Paris"}')
CALL_S = call("search", '{"query": "weather [paris]", "top_k": 3}')
W = ToolCall("call_0", "get_weather", '{"city": "Paris"}')
S0 = ToolCall("call_0", "search", '{"query": "weather [paris]", "top_k": 3}')
S1 = ToolCall("call_1", "search", '{"query": "weather [paris]", "top_k": 3}')

# (id, text, reasoning mode, tool names, expected result)
CASES = [
    ("plain", "Hello, world!\nBye <tool_call", "off", None, ParsedOutput(None, "Hello, world!\nBye <tool_call", [])),
    ("plain_tools_on", "Hello, world!\n", "off", TOOLS, ParsedOutput(None, "Hello, world!\n", [])),
    ("empty", "", "auto", TOOLS, ParsedOutput(None, None, [])),
    ("auto_think", "<think>\nLet me think.\n\n</think>\n\nThe answer is 4.", "auto", None,
     ParsedOutput("Let me think.", "The answer is 4.", [])),
    ("auto_think_leading_ws", "\n <think>a < b </thin\n</think>c", "auto", None, ParsedOutput("a < b </thin", "c", [])),
    ("auto_no_think", "  Just <thin an answer.", "auto", None, ParsedOutput(None, "  Just <thin an answer.", [])),
    ("inside", "I should add.\n</think>\n\n4", "inside", None, ParsedOutput("I should add.", "4", [])),
    ("inside_empty_reasoning", "\n</think>\n\n4", "inside", TOOLS, ParsedOutput(None, "4", [])),
    ("off_think_is_content", "<think>x</think>\ny", "off", None, ParsedOutput(None, "<think>x</think>\ny", [])),
    ("one_call", CALL_W, "off", TOOLS, ParsedOutput(None, None, [W])),
    ("two_calls", CALL_W + "\n" + CALL_S + "\n", "off", TOOLS,
     ParsedOutput(None, None, [W, S1])),
    ("content_then_call", "Let me check.\n\n" + CALL_S, "off", TOOLS, ParsedOutput(None, "Let me check.", [S0])),
    ("think_content_call", "<think>\nmaybe " + CALL_W + "\n</think>\n\nChecking. " + CALL_S, "auto", TOOLS,
     ParsedOutput("maybe " + CALL_W, "Checking.", [S0])),
    ("content_between_calls", "A\n" + CALL_W + "\nB\n" + CALL_S + "\n\n", "off", TOOLS,
     ParsedOutput(None, "A\nB", [W, S1])),
    ("content_after_call_only", CALL_W + "\n\nDone.\n", "off", TOOLS, ParsedOutput(None, "Done.\n", [W])),
    ("nested", call("search", NESTED_ARGS), "off", TOOLS,
     ParsedOutput(None, None, [ToolCall("call_0", "search", NESTED_ARGS)])),
    ("odd_whitespace", '<tool_call>{ "name" :"search" ,\n\t"arguments":{ }  }</tool_call>x', "off", TOOLS,
     ParsedOutput(None, "x", [ToolCall("call_0", "search", "{ }")])),
    ("bad_json_header", 'Hi\n<tool_call>\n{"name": get_weather}\n</tool_call>\n' + CALL_S, "off", TOOLS,
     ParsedOutput(None, 'Hi\n<tool_call>\n{"name": get_weather}\n</tool_call>', [S0])),
    ("unknown_name", call("delete_all", "{}"), "off", TOOLS, ParsedOutput(None, call("delete_all", "{}"), [])),
    ("args_not_object", call("search", '"q"'), "off", TOOLS, ParsedOutput(None, call("search", '"q"'), [])),
    ("args_first", '<tool_call>\n{"arguments": {}, "name": "search"}\n</tool_call>', "off", TOOLS,
     ParsedOutput(None, '<tool_call>\n{"arguments": {}, "name": "search"}\n</tool_call>', [])),
    # generation ended inside a header that could still be a call's (max_tokens): a truncated call, no markup
    ("unterminated_header", 'Ok.\n<tool_call>\n{"name": "get_wea', "off", TOOLS, ParsedOutput(None, "Ok.", [])),
    ("unterminated_header_alone", '<tool_call>\n{"name"', "off", TOOLS, ParsedOutput(None, None, [])),
    ("malformed_unclosed", '<tool_call>\n{"nom": 1} <tool_call> x\n', "off", TOOLS,
     ParsedOutput(None, '<tool_call>\n{"nom": 1} <tool_call> x\n', [])),
    # documented: once the header is accepted the call is committed, even if its arguments never close
    ("unterminated_args", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', "off", TOOLS,
     ParsedOutput(None, None, [ToolCall("call_0", "get_weather", '{"city": "Par')], cut_call=True)),
    ("args_broken_by_end_marker", '<tool_call>\n{"name": "search", "arguments": {"a": 1\n</tool_call>\nmore', "off",
     TOOLS, ParsedOutput(None, "more", [ToolCall("call_0", "search", '{"a": 1\n')])),
    ("no_end_marker", '<tool_call>\n{"name": "search", "arguments": {"a": 1}}\nThen text', "off", TOOLS,
     ParsedOutput(None, "Then text", [ToolCall("call_0", "search", '{"a": 1}')])),
    ("tools_disabled", "Hi " + CALL_W, "off", None, ParsedOutput(None, "Hi " + CALL_W, [])),
    ("unterminated_reasoning", "<think>\nstill thinking " + CALL_W + "\n", "auto", TOOLS,
     ParsedOutput("still thinking " + CALL_W + "\n", None, [])),
    ("unterminated_inside", "thinking <tool_call> </thi", "inside", TOOLS,
     ParsedOutput("thinking <tool_call> </thi", None, [])),
]


def chunkings(text: str) -> list[tuple[str, list[str]]]:
    out = [("whole", [text]), ("chars", list(text))]
    for seed in range(6):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
        bounds = [0, *cuts, len(text)]
        out.append((f"seed{seed}", [text[a:b] for a, b in zip(bounds, bounds[1:])]))
    return out


def stream(text: str, reasoning: str, tools: set[str] | None, pieces: list[str],
           cut: list[bool] | None = None) -> list[list[Delta]]:
    parser = OutputParser(reasoning, tools, id_factory=ids())
    batches = [parser.feed(p) for p in pieces]
    batches.append(parser.finish())
    if cut is not None:
        cut.append(parser.cut_call)
    return batches


@pytest.mark.parametrize("case_id,text,reasoning,tools,expected", CASES, ids=[c[0] for c in CASES])
def test_stream_matches_complete(case_id, text, reasoning, tools, expected):
    complete = parse_complete(text, reasoning, tools, id_factory=ids())
    assert complete == expected
    for name, pieces in chunkings(text):
        assert "".join(pieces) == text
        cut: list[bool] = []
        deltas = [d for batch in stream(text, reasoning, tools, pieces, cut) for d in batch]
        assert dataclasses.replace(assemble(deltas), cut_call=cut[0]) == complete, name
        seen: set[int] = set()
        for d in deltas:
            if d.tool_index is None:
                assert (d.content or d.reasoning), (name, d)      # no empty text deltas
            elif d.tool_index not in seen:
                seen.add(d.tool_index)
                assert d.tool_id and d.name and d.arguments == "", (name, d)
            else:
                assert d.tool_id is None and d.name is None and d.arguments, (name, d)


def test_nested_args_are_valid_json():
    assert json.loads(NESTED_ARGS)["u"] == "back\\slash\\"


def test_arguments_stream_before_call_closes():
    parser = OutputParser("off", TOOLS, id_factory=ids())
    assert parser.feed("Hello <tool") == [Delta(content="Hello")]
    assert parser.feed('_call>\n{"name": "get_weather"') == []            # header still buffered
    assert parser.feed(', "arguments": ') == []
    assert parser.feed('{"city": "Pa') == [
        Delta(tool_index=0, tool_id="call_0", name="get_weather", arguments=""),
        Delta(tool_index=0, arguments='{"city": "Pa'),
    ]
    assert parser.feed('ris"}') == [Delta(tool_index=0, arguments='ris"}')]
    assert parser.feed("}\n</tool_call>") == []
    assert parser.finish() == []


def test_malformed_header_decided_before_first_delta():
    parser = OutputParser("off", TOOLS, id_factory=ids())
    assert parser.feed('<tool_call>\n{"name": "get_weather", "argu') == []
    assert parser.feed('ments":  ') == []
    out = parser.feed('"Paris"}\n</tool_call>')
    assert out == [Delta(content='<tool_call>\n{"name": "get_weather", "arguments":  "Paris"}\n</tool_call>')]
    assert parser.finish() == []


def test_reasoning_streams_and_holds_marker_prefix():
    parser = OutputParser("auto", None)
    assert parser.feed("<thi") == []
    assert parser.feed("nk>\nstep one") == [Delta(reasoning="step one")]
    assert parser.feed("\n</th") == []
    assert parser.feed("ink>\n\nAnswer") == [Delta(content="Answer")]
    assert parser.finish() == []


def test_random_ids_by_default():
    out = parse_complete(CALL_W, "off", TOOLS)
    (tool,) = out.tool_calls
    assert tool.id.startswith("call_") and len(tool.id) == 5 + 24
    int(tool.id[5:], 16)


def test_feed_after_finish_raises():
    parser = OutputParser("off", None)
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("x")


FRAGMENTS = [
    "<think>", "</think>", "<tool_call>", "</tool_call>", "\n", " ", "x", "<", "{", "}", "[", "]", '"', "\\", ",",
    '{"name": "search", "arguments": ', '{"name": "nope", "arguments": ', '{"a": "}"}', "</thi", "<tool_",
]


@pytest.mark.parametrize("reasoning", ["off", "auto", "inside"])
def test_fuzz_chunking_invariance(reasoning):
    rng = random.Random(1234)
    for _ in range(150):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(0, 14)))
        complete = parse_complete(text, reasoning, TOOLS, id_factory=ids())
        for name, pieces in chunkings(text)[1:4]:
            deltas = [d for batch in stream(text, reasoning, TOOLS, pieces) for d in batch]
            assert assemble(deltas) == complete, (text, name)


def test_max_calls_keeps_the_first_calls_streamed_or_not():
    """parallel_tool_calls false (and a legacy functions reply): one call, whatever the model writes after it."""
    text = "Sure.\n" + CALL_W + "\n" + CALL_S + "\n" + call("get_weather", '{"city": "Rome"}')
    complete = parse_complete(text, "off", TOOLS, id_factory=ids(), max_calls=1)
    assert complete == ParsedOutput(None, "Sure.", [W])
    for name, pieces in chunkings(text):
        parser = OutputParser("off", TOOLS, id_factory=ids(), max_calls=1)
        deltas = [d for p in pieces for d in parser.feed(p)] + parser.finish()
        assert assemble(deltas) == complete, name
        assert all(d.tool_index in (None, 0) for d in deltas), name
    assert len(parse_complete(text, "off", TOOLS, id_factory=ids()).tool_calls) == 3


def test_cut_call_flag_only_for_a_kept_call():
    """`cut_call` says the reply ended inside a kept call's arguments; a call dropped by max_calls is no cut, and a
    closed call or a truncated header is none either."""
    first = call("search", '{"q": 1}')
    cut = '<tool_call>\n{"name": "search", "arguments": {"q": '
    assert parse_complete(first + cut, "off", TOOLS).cut_call
    assert not parse_complete(first + cut, "off", TOOLS, max_calls=1).cut_call
    assert not parse_complete(first, "off", TOOLS).cut_call
    assert not parse_complete('<tool_call>\n{"name": "sea', "off", TOOLS).cut_call


# ---- the XML form (Qwen3-Coder / Qwen3.5 templates: call_form="xml") -------------------------------------------

def xcall(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


XCALL_W = xcall("get_weather", city="Paris", days="3")
XW = ToolCall("call_0", "get_weather", '{"city": "Paris", "days": 3}')
XS1 = ToolCall("call_1", "search", '{"query": "a < b"}')
SCHEMAS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
    "search": {"type": "object", "properties": {
        "query": {"type": "string"}, "top_k": {"type": "integer"}, "exact": {"type": "boolean"},
        "filters": {"type": "object"}, "tags": {"type": "array"}, "note": {"type": ["string", "null"]},
        "limit": {"type": "number"}}},
}

XML_CASES = [
    ("x_one_call", XCALL_W, "off", ParsedOutput(None, None, [XW])),
    ("x_content_then_call", "Let me check.\n\n" + XCALL_W + "\n", "off", ParsedOutput(None, "Let me check.", [XW])),
    ("x_parallel", XCALL_W + "\n" + xcall("search", query="a < b") + "\n", "off",
     ParsedOutput(None, None, [XW, XS1])),
    ("x_think_then_call", "<think>\nmaybe " + XCALL_W + "\n</think>\n\n" + XCALL_W, "auto",
     ParsedOutput("maybe " + XCALL_W, None, [XW])),
    ("x_content_after", XCALL_W + "\n\nDone.", "off", ParsedOutput(None, "Done.", [XW])),
    ("x_no_params", "<tool_call>\n<function=search>\n</function>\n</tool_call>", "off",
     ParsedOutput(None, None, [ToolCall("call_0", "search", "{}")])),
    ("x_multiline_value", xcall("search", query="line 1\n\nline 3\n"), "off",
     ParsedOutput(None, None, [ToolCall("call_0", "search", json.dumps({"query": "line 1\n\nline 3\n"}))])),
    ("x_unclosed_parameters", "<tool_call>\n<function=search>\n<parameter=query>\nx\n<parameter=top_k>\n2\n"
     "</function>\n</tool_call>", "off", ParsedOutput(None, None, [ToolCall("call_0", "search",
                                                                            '{"query": "x", "top_k": 2}')])),
    ("x_hermes_inside_xml_form", CALL_W, "off", ParsedOutput(None, None, [W])),
    ("x_unknown_name", "A " + xcall("delete_all", path="/") + " B", "off",
     ParsedOutput(None, "A " + xcall("delete_all", path="/") + " B", [])),
    ("x_no_function", "<tool_call>\n<parameter=city>\nParis\n</parameter>\n</tool_call>\n" + XCALL_W, "off",
     ParsedOutput(None, "<tool_call>\n<parameter=city>\nParis\n</parameter>\n</tool_call>", [XW])),
    ("x_malformed_unclosed", "<tool_call>\nhello <tool_call> x", "off",
     ParsedOutput(None, "<tool_call>\nhello <tool_call> x", [])),
    # cut by max_tokens: no function name yet -> dropped; after the name -> kept with the closed parameters, flagged
    ("x_cut_before_name", "Ok.\n<tool_call>\n<function=get_wea", "off", ParsedOutput(None, "Ok.", [])),
    ("x_cut_after_tag", "<tool_call>\n", "off", ParsedOutput(None, None, [])),
    ("x_cut_in_value", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
     "<parameter=days>\n3", "off", ParsedOutput(None, None, [ToolCall("call_0", "get_weather", '{"city": "Paris"}')],
                                                 cut_call=True)),
    ("x_cut_before_close", XCALL_W[:-len("</tool_call>")], "off", ParsedOutput(None, None, [XW], cut_call=True)),
]


@pytest.mark.parametrize("case_id,text,reasoning,expected", XML_CASES, ids=[c[0] for c in XML_CASES])
def test_xml_form_stream_matches_complete(case_id, text, reasoning, expected):
    complete = parse_complete(text, reasoning, TOOLS, id_factory=ids(), call_form="xml")
    assert complete == expected
    for name, pieces in chunkings(text):
        parser = OutputParser(reasoning, TOOLS, id_factory=ids(), call_form="xml")
        batches = [parser.feed(p) for p in pieces] + [parser.finish()]
        deltas = [d for b in batches for d in b]
        assert dataclasses.replace(assemble(deltas), cut_call=parser.cut_call) == complete, name
        for d in deltas:     # XML calls: one first delta, then the whole arguments, in the same batch
            if d.tool_id is not None and case_id != "x_hermes_inside_xml_form":
                batch = next(b for b in batches if d in b)
                assert [x.arguments for x in batch if x.tool_index == d.tool_index][1:] == \
                    [json.dumps(json.loads(complete.tool_calls[d.tool_index].arguments))], name


def test_xml_values_typed_by_schema():
    text = xcall("search", query="42", top_k="3", exact="true", filters='{"lang": "en"}', tags='["a", "b"]',
                 note="null", limit="2.5", extra='{"k": 1}', other="hello", quoted='"x"')
    args = json.loads(parse_complete(text, "off", TOOLS, call_form="xml", tool_params=SCHEMAS).tool_calls[0].arguments)
    assert args == {"query": "42", "top_k": 3, "exact": True, "filters": {"lang": "en"}, "tags": ["a", "b"],
                    "note": None, "limit": 2.5, "extra": {"k": 1}, "other": "hello", "quoted": '"x"'}
    # a declared non-string type that does not parse stays text; without schemas, JSON values parse
    bad = xcall("search", top_k="three", exact="yes")
    assert json.loads(parse_complete(bad, "off", TOOLS, call_form="xml", tool_params=SCHEMAS).tool_calls[0]
                      .arguments) == {"top_k": "three", "exact": "yes"}
    plain = xcall("get_weather", city="Paris", days="3")
    assert json.loads(parse_complete(plain, "off", TOOLS, call_form="xml").tool_calls[0].arguments) == \
        {"city": "Paris", "days": 3}
    # one newline each side is stripped, no more
    spaced = "<tool_call>\n<function=search>\n<parameter=query>\n\n  q  \n\n</parameter>\n</function>\n</tool_call>"
    assert json.loads(parse_complete(spaced, "off", TOOLS, call_form="xml", tool_params=SCHEMAS).tool_calls[0]
                      .arguments) == {"query": "\n  q  \n"}


def test_xml_values_as_the_real_templates_write_them():
    """The Qwen3-Coder and Qwen3.5 templates write a history call's non-string values with Jinja's `| string`
    (`True`, `None`; the first Qwen3-Coder template objects too: `{'k': 'v'}`), and models imitate them: a declared
    non-string type reads them as Python literals; a string property, or an undeclared one, keeps the words."""
    def args(**params: str) -> dict:
        text = xcall("search", **params)
        return json.loads(parse_complete(text, "off", TOOLS, call_form="xml", tool_params=SCHEMAS).tool_calls[0]
                          .arguments)

    assert args(exact="True", note="None", filters="{'lang': 'en', 'strict': False}", tags="['a', ('b', 1)]") == \
        {"exact": True, "note": None, "filters": {"lang": "en", "strict": False}, "tags": ["a", ["b", 1]]}
    # a reading whose type the schema does not admit stays text: None for an integer, True for a number
    assert args(top_k="None", limit="True") == {"top_k": "None", "limit": "True"}
    assert args(exact="FALSE", query="None", other="True") == {"exact": False, "query": "None", "other": "True"}
    # no JSON value: a set, a non-string key, non-finite numbers, code
    assert args(tags="{1, 2}", filters="{1: 'x'}", limit="1e999", top_k="NaN", extra="__import__('os')") == \
        {"tags": "{1, 2}", "filters": "{1: 'x'}", "limit": "1e999", "top_k": "NaN", "extra": "__import__('os')"}


def _typed(schema: dict, **params: str) -> dict:
    text = xcall("f", **params)
    return json.loads(parse_complete(text, "off", {"f"}, call_form="xml", tool_params={"f": schema}).tool_calls[0]
                      .arguments)


def _obj(**props) -> dict:
    return {"type": "object", "properties": props}


STR_OR_NULL = {"anyOf": [{"type": "string"}, {"type": "null"}]}        # pydantic's Optional[str] (openai-agents)


@pytest.mark.parametrize("schema,text,value", [
    # a property that admits only strings, said without a direct `type`: the text, whatever JSON it looks like
    ({"type": "object", "$defs": {"S": {"type": "string"}}, "properties": {"v": {"$ref": "#/$defs/S"}}}, "42", "42"),
    ({"type": "object", "definitions": {"S": {"type": "string"}}, "properties": {"v": {"$ref": "#/definitions/S"}}},
     "true", "true"),
    (_obj(v={"enum": ["1", "2"]}), "1", "1"),
    (_obj(v={"const": "null"}), "null", "null"),
    (_obj(v={"allOf": [{"type": "string"}, {"maxLength": 9}]}), "[1, 2]", "[1, 2]"),
    ({"type": "object", "allOf": [{"properties": {"v": {"type": "string"}}}]}, "true", "true"),
    ({"$ref": "#/$defs/P", "$defs": {"P": {"type": "object", "properties": {"v": {"type": "string"}}}}}, "7", "7"),
    ({"type": "object", "additionalProperties": {"type": "string"}}, "7", "7"),
    # strings or null: null for None / null, else the text; other readings are not admitted
    (_obj(v=STR_OR_NULL), "3.10", "3.10"), (_obj(v=STR_OR_NULL), "None", None), (_obj(v=STR_OR_NULL), "null", None),
    (_obj(v=STR_OR_NULL), "true", "true"), (_obj(v=STR_OR_NULL), "'quoted'", "'quoted'"),
    (_obj(v={"type": ["string", "null"]}), "True", "True"), (_obj(v={"type": ["string", "null"]}), "[1, 2]", "[1, 2]"),
    (_obj(v={"type": ["string", "null"]}), "{'a': 1}", "{'a': 1}"), (_obj(v={"type": ["string", "null"]}), "3.10",
                                                                      "3.10"),
    (_obj(v={"type": ["string", "null"]}), "None", None), (_obj(v={"type": ["string", "null"]}), "007", "007"),
    # other types through $ref / anyOf / enum / allOf are read as they are admitted
    ({"type": "object", "$defs": {"N": {"type": "integer"}}, "properties": {"v": {"$ref": "#/$defs/N"}}}, "42", 42),
    (_obj(v={"anyOf": [{"type": "integer"}, {"type": "null"}]}), "None", None),
    (_obj(v={"anyOf": [{"type": "integer"}, {"type": "null"}]}), "7", 7),
    (_obj(v={"anyOf": [{"type": "boolean"}, {"type": "array"}]}), "True", True),
    (_obj(v={"anyOf": [{"type": "boolean"}, {"type": "array"}]}), "['a']", ["a"]),
    (_obj(v={"enum": [1, 2.5, None]}), "2.5", 2.5), (_obj(v={"enum": [1, 2.5, None]}), "None", None),
    (_obj(v={"enum": [1, "a"]}), "1", 1), (_obj(v={"enum": [1, "a"]}), "a", "a"),
    (_obj(v={"allOf": [{"type": ["integer", "string"]}, {"type": ["integer", "null"]}]}), "None", "None"),
    (_obj(v={"type": "number"}), "3", 3), (_obj(v={"type": "integer"}), "3.0", 3.0),
    (_obj(v={"type": "integer"}), "True", "True"), (_obj(v={"type": "integer"}), "1.5", "1.5"),
    (_obj(v={"type": "integer"}), "'5'", "'5'"), (_obj(v={"type": "integer"}), "(1, 2)", "(1, 2)"),
    (_obj(v={"type": "array"}), "(1, 2)", [1, 2]),
    # nothing said: JSON when it gives a non-string, else the text (no Python literals)
    (_obj(v={}), "42", 42), (_obj(v={}), "None", "None"), (_obj(v={"$ref": "#/$defs/missing"}), "42", 42),
    # malformed schemas (the parser reads what no grammar checked): they say nothing, nothing raises
    ({"type": "object", "properties": [1, 2]}, "42", 42), ({"type": "object", "required": "v"}, "1", 1),
    ({"type": "object", "allOf": {"a": 1}, "properties": {"v": {"type": 7}}}, "1", 1),
    ({"$ref": "#/$defs/A", "$defs": {"A": {"$ref": "#/$defs/A"}}}, "1", 1),
])
def test_xml_values_keep_only_admitted_readings(schema, text, value):
    """The parser reads a property's admitted JSON types as the XML grammar does (gateway.json_schema_types): `$ref`,
    `anyOf` / `oneOf`, `enum` / `const`, `allOf`, a root `$ref`, undeclared parameters by `additionalProperties`. A
    JSON or Python-literal reading is kept only where its type is admitted, else the text; `None` is null wherever
    null is admitted. (It read `properties[key]["type"]` only: a `$ref` to a string turned "42" into 42, Optional[str]
    "3.10" into 3.1.)"""
    args = _typed(schema, v=text)
    assert args == {"v": value} and type(args["v"]) is type(value), args


# The call format the Qwen3-Coder and Qwen3.5 templates instruct (their tools section, verbatim)
INSTRUCTED = ("<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n"
              "</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can "
              "span\nmultiple lines\n</parameter>\n</function>\n</tool_call>")


def test_xml_instructed_format_split_at_every_character():
    text = "Sure.\n\n" + INSTRUCTED + "\n" + INSTRUCTED.replace("value_1", "2")
    tools = {"example_function_name"}
    schema = {"example_function_name": {"type": "object", "properties": {
        "example_parameter_1": {"type": "integer"}, "example_parameter_2": {"type": "string"}}}}
    second = "This is the value for the second parameter\nthat can span\nmultiple lines"
    expected = ParsedOutput(None, "Sure.", [
        ToolCall("call_0", "example_function_name", json.dumps({"example_parameter_1": "value_1",
                                                                  "example_parameter_2": second})),
        ToolCall("call_1", "example_function_name", json.dumps({"example_parameter_1": 2,
                                                                  "example_parameter_2": second}))])
    assert parse_complete(text, "off", tools, id_factory=ids(), call_form="xml", tool_params=schema) == expected
    splits = [list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]
    for pieces in splits:
        parser = OutputParser("off", tools, id_factory=ids(), call_form="xml", tool_params=schema)
        assert assemble([d for p in pieces for d in parser.feed(p)] + parser.finish()) == expected, pieces


def test_xml_form_hermes_default_leaves_xml_as_text():
    assert parse_complete(XCALL_W, "off", TOOLS) == ParsedOutput(None, XCALL_W, [])
    with pytest.raises(ValueError):
        OutputParser("off", TOOLS, call_form="mistral")


def test_xml_max_calls_and_cut_flag():
    text = XCALL_W + "\n" + xcall("search", query="q") + "\n<tool_call>\n<function=search>\n<parameter=query>\nz"
    assert parse_complete(text, "off", TOOLS, id_factory=ids(), call_form="xml", max_calls=1) == \
        ParsedOutput(None, None, [XW])
    assert not parse_complete(text, "off", TOOLS, call_form="xml", max_calls=1).cut_call
    full = parse_complete(text, "off", TOOLS, call_form="xml")
    assert full.cut_call and [c.arguments for c in full.tool_calls][2] == "{}"


XML_FRAGMENTS = [
    "<think>", "</think>", "<tool_call>", "</tool_call>", "\n", " ", "x", "<", ">", "3", '"', "{",
    "<function=search>", "<function=nope>", "<function=", "<parameter=query>", "<parameter=top_k>", "</parameter>",
    "</function>", "<param", "</tool_", '{"name": "search", "arguments": ', "}",
]


@pytest.mark.parametrize("reasoning", ["off", "auto", "inside"])
def test_xml_fuzz_chunking_invariance(reasoning):
    rng = random.Random(4321)
    for _ in range(200):
        text = "".join(rng.choice(XML_FRAGMENTS) for _ in range(rng.randint(0, 16)))
        complete = parse_complete(text, reasoning, TOOLS, id_factory=ids(), call_form="xml", tool_params=SCHEMAS)
        for name, pieces in chunkings(text)[1:5]:
            parser = OutputParser(reasoning, TOOLS, id_factory=ids(), call_form="xml", tool_params=SCHEMAS)
            deltas = [d for p in pieces for d in parser.feed(p)] + parser.finish()
            assert dataclasses.replace(assemble(deltas), cut_call=parser.cut_call) == complete, (text, name)
            for c in complete.tool_calls:
                assert isinstance(json.loads(c.arguments), dict), text


def test_malformed_block_split_inside_its_end_marker():
    """A block rejected while a piece ends inside its `</tool_call>` still ends there (both forms)."""
    text = "<tool_call>x</tool_call><tool_call>"
    for form in ("hermes", "xml"):
        complete = parse_complete(text, "off", TOOLS, call_form=form)
        assert complete == ParsedOutput(None, "<tool_call>x</tool_call>", [])
        parser = OutputParser("off", TOOLS, call_form=form)
        deltas = parser.feed("<tool_call>x</tool_c") + parser.feed("all>") + parser.feed("<tool_call>")
        assert assemble(deltas + parser.finish()) == complete, form
