"""How one chat request is rendered, constrained and parsed: tools, tool_choice, response_format and thinking.

Coding agents send `tools` with every turn and side requests with `response_format: json_schema`. This module checks
those fields (a 400 naming the field for anything we cannot honour, never a silent fallback) and decides:

* what the chat template sees: the tools (not with tool_choice "none") and `chat_template_kwargs` such as
  `enable_thinking`;
* which grammar, if any, constrains sampling: `response_format` json_object / json_schema, or a forced tool call
  (tool_choice "required" or a named function) whose arguments follow the tool's parameter schema;
* how the reply is split: reasoning (the `<think>` block) into `reasoning_content`, tool-call blocks into
  `tool_calls`, the rest into `content`.

Decisions where the API is silent (docs/agents.md): a grammar and thinking do not mix (the grammar would have to let
free reasoning through first): a constrained request renders with `enable_thinking: false`, and asking for both is a
400. `response_format` json with tools callable (tool_choice not "none") is a 400 too: one reply cannot be both.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import invalid_request
from gateway.schemas import ChatCompletionRequest

TOOL_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")   # OpenAI's rule for function names


@dataclass
class ChatPlan:
    tools: list[dict[str, Any]] | None                 # what the template renders (None: no tools section)
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    reasoning: str = "auto"                             # OutputParser mode: "off" | "auto"
    tool_names: set[str] | None = None                  # parse tool-call blocks for these names (None: never)
    grammar: Any = None                                 # a compiled grammar spec (gateway.grammar) or None
    compiler: Any = None                                # the GrammarCompiler that compiled it (new_matcher)


def _tools(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    out, seen = [], set()
    for i, tool in enumerate(req.tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise invalid_request(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}.",
                                  param=f"tools[{i}]")
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise invalid_request(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-'.",
                                  param=f"tools[{i}].function.name")
        if name in seen:
            raise invalid_request(f"Two tools are named {name!r}.", param=f"tools[{i}].function.name")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise invalid_request(f"tools[{i}].function.parameters must be a JSON Schema object.",
                                  param=f"tools[{i}].function.parameters")
        seen.add(name)
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(req: ChatCompletionRequest, names: set[str]) -> str:
    """'none' | 'auto' | 'required' | the forced function's name (prefixed 'fn:')."""
    choice = req.tool_choice
    if choice is None:
        return "auto" if names else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise invalid_request("tool_choice must be 'none', 'auto', 'required' or a named function.",
                                  param="tool_choice")
        if choice == "required" and not names:
            raise invalid_request("tool_choice 'required' needs at least one tool in tools.", param="tool_choice")
        return "none" if not names else choice
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if choice.get("type", "function") != "function" or not isinstance(name, str):
        raise invalid_request("tool_choice must be {\"type\": \"function\", \"function\": {\"name\": ...}}.",
                              param="tool_choice")
    if name not in names:
        raise invalid_request(f"tool_choice names {name!r}, which is not in tools.", param="tool_choice")
    return "fn:" + name


def _response_format(req: ChatCompletionRequest) -> tuple[str, dict | None, bool]:
    """('text' | 'json_object' | 'json_schema', schema, strict)."""
    rf = req.response_format
    if rf is None:
        return "text", None, False
    kind = rf.get("type", "text")
    if kind == "text":
        return "text", None, False
    if kind == "json_object":
        return "json_object", None, False
    if kind == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise invalid_request("response_format json_schema needs json_schema.schema (a JSON Schema object).",
                                  param="response_format.json_schema.schema")
        return "json_schema", schema, bool(spec.get("strict", False))
    raise invalid_request(f"response_format type {kind!r} is not supported (text, json_object, json_schema).",
                          param="response_format")


def plan_chat(req: ChatCompletionRequest, get_compiler: Callable[[], Any]) -> ChatPlan:
    """Validate the agent-facing fields and decide rendering, constraint and parsing (see the module docstring).
    `get_compiler()` gives the gateway.grammar.GrammarCompiler (None when the server has no grammar engine); it is
    called only for a constrained request, so plain requests never build one."""
    tools = _tools(req)
    names = {t["function"]["name"] for t in tools}
    choice = _tool_choice(req, names)
    fmt, schema, strict = _response_format(req)
    kwargs = dict(req.chat_template_kwargs or {})
    if req.parallel_tool_calls is not None and not isinstance(req.parallel_tool_calls, bool):
        raise invalid_request("parallel_tool_calls must be a boolean.", param="parallel_tool_calls")
    parallel = req.parallel_tool_calls is not False
    constrained = fmt != "text" or choice == "required" or choice.startswith("fn:")
    if fmt != "text" and choice != "none":
        raise invalid_request("response_format json cannot be combined with callable tools; set tool_choice to "
                              "'none' or drop response_format.", param="response_format")
    thinking = kwargs.get("enable_thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise invalid_request("chat_template_kwargs.enable_thinking must be a boolean.",
                              param="chat_template_kwargs.enable_thinking")
    compiler = grammar = None
    if constrained:
        if thinking is True:
            raise invalid_request("Thinking cannot be combined with structured output or a forced tool call; set "
                                  "chat_template_kwargs.enable_thinking to false.",
                                  param="chat_template_kwargs.enable_thinking")
        kwargs["enable_thinking"] = False
        compiler = get_compiler()
        if compiler is None:
            raise invalid_request("This server has no grammar engine: structured output and forced tool calls are "
                                  "unavailable.", param="response_format" if fmt != "text" else "tool_choice")
        grammar = _compile(compiler, fmt, schema, strict, choice, tools, parallel)
    return ChatPlan(tools=tools if choice != "none" and tools else None, template_kwargs=kwargs,
                    reasoning="off" if kwargs.get("enable_thinking") is False else "auto",
                    tool_names=names if choice != "none" and names else None,
                    grammar=grammar, compiler=compiler)


def _compile(compiler, fmt: str, schema: dict | None, strict: bool, choice: str, tools: list[dict],
             parallel: bool):
    """The grammar spec of a constrained request; a schema the engine cannot enforce is a 400 naming it."""
    from gateway.grammar import GrammarError

    try:
        if fmt == "json_object":
            return compiler.json_object()
        if fmt == "json_schema":
            return compiler.json_schema(schema, strict)
        forced = "required" if choice == "required" else {"type": "function", "function": {"name": choice[3:]}}
        return compiler.tool_calls(tools, forced, parallel)
    except GrammarError as e:
        param = "response_format.json_schema.schema" if fmt == "json_schema" else "tools"
        raise invalid_request(f"Cannot enforce this schema: {e}", param=param) from None
