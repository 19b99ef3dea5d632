"""Structured output: grammars that constrain sampling, compiled and matched with llguidance.

The gateway keeps one `GrammarState` per constrained request. Before each decode step it computes the allowed-token
bitmask (`fill_mask`), sends it with the step to the last pipeline stage, which sets disallowed logits to -inf before
sampling, and then advances the state with the token that was actually accepted (`accept`), in step order.

Mask layout (llguidance's, also xgrammar's and vLLM's): int32 words, ceil(vocab / 32) of them; token i is allowed iff
bit (i % 32) of word (i // 32) is set. The mask covers the *model's* vocabulary (embedding rows, config.json's
vocab_size), which may be larger than the tokenizer's: ids the tokenizer does not have are never allowed. EOS ids are
allowed only where the grammar may end.

Why llguidance (rather than xgrammar): it builds its token trie from a `tokenizer.json` directly (no transformers),
computes masks lazily per step in ~tens of microseconds with no per-grammar precompilation pass (so a fresh JSON schema
per request costs little at request time), covers more of JSON Schema (and says which keywords it does not implement,
instead of silently ignoring them), and its Lark grammars can inline JSON schemas (`%json {...}`) and name special
tokens (`<tool_call>`), which is exactly what the tool-call format needs. Forced tool calls are written in the chat
template's form (`GrammarCompiler.call_form`): hermes JSON, or Qwen3-Coder / Qwen3.5's XML (`_XmlCall`), whose
parameters, in any order, are kept to the schema's set by llguidance's parametric rules.

JSON whitespace: by default generated JSON is in `json.dumps` form, ", " between items and ": " after keys, with no
other whitespace. That is what chat templates render tool calls in and what models imitate; it also stops a weak or
unlucky model from emitting whitespace forever inside a constrained object. Pass `flexible_whitespace=True` to allow
any JSON whitespace instead.

strict: `json_schema(schema, strict=True)` refuses a schema that uses a keyword llguidance does not implement (e.g.
"not", "unevaluatedProperties") with GrammarError. With strict=False the schema is still enforced, but such keywords are
ignored (logged as warnings), so the output matches a slightly looser schema; `oneOf` is the exception: llguidance
enforces it exactly when it can prove the alternatives disjoint, and would otherwise quietly loosen it to `anyOf`, so
such a schema is refused (GrammarError naming oneOf) whatever `strict` says. The schema is never rewritten: OpenAI's
strict mode additionally implies additionalProperties=false and all-properties-required, but here the output follows
the schema as written. A tool's `function.strict` is handled the same way.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from llguidance import LLMatcher, LLTokenizer, regex_to_lark
from tokenizers import Tokenizer as _Backend

from gateway.json_schema_types import ParamSchemas, def_ref
from gateway.output_parser import CALL_END, CALL_FORMS, CALL_START

__all__ = ["GrammarCompiler", "GrammarError", "GrammarState", "mask_to_bool", "mask_words"]

log = logging.getLogger(__name__)

# the call syntax is the output parser's (gateway/output_parser.py): what the grammar lets the model write is what it
# reads back
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = CALL_START, CALL_END
# Text an XML-form parameter value never holds: gateway.output_parser ends a value at `</parameter>` (or the next
# `<parameter=`, or `</function>`) and the block at `</tool_call>`, so a value holding one would be read cut.
_XML_MARKERS = ("</parameter>", "<parameter=", "</function>", TOOL_CALL_CLOSE)
_XML_VALUE_END = "\n</parameter>\n"
_PERMUTATION_BITS = 64             # llguidance's parametric rules carry a 64-bit set: the declared parameters seen
_MAX_ERROR_CHARS = 600


class GrammarError(ValueError):
    """The schema, tools or grammar of a request is invalid or unsupported; the API answers 400 naming the field."""


def mask_words(vocab_size: int) -> int:
    """Number of int32 words in one token mask over `vocab_size` ids."""
    return (vocab_size + 31) // 32


def mask_to_bool(words: Any, vocab_size: int) -> np.ndarray:
    """int32 mask words (shape [..., ceil(vocab/32)]) -> bool array [..., vocab]: True where the token is allowed."""
    w = np.ascontiguousarray(np.asarray(words), dtype="<i4")
    if w.shape[-1] * 32 < vocab_size:
        raise ValueError(f"mask has {w.shape[-1]} words, too few for a vocabulary of {vocab_size}")
    bits = np.unpackbits(w.view(np.uint8), axis=-1, bitorder="little")
    return bits[..., :vocab_size].astype(bool)


def _short(message: str) -> str:
    message = message.strip()
    return message if len(message) <= _MAX_ERROR_CHARS else message[:_MAX_ERROR_CHARS] + "..."


def _lark_literal(text: str) -> str:
    """A Lark string literal for `text` (JSON string escapes are valid Lark escapes)."""
    return json.dumps(text, ensure_ascii=False)


class GrammarState:
    """One request's position in its grammar; wraps an `llguidance.LLMatcher`.

    Per decode step: `fill_mask(row)` (or `mask()`), then `accept(token)` with the sampled token, then check
    `is_finished()`. Not thread-safe; each request owns its state.
    """

    __slots__ = ("_matcher", "vocab_size", "n_words", "_error", "_specials", "_ll_tokenizer")

    def __init__(self, matcher: LLMatcher, vocab_size: int, specials: np.ndarray | None = None,
                 ll_tokenizer: LLTokenizer | None = None) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.n_words = mask_words(vocab_size)
        self._error: str | None = None
        self._specials = specials if specials is not None else np.zeros(0, dtype=np.int64)
        self._ll_tokenizer = ll_tokenizer

    @property
    def matcher(self) -> LLMatcher:
        return self._matcher

    def fill_mask(self, out: np.ndarray) -> None:
        """Write the allowed-token mask for the next step into `out`: a C-contiguous int32 array of n_words words."""
        if out.dtype != np.int32 or out.size != self.n_words or not out.flags["C_CONTIGUOUS"]:
            raise ValueError(
                f"mask buffer must be a contiguous int32 array of {self.n_words} words, "
                f"got {out.dtype} of shape {out.shape}"
            )
        self._matcher.unsafe_compute_mask_ptr(out.ctypes.data, self.n_words * 4)
        ids = self._specials
        if not ids.size:
            return
        allowed = ((out[ids >> 5] >> (ids & 31)) & 1).astype(bool)
        if allowed.any() and not self._matcher.is_stopped():     # (a stopped matcher's mask is its EOS ids)
            self._spell_forced_specials(out, ids[allowed])

    def _spell_forced_specials(self, out: np.ndarray, allowed: np.ndarray) -> None:
        """Where the grammar forces text that is also an added token's (a schema `const` of "</tool_call>" or
        "<|im_end|>"), llguidance's mask allows only that added token, which its matcher then refuses as a special
        token: the request would fail. Clear every allowed added token the matcher would not consume; if nothing is
        left, allow the first token of the forced text spelled in ordinary tokens (which it does consume)."""
        bits = out.view(np.uint32)
        for tid in allowed.tolist():
            if not self._matcher.validate_tokens([tid]):
                bits[tid >> 5] &= np.uint32(~(1 << (tid & 31)) & 0xFFFFFFFF)
        if bits.any() or self._ll_tokenizer is None:
            return
        forced = self._matcher.compute_ff_bytes().decode("utf-8", "ignore")
        spelled = self._ll_tokenizer.greedy_tokenize(forced) if forced else []
        if spelled and self._matcher.validate_tokens(spelled[:1]):
            bits[spelled[0] >> 5] |= np.uint32(1 << (spelled[0] & 31))

    def mask(self) -> np.ndarray:
        """The allowed-token mask for the next step, as a new int32 array of n_words words."""
        out = np.empty(self.n_words, dtype=np.int32)
        self.fill_mask(out)
        return out

    def mask_bytes(self) -> bytes:
        """The mask as packed little-endian bits (byte i // 8, bit i % 8 = token i): shared/token_mask.py's wire form,
        the byte image of the int32 words on a little-endian host. n_words * 4 bytes."""
        return self.mask().astype("<i4", copy=False).tobytes()

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token. False if it was not allowed (the state is then in error for good)."""
        if self._error is not None:
            return False
        token_id = int(token_id)
        if not 0 <= token_id < self.vocab_size:
            self._error = f"token id {token_id} is outside the vocabulary (size {self.vocab_size})"
            return False
        return bool(self._matcher.consume_token(token_id))

    def rollback(self, num_tokens: int) -> bool:
        """Undo the last `num_tokens` accepted tokens (for speculative decoding; not needed otherwise)."""
        return bool(self._matcher.rollback(num_tokens))

    def is_finished(self) -> bool:
        """True once nothing more may be generated: the grammar is complete and cannot be extended (or EOS was
        accepted), or the state is in error (check `error`). The request should stop; finish_reason "stop"."""
        return self._error is not None or bool(self._matcher.is_stopped())

    def is_accepting(self) -> bool:
        """True if the output so far is a complete match (EOS is allowed now), though it may still be extended."""
        return self._error is None and bool(self._matcher.is_accepting())

    @property
    def error(self) -> str | None:
        """Why the matcher failed (e.g. a disallowed token was accepted); None while it is healthy."""
        if self._error is not None:
            return self._error
        if self._matcher.is_error():
            return _short(self._matcher.get_error()) or "grammar matcher error"
        return None


class GrammarCompiler:
    """Compiles grammar specs for one model and hands out `GrammarState`s. Build once per model.

    `tokenizer`: a tokenizer.json path (or the checkpoint directory holding it), or a `tokenizers.Tokenizer`.
    `eos_token_ids`: every id that ends generation (gateway Tokenizer.eos_token_ids); allowed only where the grammar
    may end. `vocab_size`: the model's vocabulary (embedding rows); masks cover this many ids. `call_form`: how the
    chat template writes tool calls ("hermes" JSON or Qwen3-Coder / Qwen3.5 "xml", shared.tokenizer's
    `tool_call_form`), the form `tool_calls` grammars make the model write.

    Spec methods (`json_object`, `json_schema`, `tool_calls`) return a grammar spec (llguidance's JSON grammar text),
    compiled eagerly so an invalid request fails with GrammarError before it is scheduled; compiled grammars are kept
    in a small LRU keyed by that text, and `new_matcher(spec)` clones the compiled matcher.
    """

    def __init__(
        self,
        tokenizer: str | Path | _Backend,
        eos_token_ids: Iterable[int],
        vocab_size: int,
        *,
        cache_size: int = 64,
        flexible_whitespace: bool = False,
        call_form: str = "hermes",
    ) -> None:
        if call_form not in CALL_FORMS:
            raise ValueError(f"call_form must be one of {CALL_FORMS}, got {call_form!r}")
        self.call_form = call_form
        backend = self._load_backend(tokenizer)
        tokenizer_vocab = backend.get_vocab_size(with_added_tokens=True)
        if vocab_size < tokenizer_vocab:
            raise ValueError(f"model vocab_size {vocab_size} is smaller than the tokenizer's {tokenizer_vocab}")
        eos = [int(i) for i in dict.fromkeys(eos_token_ids)]
        if not eos:
            raise ValueError("at least one EOS token id is needed")
        self.vocab_size = int(vocab_size)
        self.n_words = mask_words(self.vocab_size)
        self.eos_token_ids = eos
        self.ll_tokenizer = LLTokenizer(backend.to_str(), n_vocab=self.vocab_size, eos_token=eos)
        # added tokens llguidance treats as special, EOS included (GrammarState._spell_forced_specials)
        added = backend.get_added_tokens_decoder() if hasattr(backend, "get_added_tokens_decoder") else {}
        self._specials = np.array(sorted({i for i in added if i < self.vocab_size
                                          and self.ll_tokenizer.is_special_token(i)} | set(eos)), dtype=np.int64)
        # Tool-call tags are single added tokens in Qwen-style tokenizers; require exactly those tokens when present.
        self._tag = {
            tag: (tag if backend.token_to_id(tag) is not None else _lark_literal(tag))
            for tag in (TOOL_CALL_OPEN, TOOL_CALL_CLOSE)
        }
        self._json_options: dict[str, Any] = (
            {"whitespace_flexible": True}
            if flexible_whitespace
            else {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        )
        self._cache: OrderedDict[str, LLMatcher] = OrderedDict()
        self._validated: OrderedDict[str, GrammarError | None] = OrderedDict()   # _validate's answers
        self._cache_size = max(1, int(cache_size))
        self._lock = threading.Lock()

    @classmethod
    def for_tokenizer(
        cls,
        tok: Any,
        *,
        eos_ids: Iterable[int] | None = None,
        vocab_size: int | None = None,
        **kwargs: Any,
    ) -> GrammarCompiler:
        """From `shared.tokenizer.Tokenizer` (its tokenizers backend, EOS ids, vocabulary and tool-call form by
        default). Pass the model's vocab_size when its embedding is wider than the tokenizer."""
        backend = tok if isinstance(tok, _Backend) else getattr(tok, "_backend", None)
        if not isinstance(backend, _Backend):
            raise TypeError(f"cannot get a tokenizers.Tokenizer from {type(tok).__name__}")
        eos = (getattr(tok, "eos_token_ids", None) or []) if eos_ids is None else eos_ids
        size = vocab_size if vocab_size is not None else backend.get_vocab_size(with_added_tokens=True)
        kwargs.setdefault("call_form", getattr(tok, "tool_call_form", "hermes"))
        return cls(backend, eos, size, **kwargs)

    @staticmethod
    def _load_backend(tokenizer: str | Path | _Backend) -> _Backend:
        if isinstance(tokenizer, _Backend):
            return tokenizer
        path = Path(tokenizer)
        if path.is_dir():
            path = path / "tokenizer.json"
        try:
            return _Backend.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception
            raise ValueError(f"cannot load tokenizer {path}: {e}") from e

    # ---- specs --------------------------------------------------------------------------------------------------

    def json_object(self) -> str:
        """Any JSON object (response_format {"type": "json_object"})."""
        return self._compile(LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=self._json_options))

    def json_schema(self, schema: Mapping[str, Any], strict: bool = False) -> str:
        """JSON matching `schema` (response_format {"type": "json_schema"}); see the module doc for `strict`."""
        schema = self._check_schema(schema, "schema")
        try:
            spec = LLMatcher.grammar_from_json_schema(
                json.dumps(schema), overrides={**self._json_options, "lenient": not strict}
            )
        except (ValueError, TypeError) as e:
            raise GrammarError(f"invalid JSON schema: {e}") from e
        spec = self._compile(spec, what="JSON schema")
        probe = self.new_matcher(spec)
        probe.mask()
        if probe.is_finished():
            # e.g. {"$ref": "#"}: a schema defined only by itself compiles to a grammar with nothing to generate,
            # which would answer 200 with empty, non-JSON content
            raise GrammarError("the JSON schema admits no output that can be generated (is it defined only by a "
                               "reference to itself?)")
        return spec

    def regex(self, pattern: str) -> str:
        """Text matching `pattern` in full (vLLM's `guided_regex`)."""
        return self._compile(LLMatcher.grammar_from_regex(pattern), what="regular expression")

    def choice(self, options: Sequence[str]) -> str:
        """Exactly one of `options` (vLLM's `guided_choice`)."""
        return self._compile(LLMatcher.grammar_from_lark("start: " + " | ".join(_lark_literal(o) for o in options)),
                             what="choice")

    def lark(self, grammar: str) -> str:
        """Text of a Lark grammar, llguidance's dialect (vLLM's `guided_grammar`)."""
        return self._compile(LLMatcher.grammar_from_lark(grammar), what="Lark grammar")

    def tool_calls(self, tools: Sequence[Mapping[str, Any]], choice: str | Mapping[str, Any], parallel: bool, *,
                   allowed: Iterable[str] | None = None, answer: Mapping[str, Any] | None = None,
                   answer_strict: bool = False, form: str | None = None) -> str:
        """Calls are one (or, if `parallel`, one or more "\\n"-separated) blocks in the tool-call `form` (default: the
        compiler's `call_form`) whose arguments follow that tool's parameters schema. `allowed`: the names that may
        be called (default: every tool; tool_choice allowed_tools).

        "hermes": exactly `<tool_call>\\n{"name": "<name>", "arguments": <JSON>}\\n</tool_call>`, the arguments
        matching the schema. "xml" (Qwen3-Coder, Qwen3.5), exactly as their templates instruct::

            <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>

        with the schema's properties as parameters, each at most once, in any order, every required one present,
        others (a name the schema does not declare) only where `additionalProperties` allows them; see
        `_XmlCall` for the values.

        `choice` "required": the reply is calls to `allowed` tools; {"type": "function", "function": {"name": X}}:
        calls to X only; "auto": calls to `allowed` tools, or else JSON matching `answer` (a schema: response_format
        with tools, the openai-agents SDK's typed final answer), or else (no `answer`) free text that never contains
        the call tag, optionally followed by calls. "auto" with every tool allowed and no answer needs no grammar.
        """
        form = self.call_form if form is None else form
        if form not in CALL_FORMS:
            raise ValueError(f"form must be one of {CALL_FORMS}, got {form!r}")
        functions = self._functions(tools)
        allowed_names = list(functions) if allowed is None else list(dict.fromkeys(allowed))
        unknown = [n for n in allowed_names if n not in functions]
        if unknown or not allowed_names:
            raise GrammarError(f"allowed tools {unknown or allowed_names!r} are not among the tools")
        calls = 'call ("\\n" call)*' if parallel else "call"
        top = [f"start: {calls}"]
        if choice == "required":
            chosen = allowed_names
        elif choice == "auto":
            if answer is None and allowed is None:
                raise GrammarError('tool_choice "auto" with every tool allowed and no answer schema needs no grammar')
            chosen = allowed_names
            if answer is not None:
                schema = self._check_schema(answer, "response_format schema")
                schema = {**schema, "x-guidance": {**self._json_options, "lenient": not answer_strict}}
                top = [f"start: {calls} | answer", f"answer: %json {json.dumps(schema)}"]
            else:                           # free text (never the tag: only allowed calls may follow it)
                tag = re.escape(TOOL_CALL_OPEN)
                top = [f"start: TEXT | TEXT? {calls}", f"TEXT: /(?s:.+)/ & ~/(?s:.*){tag}(?s:.*)/"]
        elif isinstance(choice, Mapping):
            fn = choice.get("function")
            name = fn.get("name") if isinstance(fn, Mapping) else None
            if choice.get("type", "function") != "function" or not isinstance(name, str):
                raise GrammarError('tool_choice must be "required" or {"type": "function", "function": {"name": ...}}')
            if name not in functions:
                raise GrammarError(f"tool_choice names function {name!r}, which is not among the tools")
            chosen = [name]
        else:
            raise GrammarError(f"tool_choice {choice!r} needs no grammar: only \"required\", \"auto\" with allowed "
                               "tools or an answer schema, or a named function does")

        fns = " | ".join(f"fn_{i}" for i in range(len(chosen)))
        rules = []
        for i, name in enumerate(chosen):
            params, strict = functions[name]
            params = {**params, "x-guidance": {**self._json_options, "lenient": not strict}}
            prefix = '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '
            rules.append(f"fn_{i}: {_lark_literal(prefix)} %json {json.dumps(params)} \"}}\"")
        call = f'call: {self._tag[TOOL_CALL_OPEN]} "\\n" ({fns}) "\\n" {self._tag[TOOL_CALL_CLOSE]}'
        hermes = LLMatcher.grammar_from_lark("\n".join([*top, call, *rules]))
        if form == "hermes":
            return self._compile(hermes, what="tool parameters schema")
        # The XML grammar holds the schemas piecemeal (a property's JSON, a string's constraints), so it would pass
        # what llguidance's JSON compiler refuses whole (`"required": "city"`, `properties` a list, an external
        # `$ref`): the schemas are checked as the hermes grammar of the same tools, refused with its 400
        self._validate(hermes, what="tool parameters schema")
        rules = []
        for i, name in enumerate(chosen):
            params, strict = functions[name]
            rules += _XmlCall(f"fn_{i}", name, params, strict, self._json_options).rules()
        rules += _XmlCall.shared_rules()
        call = f"call: {self._tag[TOOL_CALL_OPEN]} \"\\n\" ({fns}) {self._tag[TOOL_CALL_CLOSE]}"
        lark = "\n".join([*top, call, *rules])
        return self._compile(LLMatcher.grammar_from_lark(lark), what="tool parameters schema")

    def _functions(self, tools: Sequence[Mapping[str, Any]]) -> dict[str, tuple[dict, bool]]:
        """name -> (parameters schema, strict) for OpenAI-style tools, validated for shape."""
        if not isinstance(tools, Sequence) or isinstance(tools, (str, bytes)) or not tools:
            raise GrammarError("tools must be a non-empty list")
        out: dict[str, tuple[dict, bool]] = {}
        for i, tool in enumerate(tools):
            fn = tool.get("function") if isinstance(tool, Mapping) else None
            if not isinstance(fn, Mapping) or tool.get("type", "function") != "function":
                raise GrammarError(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}')
            name = fn.get("name")
            if not isinstance(name, str) or not name:
                raise GrammarError(f"tools[{i}].function.name must be a non-empty string")
            params = fn.get("parameters")
            params = {"type": "object"} if params is None or params == {} else params
            out[name] = (self._check_schema(params, f"tools[{i}].function.parameters"), bool(fn.get("strict")))
        return out

    @staticmethod
    def _check_schema(schema: Any, where: str) -> dict:
        if schema is True:
            return {}
        if schema is False:
            raise GrammarError(f"{where} is false: no output can match it")
        if not isinstance(schema, Mapping):
            raise GrammarError(f"{where} must be a JSON object")
        try:
            return _closed_objects(json.loads(json.dumps(schema)))
        except (TypeError, ValueError) as e:
            raise GrammarError(f"{where} is not valid JSON: {e}") from e

    # ---- compile, cache, match ----------------------------------------------------------------------------------

    def _compile(self, spec: str, what: str = "grammar") -> str:
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return spec
        matcher = LLMatcher(self.ll_tokenizer, spec, log_level=0)  # releases the GIL while compiling
        if matcher.is_error():
            raise GrammarError(f"invalid or unsupported {what}: {_short(matcher.get_error())}")
        for warning in matcher.get_grammar_warnings():
            _check_warning(warning)
            log.warning("grammar warning: %s", warning)
        with self._lock:
            self._cache[spec] = matcher
            self._cache.move_to_end(spec)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return spec

    def _validate(self, spec: str, what: str) -> None:
        """Raise the GrammarError `_compile(spec, what)` would, without building a matcher to keep (the answers are
        kept, as many as compiled grammars)."""
        with self._lock:
            known = spec in self._validated
            if known:
                self._validated.move_to_end(spec)
                error = self._validated[spec]
        if not known:
            error = None
            is_error, messages = LLMatcher.validate_grammar_with_warnings(spec, self.ll_tokenizer)
            try:
                if is_error:
                    raise GrammarError(f"invalid or unsupported {what}: {_short(messages[0] if messages else '')}")
                for warning in messages:
                    _check_warning(warning)
            except GrammarError as e:
                error = e
            with self._lock:
                self._validated[spec] = error
                while len(self._validated) > self._cache_size:
                    self._validated.popitem(last=False)
        if error is not None:
            raise GrammarError(str(error))

    def new_matcher(self, spec: str) -> GrammarState:
        """A fresh state at the start of `spec` (compiled now if it fell out of the cache)."""
        with self._lock:
            template = self._cache.get(spec)
            if template is not None:
                self._cache.move_to_end(spec)
                return GrammarState(template.deep_copy(), self.vocab_size, self._specials, self.ll_tokenizer)
        self._compile(spec)
        with self._lock:
            template = self._cache[spec]
            return GrammarState(template.deep_copy(), self.vocab_size, self._specials, self.ll_tokenizer)


def _check_warning(warning: str) -> None:
    """A compile warning that must refuse the grammar: llguidance, lenient, would enforce a looser anyOf for a oneOf
    whose alternatives it cannot prove disjoint."""
    if "oneOf" in warning:
        raise GrammarError(f"oneOf whose alternatives may overlap cannot be enforced exactly ({warning}); "
                           "use anyOf if a value may match several alternatives")


class _XmlCall:
    """The Lark rules of one function's call in the XML form (Qwen3-Coder, Qwen3.5), as their templates instruct:
    `<function=NAME>\n`, then per parameter `<parameter=KEY>\nVALUE\n</parameter>\n`, then `</function>\n`.

    Parameters: the schema's `properties` (with those of `allOf` members), each at most once and in any order
    (llguidance's parametric rules keep the set written; a schema of more than 64 properties takes them in its
    order), every `required` one present; names the schema does not declare only where `additionalProperties` (true
    or a schema) or `patternProperties` allow them (any number, values per `additionalProperties`; the name patterns
    are not checked). A property whose name the form cannot carry (`>`, `<`, a line break, surrounding spaces) is
    left out, or refused when required.

    Values, as gateway.output_parser types them: both read the property's admitted JSON types off the schema with
    gateway.json_schema_types (`ParamSchemas.kinds`: `type`, `enum` / `const`, local `$ref`, `anyOf` / `oneOf`,
    `allOf`, the root's `allOf` members and a root `$ref`), so what the grammar lets through is read as it meant:

    * a property that admits only strings (`"type": "string"`, an `enum` / `const` of strings, also through `$ref`
      or `allOf`): its text as it is, any text but `</parameter>`, `<parameter=`, `</function>` and `</tool_call>`
      (the parser would end the value or the call there); `enum` / `const`, `minLength` / `maxLength` and `pattern`
      (a JSON Schema pattern: unanchored, `_pattern_terminal`) are enforced on the text (`format` is not);
    * one that admits no string (integer, number, boolean, null, object, array, or unions of them): JSON matching
      the schema (llguidance's `%json`, compact as all enforced JSON, `$defs` / `definitions` of the root beside it,
      strict per the tool's `strict`), except that top-level booleans and null are written `True` / `False` /
      `None`, the templates' spelling of them (`_python_spellings`);
    * one that admits strings beside other types (`["string", "null"]`, `anyOf` string or null), or does not say
      what it admits (`{}`): free text as for a string; the parser keeps a JSON or Python-literal reading of it
      only where that reading's type is admitted (`None` / `null` as null, `42` as 42 where integers are), else
      the text.

    The schema itself is checked as the hermes form checks it (`GrammarCompiler.tool_calls`), so a schema one form
    refuses the other does too, with the same 400.
    """

    def __init__(self, rule: str, name: str, params: dict, strict: bool, json_options: Mapping[str, Any]) -> None:
        self.rule, self.name, self.strict = rule, name, strict
        self.json_options = {**json_options, "lenient": not strict}
        self.types = ParamSchemas(params)           # the reading gateway.output_parser types the values by
        self.defs = self.types.defs
        self.props, self.required, self.extra = self._shape()
        self.lines: list[str] = []

    # ---- the object's shape ---------------------------------------------------------------------------------

    def _shape(self) -> tuple[dict[str, Any], list[str], Any]:
        """(properties in schema order, required names, schema of undeclared parameters or None where none may
        be written): `ParamSchemas.shape`, less the names the form cannot carry."""
        root = self.types.resolve(self.types.root)
        members = [root] if isinstance(root, Mapping) else []
        if members and isinstance(root.get("allOf"), list):
            members += [self.types.resolve(m) for m in root["allOf"]]
        if any(isinstance(m, Mapping) and "required" in m and not isinstance(m["required"], list) for m in members):
            raise GrammarError(f"function {self.name!r}: `required` must be a list of names")
        out, required, extra = self.types.shape()
        for key in list(out):
            if not key or key != key.strip() or any(c in key for c in "<>\n\r"):
                if key in required:
                    raise GrammarError(f"function {self.name!r}: required parameter {key!r} cannot be written in the "
                                       "XML tool-call form (<parameter=NAME>)")
                del out[key]
            elif out[key] is False:
                del out[key]
        return out, [r for r in required if r in out], extra

    def _refs_resolvable(self, node: Any, depth: int = 0) -> bool:
        """Every `$ref` in node points into the root's `$defs` / `definitions` (which travel with the value)."""
        if depth > 64:
            return False
        if isinstance(node, list):
            return all(self._refs_resolvable(x, depth + 1) for x in node)
        if not isinstance(node, dict):
            return True
        ref = node.get("$ref")
        if isinstance(ref, str) and self.types.ref_target(ref) is None:
            return False
        return all(self._refs_resolvable(v, depth + 1) for k, v in node.items() if k not in ("const", "enum"))

    # ---- values -----------------------------------------------------------------------------------------------

    def _value(self, tag: str, schema: Any) -> str:
        """The Lark expression of a value and the `\n</parameter>\n` after it (terminals it needs are added)."""
        kinds = self.types.kinds(schema)
        if kinds and "string" not in kinds and self._refs_resolvable(schema):
            python, json_kinds = self._python_spellings(schema, kinds)
            alts = [_lark_literal(w) for w in python]
            if json_kinds or not alts:
                # booleans and null only in the templates' spelling: the JSON part admits the other types
                value = schema if json_kinds == kinds or not json_kinds else \
                    {"allOf": [schema, {"type": sorted(json_kinds)}]}
                value = {**self.defs, **value} if isinstance(value, dict) else value
                value = {**value, "x-guidance": self.json_options} if isinstance(value, dict) else value
                alts.insert(0, f"%json {json.dumps(value)}")
            return f"({' | '.join(alts)}) XML_END" if len(alts) > 1 else f"{alts[0]} XML_END"
        if kinds == {"string"}:
            text = self._text_constraint(self.types.resolve(schema))
            if text:
                self.lines.append(f"{tag}: ({text} & XML_TEXT) XML_END")
                return tag
        return "XML_VALUE"

    def _python_spellings(self, schema: Any, kinds: frozenset[str]) -> tuple[list[str], frozenset[str]]:
        """(the words `True` / `False` / `None` of the booleans / null the schema admits, the types left to JSON).

        The XML templates write an earlier call's top-level booleans and null with Jinja's `| string` (`True`,
        `False`, `None`), so a value generated so is the text the next turn's prompt re-renders (the prefix cache
        keeps it) and the spelling the model sees in its history; gateway.output_parser reads both spellings. Where
        `ParamSchemas.admits` cannot tell whether a value is admitted (`not`, `if`), that type stays JSON."""
        words: list[str] = []
        json_kinds = set(kinds)
        for kind, values in (("boolean", (True, False)), ("null", (None,))):
            if kind not in kinds:
                continue
            verdicts = [self.types.admits(schema, v) for v in values]
            if any(v is None for v in verdicts):
                continue
            words += [repr(v) for v, ok in zip(values, verdicts) if ok]
            json_kinds.discard(kind)
        return words, frozenset(json_kinds)

    def _text_constraint(self, schema: Any) -> str | None:
        """A Lark terminal expression for a string schema's text: enum / const, length bounds, pattern."""
        if not isinstance(schema, dict):
            return None
        if isinstance(schema.get("const"), str):
            return _lark_literal(schema["const"])
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            options = [v for v in schema["enum"] if isinstance(v, str)]
            return "(" + " | ".join(_lark_literal(v) for v in options) + ")" if options else None
        parts = []
        lo, hi = schema.get("minLength", 0), schema.get("maxLength")
        lo = lo if isinstance(lo, int) and not isinstance(lo, bool) and lo > 0 else 0
        hi = hi if isinstance(hi, int) and not isinstance(hi, bool) and hi >= lo else None
        if lo or hi is not None:
            parts.append(f"/(?s:.{{{lo},{'' if hi is None else hi}}})/")
        pattern = schema.get("pattern")
        if isinstance(pattern, str):
            # kept per pattern up to a size (a request may send any text: 1,024 huge patterns must not pin the memory)
            checked = _checked_pattern_terminal if len(pattern) <= _CACHED_PATTERN_CHARS else \
                _checked_pattern_terminal.__wrapped__
            term, error = checked(pattern)
            if not error:
                parts.append(term)
            elif self.strict:
                raise GrammarError(f"function {self.name!r}: pattern {pattern!r} cannot be enforced: {_short(error)}")
            else:
                log.warning("grammar warning: function %r: pattern %r not enforced: %s", self.name, pattern,
                            _short(error))
        return " & ".join(parts) or None

    # ---- rules ------------------------------------------------------------------------------------------------

    def rules(self) -> list[str]:
        r = self.rule
        names = list(self.props)
        params = []
        for k, key in enumerate(names):
            value = self._value(f"XML_{r.upper()}_{k}", self.props[key])
            self.lines.append(f"{r}_p{k}: {_lark_literal(f'<parameter={key}>' + chr(10))} {value}")
            params.append(f"{r}_p{k}")
        extra = None
        if self.extra is not None:
            taken = " | ".join(_lark_literal(n) for n in names)
            name = "/[^<>\\s]+/" + (f" & ~({taken})" if taken else "")
            self.lines.append(f'XML_{r.upper()}_OPEN: "<parameter=" ({name}) ">\\n"')
            self.lines.append(f"{r}_x: XML_{r.upper()}_OPEN {self._value(f'XML_{r.upper()}_X', self.extra)}")
            extra = f"{r}_x"
        head = f"{r}: {_lark_literal(f'<function={self.name}>' + chr(10))}"
        tail = _lark_literal("</function>\n")
        if 0 < len(names) <= _PERMUTATION_BITS:
            # the required ones take the low bits, so "all required written" is one range test
            order = sorted(range(len(names)), key=lambda k: names[k] not in self.required)
            bit = {k: b for b, k in enumerate(order)}
            n_req = len(self.required)
            alts = ['""' + (f" %if is_ones([0:{n_req}])" if n_req else "")]
            alts += [f"{params[k]} {r}_args::set_bit({bit[k]}) %if bit_clear({bit[k]})" for k in range(len(names))]
            if extra:
                alts.append(f"{extra} {r}_args::_")
            self.lines.append(f"{r}_args::_: " + "\n    | ".join(alts))
            self.lines.append(f"{head} {r}_args::0x0 {tail}")
        else:
            seq = [p if names[k] in self.required else f"{p}?" for k, p in enumerate(params)]
            self.lines.append(" ".join([head, *seq, *([extra + "*"] if extra else []), tail]))
        return self.lines

    @staticmethod
    def shared_rules() -> list[str]:
        markers = "|".join(re.escape(m).replace("/", "\\/") for m in _XML_MARKERS)
        return [f"XML_TEXT: /(?s:.*)/ & ~/(?s:.*)({markers})(?s:.*)/",
                f"XML_END: {_lark_literal(_XML_VALUE_END)}",
                "XML_VALUE: XML_TEXT XML_END"]


_CACHED_PATTERN_CHARS = 4096


@functools.lru_cache(maxsize=1024)
def _checked_pattern_terminal(pattern: str) -> tuple[str, str]:
    """`_pattern_terminal(pattern)` and llguidance's error for it ("" when it compiles): kept per pattern, so a tool
    list sent with every request of a conversation compiles each of its patterns once, not once a request."""
    term = _pattern_terminal(pattern)
    return term, LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(f"start: X\nX: {term}"))


def _pattern_terminal(pattern: str) -> str:
    """A JSON Schema `pattern` as a Lark terminal matching whole texts.

    JSON Schema tests a pattern as an unanchored ECMAScript search: a text matches when some part of it does, `^`
    tying that part to the text's start and `$` to its end. llguidance's regexes match whole texts and take `^` /
    `$` only at their very edges, so the pattern is written as alternatives searched for one by one (`_searches`):
    `(?s:.*)` before one unless it starts with `^`, after it unless it ends with `$` (`^ab|cd$`: texts that start
    with ab, or end with cd; `(^a|b)c`: texts that start with ac, or hold bc), exactly the texts llguidance's JSON
    compiler (the hermes form) admits. A pattern whose anchors cannot be brought to the edges (`a^b`, `(^a)*`) is
    left as written, which llguidance refuses, as its JSON compiler does: `tool_calls` refuses the schema."""
    searches = _searches(pattern)
    if searches is None:
        return f"/(?s:.*)(?:{regex_to_lark(pattern, 'dw')})(?s:.*)/"
    parts = [("" if start else "(?s:.*)") + f"(?:{regex_to_lark(body, 'dw')})" + ("" if end else "(?s:.*)")
             for start, body, end in searches]
    return f"/{parts[0]}/" if len(parts) == 1 else "/" + "|".join(f"(?:{p})" for p in parts) + "/"


_MAX_SEARCHES = 64


def _searches(pattern: str) -> list[tuple[bool, str, bool]] | None:
    """(anchored at the start, body, anchored at the end) alternatives whose searches together are `pattern`'s:
    its top-level alternatives, with a group holding an anchor spliced into its alternatives (`(^a|b)c` is `^ac` or
    `bc`); None where an anchor would stay inside (quantified or lookaround groups, text before `^` or after `$`)."""
    seqs, i = _parse_alternation(pattern, 0)
    if i != len(pattern):
        return None
    out = []
    for seq in seqs:
        flat = _splice(seq)
        if flat is None or len(out) + len(flat) > _MAX_SEARCHES:
            return None
        for items in flat:
            lead = 0
            while lead < len(items) and items[lead] == "^":
                lead += 1
            trail = len(items)
            while trail > lead and items[trail - 1] == "$":
                trail -= 1
            middle = items[lead:trail]
            if any(x in ("^", "$") for x in middle):
                return None
            out.append((lead > 0, "".join(_text(x) for x in middle), trail < len(items)))
    return out


def _parse_alternation(p: str, i: int) -> tuple[list[list], int]:
    """Parse alternatives from p[i] to an unmatched `)` or the end: a list of sequences of items, an item being
    "^", "$", opaque text (an atom with its quantifier) or a group (opening text, alternatives, closing text with its
    quantifier). ECMAScript syntax, as far as grouping goes: escapes, classes (`]` ends one), groups."""
    seqs: list[list] = [[]]
    while i < len(p):
        c = p[i]
        if c == ")":
            break
        if c == "|":
            seqs.append([])
            i += 1
            continue
        if c in "^$":
            seqs[-1].append(c)
            i += 1
            continue
        if c == "(":
            m = re.match(r"\((\?(:|=|!|<=|<!|<[A-Za-z_$][\w$]*>))?", p[i:])
            inner, j = _parse_alternation(p, i + len(m.group(0)))
            if j >= len(p):
                return seqs, len(p) + 1                      # unbalanced: no match of the whole pattern
            k = _quantifier_end(p, j + 1)
            seqs[-1].append((m.group(0), inner, p[j:k]))
            i = k
            continue
        j = i + 2 if c == "\\" else i + 1
        if c == "[":
            while j < len(p) and p[j] != "]":
                j += 2 if p[j] == "\\" else 1
            j += 1
        k = _quantifier_end(p, min(j, len(p)))
        seqs[-1].append(p[i:k])
        i = k
    return seqs, i


def _quantifier_end(p: str, i: int) -> int:
    m = re.match(r"(?:[*+?]|\{\d+(?:,\d*)?\})\??", p[i:])
    return i + len(m.group(0)) if m else i


def _has_anchor(items: list) -> bool:
    return any(x in ("^", "$") or (isinstance(x, tuple) and any(_has_anchor(s) for s in x[1])) for x in items)


def _splice(items: list) -> list[list] | None:
    """The sequences `items` stands for once every group holding an anchor is replaced by each of its alternatives
    in turn; None where such a group is quantified or a lookaround, or they are too many."""
    out: list[list] = [[]]
    for x in items:
        if isinstance(x, tuple) and _has_anchor([x]):
            opening, alternatives, closing = x
            lookaround = opening in ("(?=", "(?!", "(?<=", "(?<!")
            if closing != ")" or lookaround:          # (^a)* or (?=^a): the anchor stays inside
                return None
            expanded = []
            for alt in alternatives:
                flat = _splice(alt)
                if flat is None:
                    return None
                expanded += flat
            out = [a + b for a in out for b in expanded]
        else:
            out = [a + [x] for a in out]
        if len(out) > _MAX_SEARCHES:
            return None
    return out


def _text(x: Any) -> str:
    if isinstance(x, tuple):
        opening, alternatives, closing = x
        return opening + "|".join("".join(_text(y) for y in s) for s in alternatives) + closing
    return x


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
_COMPOSED = ("$ref", "allOf", "anyOf", "oneOf", "additionalProperties", "patternProperties", "unevaluatedProperties")


def _closed_objects(node: Any, close: bool = True, root: Any = None) -> Any:
    """Objects that do not say otherwise get `additionalProperties: false` (recursively), as xgrammar's strict mode
    and OpenAI's strict structured outputs do. JSON Schema's default (any extra key) lets a model write keys forever
    and never helps a client: it asked for the properties it listed. An explicit `additionalProperties` is kept.

    `allOf` is an intersection: each member sees the whole object, so closing a member to its own properties would
    forbid the other members' keys (`allOf: [{a}, {b}]` would admit no object at all). Members are left open at
    their top level and the intersection is closed once, on the node holding it, over the union of the members'
    properties (which is exactly what zod's `unevaluatedProperties: false` on an intersection says, so that
    keyword, which llguidance does not implement, is dropped there). Members that are references or compositions
    themselves, or say how extra keys go, leave the intersection open: their keys are not known here. A member that
    is only a local reference to a `$defs` / `definitions` entry (`allOf: [{"$ref": "#/$defs/Base"}, {...}]`, a
    model extending another) is that entry written in place, open at its top level as other members are: the entry
    itself is closed to its own keys, so through the reference it would forbid the other members' keys (no object
    at all: a 400 "unsatisfiable").

    Names that `required` lists but `properties` does not declare (`{"type": "object", "required": ["x"]}`: any
    object with an `x`) are declared with the empty schema where the object is closed here: closing it to its
    `properties` alone would make the schema unsatisfiable (a 400 for a valid schema). An explicit
    `additionalProperties: false` is the client's and left as it is."""
    root = node if root is None else root
    if isinstance(node, list):
        return [_closed_objects(x, root=root) for x in node]
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [_closed_objects(x, root=root) for x in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: _closed_objects(v, root=root) for k, v in out[key].items()}
    for key in _SUBSCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = _closed_objects(out[key], root=root)
    members = out.get("allOf")
    if isinstance(members, list):
        members = [_inline_ref(m, root) for m in members]
        out["allOf"] = [_closed_objects(x, close=False, root=root) for x in members]
        if not close:
            return out
        objects = [m for m in members if isinstance(m, dict) and _is_object(m)]
        known = all(isinstance(m, dict) and not any(k in m for k in _COMPOSED) for m in members)
        if (objects or _is_object(out)) and known and "additionalProperties" not in out and "patternProperties" not in out \
                and out.get("unevaluatedProperties", False) is False:
            names = {k: {} for m in objects for k in (m.get("properties") or {})}
            names.update({k: {} for m in [out, *objects] for k in _required_names(m)})
            out["properties"] = {**names, **(out.get("properties") or {})}
            out["additionalProperties"] = False
            out.pop("unevaluatedProperties", None)
        return out
    if close and _is_object(out) and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
        props = out.get("properties") if isinstance(out.get("properties"), dict) else {}
        missing = [k for k in _required_names(out) if k not in props]
        if missing and (isinstance(out.get("properties"), dict) or "properties" not in out):
            out["properties"] = {**props, **{k: {} for k in missing}}
    return out


def _required_names(node: dict) -> list[str]:
    required = node.get("required")
    return [k for k in required if isinstance(k, str)] if isinstance(required, list) else []


def _inline_ref(member: Any, root: Any) -> Any:
    """An allOf member that is only a local reference (`{"$ref": "#/$defs/X"}`, with annotations beside it) as the
    object schema it names, when that schema is a plain one (no reference or composition of its own); else the
    member as it is."""
    if not isinstance(member, dict) or not isinstance(member.get("$ref"), str) or not isinstance(root, dict):
        return member
    if any(k not in ("$ref", "description", "title", "$comment", "examples", "default") for k in member):
        return member
    found = def_ref(member["$ref"])
    defs = root.get(found[0]) if found else None
    target = defs.get(found[1]) if isinstance(defs, dict) else None
    if not isinstance(target, dict) or not _is_object(target) or any(k in target for k in _COMPOSED):
        return member
    return {**target, **{k: v for k, v in member.items() if k != "$ref"}}


def _is_object(node: dict) -> bool:
    kind = node.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in node
