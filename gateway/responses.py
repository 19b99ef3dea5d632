"""The OpenAI Responses API (`POST /v1/responses`) as a translation around the chat path.

There is one request path: a Responses request becomes a `ChatCompletionRequest` (`to_chat_request`: `instructions`
and the input items become chat messages, flat function tools become chat tools, `text.format` becomes
`response_format`, `max_output_tokens` becomes `max_completion_tokens`), which `gateway.chat_plan` plans and the API
layer renders, tokenizes and generates exactly as it does for /v1/chat/completions. The reply goes through the same
`OutputParser` (reasoning, content, tool-call blocks), and `ResponseBuilder` turns its deltas into output items
(`reasoning`, `message`, `function_call`) and the stream events that announce them; the non-streamed response is the
same builder fed the whole reply, so both shapes always agree.

Decisions where the API is silent (docs/agents.md, "Responses API"): nothing is stored (`store` is accepted and
ignored; `previous_response_id`, `conversation` and `item_reference` items are a 400), reasoning items in the input
become the next assistant turn's `reasoning_content`, hosted tools (web_search, file_search, computer, ...) are a
400 naming `tools[i].type`, and fields we would silently ignore to the client's harm (logprobs, prompt templates,
background mode, moderation) are a 400 naming them.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from gateway import access_log
from gateway.chat_plan import ChatPlan, apply_effort
from gateway.errors import APIError, invalid_request, validate
from gateway.output_parser import THINK_END, Delta
from gateway.schemas import ChatCompletionRequest, ResponsesRequest
from shared.sampling import SamplingParams

__all__ = ["ResponseBuilder", "collect", "new_id", "renamed_params", "stream", "to_chat_request"]

# Sampling fields a Responses request may carry (the OpenAI ones, plus the chat route's extras via extra body:
# vLLM's structured-output and output ones too, which the chat path enforces or refuses as there)
_PASSED = ("model", "temperature", "top_p", "top_k", "min_p", "min_tokens", "repetition_penalty", "presence_penalty",
           "frequency_penalty", "seed", "stop", "stop_token_ids", "logit_bias", "ignore_eos", "user", "stream",
           "parallel_tool_calls", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
           "structured_outputs", "include_stop_str_in_output", "skip_special_tokens", "truncate_prompt_tokens",
           "use_beam_search", "bad_words", "allowed_token_ids")
_TEXT_PARTS = ("input_text", "output_text", "text")
_MEDIA_PARTS = ("input_image", "input_file", "input_audio")
# what OpenAI's `include` may name: the hosted-tool outputs are moot here (no hosted tools), encrypted reasoning is
# never produced, so each is accepted and adds nothing; logprobs are refused (_refuse_unservable)
INCLUDABLE = frozenset({
    "code_interpreter_call.outputs", "computer_call_output.output.image_url", "file_search_call.results",
    "message.input_image.image_url", "message.output_text.logprobs", "reasoning.encrypted_content",
    "web_search_call.action.sources", "web_search_call.results"})
# the values OpenAI's API (and the `openai` client's Response model, which echoes them) allows for these settings;
# anything else is a 400 naming the field, not a response the client cannot parse
_SETTINGS = {"reasoning": {"effort": ("none", "minimal", "low", "medium", "high", "xhigh", "max"),
                           "summary": ("auto", "concise", "detailed"),
                           "generate_summary": ("auto", "concise", "detailed"),
                           "context": ("auto", "current_turn", "all_turns")},
             "text": {"verbosity": ("low", "medium", "high")}}
_SCHEMA_NAME = "response"       # text.format json_schema's name when the request gives none
_NOT_STORED = ("Responses are not stored on this server (store is accepted but nothing is kept), so {what} cannot "
               "be resolved; send the whole conversation in input.")


def new_id(prefix: str) -> str:
    """OpenAI's id style for responses and items: `resp_...`, `msg_...`, `fc_...`, `rs_...`."""
    return f"{prefix}_{secrets.token_hex(16)}"


# ---- request -> chat request ----------------------------------------------------------------------------------

def to_chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that serves `req`; a 400 naming the Responses field for anything it cannot honour."""
    _refuse_unservable(req)
    _check_settings(req)
    body: dict[str, Any] = {k: getattr(req, k) for k in _PASSED}
    body.update(messages=input_messages(req.input, req.instructions), tools=_tools(req.tools),
                tool_choice=_tool_choice(req.tool_choice), response_format=_text_format(req.text),
                chat_template_kwargs=_template_kwargs(req), max_completion_tokens=req.max_output_tokens)
    with renamed_params():          # (a 400 names the Responses field, never a chat one the client did not send)
        return validate(ChatCompletionRequest, body)


def _check_settings(req: ResponsesRequest) -> None:
    """reasoning.* and text.verbosity take OpenAI's values (types) only (the response echoes them)."""
    for field, allowed in _SETTINGS.items():
        given = getattr(req, field) or {}
        for key, values in allowed.items():
            value = given.get(key)
            if value is not None and value not in values:
                raise invalid_request(f"{field}.{key} must be one of {', '.join(values)} (got {value!r}).",
                                      param=f"{field}.{key}")
    mode = (req.reasoning or {}).get("mode")         # free text in OpenAI's API ("standard", "pro", ...)
    if mode is not None and not isinstance(mode, str):
        raise invalid_request("reasoning.mode must be a string.", param="reasoning.mode")


def _refuse_unservable(req: ResponsesRequest) -> None:
    """Fields whose honest answer is a 400: state we do not keep, features this route does not have."""
    if req.previous_response_id is not None:
        raise invalid_request(_NOT_STORED.format(what="previous_response_id"), param="previous_response_id")
    if req.conversation is not None:
        raise invalid_request(_NOT_STORED.format(what="a conversation"), param="conversation")
    if req.prompt is not None:
        raise invalid_request("Stored prompt templates are not supported; send instructions and input.",
                              param="prompt")
    if req.background:
        raise invalid_request("Background responses need stored responses, which this server does not keep.",
                              param="background")
    if req.moderation is not None:
        raise invalid_request("Moderation is not available on this server.", param="moderation")
    unknown = [v for v in req.include or [] if v not in INCLUDABLE]
    if unknown:
        raise invalid_request(f"include: {unknown[0]!r} is not a value the Responses API knows (one of "
                              f"{sorted(INCLUDABLE)}).", param="include")
    if req.top_logprobs or "message.output_text.logprobs" in (req.include or []):
        raise invalid_request("Logprobs are not available on /v1/responses; use /v1/chat/completions.",
                              param="top_logprobs" if req.top_logprobs else "include")
    if req.max_tokens is not None:
        raise invalid_request("max_tokens is a chat completions field; the Responses API uses max_output_tokens.",
                              param="max_tokens")
    if req.num_choices > 1:
        raise invalid_request("A response has one output; n is not supported on /v1/responses.", param="n")
    # vLLM's token-id extra of the chat and completions routes, which vLLM's Responses API does not take (it
    # ignores it): refused rather than ignored. (return_tokens_as_token_ids only renames logprobs tokens, and
    # logprobs are refused above, so it is accepted and changes nothing.)
    if req.return_token_ids:
        raise invalid_request("return_token_ids is not available on /v1/responses; use /v1/chat/completions "
                              "(prompt_token_ids and each choice's token_ids) or /v1/completions.",
                              param="return_token_ids")


def _template_kwargs(req: ResponsesRequest) -> dict[str, Any] | None:
    """`reasoning.effort` as chat's `reasoning_effort` (`chat_plan.apply_effort`), with this route's field name."""
    kwargs = dict(req.chat_template_kwargs or {})
    apply_effort(kwargs, (req.reasoning or {}).get("effort"), "reasoning.effort")
    return kwargs or None


def _tools(raw: list[Any] | None) -> list[dict[str, Any]] | None:
    """Flat Responses function tools as chat tools; hosted tools (run by OpenAI's servers) are refused."""
    if raw is None:
        return None
    out = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict):
            raise invalid_request(f"tools[{i}] must be an object.", param=f"tools[{i}]")
        kind = tool.get("type")
        if kind != "function":
            raise invalid_request(f"Tool type {kind!r} is not supported: this server offers function tools only "
                                  "(the client runs them); hosted tools such as web_search, file_search, computer, "
                                  "code_interpreter or mcp are not available.", param=f"tools[{i}].type")
        for key, typ, what in (("description", str, "a string"), ("strict", bool, "a boolean")):
            if tool.get(key) is not None and not isinstance(tool[key], typ):
                raise invalid_request(f"tools[{i}].{key} must be {what}.", param=f"tools[{i}].{key}")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """Responses spellings ({"type": "function", "name"}, flat allowed_tools) as chat ones; strings as they are."""
    if choice is None or isinstance(choice, str):
        return choice
    kind = choice.get("type")
    if kind == "function":
        name = choice.get("name")
        if not isinstance(name, str):
            raise invalid_request("tool_choice {\"type\": \"function\"} needs a name.", param="tool_choice.name")
        return {"type": "function", "function": {"name": name}}
    if kind == "allowed_tools":
        return {"type": "allowed_tools", "allowed_tools": {"mode": choice.get("mode"), "tools": choice.get("tools")}}
    raise invalid_request(f"tool_choice type {kind!r} is not supported (function tools only).",
                          param="tool_choice.type")


def _text_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """text.format as the chat response_format."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise invalid_request("text.format must be an object.", param="text.format")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise invalid_request("text.format json_schema needs schema (a JSON Schema object).",
                                  param="text.format.schema")
        for key, typ, what in (("name", str, "a string"), ("description", str, "a string"),
                               ("strict", bool, "a boolean")):
            if fmt.get(key) is not None and not isinstance(fmt[key], typ):
                raise invalid_request(f"text.format.{key} must be {what}.", param=f"text.format.{key}")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name") or _SCHEMA_NAME,
                                                       "schema": fmt["schema"],
                                                       "strict": bool(fmt.get("strict", False))}}
    raise invalid_request(f"text.format type {kind!r} is not supported (text, json_object, json_schema).",
                          param="text.format.type")


_RENAMES = [(re.compile(r"^tools\[(\d+)\]\.function"), r"tools[\1]"),
            (re.compile(r"^tool_choice\.allowed_tools"), "tool_choice"),
            (re.compile(r"^response_format\.json_schema"), "text.format"),
            (re.compile(r"^response_format"), "text.format"),
            (re.compile(r"^messages.*"), "input"),
            (re.compile(r"^max_completion_tokens"), "max_output_tokens")]


def responses_param(param: str) -> str:
    """A chat field path as the Responses field it came from ("tools[0].function.name" -> "tools[0].name")."""
    for pattern, repl in _RENAMES:
        new = pattern.sub(repl, param)
        if new != param:
            return new
    return param


@contextmanager
def renamed_params() -> Iterator[None]:
    """Errors raised by the chat path name the Responses fields the client sent."""
    try:
        yield
    except APIError as e:
        if e.param:
            new = responses_param(e.param)
            e.message, e.param = e.message.replace(e.param, new), new
        # the chat path's budget is max_output_tokens here (a request's max_tokens is refused before it)
        e.message = re.sub(r"\bmax_(?:completion_)?tokens\b", "max_output_tokens", e.message)
        raise


# ---- input items -> chat messages ---------------------------------------------------------------------------------

def input_messages(items: str | list[Any] | None, instructions: str | None) -> list[dict[str, Any]]:
    """`instructions` as a leading system message, then the input: a string is one user message; a list of items
    is rendered as the chat history it stands for (see `_History`)."""
    if items is None or (isinstance(items, list) and not items):
        raise invalid_request("input must be a string or a non-empty list of items.", param="input")
    out = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        return out + [{"role": "user", "content": items}]
    history = _History()
    for i, item in enumerate(items):
        history.add(i, item)
    return out + history.messages


class _History:
    """Input items as chat messages. Consecutive assistant-side items (reasoning, an assistant message, function
    calls, in that order) are one assistant turn: reasoning text is its `reasoning_content`, the message its
    content, the calls its `tool_calls`; a `function_call_output` is a tool turn."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self._turn: dict[str, Any] | None = None      # the assistant turn still open to later parts

    def add(self, i: int, item: Any) -> None:
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid_request(f"{where} must be an object.", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            self._message(where, item)
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where, nonempty=True),
                                 "arguments": _string(item, "arguments", where)}}
            self._assistant("tool_calls").setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            self._close({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                         "content": _parts(item.get("output"), f"{where}.output", "tool")})
        elif kind == "reasoning":
            text = _reasoning_text(item, where)
            if text:
                self._assistant("reasoning_content")["reasoning_content"] = text
        elif kind == "item_reference":
            raise invalid_request(_NOT_STORED.format(what="item_reference"), param=f"{where}.id")
        else:
            raise invalid_request(f"Input item type {kind!r} is not supported (message, function_call, "
                                  "function_call_output, reasoning).", param=f"{where}.type")

    def _message(self, where: str, item: dict[str, Any]) -> None:
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise invalid_request(f"{where}.role must be user, system, developer or assistant.", param=f"{where}.role")
        content = _parts(item.get("content"), f"{where}.content", role)
        if role == "assistant":
            self._assistant("content")["content"] = content
        else:
            self._close({"role": role, "content": content})

    def _assistant(self, part: str) -> dict[str, Any]:
        """The open assistant turn if `part` may still join it (reasoning, then content, then calls), else a new
        one."""
        later = {"reasoning_content": ("reasoning_content", "content", "tool_calls"),
                 "content": ("content", "tool_calls"), "tool_calls": ()}[part]
        if self._turn is None or any(self._turn.get(k) is not None for k in later):
            self._turn = {"role": "assistant", "content": None}
            self.messages.append(self._turn)
        return self._turn

    def _close(self, message: dict[str, Any]) -> None:
        self._turn = None
        self.messages.append(message)


def _string(item: dict[str, Any], key: str, where: str, nonempty: bool = False) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (nonempty and not value):
        raise invalid_request(f"{where}.{key} must be a{' non-empty' if nonempty else ''} string.",
                              param=f"{where}.{key}")
    return value


def _parts(content: Any, where: str, role: str) -> str | list[dict[str, str]]:
    """Message content (or a tool output) as the chat route takes it: a string, or text content parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid_request(f"{where} must be a string or a list of content parts.", param=where)
    out = []
    for j, part in enumerate(content):
        here = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        elif kind == "refusal" and role == "assistant" and isinstance(part.get("refusal"), str):
            out.append({"type": "text", "text": part["refusal"]})
        elif kind in _MEDIA_PARTS:
            raise invalid_request(f"Content part type {kind!r} is not supported: this model reads text only.",
                                  param=f"{here}.type")
        else:
            raise invalid_request(f"{here} must be a text part ({', '.join(_TEXT_PARTS[:2])}).", param=here)
    return out


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """A reasoning item's text: its reasoning_text content, else its summary texts (encrypted_content, which only
    OpenAI can read, is ignored)."""
    for key in ("content", "summary"):
        parts = item.get(key) or []
        if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str)
                                                  for p in parts):
            raise invalid_request(f"{where}.{key} must be a list of text parts.", param=f"{where}.{key}")
        if parts:
            return "\n\n".join(p["text"] for p in parts)
    return ""


# ---- reply -> output items and events ---------------------------------------------------------------------------

@dataclass
class _Item:
    kind: str                   # "reasoning" | "message" | "function_call"
    id: str
    index: int                  # output_index
    text: str = ""              # reasoning text, message text or call arguments
    call_id: str = ""
    name: str = ""
    status: str = "in_progress"

    def body(self) -> dict[str, Any]:
        """The item as the API shows it (content parts empty while it is in progress, as OpenAI streams it)."""
        done = self.status != "in_progress"
        if self.kind == "reasoning":
            content = [{"type": "reasoning_text", "text": self.text}] if done else []
            return {"type": "reasoning", "id": self.id, "summary": [], "content": content, "status": self.status}
        if self.kind == "message":
            return {"type": "message", "id": self.id, "role": "assistant", "status": self.status,
                    "content": [_output_text(self.text)] if done else []}
        return {"type": "function_call", "id": self.id, "call_id": self.call_id, "name": self.name,
                "arguments": self.text, "status": self.status}


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ResponseBuilder:
    """Output items from parser deltas, with the stream events that announce them (each with its
    sequence_number), and the response object at any point. Streamed and non-streamed replies both go through it."""

    def __init__(self, response_id: str, model: str, req: ResponsesRequest, params: SamplingParams) -> None:
        self.id, self.model, self.req, self.params = response_id, model, req, params
        self.created_at = int(time.time())
        self.items: list[_Item] = []
        self.status, self.usage, self.error = "in_progress", None, None
        self.incomplete_reason: str | None = None
        self._seq = 0

    # ---- events ---------------------------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def start(self) -> list[dict[str, Any]]:
        return [self._event("response.created", response=self.response()),
                self._event("response.in_progress", response=self.response())]

    def feed(self, deltas: list[Delta]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for d in deltas:
            if d.reasoning is not None:
                item = self._current("reasoning", events)
                item.text += d.reasoning
                events.append(self._event("response.reasoning_text.delta", item_id=item.id, output_index=item.index,
                                          content_index=0, delta=d.reasoning))
            elif d.content is not None:
                item = self._current("message", events)
                item.text += d.content
                events.append(self._event("response.output_text.delta", item_id=item.id, output_index=item.index,
                                          content_index=0, delta=d.content, logprobs=[]))
            elif d.tool_id is not None:
                self._open("function_call", events, call_id=d.tool_id, name=d.name or "")
            elif d.arguments:
                item = self.items[-1]
                item.text += d.arguments
                events.append(self._event("response.function_call_arguments.delta", item_id=item.id,
                                          output_index=item.index, delta=d.arguments))
        return events

    def finish(self, finish_reason: str, usage: dict[str, Any], cut_call: bool = False) -> list[dict[str, Any]]:
        """Close the last item (incomplete if the budget ran out, or if a stop string ended it inside a call's
        arguments: `cut_call`), give a completed reply without text or calls an empty message (a cut one keeps what
        it has: OpenAI's output may then be reasoning only), and end with response.completed or
        response.incomplete."""
        events: list[dict[str, Any]] = []
        cut = finish_reason == "length"
        self._close(events, "incomplete" if cut or cut_call else "completed")
        if not cut and not any(i.kind in ("message", "function_call") for i in self.items):
            self._open("message", events)
            self._close(events, "completed")
        if any(i.kind == "function_call" for i in self.items):
            access_log.note_tool_calls()
        self.usage = usage
        self.status = "incomplete" if cut else "completed"
        self.incomplete_reason = "max_output_tokens" if cut else None
        kind = "response.incomplete" if cut else "response.completed"
        return events + [self._event(kind, response=self.response())]

    def failed_event(self, err: APIError) -> str:
        """The stream's last event when generation fails after it started (spec: response.failed)."""
        if self.items and self.items[-1].status == "in_progress":
            self.items[-1].status = "incomplete"
        self.status = "failed"
        self.error = {"code": "server_error", "message": err.message}
        return sse(self._event("response.failed", response=self.response()))

    def _current(self, kind: str, events: list[dict[str, Any]]) -> _Item:
        last = self.items[-1] if self.items else None
        if last is not None and last.kind == kind and last.status == "in_progress":
            return last
        return self._open(kind, events)

    def _open(self, kind: str, events: list[dict[str, Any]], **fields: str) -> _Item:
        self._close(events, "completed")
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
        item = _Item(kind, new_id(prefix), len(self.items), **fields)
        self.items.append(item)
        events.append(self._event("response.output_item.added", output_index=item.index, item=item.body()))
        if kind == "reasoning":
            events.append(self._part_event("added", item, {"type": "reasoning_text", "text": ""}))
        elif kind == "message":
            events.append(self._part_event("added", item, _output_text("")))
        return item

    def _close(self, events: list[dict[str, Any]], status: str) -> None:
        item = self.items[-1] if self.items else None
        if item is None or item.status != "in_progress":
            return
        where = {"item_id": item.id, "output_index": item.index}
        if item.kind == "reasoning":
            events.append(self._event("response.reasoning_text.done", **where, content_index=0, text=item.text))
            events.append(self._part_event("done", item, {"type": "reasoning_text", "text": item.text}))
        elif item.kind == "message":
            events.append(self._event("response.output_text.done", **where, content_index=0, text=item.text,
                                      logprobs=[]))
            events.append(self._part_event("done", item, _output_text(item.text)))
        else:
            events.append(self._event("response.function_call_arguments.done", **where, arguments=item.text))
        item.status = status
        events.append(self._event("response.output_item.done", output_index=item.index, item=item.body()))

    def _part_event(self, what: str, item: _Item, part: dict[str, Any]) -> dict[str, Any]:
        return self._event(f"response.content_part.{what}", item_id=item.id, output_index=item.index,
                           content_index=0, part=part)

    # ---- the response object ------------------------------------------------------------------------------------

    @property
    def has_reasoning(self) -> bool:
        return any(i.kind == "reasoning" for i in self.items)

    def response(self) -> dict[str, Any]:
        """The response as it stands, echoing the request's settings as OpenAI does (temperature and top_p are
        the values sampling used, after generation_config's defaults)."""
        req = self.req
        text = dict(req.text or {})
        text.setdefault("format", {"type": "text"})
        fmt = text["format"]
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema" and not fmt.get("name"):
            text["format"] = {**fmt, "name": _SCHEMA_NAME}      # the name it was served under (_text_format)
        done = self.status in ("completed", "incomplete")
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": self.status,
            "completed_at": int(time.time()) if done else None, "model": self.model,
            "output": [i.body() for i in self.items], "error": self.error,
            "incomplete_details": {"reason": self.incomplete_reason} if self.incomplete_reason else None,
            "instructions": req.instructions, "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "temperature": self.params.temperature, "top_p": self.params.top_p,
            "max_output_tokens": req.max_output_tokens, "previous_response_id": None,
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [], "text": text,
            "truncation": req.truncation or "disabled", "reasoning": req.reasoning, "user": req.user,
            "background": False, "usage": self.usage,
        }


def sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


# ---- driving a generation -----------------------------------------------------------------------------------------

class _Piece(Protocol):
    text: str
    finish_reason: str | None


class _Gen(Protocol):
    """What this module needs of the API layer's `_Generation` (it cannot import it: the API imports us)."""
    completion_tokens: int
    cached_tokens: int

    @property
    def request(self) -> Any: ...

    def pieces(self) -> AsyncIterator[_Piece]: ...


def _usage(gen: _Gen, reasoning_tokens: int) -> dict[str, Any]:
    prompt, completion = len(gen.request.prompt_ids), gen.completion_tokens
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": gen.cached_tokens,
                                                            "cache_write_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt + completion}


async def _events(gen: _Gen, builder: ResponseBuilder, plan: ChatPlan) -> AsyncIterator[list[dict[str, Any]]]:
    """The events of each generated piece, the parser splitting reasoning, content and calls as on the chat route.
    Reasoning tokens are the tokens up to the one that completes `</think>` (all of them if it never closes)."""
    parser = plan.output_parser()
    tail, thought = "", None                  # the last len(THINK_END) - 1 characters: a tag may span two pieces
    async for piece in gen.pieces():
        if plan.reasoning != "off" and thought is None:
            window = tail + piece.text
            if THINK_END in window:
                thought = gen.completion_tokens
            tail = window[-(len(THINK_END) - 1):]
        deltas = parser.feed(piece.text)
        if piece.finish_reason is None:
            yield builder.feed(deltas)
            continue
        events = builder.feed(deltas + parser.finish())
        reasoning = (thought or gen.completion_tokens) if builder.has_reasoning else 0
        yield events + builder.finish(piece.finish_reason, _usage(gen, reasoning), cut_call=parser.cut_call)


async def collect(gen: _Gen, builder: ResponseBuilder, plan: ChatPlan) -> dict[str, Any]:
    """The non-streamed response."""
    async for _ in _events(gen, builder, plan):
        pass
    return builder.response()


async def stream(gen: _Gen, builder: ResponseBuilder, plan: ChatPlan) -> AsyncIterator[str]:
    """The SSE stream: `event: <type>` and `data: <json>` per event, response.created first."""
    for event in builder.start():
        yield sse(event)
    async for events in _events(gen, builder, plan):
        for event in events:
            yield sse(event)
