"""JSON schemas as coding agents send them, through a real served cluster (`moepipe serve`'s launcher: the gateway
and one stage worker, each its own process, on the tiny checkpoint) and the `openai` client. Each test is a bug
found that way and fails without its fix."""

from __future__ import annotations

import json

import jsonschema
import pytest

from conftest import OpenAI, free_port

MODEL = "moepipe"
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    from gateway.launcher import Cluster, ServeOptions

    opts = ServeOptions(model=tiny_checkpoint, stages=1, port=free_port(),
                        extra={"max_model_len": 512, "access_log": False, "ple_service": False})
    with Cluster(opts) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.url + "/v1", api_key="x", timeout=120, max_retries=0)


def _json_answer(client, schema: dict, strict: bool, max_tokens: int = 60):
    r = client.chat.completions.create(
        model=MODEL, messages=HI, max_tokens=max_tokens, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": strict}})
    return r.choices[0]


def _forced_call(client, schema: dict, max_tokens: int = 60):
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=max_tokens, temperature=0,
                                       tools=[tool], tool_choice="required")
    return r.choices[0]


# ---- allOf extending a $defs model: the model was closed to its own keys, so the intersection admitted nothing ----

# a model extending another by reference (zod's `Base.and(...)` with a shared Base, pydantic-v1 / OpenAPI
# generators' `allOf: [{"$ref": Base}, {extra fields}]`): a 400 "required property 'b' is unsatisfiable"
EXTENDS = {"allOf": [{"$ref": "#/$defs/Base"},
                     {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}],
           "$defs": {"Base": {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}}}


@pytest.mark.parametrize("strict", [False, True])
def test_allof_with_a_ref_member_is_served_and_followed(client, strict):
    choice = _json_answer(client, EXTENDS, strict)
    assert choice.finish_reason == "stop", choice
    value = json.loads(choice.message.content)
    jsonschema.Draft202012Validator(EXTENDS).validate(value)
    assert set(value) == {"a", "b"}, value


def test_allof_with_a_ref_member_in_tool_parameters_is_a_valid_call(client):
    choice = _forced_call(client, EXTENDS)
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    args = json.loads(choice.message.tool_calls[0].function.arguments)
    jsonschema.Draft202012Validator(EXTENDS).validate(args)
    assert set(args) == {"a", "b"}, args


def test_a_ref_member_keeps_its_definition_closed_elsewhere(client):
    """The definition itself stays closed where it is used on its own: only its use inside allOf is opened."""
    schema = {"type": "object", "properties": {"base": {"$ref": "#/$defs/Base"}, "ext": EXTENDS["allOf"][0]},
              "required": ["base"], "additionalProperties": False, "$defs": EXTENDS["$defs"]}
    choice = _json_answer(client, schema, True)
    assert choice.finish_reason == "stop", choice
    value = json.loads(choice.message.content)
    jsonschema.Draft202012Validator(schema).validate(value)
    assert set(value["base"]) == {"a"}, value


# ---- `required` naming a key `properties` does not declare: closing the object made a valid schema unsatisfiable --

# {"type": "object", "required": ["x"]} is any object with an "x"; hand-written MCP tool schemas list required keys
# they forgot to declare. Closed to the declared properties (docs/agents.md, "Closed objects") it admitted nothing:
# a 400 "required property 'x' is unsatisfiable" for a valid schema, and in a tool list every constrained request
# offering that tool failed.
UNDECLARED = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a", "b"]}


@pytest.mark.parametrize("schema", [UNDECLARED, {"type": "object", "required": ["b"]}], ids=["some", "none"])
def test_required_but_undeclared_key_is_served(client, schema):
    choice = _json_answer(client, schema, False, max_tokens=120)
    assert choice.finish_reason in ("stop", "length"), choice
    if choice.finish_reason == "stop":
        value = json.loads(choice.message.content)
        jsonschema.Draft202012Validator(schema).validate(value)
    else:
        assert choice.message.content.startswith("{"), choice
    call = _forced_call(client, schema, max_tokens=120)
    assert call.finish_reason in ("tool_calls", "length") and call.message.tool_calls, call
    if call.finish_reason == "tool_calls":
        jsonschema.Draft202012Validator(schema).validate(json.loads(call.message.tool_calls[0].function.arguments))


def test_explicitly_closed_object_with_an_undeclared_required_key_is_still_a_400(client):
    """additionalProperties false written by the client makes such a schema unsatisfiable: the 400 stays."""
    import openai

    schema = {**UNDECLARED, "additionalProperties": False}
    with pytest.raises(openai.BadRequestError) as e:
        _json_answer(client, schema, True)
    assert e.value.body["param"] == "response_format.json_schema.schema", e.value.body
    assert "'b'" in e.value.body["message"], e.value.body
