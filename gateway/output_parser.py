"""Split a Qwen3-format model reply into reasoning, content and tool calls, streamed or all at once.

Formats (see CHAT_TEMPLATE in stage_worker/checkpoint/tokenizer_files.py):

* Reasoning: ``<think>\\n...\\n</think>\\n\\n`` at the very start of the reply. The parser is told the mode:
  ``"off"`` (the prompt already closed an empty block, so everything is content and ``<think>`` is plain text),
  ``"auto"`` (a reply whose first non-whitespace text is ``<think>`` opens a block) or ``"inside"`` (the prompt
  ended with ``<think>\\n``, so the reply starts inside the block and only ``</think>`` appears). Reasoning text is
  stripped of surrounding whitespace (as the template does with ``reasoning.strip('\\n')``), goes to
  ``reasoning_content`` only and is never parsed for tool calls. Whitespace right after ``</think>`` is dropped.
  A block that never closes is reasoning to the end, trailing whitespace included (as generated).
* Tool calls (only when ``tool_names`` is given): ``<tool_call>\\n{"name": "<fn>", "arguments": {...}}\\n</tool_call>``,
  any JSON whitespace allowed, ``name`` first. The arguments value must be a JSON object; its raw text (exactly from
  its ``{`` to its matching ``}``) is the call's ``arguments`` string. A block whose header (everything up to the
  arguments' ``{``) is not that shape, or names a function outside ``tool_names``, is malformed: its text, up to and
  including the next ``</tool_call>`` (or the end), is content. Once a header has been accepted the call is committed
  (its first delta was streamed): if the block then ends before the arguments object closes (``</tool_call>``
  outside a JSON string, or the end of generation) the call is kept with the arguments text seen so far. After the
  arguments close, ``}`` and whitespace up to ``</tool_call>`` are consumed; any other text ends the call and is
  read as content. A header that generation ends inside while it could still become a valid one (``max_tokens``
  cut it) is dropped: a truncated call, not text (the finish reason says "length"), so no markup reaches content.
  A call whose arguments generation ends inside is kept as streamed and flagged (``cut_call``): the reply's finish
  reason is then the cut's ("length", or "stop" for a stop string), never "tool_calls", whose arguments must parse.
  ``max_calls``: calls past that many are parsed and dropped (``parallel_tool_calls: false``, a legacy reply).
* Tool calls in the XML form (``call_form="xml"``: Qwen3-Coder and Qwen3.5 templates, whose text has ``<function=``;
  vLLM's ``qwen3_coder`` parser)::

      <tool_call>
      <function=NAME>
      <parameter=KEY>
      VALUE
      </parameter>
      </function>
      </tool_call>

  The block's start (after whitespace) must be ``<function=NAME>`` with NAME in ``tool_names``; a block that cannot
  be (another name, no ``<function=``) is malformed, as above. A block whose first non-whitespace character is
  ``{`` is read in the hermes form (a grammar-constrained call is written so). An accepted block is buffered until
  its ``</tool_call>`` (or the end of generation) and emitted whole: the call's first delta, then its arguments,
  a JSON object of the parameters (a ``<parameter=`` ends at ``</parameter>``, the next ``<parameter=`` or
  ``</function>``; text outside parameters is ignored; a repeated key keeps the last value). Each value loses one
  leading and one trailing newline and is typed by ``tool_params`` (tool name -> its parameters JSON schema): a
  ``"string"`` property stays text; another declared type is ``json.loads``-ed, else read as a Python literal
  (``True``, ``None``, ``{'k': 'v'}``: the real templates write a history call's non-string values with Jinja's
  ``| string``, and models imitate them), falling back to the text; an undeclared one is ``json.loads``-ed when
  that gives a non-string, else text. A header cut by the end of generation is dropped, like the hermes form's; a
  block cut after its header is kept with the parameters that closed (``</parameter>``) and flagged ``cut_call``.
* Content: text outside those blocks. Whitespace right before an accepted call is dropped, and so is
  whitespace-only text between or after calls (as vLLM does); text after a call keeps its leading whitespace as a
  separator only if content was emitted before.

Streaming hold-back rule: markers are plain text and may be split across pieces ("<tool" + "_call>"), so `feed`
releases only text whose meaning can no longer change. It holds back the longest suffix that is a proper prefix of
the marker that could come next (``</think>`` in reasoning, ``<tool_call>`` in content, ``</tool_call>`` in a
malformed block or outside strings in arguments), plus trailing whitespace that a following marker would drop.
A tool call's header is buffered until it is accepted or rejected; after that the arguments text streams as it
arrives (in the XML form the whole block is buffered). All decisions depend only on the text, never on how it was
split, so `parse_complete` (feed everything, then `finish`) gives exactly what the assembled stream gives.
"""

from __future__ import annotations

import ast
import json
import math
import re
import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace

from gateway.json_schema_types import ParamSchemas, admitted

__all__ = ["Delta", "OutputParser", "ParsedOutput", "ToolCall", "assemble", "parse_complete"]

THINK_START, THINK_END = "<think>", "</think>"
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
_JSON_WS = " \t\r\n"
_MODES = ("off", "auto", "inside")
CALL_FORMS = ("hermes", "xml")
FUNCTION_START = "<function="
# parser states
_START, _REASONING, _CONTENT, _HEADER, _ARGS, _TRAILER, _MALFORMED, _XML_OPEN, _XML_BODY = range(9)
# header scan results
_MORE, _MATCH, _FAIL = range(3)


@dataclass(frozen=True)
class Delta:
    """One streamed piece: exactly one of reasoning text, content text, or a tool-call delta.

    A tool call's first delta has `tool_id` and `name` set and `arguments == ""`; later ones carry only
    `tool_index` and a non-empty piece of `arguments`."""

    reasoning: str | None = None
    content: str | None = None
    tool_index: int | None = None
    tool_id: str | None = None
    name: str | None = None
    arguments: str | None = None

    def __post_init__(self) -> None:
        kinds = (self.reasoning is not None) + (self.content is not None) + (self.tool_index is not None)
        is_tool = self.tool_index is not None
        if kinds != 1 or is_tool != (self.arguments is not None) or (not is_tool and (self.tool_id or self.name)):
            raise ValueError(f"a Delta holds exactly one of reasoning, content or a tool-call delta: {self!r}")


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str      # raw JSON text of the arguments object


@dataclass(frozen=True)
class ParsedOutput:
    reasoning_content: str | None
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)
    cut_call: bool = False          # the last call's arguments never closed (OutputParser.cut_call)


def random_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def assemble(deltas: Iterable[Delta]) -> ParsedOutput:
    """Join streamed deltas into the non-streamed result (empty text becomes None)."""
    reasoning: list[str] = []
    content: list[str] = []
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if d.reasoning is not None:
            reasoning.append(d.reasoning)
        elif d.content is not None:
            content.append(d.content)
        else:
            assert d.tool_index is not None and d.arguments is not None
            if d.tool_id is not None:
                calls[d.tool_index] = [d.tool_id, d.name or "", ""]
            calls[d.tool_index][2] += d.arguments
    return ParsedOutput(
        "".join(reasoning) or None, "".join(content) or None, [ToolCall(*calls[i]) for i in sorted(calls)]
    )


class OutputParser:
    """Incremental parser for one reply: `feed` each decoded piece, then `finish` once."""

    def __init__(
        self,
        reasoning: str = "off",
        tool_names: Iterable[str] | None = None,
        *,
        id_factory: Callable[[], str] | None = None,
        max_calls: int | None = None,
        call_form: str = "hermes",
        tool_params: Mapping[str, Mapping] | None = None,
    ) -> None:
        if reasoning not in _MODES:
            raise ValueError(f"reasoning must be one of {_MODES}, got {reasoning!r}")
        if call_form not in CALL_FORMS:
            raise ValueError(f"call_form must be one of {CALL_FORMS}, got {call_form!r}")
        self._xml = call_form == "xml"
        self._tool_params = tool_params or {}      # tool name -> parameters JSON schema (XML values' types)
        self._xml_name = ""                         # the accepted XML call's function name
        self.tool_names: frozenset[str] | None = None if tool_names is None else frozenset(tool_names)
        self._new_id = id_factory or random_call_id
        self._max_calls = max_calls     # later calls are parsed and dropped (parallel_tool_calls false, legacy)
        self._state = {"off": _CONTENT, "auto": _START, "inside": _REASONING}[reasoning]
        self._buf = ""                  # text received but not yet decided
        self._out: list[Delta] = []
        self._reasoning_lead = True     # strip whitespace at the start of the reasoning block
        self._ws = ""                   # trailing content whitespace held back (dropped if a call follows)
        self._lead_drop = False         # drop leading whitespace of the next content
        self._after_call = False        # content since the last call is whitespace only (dropped at the end)
        self._content_emitted = False
        self._calls = 0                 # index of the call being parsed / number of finished calls
        self._depth, self._in_str, self._esc = 0, False, False     # JSON scan state of the arguments
        self._done = False
        self.cut_call = False           # generation ended inside a call's arguments: not a finished call

    # ---- public API -------------------------------------------------------------------------------------------

    def feed(self, text: str) -> list[Delta]:
        """Add the next decoded piece; return the deltas that are now certain."""
        if self._done:
            raise RuntimeError("feed() after finish()")
        self._buf += text
        return self._run(final=False)

    def finish(self) -> list[Delta]:
        """End of generation: flush everything held back."""
        if self._done:
            return []
        return self._run(final=True)

    @classmethod
    def parse_complete(
        cls,
        text: str,
        reasoning: str = "off",
        tool_names: Iterable[str] | None = None,
        *,
        id_factory: Callable[[], str] | None = None,
        max_calls: int | None = None,
        call_form: str = "hermes",
        tool_params: Mapping[str, Mapping] | None = None,
    ) -> ParsedOutput:
        """Non-streaming parse: feed the whole text, then finish."""
        parser = cls(reasoning, tool_names, id_factory=id_factory, max_calls=max_calls, call_form=call_form,
                     tool_params=tool_params)
        parsed = assemble(parser.feed(text) + parser.finish())
        return replace(parsed, cut_call=parser.cut_call)

    # ---- driver -----------------------------------------------------------------------------------------------

    def _run(self, final: bool) -> list[Delta]:
        steps = {
            _START: self._on_start, _REASONING: self._on_reasoning, _CONTENT: self._on_content,
            _HEADER: self._on_header, _ARGS: self._on_args, _TRAILER: self._on_trailer,
            _MALFORMED: self._on_malformed, _XML_OPEN: self._on_xml_open, _XML_BODY: self._on_xml_body,
        }
        while steps[self._state](final):    # each step returns True when it changed state and more may follow
            pass
        if final:
            if self._ws and not (self._lead_drop or self._after_call):
                self._emit(Delta(content=self._ws))
            self._ws, self._done = "", True
        out, self._out = _merge(self._out), []
        return out

    def _emit(self, delta: Delta) -> None:
        if delta.tool_index is not None and self._max_calls is not None and delta.tool_index >= self._max_calls:
            return
        self._out.append(delta)

    def _content(self, text: str) -> None:
        """Emit content, holding back trailing whitespace (when a call could follow) and applying the drop rules."""
        if not text:
            return
        text, self._ws = self._ws + text, ""
        body = text
        if self.tool_names is not None:
            body = text.rstrip()
            self._ws = text[len(body):]
        if self._lead_drop:
            body = body.lstrip()
        if body:
            self._lead_drop = self._after_call = False
            self._content_emitted = True
            self._emit(Delta(content=body))

    def _end_call(self) -> None:
        self._calls += 1
        self._state = _CONTENT
        self._ws = ""
        self._after_call = True
        self._lead_drop = self._lead_drop or not self._content_emitted

    # ---- states -----------------------------------------------------------------------------------------------

    def _on_start(self, final: bool) -> bool:
        s = self._buf.lstrip()
        if s.startswith(THINK_START):
            self._buf, self._state = s[len(THINK_START):], _REASONING
            return True
        if not final and THINK_START.startswith(s):
            return False
        self._state = _CONTENT
        return True

    def _on_reasoning(self, final: bool) -> bool:
        if self._reasoning_lead:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return False
            self._reasoning_lead = False
        buf = self._buf
        i = buf.find(THINK_END)
        if i >= 0:
            self._emit_reasoning(buf[:i].rstrip())
            self._buf, self._state, self._lead_drop = buf[i + len(THINK_END):], _CONTENT, True
            return True
        cut = len(buf) if final else len(buf[: len(buf) - _partial_suffix(buf, THINK_END)].rstrip())
        self._emit_reasoning(buf[:cut])
        self._buf = buf[cut:]
        return False

    def _emit_reasoning(self, text: str) -> None:
        if text:
            self._emit(Delta(reasoning=text))

    def _on_content(self, final: bool) -> bool:
        buf = self._buf
        hold = 0
        if self.tool_names is not None:
            i = buf.find(CALL_START)
            if i >= 0:
                self._content(buf[:i])
                self._buf, self._state = buf[i + len(CALL_START):], _XML_OPEN if self._xml else _HEADER
                return True
            if not final:
                hold = _partial_suffix(buf, CALL_START)
        self._content(buf[: len(buf) - hold])
        self._buf = buf[len(buf) - hold:]
        return False

    def _on_header(self, final: bool) -> bool:
        buf = self._buf
        end = buf.find(CALL_END)
        status, name, pos = _scan_header(buf if end < 0 else buf[:end], self.tool_names or frozenset())
        if status == _MORE and end < 0:
            if not final:
                return False                # header not complete yet: keep buffering, emit nothing
            # generation ended inside a header that was still a call's (max_tokens): a truncated call, not text
            self._buf, self._state, self._ws = "", _CONTENT, ""
            return True
        if status == _MATCH:
            self._ws = ""                   # whitespace before a call is dropped
            self._emit(Delta(tool_index=self._calls, tool_id=self._new_id(), name=name, arguments=""))
            self._buf, self._state = buf[pos:], _ARGS
            self._depth, self._in_str, self._esc = 0, False, False
            return True
        # malformed: the block's text is content, up to and including its </tool_call>
        self._reject_block(buf, end)
        return True

    def _reject_block(self, buf: str, end: int) -> None:
        """A malformed block: its text is content, up to and including its `</tool_call>` at `end` (-1: not yet
        seen: the rest, a partial `</tool_call>` held back, is read as a malformed block's)."""
        if end >= 0:
            cut = end + len(CALL_END)
            block, self._buf, self._state = buf[:cut], buf[cut:], _CONTENT
            self._content(CALL_START + block)
        else:
            self._content(CALL_START)
            self._state = _MALFORMED

    def _on_xml_open(self, final: bool) -> bool:
        """XML form: match `<function=NAME>` at the block's start (a `{` there: the hermes form)."""
        buf = self._buf
        s = buf.lstrip(_JSON_WS)
        if not s or s.startswith("{"):
            if not s and not final:
                return False
            self._state = _HEADER
            return True
        end = buf.find(CALL_END)
        status, name, pos = _scan_xml_header(buf if end < 0 else buf[:end], self.tool_names or frozenset())
        if status == _MORE and end < 0:
            if not final:
                return False
            self._buf, self._state, self._ws = "", _CONTENT, ""     # a truncated header: dropped (as hermes)
            return True
        if status == _MATCH:
            self._xml_name, self._buf, self._state = name, buf[pos:], _XML_BODY
            return True
        self._reject_block(buf, end)
        return True

    def _on_xml_body(self, final: bool) -> bool:
        """XML form: buffer the accepted block to its `</tool_call>` (or the end), then emit the whole call."""
        buf = self._buf
        end = buf.find(CALL_END)
        if end < 0 and not final:
            return False
        body = buf if end < 0 else buf[:end]
        self._buf = "" if end < 0 else buf[end + len(CALL_END):]
        args = _xml_arguments(body, self._tool_params.get(self._xml_name), closed=end >= 0)
        self._ws = ""                   # whitespace before a call is dropped
        self._emit(Delta(tool_index=self._calls, tool_id=self._new_id(), name=self._xml_name, arguments=""))
        self._emit(Delta(tool_index=self._calls, arguments=args))
        if end < 0:                     # generation ended inside the block (max_tokens, a stop string)
            self.cut_call = self._max_calls is None or self._calls < self._max_calls
        self._end_call()
        return True

    def _on_malformed(self, final: bool) -> bool:
        buf = self._buf
        end = buf.find(CALL_END)
        if end >= 0:
            cut = end + len(CALL_END)
            self._content(buf[:cut])
            self._buf, self._state = buf[cut:], _CONTENT
            return True
        hold = 0 if final else _partial_suffix(buf, CALL_END)
        self._content(buf[: len(buf) - hold])
        self._buf = buf[len(buf) - hold:]
        return False

    def _on_args(self, final: bool) -> bool:
        buf, n, i = self._buf, len(self._buf), 0
        depth, in_str, esc = self._depth, self._in_str, self._esc
        closed = broken = False
        while i < n:
            c = buf[i]
            if in_str:
                if esc:
                    esc = False
                elif c == "\\":
                    esc = True
                elif c == '"':
                    in_str = False
            elif c == '"':
                in_str = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth <= 0:
                    i, closed = i + 1, True
                    break
            elif c == "<":
                if buf.startswith(CALL_END, i):
                    broken = True
                    break
                if not final and n - i < len(CALL_END) and CALL_END.startswith(buf[i:]):
                    break                   # could be the start of </tool_call>: hold it back
            i += 1
        self._depth, self._in_str, self._esc = depth, in_str, esc
        if i:
            self._emit(Delta(tool_index=self._calls, arguments=buf[:i]))
        self._buf = buf[i:]
        if closed:
            self._state = _TRAILER
            return True
        if broken:                          # block ended inside the arguments: keep the call as streamed
            self._buf = self._buf[len(CALL_END):]
            self._end_call()
            return True
        if final:                           # generation ended inside the arguments (max_tokens, a stop string)
            self.cut_call = self._max_calls is None or self._calls < self._max_calls     # a dropped call is no cut
            self._end_call()
            return True
        return False

    def _on_trailer(self, final: bool) -> bool:
        s = self._buf.lstrip(_JSON_WS)
        if s.startswith("}"):
            s = s[1:].lstrip(_JSON_WS)
        if s.startswith(CALL_END):
            self._buf = s[len(CALL_END):]
        elif CALL_END.startswith(s):
            if not final:
                return False
            self._buf = ""
        else:
            self._buf = s                   # unexpected text after the arguments: the call ends, the rest is content
        self._end_call()
        return True


parse_complete = OutputParser.parse_complete


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker (0 if none)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def _scan_header(s: str, names: frozenset[str]) -> tuple[int, str, int]:
    """Match `{"name": "<fn>", "arguments": ` + `{` at the start of s (JSON whitespace anywhere).

    Returns (_MATCH, name, index of the arguments' `{`), (_MORE, "", 0) when s is a prefix of a possible match, or
    (_FAIL, "", 0). Monotone: a longer s never turns _FAIL into anything else, nor changes a _MATCH."""
    n, i = len(s), 0
    name = ""
    for token in ("{", '"name"', ":", None, ",", '"arguments"', ":", ""):
        while i < n and s[i] in _JSON_WS:
            i += 1
        if token is None:                   # the name: a JSON string
            if i == n:
                return _MORE, "", 0
            if s[i] != '"':
                return _FAIL, "", 0
            j, esc = i + 1, False
            while j < n and (esc or s[j] != '"'):
                esc = not esc and s[j] == "\\"
                j += 1
            if j == n:
                return _MORE, "", 0
            try:
                name = json.loads(s[i:j + 1])
            except ValueError:
                return _FAIL, "", 0
            if name not in names:
                return _FAIL, "", 0
            i = j + 1
            continue
        if not token:                       # the arguments' opening brace: the header is complete
            if i == n:
                return _MORE, "", 0
            return (_MATCH, name, i) if s[i] == "{" else (_FAIL, "", 0)
        part = s[i:i + len(token)]
        if part != token:
            return (_MORE, "", 0) if len(part) < len(token) and token.startswith(part) else (_FAIL, "", 0)
        i += len(token)
    raise AssertionError("unreachable")


def _scan_xml_header(s: str, names: frozenset[str]) -> tuple[int, str, int]:
    """Match whitespace, `<function=NAME>` at the start of s, NAME in names: (_MATCH, name, index past `>`),
    (_MORE, "", 0) while s could still become one, or (_FAIL, "", 0). Monotone, like `_scan_header`."""
    i = len(s) - len(s.lstrip(_JSON_WS))
    rest = s[i:]
    if len(rest) <= len(FUNCTION_START):
        return (_MORE, "", 0) if FUNCTION_START.startswith(rest) else (_FAIL, "", 0)
    if not rest.startswith(FUNCTION_START):
        return _FAIL, "", 0
    tail = rest[len(FUNCTION_START):]
    close = tail.find(">")
    if close < 0:
        return (_MORE, "", 0) if any(n.startswith(tail) for n in names) else (_FAIL, "", 0)
    name = tail[:close]
    if name not in names:
        return _FAIL, "", 0
    return _MATCH, name, i + len(FUNCTION_START) + close + 1


_XML_PARAM = re.compile(r"<parameter=([^>]*)>(.*?)(</parameter>|(?=<parameter=)|(?=</function>)|\Z)", re.DOTALL)


def _xml_arguments(body: str, schema: Mapping | None, closed: bool) -> str:
    """The JSON arguments of an XML call's body (the text after `<function=NAME>`). `closed` False: the block was
    cut, so a parameter that did not close with `</parameter>` is left out."""
    if "</function>" in body:
        body, closed = body.split("</function>", 1)[0], True
    types = ParamSchemas(schema)
    props, _, extra = types.shape()
    args: dict[str, object] = {}
    for m in _XML_PARAM.finditer(body):
        key, value, ender = m.group(1).strip(), m.group(2), m.group(3)
        if not closed and not ender and m.end() == len(body):
            continue                    # cut inside this parameter's value
        if value.startswith("\n"):
            value = value[1:]
        if value.endswith("\n"):
            value = value[:-1]
        args[key] = _xml_value(value, types.kinds(props.get(key, extra)))
    return json.dumps(args, ensure_ascii=False)


def _xml_value(text: str, kinds: frozenset[str] | None) -> object:
    """A parameter's value by the JSON types its schema admits (`kinds`, gateway.json_schema_types: the reading the
    grammar writes values by): strings only, the text; other types, the value of the text as JSON, else as a
    Python literal (the Qwen3-Coder and Qwen3.5 templates write a history call's non-string values with Jinja's
    `| string`: `True`, `False`, `None`, and in the first Qwen3-Coder template `{'k': 'v'}` for objects, so models
    write them so too; `TRUE` / `False` in any case for a boolean, as vLLM's qwen3_coder parser reads them), kept
    only where its type is admitted (`3.10` stays text where a string or null is, `None` is null wherever null is),
    else the text. Unknown types (`{}`, no schema): JSON when that gives a non-string, else the text. Non-finite
    numbers stay text (they are no JSON)."""
    if kinds is not None and kinds <= {"string"}:
        return text
    try:
        value = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except ValueError:
        value = _NO_VALUE
    if kinds is None:
        return text if value is _NO_VALUE or isinstance(value, str) else value
    if value is not _NO_VALUE and not isinstance(value, str) and admitted(value, kinds):
        return value
    value = _python_literal(text.strip())
    if value is not _NO_VALUE and not isinstance(value, str) and admitted(value, kinds):
        return value
    low = text.strip().lower()
    if "boolean" in kinds and low in ("true", "false"):
        return low == "true"
    return text


_NO_VALUE = object()


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is no JSON value")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range")
    return value


def _python_literal(text: str) -> object:
    """`ast.literal_eval` of text when it gives a JSON value (None, bools, numbers, strings, lists, tuples, dicts
    with string keys, nested), else _NO_VALUE."""
    if not text or len(text) > 1_000_000:
        return _NO_VALUE
    try:
        value = ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _NO_VALUE
    return value if _is_json_value(value) else _NO_VALUE


def _is_json_value(value: object, depth: int = 0) -> bool:
    if depth > 200:
        return False
    if value is None or isinstance(value, (bool, int, str)):
        return True
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, (list, tuple)):
        return all(_is_json_value(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_json_value(v, depth + 1) for k, v in value.items())
    return False


def _merge(deltas: list[Delta]) -> list[Delta]:
    """Join adjacent deltas of the same kind (never into a call's first delta, whose arguments stay "")."""
    out: list[Delta] = []
    for d in deltas:
        if out:
            p = out[-1]
            if d.content is not None and p.content is not None:
                out[-1] = Delta(content=p.content + d.content)
                continue
            if d.reasoning is not None and p.reasoning is not None:
                out[-1] = Delta(reasoning=p.reasoning + d.reasoning)
                continue
            if (d.tool_index is not None and d.tool_id is None and p.tool_index == d.tool_index
                    and p.tool_id is None and p.arguments is not None and d.arguments is not None):
                out[-1] = Delta(tool_index=d.tool_index, arguments=p.arguments + d.arguments)
                continue
        out.append(d)
    return out
