"""A checkpoint's tokenizer: its `tokenizer.json` and chat template, without transformers. In `shared` because the
gateway and the stage worker's commands (`generate`, `route-stats`) both tokenize, and services import only `shared`.

The gateway needs four things from a Hugging Face checkpoint directory: encode prompts, render chat templates the way
`transformers` does (same Jinja environment, so a checkpoint's template gives the same prompt here as there), know the
ids generation stops on, and stream generated text. Streaming is the subtle part: a byte-level BPE token can hold half
of a multi-byte UTF-8 character, so text is emitted only once its bytes are complete (see IncrementalDetokenizer).
"""

from __future__ import annotations

import codecs
import functools
import json
from collections.abc import Iterable, Mapping
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken
from tokenizers import Tokenizer as _Backend
from tokenizers import decoders

from shared.cluster_config import CHAT_TEMPLATE_CONTENT_FORMATS

__all__ = ["IncrementalDetokenizer", "Tokenizer"]

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"  # newer checkpoints ship the template beside the config instead of inside it
TEMPLATE_DIR = "additional_chat_templates"  # named templates beside it (file name = template name)
GENERATION_CONFIG_FILE = "generation_config.json"

# Names a message's reasoning arrives under; templates read the first (transformers aliases them the same way).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Above this many characters (ids) the Rust tokenizer runs through its batch entry points, which release the GIL:
# `encode` of a 1.6M-character prompt held it for its whole 2.8 s, so a gateway thread tokenizing it stopped the event
# loop and the engine-core thread with it (every stream paused, /health missed heartbeats). Same ids, same text.
LONG_INPUT = 4096


def _byte_decoder() -> dict[str, int]:
    """Inverse of the GPT-2 byte-to-unicode table that byte-level BPE vocabularies are written in.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes (controls, space, ...) are shifted to U+0100..
    in byte order, so every byte has a visible, non-whitespace character.
    """
    visible = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in visible}
    shifted = 0
    for b in range(256):
        if b not in visible:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


_BYTE_OF_CHAR = _byte_decoder()


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string, null, or a serialized AddedToken dict."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


def _plain(value: Any) -> Any:
    """Messages and tools as plain dicts and lists (pydantic models too), as the template sees them."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return value


def _alias_reasoning(message: dict) -> dict:
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson HTML-escapes and forces ASCII; chat templates expect plain json.dumps (as transformers has).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def read_chat_template(path: str | Path) -> str:
    """A chat template file's text, checked to compile (a ValueError naming the file and the error)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"chat template {path} is not a file")
    return check_chat_template(path.read_text(encoding="utf-8"), f"chat template {path}")


def check_chat_template(source: str, where: str) -> str:
    """`source`, checked to compile (a ValueError starting with `where` and naming the error)."""
    try:
        _compile_template(source)
    except jinja2.TemplateError as e:
        raise ValueError(f"{where}: {e}") from e
    return source


def _environment() -> ImmutableSandboxedEnvironment:
    """An environment that matches transformers', so Hub templates render identically."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _compile_template(source: str) -> jinja2.Template:
    return _environment().from_string(source)


@functools.lru_cache(maxsize=8)
def _loops_over_content(source: str) -> bool:
    """Whether a template reads a message's content as a list of parts: a `for` over something named content
    (`message.content`, `message['content']`, a macro's `content` argument: Qwen3.5's, the demo model's). Templates
    that never do (Qwen3, Qwen3-Coder) concatenate content as a string. vLLM decides its "string" / "openai" content
    format the same way, from the template's syntax tree."""
    try:
        tree = _environment().parse(source)
    except jinja2.TemplateError:
        return True
    for loop in tree.find_all(nodes.For):
        it = loop.iter
        while isinstance(it, nodes.Filter) and it.node is not None:     # `for part in content | list`
            it = it.node
        if (isinstance(it, nodes.Name) and "content" in it.name
                or isinstance(it, nodes.Getattr) and it.attr == "content"
                or isinstance(it, nodes.Getitem) and isinstance(it.arg, nodes.Const) and it.arg.value == "content"):
            return True
    return False


def _content_as_text(message: dict) -> dict:
    """A message for a template that reads content as a string: no content (null) is "", a list of text parts is
    their texts joined by newlines (vLLM's "string" content format); other lists are left to the template."""
    if not isinstance(message, dict):
        return message
    content = message.get("content")
    if content is None:
        return {**message, "content": ""}
    if isinstance(content, list):
        texts = [p if isinstance(p, str) else p.get("text") if isinstance(p, Mapping) and p.get("type") == "text"
                 else None for p in content]
        if all(isinstance(t, str) for t in texts):
            return {**message, "content": "\n".join(texts)}
    return message


def _content_as_parts(message: dict) -> dict:
    """A message as vLLM's "openai" content format gives it: content a list of parts, a string as one text part,
    null as none (--chat-template-content-format openai, for a template the detection reads wrong)."""
    if not isinstance(message, dict):
        return message
    content = message.get("content")
    if content is None:
        return {**message, "content": []}
    if isinstance(content, str):
        return {**message, "content": [{"type": "text", "text": content}]}
    if isinstance(content, list):
        return {**message, "content": [{"type": "text", "text": p} if isinstance(p, str) else p for p in content]}
    return message


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def _pick_template(config: dict, directory: Path) -> str | dict[str, str] | None:
    """The chat template as transformers loads it: chat_template.jinja and additional_chat_templates/*.jinja (by
    file name) replace tokenizer_config.json's; a list there names its templates. One default is a string, several
    a dict by name."""
    found = {}
    jinja_file = directory / TEMPLATE_FILE
    if jinja_file.is_file():
        found["default"] = jinja_file.read_text(encoding="utf-8")
    extra = directory / TEMPLATE_DIR
    if extra.is_dir():
        for f in sorted(extra.glob("*.jinja")):
            found[f.name.removesuffix(".jinja")] = f.read_text(encoding="utf-8")
    template = found or config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
    if isinstance(template, dict):
        template = {k: v for k, v in template.items() if isinstance(k, str) and isinstance(v, str)}
        if list(template) == ["default"]:
            return template["default"]
        return template or None
    return template if isinstance(template, str) else None


# transformers' SPECIAL_TOKENS_ATTRIBUTES order, in which it adds named special tokens its backend lacks
_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _add_missing_tokens(backend: _Backend, config: dict) -> None:
    """Tokens tokenizer_config.json declares that tokenizer.json lacks, added as transformers adds them (at the next
    free ids, whatever id the config wrote): added_tokens_decoder in id order, then the named special tokens, then
    additional_special_tokens. Without this their text was encoded byte by byte."""
    def add(value: Any, special: bool, spec: Mapping | None = None) -> None:
        content = _token_text(value)
        if not content or backend.token_to_id(content) is not None:
            return
        spec = spec or {}
        token = AddedToken(content, single_word=bool(spec.get("single_word", False)),
                           lstrip=bool(spec.get("lstrip", False)), rstrip=bool(spec.get("rstrip", False)),
                           normalized=bool(spec.get("normalized", not special)), special=special)
        (backend.add_special_tokens if special else backend.add_tokens)([token])

    decoder = config.get("added_tokens_decoder")
    if isinstance(decoder, Mapping):
        def order(item):
            return int(item[0]) if str(item[0]).isdigit() else float("inf")
        for _, spec in sorted(decoder.items(), key=order):
            if isinstance(spec, Mapping):
                add(spec, bool(spec.get("special", True)), spec)
    for name in _NAMED_SPECIAL:
        add(config.get(name), True, config.get(name) if isinstance(config.get(name), Mapping) else None)
    # transformers 5 reads extra_special_tokens (a list, or a dict naming them), additional_special_tokens only
    # beside a dict or without it
    extra = config.get("extra_special_tokens")
    values = list(extra.values()) if isinstance(extra, Mapping) else extra if isinstance(extra, list) else []
    if extra is None or isinstance(extra, Mapping):
        more = config.get("additional_special_tokens")
        values += more if isinstance(more, list) else []
    for value in values:
        add(value, True, value if isinstance(value, Mapping) else None)


def _model_config_eos(directory: Path) -> list[int]:
    """config.json's eos_token_id (the top level's, else its text_config's): what transformers' generation stops on
    when a checkpoint ships no generation_config.json (GenerationConfig.from_model_config)."""
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    if not isinstance(config, dict):
        return []
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    eos = config.get("eos_token_id")
    eos = text.get("eos_token_id") if eos is None else eos
    eos = [eos] if isinstance(eos, int) else eos if isinstance(eos, list) else []
    return [i for i in eos if isinstance(i, int) and not isinstance(i, bool)]


class Tokenizer:
    """Encode, decode and chat-format for one checkpoint; build it with `Tokenizer.from_dir`."""

    def __init__(
        self,
        backend: _Backend,
        *,
        chat_template: str | Mapping[str, str] | None,
        special_tokens: Mapping[str, str | None],
        eos_token_ids: Iterable[int],
        content_format: str = "auto",
    ) -> None:
        if content_format not in CHAT_TEMPLATE_CONTENT_FORMATS:
            raise ValueError(f"chat template content format {content_format!r}: choose from "
                             f"{', '.join(CHAT_TEMPLATE_CONTENT_FORMATS)}")
        self._backend = backend
        self._template_source = chat_template
        self.content_format = content_format        # "auto": read off the template (_loops_over_content)
        self._special_tokens = dict(special_tokens)  # bos_token/eos_token/... strings, passed to the template
        self._eos_token_ids = list(dict.fromkeys(eos_token_ids))
        added = backend.get_added_tokens_decoder()
        self._special_ids = frozenset(i for i, tok in added.items() if tok.special)
        # A byte-level decoder maps each token to bytes independently, which is what lets streaming be exact.
        self.is_byte_level = isinstance(backend.decoder, decoders.ByteLevel)
        self._bytes_cache: dict[int, bytes] = {}

    @classmethod
    def from_dir(cls, path: str | Path, chat_template: str | Path | None = None,
                 content_format: str = "auto") -> Tokenizer:
        """Load `tokenizer.json` + `tokenizer_config.json` (+ `chat_template.jinja`, `generation_config.json`).
        `chat_template`: a Jinja file used instead of the checkpoint's templates (vLLM's --chat-template).
        `content_format`: vLLM's --chat-template-content-format (see apply_chat_template).
        Without `tokenizer_config.json` (transformers loads `tokenizer.json` alone too): no named special tokens
        beyond what tokenizer.json marks special, the end-of-sequence ids from generation_config.json or
        config.json, a chat template only from its own file."""
        directory = Path(path)
        if not directory.is_dir():
            raise ValueError(f"tokenizer directory {directory} does not exist")
        if not (directory / TOKENIZER_FILE).is_file():
            raise ValueError(f"{directory} has no {TOKENIZER_FILE}: not a Hugging Face tokenizer directory (moepipe "
                             f"reads the fast tokenizer's file only)")
        try:
            backend = _Backend.from_file(str(directory / TOKENIZER_FILE))
        except Exception as e:  # the Rust side raises a bare Exception for malformed files
            raise ValueError(f"cannot load {directory / TOKENIZER_FILE}: {e}") from e
        config = _read_json(directory / CONFIG_FILE) if (directory / CONFIG_FILE).is_file() else {}
        _add_missing_tokens(backend, config)

        special_tokens = {
            name: _token_text(config.get(name)) for name in ("bos_token", "eos_token", "pad_token", "unk_token")
        }
        eos_ids: list[int] = []
        generation_file = directory / GENERATION_CONFIG_FILE
        if generation_file.is_file():
            configured = _read_json(generation_file).get("eos_token_id")
            eos_ids += configured if isinstance(configured, list) else [] if configured is None else [configured]
        else:
            eos_ids += _model_config_eos(directory)
        eos_text = special_tokens["eos_token"]
        if eos_text is not None and (eos_id := backend.token_to_id(eos_text)) is not None:
            eos_ids.append(eos_id)
        return cls(
            backend,
            chat_template=_pick_template(config, directory) if chat_template is None else
            read_chat_template(chat_template),
            special_tokens=special_tokens,
            eos_token_ids=[int(i) for i in eos_ids],
            content_format=content_format,
        )

    # ---- ids and text -------------------------------------------------------------------------------------------

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends generation: generation_config.json's list (with no such file, config.json's, as
        transformers takes it), then the tokenizer's own eos_token."""
        return list(self._eos_token_ids)

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer knows, added tokens included; the model's embedding may have more rows."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids `decode(..., skip_special_tokens=True)` drops (not the tool-call and think tags)."""
        return self._special_ids

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Special-token strings in `text` (as in a rendered chat template) become their single ids."""
        if len(text) > LONG_INPUT:
            return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = list(ids)
        if len(ids) > LONG_INPUT:
            return self._backend.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_strings(self, ids: list[int]) -> list[str]:
        """Each id decoded alone (with special tokens), the GIL released for long lists (`/tokenize`'s strings)."""
        return self._backend.decode_batch([[i] for i in ids], skip_special_tokens=False)

    def token_bytes(self, token_id: int, skip_special_tokens: bool = True) -> bytes:
        """The bytes one token contributes to the decoded text (byte-level tokenizers only).

        Mirrors the `tokenizers` ByteLevel decoder: a token whose characters are all in the byte table is those
        bytes, any other (an added token like "a b") is its UTF-8. Unknown ids (embedding rows past the
        vocabulary) contribute nothing, as in `decode`.
        """
        if skip_special_tokens and token_id in self._special_ids:
            return b""
        cached = self._bytes_cache.get(token_id)
        if cached is None:
            text = self._backend.id_to_token(token_id)
            if text is None:
                cached = b""
            else:
                try:
                    cached = bytes(_BYTE_OF_CHAR[c] for c in text)
                except KeyError:
                    cached = text.encode("utf-8")
            self._bytes_cache[token_id] = cached
        return cached

    # ---- chat ---------------------------------------------------------------------------------------------------

    @cached_property
    def _template(self) -> jinja2.Template:
        return self._named_template(None)

    @cached_property
    def tool_call_form(self) -> str:
        """How replies write tool calls, read off the template used with tools: "xml" when its text has
        `<function=` (Qwen3-Coder and Qwen3.5: `<tool_call><function=NAME><parameter=KEY>...`, vLLM's qwen3_coder
        parser), else "hermes" (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`, the default)."""
        source = self._template_source
        if isinstance(source, Mapping):
            source = source.get("tool_use" if "tool_use" in source else "default")
        return "xml" if isinstance(source, str) and "<function=" in source else "hermes"

    @cached_property
    def _tool_template(self) -> jinja2.Template:
        return self._named_template("tool_use")

    def _named_source(self, preferred: str | None) -> str:
        """transformers' get_chat_template: of named templates, `tool_use` when tools are given and it exists,
        else `default`."""
        source = self._template_source
        if isinstance(source, Mapping):
            name = preferred if preferred in source else "default"
            if name not in source:
                raise ValueError(f"this checkpoint has chat templates {sorted(source)} and none named 'default'")
            source = source[name]
        if source is None:
            raise ValueError("this checkpoint's tokenizer has no chat template")
        return source

    def _named_template(self, preferred: str | None) -> jinja2.Template:
        return _compile_template(self._named_source(preferred))

    def _reads_content_lists(self, preferred: str | None) -> bool:
        if self.content_format != "auto":
            return self.content_format == "openai"
        return _loops_over_content(self._named_source(preferred))

    def apply_chat_template(
        self,
        messages: Iterable[Mapping[str, Any]],
        *,
        tools: list[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render a conversation to prompt text. Extra kwargs (e.g. `enable_thinking=False`) go to the template.

        A template that never loops over a message's content (Qwen3's, Qwen3-Coder's: `'\\n' + message.content`)
        gets content as a string: null as "", text parts joined by newlines, as vLLM gives such templates (a list
        would render as its Python repr, null would fail). `content_format` (vLLM's --chat-template-content-format)
        overrides that reading of the template: "string" always so, "openai" always a list of parts (a string one
        text part, null none, as vLLM's "openai" format).

        A template's `raise_exception` (bad roles, unsupported content) and other template errors, and Python errors
        raised while it renders (`'</think>' in None`, `|items` of a string), surface as ValueError, so the API
        layer can answer 400.
        """
        named = isinstance(self._template_source, Mapping) and tools is not None
        turns = [_alias_reasoning(m) for m in _plain(list(messages))]
        if not self._reads_content_lists("tool_use" if named else None):
            turns = [_content_as_text(m) for m in turns]
        elif self.content_format == "openai":
            turns = [_content_as_parts(m) for m in turns]
        context = {
            **self._special_tokens,
            **_plain(template_kwargs),
            "messages": turns,
            "tools": _plain(tools) if tools is not None else None,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return (self._tool_template if named else self._template).render(**context)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template rejected the conversation: {e}") from e
        except (TypeError, AttributeError, KeyError, IndexError) as e:
            raise ValueError(f"chat template failed on the conversation: {type(e).__name__}: {e}") from e


class IncrementalDetokenizer:
    """Turns generated ids into text one token at a time, never emitting half a character.

    Byte-level tokenizers (all Qwen checkpoints): each token's bytes go through an incremental UTF-8 decoder, which
    holds back an incomplete trailing sequence until its remaining bytes arrive: O(1) per token, and the pieces add
    up to exactly `decode(all_ids)`, even when BPE merged the tail of one character with the head of the next.

    Other decoders (or `window=True`): vLLM's scheme, decoding only the ids since the last complete character plus
    one step of context and emitting the new suffix unless it ends in U+FFFD (an incomplete character).
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True, window: bool | None = None) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._window = (not tokenizer.is_byte_level) if window is None else window
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._ids: list[int] = []  # window mode: ids from the prefix offset on
        self._read = 0  # window mode: ids before this index have been emitted

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text it completes (often "", never a dangling partial character)."""
        if not self._window:
            return self._utf8.decode(self._tok.token_bytes(token_id, self._skip))
        self._ids.append(token_id)
        prefix_text = self._tok.decode(self._ids[: self._read], self._skip)
        text = self._tok.decode(self._ids, self._skip)
        if text.endswith("\ufffd"):
            return ""  # wait for the rest of the character
        # Keep the last emitted step as context: some decoders render a token differently at the start of a string.
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        return text[len(prefix_text) :]

    def flush(self) -> str:
        """End of generation: whatever is still held back (a truncated character decodes to U+FFFD)."""
        if not self._window:
            return self._utf8.decode(b"", final=True)
        prefix_text = self._tok.decode(self._ids[: self._read], self._skip)
        text = self._tok.decode(self._ids, self._skip)
        self._ids, self._read = [], 0
        return text[len(prefix_text) :]
