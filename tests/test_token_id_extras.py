"""vLLM's token-id extras, which RL trainers (verl, SkyRL, agent-lightning) send through extra_body to an
OpenAI-compatible server, served end to end: real uvicorn over the in-process engine core on the tiny model, the
official `openai` client and raw httpx.

- `return_token_ids`: chat answers the prompt's ids (`prompt_token_ids`, top level) and each choice's generated ids
  (`token_ids`); completions each choice's `prompt_token_ids` and `token_ids`. The ids are the ones /tokenize gives
  for the same prompt and decode to exactly the text; a stop token and the tokens that carried a stop string are in
  them (vLLM's). Streamed, the prompt's ids ride on each choice's first chunk and every later chunk carries the ids
  of its delta, which put together are the non-streamed ones.
- `return_tokens_as_token_ids`: with logprobs every token is "token_id:N", N the generated id.
- Without them (absent or false) the bodies carry neither key, and are otherwise what the flagged request gets.
- /v1/responses refuses `return_token_ids` by name (vLLM's Responses API does not take it).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import httpx
import openai
import pytest

from conftest import InProcessServer, OpenAI
from gateway.api import create_app
from gateway.engine import AsyncEngine
from gateway.metrics import Metrics
from shared.sampling import read_generation_config
from shared.tokenizer import Tokenizer
from stage_worker.inprocess_executor import local_engine_core

MODEL = "tiny-test"
MESSAGES = [{"role": "user", "content": "Write a haiku about GPUs"}]
PROMPT = "The quick brown fox jumps over"
N = 8
IDS = {"return_token_ids": True}
AS_IDS = {"return_tokens_as_token_ids": True}
PLACEHOLDER = re.compile(r"token_id:(\d+)")


@dataclass
class Served:
    url: str
    tok: Tokenizer

    @property
    def client(self) -> openai.OpenAI:
        return OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)

    def post(self, path: str, body: dict) -> dict:
        r = httpx.post(f"{self.url}{path}", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    def stream(self, path: str, body: dict) -> list[dict]:
        """The JSON chunks of a streamed request (raw SSE: the keys exactly as sent)."""
        with httpx.stream("POST", f"{self.url}{path}", json={**body, "stream": True}, timeout=120) as r:
            assert r.status_code == 200, r.read()
            lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "[DONE]"
        return [json.loads(x) for x in lines[:-1]]

    def tokenize(self, **body) -> list[int]:
        return self.post("/tokenize", {"model": MODEL, **body})["tokens"]

    def detokenize(self, ids: list[int]) -> str:
        return self.post("/detokenize", {"model": MODEL, "tokens": ids})["prompt"]


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    tok = Tokenizer.from_dir(tiny_checkpoint)
    metrics = Metrics()
    backend = local_engine_core(tiny_checkpoint, max_model_len=512, max_num_seqs=4)
    backend.attach_metrics(metrics)
    app = create_app(AsyncEngine(backend), tok, model_name=MODEL,
                     generation_config=read_generation_config(tiny_checkpoint), metrics=metrics)
    with InProcessServer(app, backend) as url:
        yield Served(url, tok)


def chat_body(**kw) -> dict:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": N, "temperature": 0, "seed": 7, **kw}


def completion_body(**kw) -> dict:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": N, "temperature": 0, "seed": 7, **kw}


def without(body: dict, top: tuple[str, ...], per_choice: tuple[str, ...]) -> dict:
    """`body` less the given keys (and the per-request id and time)."""
    out = {k: v for k, v in body.items() if k not in top + ("id", "created")}
    out["choices"] = [{k: v for k, v in c.items() if k not in per_choice} for c in body["choices"]]
    return out


def plain_chunks(chunks: list[dict]) -> list[dict]:
    """Streamed chunks less the token-id keys (and the per-request ids and time)."""
    out = []
    for c in chunks:
        c = {k: v for k, v in c.items() if k not in ("id", "created", "prompt_token_ids")}
        c["choices"] = [{k: v for k, v in ch.items() if k not in ("token_ids", "prompt_token_ids")}
                        for ch in c["choices"]]
        out.append(json.loads(re.sub(r'"call_[0-9a-f]+"', '"call_"', json.dumps(c))))
    return out


def joined_ids(chunks: list[dict], index: int = 0) -> list[int]:
    return [i for c in chunks for ch in c["choices"] if ch["index"] == index for i in ch.get("token_ids") or []]


# ---- return_token_ids -----------------------------------------------------------------------------------------

def test_chat_ids_are_the_prompt_and_decode_to_the_text(served):
    r = served.post("/v1/chat/completions", chat_body(**IDS))
    choice = r["choices"][0]
    assert r["prompt_token_ids"] == served.tokenize(messages=MESSAGES)
    assert len(choice["token_ids"]) == r["usage"]["completion_tokens"] == N
    assert served.detokenize(choice["token_ids"]) == choice["message"]["content"]
    assert len(r["prompt_token_ids"]) == r["usage"]["prompt_tokens"]
    # the openai client keeps the extras readable
    c = served.client.chat.completions.create(messages=MESSAGES, model=MODEL, max_tokens=N, temperature=0, seed=7,
                                              extra_body=IDS)
    assert c.prompt_token_ids == r["prompt_token_ids"] and c.choices[0].token_ids == choice["token_ids"]


def test_completion_ids_are_the_prompt_and_decode_to_the_text(served):
    r = served.post("/v1/completions", completion_body(**IDS, n=2, prompt=[PROMPT, "Once upon a time"]))
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    for c in r["choices"]:
        prompt = PROMPT if c["index"] < 2 else "Once upon a time"
        assert c["prompt_token_ids"] == served.tokenize(prompt=prompt, add_special_tokens=False)
        assert len(c["token_ids"]) == N and served.detokenize(c["token_ids"]) == c["text"]
    # a token-id prompt comes back as it was sent
    ids = served.tokenize(prompt=PROMPT, add_special_tokens=False)
    r = served.post("/v1/completions", completion_body(**IDS, prompt=ids))
    assert r["choices"][0]["prompt_token_ids"] == ids


def test_without_the_flags_the_bodies_have_no_new_keys(served):
    for flags in ({}, {"return_token_ids": False, "return_tokens_as_token_ids": False}):
        plain = served.post("/v1/chat/completions", chat_body(**flags))
        assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
        flagged = served.post("/v1/chat/completions", chat_body(**IDS))
        assert without(flagged, ("prompt_token_ids",), ("token_ids",)) == without(plain, (), ())
        plain = served.post("/v1/completions", completion_body(**flags))
        assert not {"prompt_token_ids", "token_ids"} & set(plain["choices"][0])
        flagged = served.post("/v1/completions", completion_body(**IDS))
        assert without(flagged, (), ("prompt_token_ids", "token_ids")) == without(plain, (), ())
        for path, body in (("/v1/chat/completions", chat_body(**flags)),
                           ("/v1/completions", completion_body(**flags))):
            for c in served.stream(path, body):
                assert "prompt_token_ids" not in c and all("token_ids" not in ch for ch in c["choices"]), c
    # logprobs keep the token texts
    plain = served.post("/v1/chat/completions", chat_body(logprobs=True, top_logprobs=2))
    assert not any(PLACEHOLDER.fullmatch(e["token"]) for e in plain["choices"][0]["logprobs"]["content"])


def test_chat_streamed_ids_are_the_non_streamed_ones(served):
    full = served.post("/v1/chat/completions", chat_body(**IDS))
    chunks = served.stream("/v1/chat/completions", chat_body(**IDS))
    assert chunks[0]["prompt_token_ids"] == full["prompt_token_ids"]
    assert "token_ids" not in chunks[0]["choices"][0]              # the role chunk (vLLM's)
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert all("token_ids" in c["choices"][0] for c in chunks[1:])
    assert joined_ids(chunks) == full["choices"][0]["token_ids"]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == full["choices"][0]["message"]["content"]
    # the flag adds keys to the chunks sent without it, nothing else
    assert plain_chunks(chunks) == plain_chunks(served.stream("/v1/chat/completions", chat_body()))


def test_tool_call_ids_stream_as_they_are_generated(served):
    """Through the output parser (a forced call: its text is held until the name is known): the streamed ids are
    the non-streamed ones, and the chunks are those sent without the flag."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
    body = chat_body(**IDS, max_tokens=24, tools=[tool], tool_choice="required")
    full = served.post("/v1/chat/completions", body)
    choice = full["choices"][0]
    assert choice["message"]["tool_calls"] and len(choice["token_ids"]) == full["usage"]["completion_tokens"]
    chunks = served.stream("/v1/chat/completions", body)
    assert joined_ids(chunks) == choice["token_ids"]
    plain = dict(body)
    del plain["return_token_ids"]
    assert plain_chunks(chunks) == plain_chunks(served.stream("/v1/chat/completions", plain))


def test_completion_streamed_ids_are_the_non_streamed_ones(served):
    for extra in ({}, {"echo": True}):
        full = served.post("/v1/completions", completion_body(**IDS, **extra))
        chunks = served.stream("/v1/completions", completion_body(**IDS, **extra))
        assert chunks[0]["choices"][0]["prompt_token_ids"] == full["choices"][0]["prompt_token_ids"]
        assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
        assert joined_ids(chunks) == full["choices"][0]["token_ids"]
        assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]
        assert plain_chunks(chunks) == plain_chunks(served.stream("/v1/completions", completion_body(**extra)))
    # echo keeps the prompt in the text; the ids stay the generated ones
    assert full["choices"][0]["text"].startswith(PROMPT)
    assert PROMPT + served.detokenize(full["choices"][0]["token_ids"]) == full["choices"][0]["text"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_held_back_text_brings_its_ids_along(served, path):
    """A token whose whole text may begin a stop string is held back: its id rides with the chunk that shows its
    text (here, with the next token's, once the stop string cannot match), so a chunk's ids are its text's."""
    body = (completion_body if path == "/v1/completions" else chat_body)(**IDS)
    full = served.post(path, body)["choices"][0]
    ids = full["token_ids"]
    k = 3
    held = served.detokenize([ids[k]])
    assert held.strip() and held not in served.detokenize(ids[:k])
    chunks = served.stream(path, {**body, "stop": [held + "\x00"]})
    assert joined_ids(chunks) == ids
    texts = {tuple(c["choices"][0]["token_ids"]): c["choices"][0]["text"] if "text" in c["choices"][0] else
             c["choices"][0]["delta"].get("content") for c in chunks if c["choices"][0].get("token_ids")}
    assert texts[(ids[k], ids[k + 1])] == served.detokenize(ids[k:k + 2])
    for chunk_ids, text in texts.items():
        assert served.detokenize(list(chunk_ids)) == text


def test_n_choices_each_carry_their_ids(served):
    body = chat_body(**IDS, n=2, temperature=1.0)
    full = served.post("/v1/chat/completions", body)
    assert len(full["prompt_token_ids"]) == full["usage"]["prompt_tokens"]
    for c in full["choices"]:
        assert served.detokenize(c["token_ids"]) == c["message"]["content"]
    chunks = served.stream("/v1/chat/completions", body)
    firsts = [c for c in chunks if "prompt_token_ids" in c]
    assert sorted(c["choices"][0]["index"] for c in firsts) == [0, 1]        # each choice's first chunk
    assert all(c["prompt_token_ids"] == full["prompt_token_ids"] for c in firsts)
    for i in (0, 1):            # seeded: choice i samples with seed + i, streamed or not
        assert joined_ids(chunks, i) == full["choices"][i]["token_ids"]


def test_a_stop_string_keeps_the_ids_that_carried_it(served):
    """vLLM's: the text ends before the stop string, the ids run to the token that completed it."""
    ref = served.post("/v1/completions", completion_body(**IDS))["choices"][0]
    text = ref["text"]
    stop = text[len(text) // 2: len(text) // 2 + 2]
    assert len(stop) == 2 and stop.strip()
    for stream in (False, True):
        if stream:
            chunks = served.stream("/v1/completions", completion_body(**IDS, stop=[stop]))
            got, ids = "".join(c["choices"][0]["text"] for c in chunks), joined_ids(chunks)
        else:
            c = served.post("/v1/completions", completion_body(**IDS, stop=[stop]))["choices"][0]
            got, ids = c["text"], c["token_ids"]
        assert got == text[:text.find(stop)]
        decoded = served.detokenize(ids)
        assert decoded.startswith(got + stop) and stop not in served.detokenize(ids[:-1])
        assert ids == ref["token_ids"][:len(ids)]


def test_a_stop_token_is_in_the_ids(served):
    ref = served.post("/v1/chat/completions", chat_body(**IDS))["choices"][0]["token_ids"]
    stop_id = ref[3]
    first = ref.index(stop_id)
    r = served.post("/v1/chat/completions", chat_body(**IDS, stop_token_ids=[stop_id]))
    choice = r["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["token_ids"] == ref[:first + 1]
    assert r["usage"]["completion_tokens"] == first + 1
    chunks = served.stream("/v1/chat/completions", chat_body(**IDS, stop_token_ids=[stop_id]))
    assert joined_ids(chunks) == ref[:first + 1]


# ---- return_tokens_as_token_ids --------------------------------------------------------------------------------

def test_chat_logprobs_name_tokens_by_id(served):
    body = chat_body(**IDS, **AS_IDS, logprobs=True, top_logprobs=3)
    full = served.post("/v1/chat/completions", body)
    plain = served.post("/v1/chat/completions", chat_body(logprobs=True, top_logprobs=3))
    choice = full["choices"][0]
    content = choice["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{i}" for i in choice["token_ids"]]
    for entry, ref, tid in zip(content, plain["choices"][0]["logprobs"]["content"], choice["token_ids"]):
        # the sampled token keeps its own bytes (vLLM's); alternatives' bytes are their "token_id:N" strings
        assert entry["bytes"] == list(served.tok.token_bytes(tid, skip_special_tokens=False)) == ref["bytes"]
        assert entry["logprob"] == ref["logprob"]
        assert len(entry["top_logprobs"]) == 3
        for alt, ref_alt in zip(entry["top_logprobs"], ref["top_logprobs"]):
            m = PLACEHOLDER.fullmatch(alt["token"])
            assert m and alt["bytes"] == list(alt["token"].encode()) and alt["logprob"] == ref_alt["logprob"]
            assert served.tok.decode([int(m.group(1))], skip_special_tokens=False) == ref_alt["token"] or \
                "\\x" in ref_alt["token"]
    chunks = served.stream("/v1/chat/completions", body)
    streamed = [e["token"] for c in chunks if c["choices"] and c["choices"][0].get("logprobs")
                for e in c["choices"][0]["logprobs"]["content"]]
    assert streamed == [e["token"] for e in content]
    for c in chunks:            # a chunk's logprobs are the tokens of its token_ids
        ch = c["choices"][0]
        if ch.get("logprobs"):
            assert [e["token"] for e in ch["logprobs"]["content"]] == [f"token_id:{i}" for i in ch["token_ids"]]


def test_completion_logprobs_name_tokens_by_id(served):
    body = completion_body(**IDS, **AS_IDS, logprobs=2)
    choice = served.post("/v1/completions", body)["choices"][0]
    ref = served.post("/v1/completions", completion_body(logprobs=2))["choices"][0]["logprobs"]
    lp = choice["logprobs"]
    assert lp["tokens"] == [f"token_id:{i}" for i in choice["token_ids"]]
    assert lp["token_logprobs"] == ref["token_logprobs"] and lp["text_offset"] == ref["text_offset"]
    for top, tok in zip(lp["top_logprobs"], lp["tokens"]):
        assert tok in top and all(PLACEHOLDER.fullmatch(k) for k in top)
    # echoed prompt tokens too
    echoed = served.post("/v1/completions", completion_body(**IDS, **AS_IDS, logprobs=1, echo=True))["choices"][0]
    p = len(echoed["prompt_token_ids"])
    assert echoed["logprobs"]["tokens"] == [f"token_id:{i}" for i in echoed["prompt_token_ids"] + echoed["token_ids"]]
    assert echoed["logprobs"]["top_logprobs"][0] is None
    assert all(PLACEHOLDER.fullmatch(k) for top in echoed["logprobs"]["top_logprobs"][1:] for k in top)
    assert echoed["logprobs"]["text_offset"][p] == len(PROMPT)
    chunks = served.stream("/v1/completions", body)
    streamed = [t for c in chunks if c["choices"][0].get("logprobs") for t in c["choices"][0]["logprobs"]["tokens"]]
    assert streamed == lp["tokens"]


def test_as_token_ids_alone_names_logprobs_tokens(served):
    """Without return_token_ids: the ids show in the logprobs only (no token_ids keys), as vLLM's."""
    r = served.post("/v1/chat/completions", chat_body(**AS_IDS, logprobs=True))
    assert "prompt_token_ids" not in r and "token_ids" not in r["choices"][0]
    ids = [int(PLACEHOLDER.fullmatch(e["token"]).group(1)) for e in r["choices"][0]["logprobs"]["content"]]
    assert served.detokenize(ids) == r["choices"][0]["message"]["content"]
    # without logprobs it changes nothing
    assert without(served.post("/v1/chat/completions", chat_body(**AS_IDS)), (), ()) == \
        without(served.post("/v1/chat/completions", chat_body()), (), ())


# ---- /v1/responses ---------------------------------------------------------------------------------------------

def test_responses_refuses_return_token_ids_by_name(served):
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 4, "temperature": 0}
    r = httpx.post(f"{served.url}/v1/responses", json={**body, **IDS}, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_token_ids", r.text
    for extra in ({"return_token_ids": False}, AS_IDS):
        assert served.post("/v1/responses", {**body, **extra})["object"] == "response"
