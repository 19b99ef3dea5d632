"""The OpenAI-compatible API end to end: real uvicorn over the engine core (in-process executor) and the tiny model,
driven by the official `openai` client and raw httpx; error paths of the engine interface through stub engines."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import torch
from fastapi.testclient import TestClient

from conftest import InProcessServer, OpenAI
from gateway.api import create_app
from shared.engine_core import EngineFailed, EngineInterrupted, EngineOverloaded, EngineUnavailable, GenerationRequest, TokenEvent
from gateway.engine import AsyncEngine
from gateway.metrics import Metrics
from shared.tokenizer import Tokenizer
from shared.sampling import SamplingParams, read_generation_config
from stage_worker.checkpoint.loader import load_model
from shared.engine_core import EngineCore
from stage_worker.generate import GenerateResult, generate
from stage_worker.inprocess_executor import local_engine_core
from stage_worker.local_engine import LocalEngine

MODEL = "tiny-test"
MAX_LEN = 512
CHAT_PROMPT = "Write a haiku about GPUs"
TEXT_PROMPT = "The quick brown fox jumps over"
N = 8


@dataclass
class Served:
    url: str
    backend: EngineCore
    metrics: Metrics
    tok: Tokenizer
    model_dir: Path

    @property
    def client(self) -> openai.OpenAI:
        return OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)

    def post(self, path: str, **kwargs) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", timeout=120, **kwargs, verify=False)


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint) -> Path:
    return tiny_checkpoint              # read only: the session's tiny preset (seed 0)


@pytest.fixture(scope="module")
def served(model_dir):
    tok = Tokenizer.from_dir(model_dir)
    metrics = Metrics()
    backend = local_engine_core(model_dir, max_model_len=MAX_LEN, max_num_seqs=4)
    backend.attach_metrics(metrics)
    app = create_app(AsyncEngine(backend), tok, model_name=MODEL, generation_config=read_generation_config(model_dir),
                     metrics=metrics)
    with InProcessServer(app, backend) as url:
        yield Served(url, backend, metrics, tok, model_dir)


@pytest.fixture(scope="module")
def chat_ref(model_dir) -> GenerateResult:
    return generate(model_dir, CHAT_PROMPT, SamplingParams(max_tokens=N, temperature=0.0), chat=True)


@pytest.fixture(scope="module")
def text_ref(model_dir) -> GenerateResult:
    return generate(model_dir, TEXT_PROMPT, SamplingParams(max_tokens=N, temperature=0.0))


def chat(served: Served, **kwargs):
    kwargs.setdefault("messages", [{"role": "user", "content": CHAT_PROMPT}])
    return served.client.chat.completions.create(model=MODEL, temperature=0.0, **kwargs)


def stream_chat(served: Served, **kwargs) -> list:
    return list(chat(served, stream=True, **kwargs))


def reference_logprobs(model_dir: Path, prompt_ids: list[int], out_ids: list[int]) -> list[torch.Tensor]:
    """log_softmax rows in-process, fed exactly as the backend feeds them: prompt, then one token at a time."""
    engine = LocalEngine([load_model(model_dir)], max_seqs=1, max_tokens=len(prompt_ids) + len(out_ids) + 16)
    engine.add(0)
    rows = [engine.step([(0, prompt_ids)])[0]]
    for t in out_ids[:-1]:
        rows.append(engine.step([(0, [t])])[0])
    return [torch.log_softmax(r.float(), dim=-1) for r in rows]


def chat_prompt_ids(served: Served) -> list[int]:
    return served.tok.encode(served.tok.apply_chat_template([{"role": "user", "content": CHAT_PROMPT}]))


def metric_value(served: Served, name: str, labels: str = "") -> float:
    text = httpx.get(f"{served.url}/metrics", verify=False).text
    for line in text.splitlines():
        if line.startswith(name + labels + " ") or (not labels and line.startswith(name + " ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait_idle(backend: EngineCore, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while backend.num_running or backend.num_waiting:
        assert time.monotonic() < deadline, "the backend kept computing a request nobody listens to"
        time.sleep(0.02)


# ---- happy paths --------------------------------------------------------------------------------------------------

def test_models_and_health(served):
    assert [m.id for m in served.client.models.list().data] == [MODEL]
    r = httpx.get(f"{served.url}/health", verify=False)
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_chat_greedy_matches_generate(served, chat_ref):
    r = chat(served, max_tokens=N)
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == chat_ref.text
    assert r.choices[0].finish_reason == chat_ref.finish_reason == "length"
    assert r.usage.prompt_tokens == chat_ref.prompt_tokens
    assert r.usage.completion_tokens == N
    assert r.usage.total_tokens == chat_ref.prompt_tokens + N


def test_chat_stream_equals_nonstream(served, chat_ref):
    chunks = stream_chat(served, max_completion_tokens=N, stream_options={"include_usage": True})
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat_ref.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == N
    assert chunks[-1].usage.prompt_tokens == chat_ref.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_text_and_token_ids(served, text_ref):
    r = served.client.completions.create(model=MODEL, prompt=TEXT_PROMPT, max_tokens=N, temperature=0.0)
    assert r.object == "text_completion"
    assert r.choices[0].text == text_ref.text and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (text_ref.prompt_tokens, N)
    ids = served.tok.encode(TEXT_PROMPT)
    r2 = served.client.completions.create(model=MODEL, prompt=ids, max_tokens=N, temperature=0.0)
    assert r2.choices[0].text == text_ref.text
    pieces = served.client.completions.create(model=MODEL, prompt=[TEXT_PROMPT], max_tokens=N, temperature=0.0,
                                              stream=True)
    assert "".join(c.choices[0].text for c in pieces if c.choices) == text_ref.text


def test_concurrent_requests_are_batched_and_unchanged(served, chat_ref, text_ref):
    from concurrent.futures import ThreadPoolExecutor

    def text_call():
        return served.client.completions.create(model=MODEL, prompt=TEXT_PROMPT, max_tokens=N, temperature=0.0)

    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(chat, served, max_tokens=N), pool.submit(text_call), pool.submit(chat, served,
                                                                                                max_tokens=N)]
        a, b, c = (f.result() for f in futures)
    assert a.choices[0].message.content == c.choices[0].message.content == chat_ref.text
    assert b.choices[0].text == text_ref.text


def test_stop_string_never_in_output(served, chat_ref):
    text = chat_ref.text
    middle = len(text) // 2
    stop = text[middle: middle + 3]
    assert len(stop) == 3
    expected = text[: text.find(stop)]
    r = chat(served, max_tokens=N, stop=[stop, "\x00never"])
    assert r.choices[0].message.content == expected and stop not in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < N or text.find(stop) + len(stop) > len(text) - 1
    chunks = stream_chat(served, max_tokens=N, stop=stop)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["stop"]
    wait_idle(served.backend)


def test_stop_token_ends_with_stop_and_is_not_emitted(served, chat_ref):
    stop_id = chat_ref.token_ids[3]
    first = chat_ref.token_ids.index(stop_id)
    r = chat(served, max_tokens=N, extra_body={"stop_token_ids": [stop_id]})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == served.tok.decode(chat_ref.token_ids[:first])
    assert r.usage.completion_tokens == first + 1        # the stop token was generated, so it counts


def test_chat_logprobs_match_in_process(served, chat_ref):
    k, n = 5, 6
    r = chat(served, max_tokens=n, logprobs=True, top_logprobs=k)
    content = r.choices[0].logprobs.content
    out_ids = chat_ref.token_ids[:n]
    assert len(content) == n
    rows = reference_logprobs(served.model_dir, chat_prompt_ids(served), out_ids)
    for entry, tid, lp in zip(content, out_ids, rows):
        raw = served.tok.token_bytes(tid, skip_special_tokens=False)
        assert entry.bytes == list(raw)
        assert math.isclose(entry.logprob, float(lp[tid]), abs_tol=1e-4)
        tops = entry.top_logprobs
        assert len(tops) == k
        assert all(a.logprob >= b.logprob for a, b in zip(tops, tops[1:]))
        assert tops[0].token == entry.token and math.isclose(tops[0].logprob, entry.logprob, abs_tol=1e-6)
        best = torch.topk(lp, k)
        for t, ref_lp in zip(tops, best.values.tolist()):
            assert math.isclose(t.logprob, ref_lp, abs_tol=1e-4) and t.logprob <= 0 and isinstance(t.bytes, list)
    assert b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace") == r.choices[0].message.content
    chunks = stream_chat(served, max_tokens=n, logprobs=True, top_logprobs=k)
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in content]


def test_a_suffix_makes_the_fill_in_the_middle_prompt(served, monkeypatch):
    """`suffix` (editor autocompletion): the prompt is prefix + suffix + middle in the tokenizer's FIM tokens, the
    same completion as that token-id prompt sent by hand; `best_of` = n is served; a tokenizer without the tokens
    refuses a suffix by name instead of ignoring it."""
    import gateway.api as api

    prefix, suffix = "def area(r):\n    return ", "\n\nprint(area(2))\n"
    pre, suf, mid = (served.tok.token_to_id(t) for t in api.FIM_TOKENS)
    by_hand = [pre, *served.tok.encode(prefix), suf, *served.tok.encode(suffix), mid]
    want = served.client.completions.create(model=MODEL, prompt=by_hand, max_tokens=N, temperature=0.0)
    got = served.client.completions.create(model=MODEL, prompt=prefix, suffix=suffix, max_tokens=N,
                                           temperature=0.0, best_of=1)
    plain = served.client.completions.create(model=MODEL, prompt=prefix, max_tokens=N, temperature=0.0)
    assert got.choices[0].text == want.choices[0].text
    assert got.usage.prompt_tokens == len(by_hand) and plain.usage.prompt_tokens == len(served.tok.encode(prefix))
    two = served.post("/v1/completions", json={"model": MODEL, "prompt": prefix, "suffix": suffix, "n": 2,
                                               "best_of": 2, "max_tokens": 2, "temperature": 0.0})
    assert two.status_code == 200 and len(two.json()["choices"]) == 2, two.text
    monkeypatch.setattr(api, "FIM_TOKENS", ("<|fim_prefix|>", "<|no_such_suffix|>", "<|no_such_middle|>"))
    err = _assert_error(served.post("/v1/completions", json={"model": MODEL, "prompt": prefix, "suffix": suffix,
                                                             "max_tokens": 1}), 400, "suffix")
    assert "<|no_such_suffix|>" in err["message"]
    # echo would show the prompt text beside logprobs of the FIM-wrapped ids (QA): refused by name
    _assert_error(served.post("/v1/completions", json={"model": MODEL, "prompt": prefix, "suffix": suffix,
                                                       "echo": True, "logprobs": 1, "max_tokens": 1}), 400, "echo")


def test_completion_echo_with_logprobs(served, model_dir):
    n = 4
    ref = generate(model_dir, TEXT_PROMPT, SamplingParams(max_tokens=n, temperature=0.0))
    r = served.client.completions.create(model=MODEL, prompt=TEXT_PROMPT, max_tokens=n, temperature=0.0,
                                         echo=True, logprobs=3)
    choice = r.choices[0]
    assert choice.text == TEXT_PROMPT + ref.text
    lp = choice.logprobs
    prompt_ids = served.tok.encode(TEXT_PROMPT)
    p = len(prompt_ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == p + n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    engine = LocalEngine([load_model(model_dir)], max_seqs=1, max_tokens=64)
    engine.add(0)
    rows = torch.log_softmax(engine.step([(0, prompt_ids)], all_logits=True).float(), dim=-1)
    for i in range(1, p):
        assert math.isclose(lp.token_logprobs[i], float(rows[i - 1, prompt_ids[i]]), abs_tol=1e-4)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert lp.text_offset[p] == len(TEXT_PROMPT)
    for tok, val, top in zip(lp.tokens[p:], lp.token_logprobs[p:], lp.top_logprobs[p:]):
        assert val <= 0 and tok in top and 3 <= len(top) <= 4 and math.isclose(top[tok], val)
    stream = served.client.completions.create(model=MODEL, prompt=TEXT_PROMPT, max_tokens=n, temperature=0.0,
                                              echo=True, stream=True)
    texts = [c.choices[0].text for c in stream if c.choices]
    assert texts[0] == TEXT_PROMPT and "".join(texts) == TEXT_PROMPT + ref.text


def test_echo_with_max_tokens_0_scores_the_prompt(served):
    """lm-eval's loglikelihood request (vLLM takes it): echo, logprobs, max_tokens 0 gives the prompt and its
    logprobs, nothing generated (completion_tokens 0, finish "length"), the same prompt logprobs as with a token
    generated; streamed alike. max_tokens 0 without echo is a 400 naming it."""
    kw = dict(model=MODEL, prompt=TEXT_PROMPT, temperature=0.0, echo=True, logprobs=2)
    zero = served.client.completions.create(max_tokens=0, **kw)
    one = served.client.completions.create(max_tokens=1, **kw)
    p = len(served.tok.encode(TEXT_PROMPT))
    c = zero.choices[0]
    assert c.text == TEXT_PROMPT and c.finish_reason == "length" and zero.usage.completion_tokens == 0
    assert zero.usage.prompt_tokens == p and len(c.logprobs.tokens) == p
    assert c.logprobs.token_logprobs == one.choices[0].logprobs.token_logprobs[:p]
    chunks = [ch for ch in served.client.completions.create(max_tokens=0, stream=True, **kw) if ch.choices]
    assert "".join(ch.choices[0].text for ch in chunks) == TEXT_PROMPT and chunks[-1].choices[0].finish_reason == "length"
    r = served.post("/v1/completions", json={"model": MODEL, "prompt": TEXT_PROMPT, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_seeded_sampling_reproduces_generate(served, model_dir):
    params = dict(max_tokens=8, temperature=1.0, top_p=1.0, top_k=0, seed=1234)
    a = served.client.completions.create(model=MODEL, prompt=TEXT_PROMPT, extra_body={"top_k": 0},
                                         **{k: v for k, v in params.items() if k != "top_k"})
    b = served.client.completions.create(model=MODEL, prompt=TEXT_PROMPT, extra_body={"top_k": 0},
                                         **{k: v for k, v in params.items() if k != "top_k"})
    assert a.choices[0].text == b.choices[0].text
    ref = generate(model_dir, TEXT_PROMPT, SamplingParams(**params))
    assert a.choices[0].text == ref.text


def test_context_length_clamp_and_refusal(served):
    """An asked-for max_tokens past the context is a 400 naming it (as vLLM and OpenAI answer; docs/agents.md);
    a length the client did not ask for (the completions default) is cut to the one token that fits."""
    ids = [100] * (MAX_LEN - 1)
    r = served.post("/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 50, "temperature": 0})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "max_tokens" and r.json()["error"]["code"] == "context_length_exceeded"
    r = served.post("/v1/completions", json={"model": MODEL, "prompt": ids, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 1 and body["choices"][0]["finish_reason"] == "length"
    r = served.post("/v1/completions", json={"model": MODEL, "prompt": [100] * MAX_LEN})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "prompt" and r.json()["error"]["code"] == "context_length_exceeded"
    r = served.post("/v1/chat/completions",
                    json={"model": MODEL, "messages": [{"role": "user", "content": "word " * 2000}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


# ---- client mistakes ----------------------------------------------------------------------------------------------

def _assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


GOOD_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


@pytest.mark.parametrize("body, param", [
    ({"messages": "hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"content": "no role"}]}, "messages[0].role"),
    ({"n": 17}, "n"),
    ({"n": 0}, "n"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": "x"}}, "logit_bias"),
    ({"logit_bias": {"999999999": 1}}, "logit_bias"),
    ({"functions": [{"name": "f"}], "tools": [{"type": "function", "function": {"name": "f"}}]}, "functions"),
    ({"functions": [{"name": "bad name!"}]}, "functions[0].name"),
    ({"functions": [{"name": "f"}], "function_call": {"name": "g"}}, "function_call"),
    ({"functions": [{"name": "f"}], "function_call": "always"}, "function_call"),
    ({"function_call": "auto"}, "function_call"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "sometimes", "tools": []}}},
     "tool_choice.allowed_tools.mode"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}},
     "tool_choice.allowed_tools.tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
          {"type": "function", "function": {"name": "g"}}]}}}, "tool_choice.allowed_tools.tools[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]}, "messages[0].content[0]"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "oneOf": [{"type": "integer"}, {"type": "number"}]}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
        "oneOf": [{"type": "integer"}, {"type": "number"}]}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}},
     "response_format.json_schema.schema"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1e-46}, "top_p"),
    ({"repetition_penalty": 1e-300}, "repetition_penalty"),
    ({"temperature": 1e9}, "temperature"),
    ({"stop": [f"s{i}" for i in range(65)]}, "stop"),        # vLLM takes any number, OpenAI 4: 64 here
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]},
     "tools[1].function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object"}, "tools": [{"type": "function", "function": {"name": "f"}}],
      "chat_template_kwargs": {"enable_thinking": True}}, "chat_template_kwargs.enable_thinking"),
    ({"response_format": {"type": "json_object"}, "chat_template_kwargs": {"enable_thinking": True}},
     "chat_template_kwargs.enable_thinking"),
    ({"chat_template_kwargs": {"enable_thinking": "yes"}}, "chat_template_kwargs.enable_thinking"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": 5}]},
     "messages[1].tool_calls"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [5]}]},
     "messages[1].tool_calls[0]"),
    ({"messages": [{"role": "user", "content": "hi"},
                   {"role": "assistant", "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]}]},
     "messages[1].tool_calls[0].function.name"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None,
                                                       "function_call": {"arguments": "{}"}}]},
     "messages[1].function_call.name"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 7}]}, "messages[0].tool_call_id"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "refusal"}]}]},
     "messages[1].content[0].refusal"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),        # without stream: OpenAI's and vLLM's 400
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),     # no prompt left (vLLM: >= 1 or -1)
])
def test_chat_bad_requests_name_the_field(served, body, param):
    err = _assert_error(served.post("/v1/chat/completions", json={**GOOD_CHAT, **body}), 400, param)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("body, param", [
    ({"prompt": ["a", ""]}, "prompt"),
    ({"prompt": [[5], [10**9]]}, "prompt"),
    ({"prompt": ["x"] * 65}, "prompt"),
    ({"prompt": ["x"] * 5, "n": 16}, "n"),
    ({"logit_bias": {"-1": 5}}, "logit_bias"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"logprobs": 21}, "logprobs"),
    ({"n": 17}, "n"),
    ({"best_of": 2}, "best_of"),               # more than n: only n choices would come back
    ({"best_of": 0}, "best_of"),
    ({"prompt": [5, 6], "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
])
def test_completion_bad_requests_name_the_field(served, body, param):
    _assert_error(served.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1, **body}),
                  400, param)


def test_malformed_bodies(served):
    for raw in (b'{"model": "\xff\xfe"}', b'{"model": ', b"[1, 2]", b"", b'"just a string"', b"[" * 100000):
        _assert_error(served.post("/v1/chat/completions", content=raw,
                                  headers={"content-type": "application/json"}), 400)


def test_bodies_must_be_declared_as_json(served):
    """A web page can send text/plain, form or multipart bodies cross-origin without a preflight: refused."""
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}).encode()
    for kind in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        err = _assert_error(served.post("/v1/completions", content=body, headers={"content-type": kind}), 415)
        assert err["code"] == "unsupported_media_type"
    for kind in ("application/json", "application/json; charset=utf-8", "application/vnd.api+json"):
        assert served.post("/v1/completions", content=body, headers={"content-type": kind}).status_code == 200


def test_non_finite_numbers_are_refused(served):
    """Python's json reads NaN and Infinity; no sampling field takes them."""
    for field in ("temperature", "top_p", "presence_penalty", "repetition_penalty", "min_p"):
        for value in (b"NaN", b"Infinity", b"-Infinity"):
            raw = b'{"model": "%s", "prompt": "x", "max_tokens": 1, "%s": %s}' % (MODEL.encode(), field.encode(),
                                                                               value)
            _assert_error(served.post("/v1/completions", content=raw,
                                      headers={"content-type": "application/json"}), 400, field)


def test_lone_surrogates_are_refused(served):
    raw = b'{"model": "%s", "prompt": "a\\ud800b", "max_tokens": 1}' % MODEL.encode()
    _assert_error(served.post("/v1/completions", content=raw), 400, "prompt")
    raw = b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 1}'
    _assert_error(served.post("/v1/chat/completions", content=raw), 400, "messages")


def test_unknown_model_and_route(served):
    _assert_error(served.post("/v1/chat/completions", json={**GOOD_CHAT, "model": "gpt-9"}), 404, "model",
                  "model_not_found")
    with pytest.raises(openai.NotFoundError):
        served.client.completions.create(model="gpt-9", prompt="hi", max_tokens=1)
    _assert_error(httpx.get(f"{served.url}/v1/nothing-here", verify=False), 404)


def test_ten_megabyte_prompt_is_a_clean_400(served):
    big = "a" * (10 << 20)
    t0 = time.monotonic()
    _assert_error(served.post("/v1/completions", json={"model": MODEL, "prompt": big}), 400, "prompt",
                  "context_length_exceeded")
    _assert_error(served.post("/v1/chat/completions",
                              json={"model": MODEL, "messages": [{"role": "user", "content": big}]}),
                  400, "messages", "context_length_exceeded")
    assert time.monotonic() - t0 < 20


def test_harmless_tool_fields_are_accepted(served):
    r = served.post("/v1/chat/completions", json={**GOOD_CHAT, "tool_choice": "none", "parallel_tool_calls": False,
                                                  "response_format": {"type": "text"}, "user": "u",
                                                  "some_future_field": {"x": 1},
                                                  "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text


def test_explicit_nulls_mean_unset(served):
    nulls = dict.fromkeys(["temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                           "frequency_penalty", "seed", "stop", "n", "stream", "stream_options", "user", "logprobs",
                           "top_logprobs", "tools", "tool_choice", "response_format", "chat_template_kwargs",
                           "ignore_eos", "max_completion_tokens", "stop_token_ids"])
    r = served.post("/v1/chat/completions", json={**GOOD_CHAT, **nulls})
    assert r.status_code == 200, r.text
    nulls = {k: None for k in ("echo", "logprobs", "stream", "seed", "stop", "suffix")}
    r = served.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1, **nulls})
    assert r.status_code == 200, r.text


def test_normal_request_after_errors(served, chat_ref):
    assert chat(served, max_tokens=N).choices[0].message.content == chat_ref.text


# ---- disconnects, metrics -------------------------------------------------------------------------------------

def test_client_disconnect_cancels_the_request(served):
    aborted = metric_value(served, "moepipe_requests_total", '{finish_reason="abort"}')
    # Greedy and ignore_eos: the request cannot end on its own before the client leaves.
    body = {**GOOD_CHAT, "max_tokens": 400, "stream": True, "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", f"{served.url}/v1/chat/completions", json=body, timeout=60, verify=False) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    wait_idle(served.backend)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{served.url}/v1/chat/completions", json={**body, "stream": False}, timeout=1.0, verify=False)
    wait_idle(served.backend)
    deadline = time.monotonic() + 5
    while metric_value(served, "moepipe_requests_total", '{finish_reason="abort"}') < aborted + 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_metrics_count_requests(served):
    before = metric_value(served, "moepipe_requests_total", '{finish_reason="length"}')
    gen_before = metric_value(served, "moepipe_generation_tokens_total")
    chat(served, max_tokens=2)
    text = httpx.get(f"{served.url}/metrics", verify=False).text
    for name in ("moepipe_time_to_first_token_seconds", "moepipe_inter_token_latency_seconds",
                 "moepipe_e2e_request_latency_seconds", "moepipe_prompt_tokens_total",
                 "moepipe_generation_tokens_total", "moepipe_requests_total", "moepipe_requests_running",
                 "moepipe_requests_waiting", "moepipe_kv_blocks_used", "moepipe_kv_blocks_total",
                 "moepipe_state_slots_used", "moepipe_stage_step_seconds", "moepipe_stage_busy_fraction",
                 "moepipe_ple_prefetch_pages_total", "moepipe_ple_prefetch_seconds_total",
                 "moepipe_ple_gather_seconds_total",
                 "moepipe_ple_stage_wait_seconds_total", "moepipe_ple_stage_gathers_total",
                 "moepipe_ple_stage_gather_seconds_total", "moepipe_ple_rows_after_launch_total",
                 "moepipe_ple_wait_timeouts_total"):
        assert f"# TYPE {name.removesuffix('_total')}" in text, name
    assert metric_value(served, "moepipe_requests_total", '{finish_reason="length"}') == before + 1
    assert metric_value(served, "moepipe_generation_tokens_total") == gen_before + 2
    assert metric_value(served, "moepipe_time_to_first_token_seconds_count") >= 1
    assert metric_value(served, "moepipe_kv_blocks_total") > 0
    # the same numbers under vLLM's names, which its dashboards and autoscalers read
    text = httpx.get(f"{served.url}/metrics", verify=False).text
    for theirs, ours in (('vllm:request_success_total{finished_reason="length",model_name="moepipe"}',
                          'moepipe_requests_total{finish_reason="length"}'),
                         ('vllm:generation_tokens_total{model_name="moepipe"}', "moepipe_generation_tokens_total"),
                         ('vllm:prompt_tokens_total{model_name="moepipe"}', "moepipe_prompt_tokens_total"),
                         ('vllm:time_to_first_token_seconds_count{model_name="moepipe"}',
                          "moepipe_time_to_first_token_seconds_count"),
                         ('vllm:num_requests_running{model_name="moepipe"}', "moepipe_requests_running")):
        name, _, labels = theirs.partition("{")
        ours_name, _, ours_labels = ours.partition("{")
        assert metric_value(served, name, "{" + labels) == metric_value(
            served, ours_name, "{" + ours_labels if ours_labels else ""), theirs
    assert f'vllm:num_requests_waiting{{model_name="moepipe"}}' in text
    usage = metric_value(served, "vllm:kv_cache_usage_perc", '{model_name="moepipe"}')
    assert usage == metric_value(served, "moepipe_kv_blocks_used") / metric_value(served, "moepipe_kv_blocks_total")


PHASES = ["request_queue_time", "request_prefill_time", "request_gateway_time", "time_to_first_token",
          "request_decode_time", "request_inference_time", "e2e_request_latency", "request_time_per_output_token"]


def phase_totals(served: Served) -> dict[str, tuple[float, float]]:
    """Each PHASES histogram's (count, sum) on /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{served.url}/metrics", verify=False).text
    v = {smp.name: smp.value for fam in text_string_to_metric_families(text) for smp in fam.samples}
    return {n: (v[f"moepipe_{n}_seconds_count"], v[f"moepipe_{n}_seconds_sum"]) for n in PHASES}


def test_request_phase_metrics(served, chat_ref):
    """Streamed, non-streamed, n=2 and a request the gateway ends (stop string): each generation is observed once in
    every phase series, and per request queue + prefill + gateway = TTFT <= e2e, prefill + decode = inference."""
    text = chat_ref.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    before = phase_totals(served)
    usages = [chat(served, max_tokens=N).usage, chat(served, max_tokens=N, stop=[stop]).usage]
    chunks = stream_chat(served, max_tokens=N, stream_options={"include_usage": True})
    usages.append(chunks[-1].usage)
    r = served.client.completions.create(model=MODEL, prompt=TEXT_PROMPT, max_tokens=3, n=2, temperature=0.8,
                                         seed=5)
    assert [c.finish_reason for c in r.choices] == ["length", "length"]
    gens, multi = 5, sum(u.completion_tokens > 1 for u in usages) + 2
    after = phase_totals(served)
    count = {n: after[n][0] - before[n][0] for n in PHASES}
    total = {n: after[n][1] - before[n][1] for n in PHASES}
    assert count == {**{n: gens for n in PHASES}, "request_time_per_output_token": multi}
    assert total["request_queue_time"] + total["request_prefill_time"] + total["request_gateway_time"] == \
        pytest.approx(total["time_to_first_token"], abs=1e-6)
    assert 0 < total["request_queue_time"] + total["request_prefill_time"] < total["time_to_first_token"] \
        <= total["e2e_request_latency"]
    assert total["request_prefill_time"] + total["request_decode_time"] == \
        pytest.approx(total["request_inference_time"], abs=1e-6)
    assert 0 < total["request_decode_time"] < total["request_inference_time"] < total["e2e_request_latency"]
    metrics = httpx.get(f"{served.url}/metrics", verify=False).text
    assert "to its FIRST scheduling" in metrics            # the queue time's help says what preemption does


# ---- engine failures through stub engines --------------------------------------------------------------------

class StubEngine:
    """Raises `fail` when generation starts (or after `after` tokens); records the last request."""

    max_model_len = 256

    def __init__(self, fail: BaseException | None = None, after: int = 0, down: list[str] | None = None) -> None:
        self.fail, self.after, self.down = fail, after, down or []
        self.last: GenerationRequest | None = None

    async def generate(self, request: GenerationRequest):
        self.last = request
        for i in range(request.params.max_tokens):
            if self.fail is not None and i == self.after:
                raise self.fail
            done = i + 1 == request.params.max_tokens
            yield TokenEvent(token_id=100 + i, finish_reason="length" if done else None)

    closing = None                       # the Engine protocol's: not stopping

    def health(self) -> list[str]:
        return self.down


@pytest.fixture(scope="module")
def stub_app(model_dir):
    tok = Tokenizer.from_dir(model_dir)
    gen_cfg = read_generation_config(model_dir)

    def build(engine: StubEngine, **kwargs) -> TestClient:
        app = create_app(engine, tok, model_name=MODEL, generation_config=gen_cfg, metrics=Metrics(), **kwargs)
        return TestClient(app, raise_server_exceptions=False)

    return build


def test_engine_errors_map_to_status(stub_app):
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 3}
    r = stub_app(StubEngine(EngineOverloaded("queue full"))).post("/v1/completions", json=body)
    _assert_error(r, 429)
    assert r.headers["retry-after"] == "1"          # the openai SDKs wait that long before retrying
    r = stub_app(StubEngine(EngineUnavailable("stage-1"))).post("/v1/completions", json=body)
    err = _assert_error(r, 503)
    assert "stage-1" in err["message"] and int(r.headers["retry-after"]) > 0
    err = _assert_error(stub_app(StubEngine(RuntimeError("secret detail"))).post("/v1/completions", json=body), 500)
    assert "secret" not in err["message"]
    err = _assert_error(stub_app(StubEngine(EngineFailed("stage 2 died"), after=1)).post("/v1/completions",
                                                                                         json=body), 500)
    client = stub_app(StubEngine(EngineFailed("stage 2 died"), after=1))
    lines = [ln for ln in client.post("/v1/completions", json={**body, "stream": True}).text.splitlines() if ln]
    assert lines[-1] == "data: [DONE]" and "error" in json.loads(lines[-2].removeprefix("data: "))



def test_a_request_interrupted_by_the_server_stopping_is_a_503_unless_its_tokens_were_streamed(stub_app):
    """The server stopping (or a component lost) ends requests that already have tokens with EngineInterrupted: a
    stream that sent them ends with its error event, but a non-streamed request's client has seen nothing, so it
    gets 503 + Retry-After (send it again) rather than a 500 (it used to be a 500)."""
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 5}
    stopping = EngineInterrupted("the server is shutting down")
    for path, req in (("/v1/completions", body),
                      ("/v1/chat/completions", {"model": MODEL, "max_tokens": 5,
                                                "messages": [{"role": "user", "content": "hi"}]}),
                      ("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 5})):
        r = stub_app(StubEngine(stopping, after=1)).post(path, json=req)
        err = _assert_error(r, 503)
        assert "shutting down" in err["message"] and int(r.headers["retry-after"]) > 0, path
    lines = [ln for ln in stub_app(StubEngine(stopping, after=1)).post("/v1/completions",
                                                                       json={**body, "stream": True}).text.splitlines()
             if ln]
    event = json.loads(lines[-2].removeprefix("data: "))
    assert lines[-1] == "data: [DONE]" and "shutting down" in event["error"]["message"], lines[-3:]

def test_health_names_missing_components(stub_app):
    r = stub_app(StubEngine(down=["stage-0", "ple"])).get("/health")
    err = _assert_error(r, 503)
    assert "stage-0" in err["message"] and "ple" in err["message"]
    assert r.json()["down"] == ["stage-0", "ple"] and r.headers["retry-after"]     # what the launcher reads


def test_health_is_503_while_the_server_stops(stub_app):
    """Requests get 503 'the server is shutting down' during the gateway's graceful stop, but /health answered
    200, so a load balancer kept sending them here."""
    engine = StubEngine()
    client = stub_app(engine)
    assert client.get("/health").status_code == 200
    engine.closing = "the server is shutting down"
    r = client.get("/health")
    err = _assert_error(r, 503, code="shutting_down")
    assert "shutting down" in err["message"] and r.headers["retry-after"] and "down" not in r.json()
    assert client.get("/ping").status_code == 503


def test_clamp_max_tokens_cuts_an_asked_for_length_to_fit(stub_app):
    """Agents that send a fixed cap larger than a small context (Zed 65,535) failed every request with the 400;
    `clamp_max_tokens` (--clamp-max-tokens) cuts it to what the context leaves, as llama.cpp does."""
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 5000}
    _assert_error(stub_app(StubEngine()).post("/v1/completions", json=body), 400, param="max_tokens",
                  code="context_length_exceeded")
    engine = StubEngine()
    r = stub_app(engine, clamp_max_tokens=True).post("/v1/completions", json={**body, "max_tokens": 5000})
    assert r.status_code == 200, r.text
    prompt = r.json()["usage"]["prompt_tokens"]
    assert engine.last.params.max_tokens == StubEngine.max_model_len - prompt


def test_body_size_limit(stub_app):
    client = stub_app(StubEngine(), max_body_bytes=1024)
    _assert_error(client.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 2000}), 413)
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}).status_code == 200


def test_defaults_come_from_generation_config(stub_app, model_dir):
    engine = StubEngine()
    client = stub_app(engine)
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "seed": 7})
    assert r.status_code == 200, r.text
    params, gen_cfg = engine.last.params, read_generation_config(model_dir)
    assert (params.temperature, params.top_p, params.top_k) == (gen_cfg["temperature"], gen_cfg["top_p"],
                                                                 gen_cfg["top_k"])
    assert params.seed == 7
    assert params.max_tokens == 16              # the legacy endpoint's default length (OpenAI's, vLLM's)
    client.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "max_tokens": None})
    assert engine.last.params.max_tokens == StubEngine.max_model_len - len(engine.last.prompt_ids)   # explicit null
    assert engine.last.stop_token_ids == set(gen_cfg["eos_token_id"])
    client.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "ignore_eos": True, "top_k": -1,
                                         "temperature": 0.5, "max_tokens": 5})
    assert engine.last.stop_token_ids == set() and engine.last.params.top_k == 0
    assert (engine.last.params.temperature, engine.last.params.max_tokens) == (0.5, 5)
    # a k of at least the vocabulary filters nothing: "off" too (schemathesis sent 10^30, which no plan can carry)
    vocab = Tokenizer.from_dir(model_dir).vocab_size
    for k, want in ((10 ** 30, 0), (vocab, 0), (vocab - 1, vocab - 1), (5, 5)):
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hello", "top_k": k, "max_tokens": 1})
        assert r.status_code == 200 and engine.last.params.top_k == want, (k, r.text)


def test_structured_output_and_forced_call_through_the_in_process_backend(served):
    """The in-process executor runs the cluster's own last stage: grammar masks as in tests/test_agents.py."""
    import jsonschema

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                                 "maximum": 9}},
              "required": ["ok", "n"]}
    r = chat(served, max_tokens=40, seed=3,
             response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"color": {"enum": ["red", "blue"]}}, "required": ["color"]}}}
    r = chat(served, max_tokens=40, seed=4, tools=[tool], tool_choice="required")
    call, = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "pick"
    assert json.loads(call.function.arguments)["color"] in ("red", "blue")


def test_logit_bias_and_n_through_the_in_process_backend(served, chat_ref):
    """The in-process executor applies logit_bias in the cluster's own last stage: -100 on the greedy first token
    changes the answer and keeps the token out; n=2 seeded choices are choice 0 = the n=1 answer, choice 1 another
    draw."""
    first = chat_ref.token_ids[0]
    r = chat(served, max_tokens=N, logprobs=True, logit_bias={str(first): -100})
    banned = list(served.tok.token_bytes(first, skip_special_tokens=False))
    assert r.choices[0].message.content != chat_ref.text
    assert banned not in [e.bytes for e in r.choices[0].logprobs.content]
    forced = chat(served, max_tokens=2, logit_bias={str(first): 100, str(chat_ref.token_ids[1]): -100})
    assert forced.choices[0].message.content == served.tok.decode([first, first])
    hot = dict(model=MODEL, messages=[{"role": "user", "content": CHAT_PROMPT}], max_tokens=N, temperature=1.0,
               seed=9)
    one = served.client.chat.completions.create(**hot)
    counted = metric_value(served, "moepipe_prompt_tokens_total")
    two = served.client.chat.completions.create(n=2, **hot)
    assert metric_value(served, "moepipe_prompt_tokens_total") - counted == two.usage.prompt_tokens   # once
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].message.content == one.choices[0].message.content != two.choices[1].message.content
    assert two.usage.prompt_tokens == one.usage.prompt_tokens


def test_openapi_describes_every_body(served):
    """/openapi.json carries the request and response models the server validates with; every $ref resolves."""
    doc = httpx.get(f"{served.url}/openapi.json", verify=False).json()
    schemas = doc["components"]["schemas"]
    for path, model in (("/v1/chat/completions", "ChatCompletionRequest"), ("/v1/completions", "CompletionRequest"),
                        ("/v1/responses", "ResponsesRequest")):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
    chat = schemas["ChatCompletionRequest"]
    assert "messages" in chat["required"]
    temperature = chat["properties"]["temperature"]["anyOf"][0]
    assert temperature["maximum"] == 100.0 and temperature["minimum"] == 0.0
    ok = doc["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert ok["application/json"]["schema"] == {"$ref": "#/components/schemas/ChatCompletionResponse"}

    def refs(x):
        if isinstance(x, dict):
            yield from ([x["$ref"]] if "$ref" in x else [])
            for v in x.values():
                yield from refs(v)
        elif isinstance(x, list):
            for v in x:
                yield from refs(v)

    assert {r.rsplit("/", 1)[1] for r in refs(doc)} <= set(schemas)


# ---- tool calls in the Qwen3-Coder / Qwen3.5 XML form, chosen by the chat template ----------------------------

XML_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "Call a tool as:\n<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n"
    "</tool_call><|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
XML_REPLY = ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
             "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n"
             "<parameter=city>\n12\n</parameter>\n</function>\n</tool_call>")


class ScriptedEngine(StubEngine):
    """Replies with the given token ids, then stops."""

    def __init__(self, ids: list[int]) -> None:
        super().__init__()
        self.ids = ids

    async def generate(self, request: GenerationRequest):
        self.last = request
        for i, t in enumerate(self.ids):
            yield TokenEvent(token_id=t, finish_reason="stop" if i + 1 == len(self.ids) else None)


def test_xml_tool_calls_parsed_when_the_template_writes_them(model_dir, tmp_path):
    template = tmp_path / "xml.jinja"
    template.write_text(XML_TEMPLATE)
    tok = Tokenizer.from_dir(model_dir, template)
    assert tok.tool_call_form == "xml" and Tokenizer.from_dir(model_dir).tool_call_form == "hermes"
    app = create_app(ScriptedEngine(tok.encode(XML_REPLY)), tok, model_name=MODEL,
                     generation_config=read_generation_config(model_dir), metrics=Metrics())
    client = TestClient(app, raise_server_exceptions=False)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Weather?"}], "tools": [tool],
            "chat_template_kwargs": {"enable_thinking": False}}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Checking."
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"]]
    assert calls == [("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "12"})]
    # streamed: each call arrives whole when its block closes
    lines = [ln.removeprefix("data: ") for ln in client.post("/v1/chat/completions", json={**body, "stream": True})
             .text.splitlines() if ln.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in map(json.loads, lines) if c["choices"]]
    streamed = [tc for d in deltas for tc in d.get("tool_calls") or []]
    args: dict[int, str] = {}
    for tc in streamed:
        args[tc["index"]] = args.get(tc["index"], "") + (tc["function"].get("arguments") or "")
    assert [json.loads(args[i]) for i in sorted(args)] == [c[1] for c in calls]
    assert "".join(d.get("content") or "" for d in deltas) == "Checking."
    # without tools in the request the XML is plain text
    r = client.post("/v1/chat/completions", json={k: v for k, v in body.items() if k != "tools"})
    assert r.json()["choices"][0]["message"]["content"] == XML_REPLY
