"""Tokenizer files for random-weight checkpoints, and the gateway's tokenizer, checked against transformers."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest

from shared.tokenizer import IncrementalDetokenizer, Tokenizer
from stage_worker.checkpoint.tokenizer_files import (
    ADDED_TOKENS,
    CHAT_TEMPLATE,
    MAX_BPE_VOCAB,
    SpecialTokens,
    write_tokenizer_files,
)

REPO = Path(__file__).resolve().parents[1]
VOCAB = 2048

TEXTS = {
    "ascii": "Hello, world! The quick brown fox jumps over the lazy dog.",
    "code": 'def add(a: int, b: int) -> int:\n\t"""Sum."""\n    return a + b  # 42\n\nprint(add(1, 2))\n',
    "chinese": "你好，世界！这是一个分词器的测试。",
    "emoji": "rain 🌧️ rocket 🚀 coder 👩‍💻 flag 🇫🇷 done",
    "mixed": "naïve café — 東京 🍣 Ωmega ∑ x²\r\n  trailing  ",
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
TOOLS_SYSTEM = (
    "# Tools\n\nYou may call one or more of the functions below to help with the request.\n\n"
    "Their signatures are given as JSON inside <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(TOOLS[0], ensure_ascii=False)
    + "\n</tools>\n\nTo call a function, reply with a JSON object holding its name and arguments inside "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
    "\n</tool_call><|im_end|>\n"
)

CHATS = {
    "plain": (
        dict(
            messages=[
                {"role": "system", "content": "You are helpful."},
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello! How can I help?"},
                {"role": "user", "content": "Tell me a joke."},
            ],
            add_generation_prompt=True,
        ),
        "<|im_start|>system\nYou are helpful.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello! How can I help?<|im_end|>\n"
        "<|im_start|>user\nTell me a joke.<|im_end|>\n"
        "<|im_start|>assistant\n",
    ),
    "tools": (
        dict(
            messages=[
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in 東京?"},
                {
                    "role": "assistant",
                    "content": "",
                    "reasoning_content": "Call the tool.",
                    "tool_calls": [
                        {"id": "c1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "東京"}'}},
                        {"id": "c2", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "rain, 12°C"},
                {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "sun"}]},
            ],
            tools=TOOLS,
            add_generation_prompt=True,
            enable_thinking=False,
        ),
        "<|im_start|>system\nBe brief.\n\n" + TOOLS_SYSTEM
        + "<|im_start|>user\nWeather in 東京?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nCall the tool.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nrain, 12°C\n</tool_response>\n"
        "<tool_response>\nsun\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n",
    ),
    "reasoning": (
        dict(
            messages=[
                {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+2?"}]},
                {"role": "assistant", "content": "4", "reasoning_content": "2+2=4"},  # before the last query: dropped
                {"role": "user", "content": "And 3+3?"},
                {"role": "assistant", "content": "<think>\n3+3=6\n</think>\n\n6"},
            ],
            add_generation_prompt=False,
        ),
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nAnd 3+3?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n3+3=6\n</think>\n\n6<|im_end|>\n",
    ),
}


@pytest.fixture(scope="session")
def written(tmp_path_factory) -> tuple[Path, SpecialTokens]:
    out = tmp_path_factory.mktemp("tok")
    special = write_tokenizer_files(out, vocab_size=VOCAB, model_max_length=4096)
    generation = {"bos_token_id": special.endoftext, "eos_token_id": special.eos_ids, "pad_token_id": special.pad_id}
    (out / "generation_config.json").write_text(json.dumps(generation))
    return out, special


@pytest.fixture(scope="session")
def tok(written) -> Tokenizer:
    return Tokenizer.from_dir(written[0])


@pytest.fixture(scope="session")
def hf(written):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(written[0]))


def stream(tokenizer: Tokenizer, ids: list[int], **kwargs) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, **kwargs)
    return [detok.push(i) for i in ids] + [detok.flush()]


# ---- the written files ----------------------------------------------------------------------------------------------


def test_files_look_like_qwen(written, tok):
    out, special = written
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "Qwen2Tokenizer"
    assert (config["eos_token"], config["pad_token"], config["bos_token"]) == ("<|im_end|>", "<|endoftext|>", None)
    assert config["model_max_length"] == 4096 and config["chat_template"] == CHAT_TEMPLATE
    flags = {v["content"]: (int(k), v["special"]) for k, v in config["added_tokens_decoder"].items()}
    assert flags == {text: (special.endoftext + i, sp) for i, (text, sp) in enumerate(ADDED_TOKENS)}
    assert flags["<|im_end|>"][1] and flags["<|endoftext|>"][1] and flags["<|im_start|>"][1]
    assert not any(flags[t][1] for t in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
                                         "<think>", "</think>"))
    assert special.eos_ids == [special.im_end, special.endoftext]
    assert tok.eos_token_ids == special.eos_ids
    assert tok.vocab_size == VOCAB  # the BPE target leaves exactly room for the added tokens
    assert special.im_end in tok.special_ids and special.think not in tok.special_ids
    assert special.endoftext == VOCAB - len(ADDED_TOKENS)


def test_vocab_size_limits(tmp_path):
    with pytest.raises(ValueError, match="too small"):
        write_tokenizer_files(tmp_path, vocab_size=200, model_max_length=128)
    special = write_tokenizer_files(tmp_path, vocab_size=248_320, model_max_length=262_144)
    size = Tokenizer.from_dir(tmp_path).vocab_size
    assert size <= MAX_BPE_VOCAB + len(ADDED_TOKENS) and special.endoftext == size - len(ADDED_TOKENS)


def test_training_is_deterministic_across_processes_and_threads(written, tmp_path):
    # A second write in a fresh process (new hash seeds) on one rayon thread must give the same bytes.
    code = (
        "import sys; from pathlib import Path; "
        "from stage_worker.checkpoint.tokenizer_files import write_tokenizer_files; "
        f"write_tokenizer_files(Path(sys.argv[1]), vocab_size={VOCAB}, model_max_length=4096)"
    )
    env = {**os.environ, "RAYON_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, env=env, check=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (written[0] / name).read_bytes(), name


# ---- encode / decode ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", TEXTS)
def test_round_trip(tok, name):
    text = TEXTS[name]
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_special_tokens_are_single_ids(tok, written):
    special = written[1]
    for text, token_id in special.ids_by_text.items():
        assert tok.encode(text) == [token_id], text
        assert tok.encode(f"x{text}y")[1:-1] == [token_id], text
    ids = tok.encode("<|im_start|>assistant\n<think>a</think><tool_call>b</tool_call><|im_end|><|endoftext|>")
    assert tok.decode(ids) == "assistant\n<think>a</think><tool_call>b</tool_call>"
    assert tok.decode(ids, skip_special_tokens=False).startswith("<|im_start|>assistant")


# ---- streaming ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [False, True])
@pytest.mark.parametrize("name", TEXTS)
def test_detokenizer_matches_decode(tok, name, window):
    ids = tok.encode("<|im_start|>assistant\n<think>" + TEXTS[name] + "<|im_end|>")
    for skip in (True, False):
        pieces = stream(tok, ids, skip_special_tokens=skip, window=window)
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
        assert not any("\ufffd" in p for p in pieces)


def test_multibyte_characters_really_split_across_tokens(tok):
    # Otherwise the streaming tests above would prove nothing about holding back partial characters.
    def complete(b: bytes) -> bool:
        try:
            b.decode("utf-8")
            return True
        except UnicodeDecodeError:
            return False

    ids = tok.encode(TEXTS["chinese"] + TEXTS["emoji"])
    assert sum(not complete(tok.token_bytes(i)) for i in ids) > 5


def test_detokenizer_on_random_ids(tok):
    # What a random-weight model emits: arbitrary ids, invalid UTF-8, ids past the vocabulary (embedding padding).
    rng = random.Random(1234)
    for _ in range(300):
        ids = [rng.randrange(VOCAB + 64) for _ in range(rng.randrange(1, 40))]
        for window in (False, True):
            assert "".join(stream(tok, ids, window=window)) == tok.decode(ids), ids


def test_detokenizer_window_stays_small(tok):
    ids = tok.encode(" ".join(TEXTS.values()) * 20)
    detok = IncrementalDetokenizer(tok, window=True)
    longest = 0
    for i in ids:
        detok.push(i)
        longest = max(longest, len(detok._ids))
    assert longest <= 8  # decode work per token is bounded, not proportional to the output so far


# ---- chat template --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CHATS)
def test_chat_template_renders_expected(tok, name):
    kwargs, expected = CHATS[name]
    kwargs = dict(kwargs)
    assert tok.apply_chat_template(kwargs.pop("messages"), **kwargs) == expected


def test_enable_thinking(tok):
    messages = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(messages).endswith("<|im_start|>assistant\n")
    assert tok.apply_chat_template(messages, enable_thinking=True).endswith("<|im_start|>assistant\n")
    assert tok.apply_chat_template(messages, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert not tok.apply_chat_template(messages, add_generation_prompt=False).endswith("assistant\n")


def test_template_errors_are_value_errors(tok):
    with pytest.raises(ValueError, match="Unexpected message role"):
        tok.apply_chat_template([{"role": "narrator", "content": "x"}])
    with pytest.raises(ValueError, match="Only text content"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


# ---- transformers as the oracle -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CHATS)
def test_transformers_renders_the_same(tok, hf, name):
    kwargs, expected = CHATS[name]
    kwargs = dict(kwargs)
    assert hf.apply_chat_template(kwargs.pop("messages"), tokenize=False, **kwargs) == expected
    assert hf.encode(expected, add_special_tokens=False) == tok.encode(expected)


def test_transformers_encodes_and_decodes_the_same(tok, hf):
    texts = [*TEXTS.values(), unicodedata.normalize("NFD", "café Ångström"), "<|im_start|>user\nhi<|im_end|>"]
    for text in texts:
        ids = tok.encode(text)
        assert hf.encode(text, add_special_tokens=False) == ids, text
        assert hf.decode(ids, skip_special_tokens=True) == tok.decode(ids), text
        assert hf.decode(ids, skip_special_tokens=False) == tok.decode(ids, skip_special_tokens=False), text
    assert set(hf.all_special_ids) == set(tok.special_ids)
    assert hf.eos_token_id == tok.eos_token_ids[0] and hf.pad_token_id == tok.eos_token_ids[1]


# ---- loading --------------------------------------------------------------------------------------------------------


def test_missing_files_are_named(written, tmp_path):
    shutil.copy(written[0] / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        Tokenizer.from_dir(tmp_path / "nope")


def test_tokenizer_json_alone_loads_as_transformers_loads_it(written, tmp_path):
    """No tokenizer_config.json (transformers loads tokenizer.json alone too): the same ids and text as
    transformers, the special ids tokenizer.json marks, the end-of-sequence ids of generation_config.json, and no
    chat template (a chat request then gets the no-template error)."""
    from transformers import AutoTokenizer

    for name in ("tokenizer.json", "generation_config.json"):
        shutil.copy(written[0] / name, tmp_path / name)
    tok = Tokenizer.from_dir(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    for text in ("hello world", "東京 <|im_end|> x", "  spaces\n\ttabs"):
        ids = tok.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False), text
        assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False), text
    assert tok.eos_token_ids == written[1].eos_ids and tok.special_ids
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_jinja_file_wins_and_tojson(written, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(written[0] / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.content | tojson }}|{{ m | tojson(indent=1) }}{% endfor %}"
    )
    tok = Tokenizer.from_dir(tmp_path)
    message = {"role": "user", "content": "東京 <b>"}
    rendered = tok.apply_chat_template([message])
    assert rendered == '"東京 <b>"|' + json.dumps(message, ensure_ascii=False, indent=1)
    assert tok.eos_token_ids == [written[1].im_end]  # no generation_config.json here: the tokenizer's eos_token


def test_a_long_prompt_is_tokenized_with_the_gil_released(tok):
    """The gateway tokenizes in a worker thread; the Rust tokenizer must not hold the GIL meanwhile, or one long
    prompt stops the event loop and the engine-core thread (every other request stalls for its whole duration).
    Long inputs give the same ids and text as the short path's entry points, and a thread keeps running."""
    import threading
    import time

    text = "def f(x):\n    return x * 2  # a comment, über 中文\n" * 12000
    ids = tok.encode(text)
    assert ids == tok._backend.encode(text).ids and len(ids) > 100_000
    assert tok.decode(ids, skip_special_tokens=False) == tok._backend.decode(ids, skip_special_tokens=False)
    assert tok.token_strings(ids[:50]) == [tok.decode([i], skip_special_tokens=False) for i in ids[:50]]
    gaps, done = [], threading.Event()

    def tick():
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.002)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.05)
    t0 = time.perf_counter()
    tok.encode(text * 2)
    took = time.perf_counter() - t0
    done.set()
    ticker.join()
    assert max(gaps) < 0.5 * took, (max(gaps), took)     # holding the GIL: one gap as long as the whole encode
