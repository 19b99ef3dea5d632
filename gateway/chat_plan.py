"""How one chat request is rendered, constrained and parsed: messages, tools, tool_choice, response_format and
thinking.

Coding agents send `tools` with every turn and side requests with `response_format: json_schema`. This module checks
those fields (a 400 naming the field for anything we cannot honour, never a silent fallback) and decides:

* what the chat template sees: the messages (`template_messages`: developer messages as system, refusal parts and
  legacy function turns as text and tool turns), the tools (not with tool_choice "none") and `chat_template_kwargs`
  such as `enable_thinking`;
* which grammar, if any, constrains sampling: `response_format` json_object / json_schema (or one of vLLM's
  extras: guided_json / guided_regex / guided_choice / guided_grammar / structured_outputs), a forced tool call
  (tool_choice "required", a named function, allowed_tools "required") whose arguments follow the tool's parameter
  schema, a call restricted to allowed_tools, or "a call or the schema's JSON" (response_format with callable tools);
  calls in the chat template's form (the compiler's `call_form`: hermes JSON, or Qwen3-Coder / Qwen3.5 XML);
* how the reply is split: reasoning (the `<think>` block) into `reasoning_content`, tool-call blocks into
  `tool_calls` (or, for a legacy `functions` request, the first call into `function_call`), the rest into `content`.

Decisions where the API is silent (docs/agents.md): a grammar and thinking do not mix (the grammar would have to let
free reasoning through first): a constrained request renders with `enable_thinking: false`, and asking for both is a
400.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import invalid_request
from gateway.output_parser import OutputParser, ParsedOutput, parse_complete
from gateway.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest

TOOL_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")   # OpenAI's rule for function names


@dataclass
class ChatPlan:
    tools: list[dict[str, Any]] | None                 # what the template renders (None: no tools section)
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    reasoning: str = "auto"                             # OutputParser mode: "off" | "auto"
    tool_names: set[str] | None = None                  # parse tool-call blocks for these names (None: never)
    grammar: Any = None                                 # a compiled grammar spec (gateway.grammar) or None
    compiler: Any = None                                # the GrammarCompiler that compiled it (new_matcher)
    legacy: bool = False                                # a `functions` request: answer with message.function_call
    max_calls: int | None = None                        # 1: parallel_tool_calls false or legacy (OutputParser)
    call_form: str = "hermes"                           # tool-call form of the template (Tokenizer.tool_call_form)
    tool_params: dict[str, Any] = field(default_factory=dict)   # name -> parameters schema (XML values' types)

    def output_parser(self, **kwargs: Any) -> OutputParser:
        """The parser of this request's replies."""
        return OutputParser(self.reasoning, self.tool_names, max_calls=self.max_calls, call_form=self.call_form,
                            tool_params=self.tool_params, **kwargs)

    def parse_complete(self, text: str) -> ParsedOutput:
        """A whole reply parsed (the non-streamed answer)."""
        return parse_complete(text, self.reasoning, self.tool_names, max_calls=self.max_calls,
                              call_form=self.call_form, tool_params=self.tool_params)


@dataclass
class _Choice:
    """tool_choice resolved: mode "none" | "auto" | "required" | "named", and the names that may be called (None:
    every tool)."""
    mode: str
    allowed: list[str] | None = None


def _tools(raw: list[dict[str, Any]] | None, param: str, legacy: bool = False) -> list[dict[str, Any]]:
    """OpenAI tools (or, `legacy`, the old `functions` list of bare function objects) as template tools."""
    out, seen = [], set()
    for i, tool in enumerate(raw or []):
        where = f"{param}[{i}]"
        fn = tool if legacy else (tool.get("function") if isinstance(tool, dict) else None)
        if legacy and not isinstance(fn, dict):
            raise invalid_request(f"{where} must be a function object {{\"name\", \"parameters\", ...}}.",
                                  param=where)
        if not legacy and (not isinstance(tool, dict) or tool.get("type", "function") != "function"
                           or not isinstance(fn, dict)):
            raise invalid_request(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}.", param=where)
        where_fn = where if legacy else f"{where}.function"
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise invalid_request(f"{where_fn}.name must be 1-64 letters, digits, '_', '.' or '-'.",
                                  param=f"{where_fn}.name")
        if name in seen:
            raise invalid_request(f"Two tools are named {name!r}.", param=f"{where_fn}.name")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise invalid_request(f"{where_fn}.parameters must be a JSON Schema object.",
                                  param=f"{where_fn}.parameters")
        seen.add(name)
        out.append({"type": "function", "function": fn})
    return out


def _legacy_choice(req: ChatCompletionRequest) -> str | dict[str, Any] | None:
    """function_call as a tool_choice: "none" / "auto" as they are, {"name": X} as the named function X."""
    fc = req.function_call
    if fc is None or fc in ("none", "auto"):
        return fc
    if isinstance(fc, dict) and isinstance(fc.get("name"), str):
        return {"type": "function", "function": {"name": fc["name"]}}
    raise invalid_request("function_call must be 'none', 'auto' or {\"name\": ...}.", param="function_call")


def _tool_choice(choice: str | dict[str, Any] | None, names: set[str], param: str) -> _Choice:
    if choice is None:
        return _Choice("auto" if names else "none")
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise invalid_request(f"{param} must be 'none', 'auto', 'required', a named function or allowed_tools.",
                                  param=param)
        if choice == "required" and not names:
            raise invalid_request(f"{param} 'required' needs at least one tool in tools.", param=param)
        return _Choice("none" if not names else choice)
    if not isinstance(choice, dict):
        raise invalid_request(f"{param} must be a string or an object.", param=param)
    if choice.get("type") == "allowed_tools":
        return _allowed_tools(choice.get("allowed_tools"), names, param)
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    if choice.get("type", "function") != "function" or not isinstance(name, str):
        raise invalid_request(f"{param} must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}} or "
                              "{\"type\": \"allowed_tools\", ...}.", param=param)
    if name not in names:
        raise invalid_request(f"{param} names {name!r}, which is not in tools.", param=param)
    return _Choice("named", [name])


def _allowed_tools(spec: Any, names: set[str], param: str) -> _Choice:
    """{"mode": "auto" | "required", "tools": [{"type": "function", "function": {"name": ...}}, ...]}; a tool given
    as {"type": "function", "name": ...} (the Responses API's spelling) is accepted too."""
    where = f"{param}.allowed_tools"
    if not isinstance(spec, dict) or spec.get("mode") not in ("auto", "required"):
        raise invalid_request(f"{where}.mode must be 'auto' or 'required'.", param=f"{where}.mode")
    listed = spec.get("tools")
    if not isinstance(listed, list) or not listed:
        raise invalid_request(f"{where}.tools must be a non-empty list of functions.", param=f"{where}.tools")
    allowed = []
    for i, tool in enumerate(listed):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(name, str):
            raise invalid_request(f"{where}.tools[{i}] must be {{\"type\": \"function\", \"function\": "
                                  "{\"name\": ...}}.", param=f"{where}.tools[{i}]")
        if name not in names:
            raise invalid_request(f"{where}.tools[{i}] names {name!r}, which is not in tools.",
                                  param=f"{where}.tools[{i}]")
        allowed.append(name)
    allowed = list(dict.fromkeys(allowed))
    return _Choice(spec["mode"], None if set(allowed) == names else allowed)


_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
_STRUCTURED = ("json", "regex", "choice", "grammar", "json_object")


def guided_format(req: ChatCompletionRequest | CompletionRequest) -> tuple[str, Any, bool, str] | None:
    """vLLM's structured-output extras as (kind, value, strict, the field it came from): guided_json (a schema, or
    its JSON text) -> json_schema, guided_regex -> regex, guided_choice -> choice, guided_grammar (a Lark grammar,
    llguidance's dialect) -> grammar, or the same under `structured_outputs` (json / regex / choice / grammar /
    json_object).
    None when none is given; more than one is a 400. vLLM clients send these through extra_body: ignoring them
    would answer 200 with unconstrained text."""
    found = [(name, getattr(req, name)) for name in _GUIDED if getattr(req, name) is not None]
    so = req.structured_outputs
    if so is not None:
        unknown = sorted(set(so) - set(_STRUCTURED) - {"disable_any_whitespace", "disable_additional_properties",
                                                       "whitespace_pattern", "backend"})
        if unknown:
            raise invalid_request(f"structured_outputs.{unknown[0]} is not supported (one of "
                                  f"{', '.join(_STRUCTURED)}).", param=f"structured_outputs.{unknown[0]}")
        found += [(f"structured_outputs.{k}", so[k]) for k in _STRUCTURED if so.get(k) not in (None, False)]
    if not found:
        return None
    if len(found) > 1:
        raise invalid_request(f"Give one structured-output constraint, not {found[0][0]} and {found[1][0]}.",
                              param=found[1][0])
    param, value = found[0]
    kind = param.rsplit(".", 1)[-1].removeprefix("guided_")
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise invalid_request(f"{param} is not valid JSON.", param=param) from None
        if not isinstance(value, dict):
            raise invalid_request(f"{param} must be a JSON Schema object.", param=param)
        return "json_schema", value, False, param
    if kind == "json_object":
        return "json_object", None, False, param
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
            raise invalid_request(f"{param} must be a non-empty list of non-empty strings.", param=param)
        return "choice", value, False, param
    if not isinstance(value, str) or not value:
        raise invalid_request(f"{param} must be a non-empty string.", param=param)
    return kind, value, False, param


_SCHEMA_PARAM = "response_format.json_schema.schema"


def _response_format(req: ChatCompletionRequest | CompletionRequest) -> tuple[str, Any, bool, str]:
    """('text' | 'json_object' | 'json_schema' | 'regex' | 'choice' | 'grammar', schema or pattern, strict, the
    field it came from, which errors about it name): response_format, or one of vLLM's extras (`guided_format`),
    not both."""
    rf = req.response_format
    guided = guided_format(req)
    if guided is not None:
        if rf is not None and rf.get("type", "text") != "text":
            raise invalid_request("response_format and a guided_* / structured_outputs constraint cannot both be "
                                  "given.", param="response_format")
        return guided
    if rf is None:
        return "text", None, False, "response_format"
    kind = rf.get("type", "text")
    if kind == "text":
        return "text", None, False, "response_format"
    if kind == "json_object":
        return "json_object", None, False, "response_format"
    if kind == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise invalid_request("response_format json_schema needs json_schema.schema (a JSON Schema object).",
                                  param=_SCHEMA_PARAM)
        return "json_schema", schema, bool(spec.get("strict", False)), _SCHEMA_PARAM
    raise invalid_request(f"response_format type {kind!r} is not supported (text, json_object, json_schema).",
                          param="response_format")


def apply_effort(kwargs: dict[str, Any], effort: str | None, param: str) -> None:
    """OpenAI's reasoning effort "none" is the Qwen3 switch `enable_thinking: false` (in `kwargs`, the template's
    arguments); other efforts keep the template's default (Qwen3 and the demo model have no effort levels)."""
    if effort != "none":
        return
    if kwargs.get("enable_thinking") is True:
        raise invalid_request(f"{param} 'none' contradicts chat_template_kwargs.enable_thinking true.", param=param)
    kwargs["enable_thinking"] = False


def plan_chat(req: ChatCompletionRequest, get_compiler: Callable[[], Any]) -> ChatPlan:
    """Validate the agent-facing fields and decide rendering, constraint and parsing (see the module docstring).
    `get_compiler()` gives the gateway.grammar.GrammarCompiler (None when the server has no grammar engine); it is
    called only for a constrained request, so plain requests never build one."""
    legacy = req.functions is not None
    if legacy:
        if req.tools is not None or req.tool_choice is not None:
            raise invalid_request("functions (legacy) cannot be combined with tools or tool_choice.",
                                  param="functions")
        tools = _tools(req.functions, "functions", legacy=True)
        names = {t["function"]["name"] for t in tools}
        choice = _tool_choice(_legacy_choice(req), names, "function_call")
    else:
        if req.function_call is not None:
            raise invalid_request("function_call goes with the legacy functions; with tools use tool_choice.",
                                  param="function_call")
        tools = _tools(req.tools, "tools")
        names = {t["function"]["name"] for t in tools}
        choice = _tool_choice(req.tool_choice, names, "tool_choice")
    fmt, schema, strict, fmt_param = _response_format(req)
    kwargs = dict(req.chat_template_kwargs or {})
    if req.parallel_tool_calls is not None and not isinstance(req.parallel_tool_calls, bool):
        raise invalid_request("parallel_tool_calls must be a boolean.", param="parallel_tool_calls")
    parallel = req.parallel_tool_calls is not False and not legacy     # a legacy reply holds one function_call
    constrained = fmt != "text" or choice.mode in ("required", "named") or (
        choice.mode == "auto" and choice.allowed is not None)
    thinking = kwargs.get("enable_thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise invalid_request("chat_template_kwargs.enable_thinking must be a boolean.",
                              param="chat_template_kwargs.enable_thinking")
    apply_effort(kwargs, req.reasoning_effort, "reasoning_effort")
    thinking = kwargs.get("enable_thinking")
    compiler = grammar = None
    if constrained:
        if thinking is True:
            raise invalid_request("Thinking cannot be combined with structured output, a forced tool call or "
                                  "allowed_tools; set chat_template_kwargs.enable_thinking to false.",
                                  param="chat_template_kwargs.enable_thinking")
        kwargs["enable_thinking"] = False
        compiler = get_compiler()
        if compiler is None:
            raise invalid_request("This server has no grammar engine: structured output and forced tool calls are "
                                  "unavailable.", param=fmt_param if fmt != "text"
                                  else "function_call" if legacy else "tool_choice")
        grammar = _compile(compiler, fmt, schema, strict, choice, tools, parallel,
                           "functions" if legacy else "tools", fmt_param)
    callable_tools = choice.mode != "none" and bool(tools)
    return ChatPlan(tools=tools if callable_tools else None, template_kwargs=kwargs,
                    reasoning="off" if kwargs.get("enable_thinking") is False else "auto",
                    tool_names=set(choice.allowed or names) if callable_tools else None,
                    grammar=grammar, compiler=compiler, legacy=legacy, max_calls=None if parallel else 1,
                    tool_params={t["function"]["name"]: t["function"].get("parameters") for t in tools})


def _compile(compiler, fmt: str, schema: dict | None, strict: bool, choice: _Choice, tools: list[dict],
             parallel: bool, tools_param: str, fmt_param: str = _SCHEMA_PARAM):
    """The grammar spec of a constrained request; a schema the engine cannot enforce is a 400 naming it (the field
    the client sent it in, `fmt_param`: response_format's schema, guided_json, structured_outputs.json).

    Tools callable: "required" / named force calls (response_format does not apply: the reply is a call);
    "auto" with response_format json allows a call or the JSON answer; "auto" with allowed_tools allows text or a
    call to an allowed tool. Tools not callable: the JSON grammar alone."""
    from gateway.grammar import GrammarError

    if fmt in ("regex", "choice", "grammar"):
        if choice.mode != "none":
            raise invalid_request(f"A guided {fmt} cannot be combined with callable tools; send tool_choice \"none\" "
                                  "or no tools.", param="tool_choice")
        return text_grammar(compiler, fmt, schema, fmt_param)
    try:                                # the answer schema alone first, so its errors name where it was sent
        answer_only = compiler.json_schema(schema, strict) if fmt == "json_schema" else None
    except GrammarError as e:
        raise invalid_request(f"Cannot enforce this schema: {e}", param=fmt_param) from None
    if choice.mode == "none":
        return answer_only if fmt == "json_schema" else compiler.json_object()
    # json_object is any object, as without tools (an open object: a bare {"type": "object"} would be closed to {})
    answer = {"type": "object", "additionalProperties": True} if fmt == "json_object" else schema
    try:
        if choice.mode == "named":
            return compiler.tool_calls(tools, {"type": "function", "function": {"name": choice.allowed[0]}},
                                       parallel)
        if choice.mode == "required":
            return compiler.tool_calls(tools, "required", parallel, allowed=choice.allowed)
        return compiler.tool_calls(tools, "auto", parallel, allowed=choice.allowed,
                                   answer=answer if fmt != "text" else None, answer_strict=strict)
    except GrammarError as e:
        raise invalid_request(f"Cannot enforce this schema: {e}", param=tools_param) from None


def text_grammar(compiler, fmt: str, value: Any, param: str) -> str:
    """The grammar spec of a regex / choice / Lark constraint; what llguidance refuses is a 400 naming `param`, the
    field it was sent in (guided_regex, structured_outputs.regex, ...)."""
    from gateway.grammar import GrammarError

    make = {"regex": compiler.regex, "choice": compiler.choice, "grammar": compiler.lark}[fmt]
    try:
        return make(value)
    except (GrammarError, ValueError, TypeError) as e:
        raise invalid_request(f"Cannot enforce this {fmt}: {e}", param=param) from None


def completion_grammar(req: CompletionRequest, get_compiler: Callable[[], Any]) -> tuple[Any, Any]:
    """(grammar spec, compiler) for /v1/completions' response_format or vLLM extras, (None, None) for plain text."""
    fmt, schema, strict, fmt_param = _response_format(req)
    if fmt == "text":
        return None, None
    compiler = get_compiler()
    if compiler is None:
        raise invalid_request("This server has no grammar engine: structured output is unavailable.",
                              param=fmt_param)
    if fmt in ("regex", "choice", "grammar"):
        return text_grammar(compiler, fmt, schema, fmt_param), compiler
    return _compile(compiler, fmt, schema, strict, _Choice("none"), [], False, "prompt", fmt_param), compiler


# ---- messages -------------------------------------------------------------------------------------------------

def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the chat template sees them (content parts pass through, as transformers passes them).

    OpenAI roles and shapes the Qwen templates do not know are mapped: `developer` is `system` (OpenAI treats it so);
    the leading run of system/developer messages becomes one system message, their texts joined by a blank line in
    order (templates take only the first message as the system prompt, and the tools section joins it); an
    assistant's `refusal` content part (or `refusal` field with no content) is its text; the legacy
    `{"role": "function", "name", "content"}` result is a tool turn and an assistant's legacy `function_call` a tool
    call. A call's `arguments`, JSON text as OpenAI sends it, reach the template as the object it holds (as vLLM
    passes them, and transformers documents): templates in the Qwen3-Coder / Qwen3.5 form iterate them
    (`tool_call.arguments|items`) and cannot read a string; hermes templates write an object with `tojson`. Text
    that is not a JSON object stays text, and empty text is `{}`."""
    out = [_template_message(i, m) for i, m in enumerate(messages)]
    for m in out:
        for call in m.get("tool_calls") or [] if m["role"] == "assistant" else []:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                fn["arguments"] = _arguments_object(fn["arguments"])
    call_id = None                      # a legacy function result answers the latest legacy call
    for m, original in zip(out, messages):
        if original.role == "assistant" and m.get("tool_calls"):
            call_id = m["tool_calls"][0].get("id")
        elif original.role == "function":
            m.setdefault("tool_call_id", call_id or "call_0")
    lead = 0
    while lead < len(out) and out[lead]["role"] == "system":
        lead += 1
    if lead > 1:
        merged = {**out[0], "content": "\n\n".join(_text(m["content"]) for m in out[:lead])}
        out = [merged] + out[lead:]
    return out


def _arguments_object(text: str) -> Any:
    """A history call's arguments text as the object it holds; other JSON (or none) stays the text."""
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return text
    return value if isinstance(value, dict) else text


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text") or "" for part in content)


def _template_message(index: int, message: ChatMessage) -> dict[str, Any]:
    role = "system" if message.role == "developer" else message.role
    extra = message.template_extras()
    out: dict[str, Any] = {"role": role, **extra}
    if message.name is not None:
        out["name"] = message.name
    content = message.content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if part.type == "refusal" and role == "assistant" and isinstance(part.refusal, str):
                parts.append({"type": "text", "text": part.refusal})
            elif part.type == "text" and part.text is not None:
                parts.append(part.model_dump(exclude_none=True))
            elif part.type in ("text", "refusal") and (part.type == "text" or role == "assistant"):
                field = "text" if part.type == "text" else "refusal"
                raise invalid_request(f"A {part.type} content part needs a string {field!r}.",
                                      param=f"messages[{index}].content[{j}].{field}")
            else:
                allowed = "text or (assistant) refusal" if role == "assistant" else "text"
                raise invalid_request(f"Content part type {part.type!r} is not supported: this model reads text "
                                      f"only (content parts: {allowed}).", param=f"messages[{index}].content[{j}]")
        content = parts
    if role == "assistant" and not content and isinstance(extra.get("refusal"), str):
        content = extra["refusal"]
    out["content"] = content
    if role == "function":              # legacy function result: a tool turn
        out["role"] = "tool"
    fc = extra.get("function_call")
    if role == "assistant" and isinstance(fc, dict) and not extra.get("tool_calls"):
        out["tool_calls"] = [{"id": f"call_{index}", "type": "function", "function": fc}]
        del out["function_call"]
    return out
