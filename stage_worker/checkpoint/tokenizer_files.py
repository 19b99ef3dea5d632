"""A real, trained tokenizer for the random-weight checkpoints `moepipe make-model` writes.

A random-weight checkpoint is only useful for testing the serving path if everything around the weights is real: the
gateway must tokenize prompts, render chat templates and stream detokenized text exactly as it would for a Qwen
checkpoint, and Hugging Face tooling must be able to load the directory. So we train a small byte-level BPE in the
layout of Qwen's `tokenizer.json` (same split regex, NFC normalizer, byte-level pre-tokenizer and decoder) and append
Qwen3's 26 added tokens in Qwen3's order, with Qwen3's `special` flags.

The training text is read from the running Python's standard library (fixed files, fixed order, capped size): it exists
offline on every machine and is identical wherever the same Python is installed. BPE training in `tokenizers` 0.23
turned out deterministic without pinning threads: the same bytes across processes (fresh hash seeds) and any
RAYON_NUM_THREADS, which tests/test_tokenizer.py checks on every run.
"""

from __future__ import annotations

import functools
import json
import sysconfig
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

__all__ = [
    "ADDED_TOKENS",
    "CHAT_TEMPLATE",
    "CORPUS_FILES",
    "CORPUS_MAX_BYTES",
    "MAX_BPE_VOCAB",
    "QWEN_SPLIT_REGEX",
    "SpecialTokens",
    "corpus_texts",
    "write_tokenizer_files",
]

# Qwen2/Qwen3's pre-tokenizer split: contractions, letter runs, single digits, punctuation runs, newline runs, spaces.
# transformers' Qwen2Tokenizer rebuilds its pipeline with exactly this regex (and NFC), so using it keeps ids identical.
QWEN_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen3's added tokens in id order, with its `special` flags: only tokens that must never reach the user are special
# (stripped by skip_special_tokens); tool-call, think and FIM tags are plain added tokens so parsers can see them.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)

# Standard-library files to train on, relative to sysconfig's stdlib dir, in this fixed order. Prose (the license and
# pydoc's topic docs) plus a spread of modules. Files missing from some Python version are skipped.
CORPUS_FILES: tuple[str, ...] = tuple(
    sorted(
        (
            "LICENSE.txt", "_pydecimal.py", "_pyio.py", "abc.py", "argparse.py", "ast.py",
            "asyncio/base_events.py", "base64.py", "bisect.py", "bz2.py", "calendar.py", "cmd.py", "code.py",
            "codecs.py", "collections/__init__.py", "colorsys.py", "concurrent/futures/_base.py",
            "configparser.py", "contextvars.py", "copy.py", "csv.py", "dataclasses.py", "datetime.py",
            "difflib.py", "dis.py", "doctest.py", "email/_header_value_parser.py", "email/message.py", "enum.py",
            "fnmatch.py", "fractions.py", "ftplib.py", "functools.py", "getopt.py", "getpass.py", "gettext.py",
            "glob.py", "graphlib.py", "gzip.py", "hashlib.py", "heapq.py", "hmac.py", "http/client.py",
            "http/cookiejar.py", "http/server.py", "imaplib.py", "importlib/_bootstrap.py",
            "importlib/_bootstrap_external.py", "inspect.py", "ipaddress.py", "json/decoder.py",
            "json/encoder.py", "keyword.py", "locale.py", "logging/__init__.py", "lzma.py", "mailbox.py",
            "mimetypes.py", "multiprocessing/pool.py", "netrc.py", "numbers.py", "operator.py", "optparse.py",
            "os.py", "pathlib.py", "pdb.py", "pickle.py", "platform.py", "plistlib.py", "pprint.py", "pydoc.py",
            "pydoc_data/topics.py", "queue.py", "random.py", "re/_compiler.py", "re/_parser.py", "reprlib.py",
            "sched.py", "secrets.py", "selectors.py", "shlex.py", "shutil.py", "signal.py", "site.py",
            "smtplib.py", "socket.py", "sqlite3/__init__.py", "ssl.py", "statistics.py", "string.py",
            "stringprep.py", "struct.py", "subprocess.py", "symtable.py", "sysconfig.py", "tarfile.py",
            "tempfile.py", "textwrap.py", "this.py", "threading.py", "timeit.py", "token.py", "tokenize.py",
            "trace.py", "traceback.py", "turtle.py", "typing.py", "unittest/case.py", "urllib/parse.py",
            "urllib/request.py", "uuid.py", "warnings.py", "wave.py", "weakref.py", "webbrowser.py",
            "xml/dom/minidom.py", "xml/etree/ElementTree.py", "zipfile.py", "zipimport.py",
        )
    )
)
CORPUS_MAX_BYTES = 6_000_000  # ~5.6 MB on CPython 3.11: enough text for a 32k vocabulary, trains in a few seconds
MAX_BPE_VOCAB = 32_000  # beyond this the stdlib text has nothing left worth merging


@dataclass(frozen=True)
class SpecialTokens:
    """Ids of the tokens serving code and generation_config.json must know, with their (fixed) strings."""

    endoftext: int
    im_start: int
    im_end: int
    tool_call: int
    tool_call_end: int
    tool_response: int
    tool_response_end: int
    think: int
    think_end: int

    ENDOFTEXT: ClassVar[str] = "<|endoftext|>"
    IM_START: ClassVar[str] = "<|im_start|>"
    IM_END: ClassVar[str] = "<|im_end|>"
    TOOL_CALL: ClassVar[str] = "<tool_call>"
    TOOL_CALL_END: ClassVar[str] = "</tool_call>"
    TOOL_RESPONSE: ClassVar[str] = "<tool_response>"
    TOOL_RESPONSE_END: ClassVar[str] = "</tool_response>"
    THINK: ClassVar[str] = "<think>"
    THINK_END: ClassVar[str] = "</think>"

    @property
    def eos_ids(self) -> list[int]:
        """Generation stops on either, chat EOS first (generation_config.json's `eos_token_id`, as in Qwen3)."""
        return [self.im_end, self.endoftext]

    @property
    def pad_id(self) -> int:
        return self.endoftext

    @property
    def ids_by_text(self) -> dict[str, int]:
        return {
            self.ENDOFTEXT: self.endoftext,
            self.IM_START: self.im_start,
            self.IM_END: self.im_end,
            self.TOOL_CALL: self.tool_call,
            self.TOOL_CALL_END: self.tool_call_end,
            self.TOOL_RESPONSE: self.tool_response,
            self.TOOL_RESPONSE_END: self.tool_response_end,
            self.THINK: self.think,
            self.THINK_END: self.think_end,
        }

    @classmethod
    def from_ids(cls, ids_by_text: dict[str, int]) -> SpecialTokens:
        return cls(
            endoftext=ids_by_text[cls.ENDOFTEXT],
            im_start=ids_by_text[cls.IM_START],
            im_end=ids_by_text[cls.IM_END],
            tool_call=ids_by_text[cls.TOOL_CALL],
            tool_call_end=ids_by_text[cls.TOOL_CALL_END],
            tool_response=ids_by_text[cls.TOOL_RESPONSE],
            tool_response_end=ids_by_text[cls.TOOL_RESPONSE_END],
            think=ids_by_text[cls.THINK],
            think_end=ids_by_text[cls.THINK_END],
        )


# Qwen3-style ChatML. All output goes through `{{- '...' }}` expressions so the template's own layout (and HF's
# trim_blocks/lstrip_blocks) never leaks whitespace into the prompt. Reasoning is shown only for assistant turns after
# the last real user query (older reasoning is dropped, as Qwen3 does); a user message that is just a wrapped
# <tool_response> does not count as a query.
CHAT_TEMPLATE = r"""
{%- macro text_of(content) -%}
    {%- if content is none -%}
    {%- elif content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part is string -%}
                {{- part -}}
            {%- elif part.type == 'text' -%}
                {{- part.text -}}
            {%- else -%}
                {{- raise_exception('Only text content parts are supported, got type: ' ~ part.type) -}}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{- raise_exception('Message content must be a string or a list of text parts.') -}}
    {%- endif -%}
{%- endmacro -%}

{%- if messages and messages[0].role == 'system' -%}
    {%- set system_text = text_of(messages[0].content) -%}
    {%- set turns = messages[1:] -%}
{%- else -%}
    {%- set system_text = '' -%}
    {%- set turns = messages -%}
{%- endif -%}

{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if system_text -%}
        {{- system_text + '\n\n' -}}
    {%- endif -%}
    {{- '# Tools\n\nYou may call one or more of the functions below to help with the request.\n\n' -}}
    {{- 'Their signatures are given as JSON inside <tools></tools> XML tags:\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\n' + (tool | tojson) -}}
    {%- endfor -%}
    {{- '\n</tools>\n\nTo call a function, reply with a JSON object holding its name and arguments inside ' -}}
    {{- '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}' -}}
    {{- '\n</tool_call><|im_end|>\n' -}}
{%- elif messages and messages[0].role == 'system' -%}
    {{- '<|im_start|>system\n' + system_text + '<|im_end|>\n' -}}
{%- endif -%}

{%- set ns = namespace(last_query=-1) -%}
{%- for message in turns -%}
    {%- if message.role == 'user' -%}
        {%- set text = text_of(message.content) -%}
        {%- if not (text.startswith('<tool_response>') and text.endswith('</tool_response>')) -%}
            {%- set ns.last_query = loop.index0 -%}
        {%- endif -%}
    {%- endif -%}
{%- endfor -%}

{%- for message in turns -%}
    {%- if message.role == 'user' or message.role == 'system' -%}
        {{- '<|im_start|>' + message.role + '\n' + text_of(message.content) + '<|im_end|>\n' -}}
    {%- elif message.role == 'assistant' -%}
        {%- set content = text_of(message.content) -%}
        {%- set reasoning = '' -%}
        {%- if message.reasoning_content is string -%}
            {%- set reasoning = message.reasoning_content -%}
        {%- elif '</think>' in content -%}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}
            {%- set content = content.split('</think>')[-1].lstrip('\n') -%}
        {%- endif -%}
        {%- set reasoning = reasoning.strip('\n') -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- if reasoning and loop.index0 > ns.last_query -%}
            {{- '<think>\n' + reasoning + '\n</think>\n\n' -}}
        {%- endif -%}
        {{- content -}}
        {%- for call in message.tool_calls or [] -%}
            {%- set fn = call.function if call.function is defined else call -%}
            {%- if content or not loop.first -%}
                {{- '\n' -}}
            {%- endif -%}
            {{- '<tool_call>\n{"name": ' + (fn.name | tojson) + ', "arguments": ' -}}
            {%- if fn.arguments is string -%}
                {{- fn.arguments -}}
            {%- else -%}
                {{- fn.arguments | tojson -}}
            {%- endif -%}
            {{- '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or loop.previtem.role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' + text_of(message.content) + '\n</tool_response>' -}}
        {%- if loop.last or loop.nextitem.role != 'tool' -%}
            {{- '<|im_end|>\n' -}}
        {%- endif -%}
    {%- else -%}
        {{- raise_exception('Unexpected message role: ' ~ message.role) -}}
    {%- endif -%}
{%- endfor -%}

{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- endif -%}
{%- endif -%}
""".strip()


def corpus_texts(max_bytes: int = CORPUS_MAX_BYTES) -> Iterator[str]:
    """Yield the training text file by file; the file that crosses `max_bytes` is cut at a line boundary."""
    root = Path(sysconfig.get_paths()["stdlib"])
    left = max_bytes
    for rel in CORPUS_FILES:
        path = root / rel
        if left <= 0:
            return
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        data = text.encode("utf-8")
        if len(data) > left:
            text = data[: data.rfind(b"\n", 0, left) + 1].decode("utf-8", errors="ignore")
            left = 0
        else:
            left -= len(data)
        if text:
            yield text


def _empty_qwen_style_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _train(bpe_vocab: int, texts: Iterable[str]) -> tuple[str, tuple[tuple[str, int], ...], int]:
    """The trained tokenizer: tokenizer.json's text, the added tokens' ids, and the size with them."""
    tok = _empty_qwen_style_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_vocab,
        min_frequency=2,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # Added after training, so (as in Qwen) they sit right after the BPE vocabulary and are not part of the model.
    tok.add_tokens(
        [
            AddedToken(content, special=special, normalized=False, lstrip=False, rstrip=False, single_word=False)
            for content, special in ADDED_TOKENS
        ]
    )
    ids = tuple((content, tok.token_to_id(content)) for content, _ in ADDED_TOKENS)

    # Spell out the settings the Python bindings cannot set, so the JSON reads like Qwen's; decoding is unaffected.
    tokenizer_json = json.loads(tok.to_str())
    tokenizer_json["decoder"] = dict(type="ByteLevel", add_prefix_space=False, trim_offsets=False, use_regex=False)
    tokenizer_json["model"].update(continuing_subword_prefix="", end_of_word_suffix="")
    text = json.dumps(tokenizer_json, indent=2, ensure_ascii=False) + "\n"
    return text, ids, tok.get_vocab_size(with_added_tokens=True)


@functools.lru_cache(maxsize=4)
def _trained_on_corpus(bpe_vocab: int) -> tuple[str, tuple[tuple[str, int], ...], int]:
    """`_train` on the standard-library corpus, once per process and BPE size: the training is deterministic (the
    module docstring), and a process writing several checkpoints (the test suite, scripts that make a family of
    presets) would otherwise train the same tokenizer again for each, 3-4 s of CPU a time."""
    return _train(bpe_vocab, corpus_texts())


def write_tokenizer_files(out_dir: Path, *, vocab_size: int, model_max_length: int,
                          texts: Iterable[str] | None = None) -> SpecialTokens:
    """Train the tokenizer and write `tokenizer.json` and `tokenizer_config.json` into `out_dir`.

    `vocab_size` is the model's embedding row count: the tokenizer (BPE vocabulary plus added tokens) never exceeds
    it, and for large values stops at what the training text supports (MAX_BPE_VOCAB), like real Qwen tokenizers
    that are somewhat smaller than their embeddings. Returns the ids generation_config.json needs.
    """
    min_size = 256 + len(ADDED_TOKENS)
    if vocab_size < min_size:
        raise ValueError(f"vocab_size={vocab_size} is too small for a byte-level tokenizer; need >= {min_size}")
    if model_max_length <= 0:
        raise ValueError(f"model_max_length must be positive, got {model_max_length}")

    bpe_vocab = min(vocab_size - len(ADDED_TOKENS), MAX_BPE_VOCAB)
    tokenizer_text, ids_items, size = _trained_on_corpus(bpe_vocab) if texts is None else _train(bpe_vocab, texts)
    ids = dict(ids_items)
    assert size <= vocab_size

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_text(tokenizer_text, encoding="utf-8")

    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(ids[content]): {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }
            for content, special in ADDED_TOKENS
        },
        # Qwen lists every special token except the pad token here.
        "additional_special_tokens": [c for c, special in ADDED_TOKENS if special and c != SpecialTokens.ENDOFTEXT],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": SpecialTokens.IM_END,
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": SpecialTokens.ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    _write_json(out_dir / "tokenizer_config.json", config)
    return SpecialTokens.from_ids(ids)
