"""What real agents send, replayed against the real server (the "api" group's 2-stage cluster on the tiny model,
conftest.small_cluster: gateway and two stage workers, each its own process): the request
bodies in `data/agent_requests.json` were recorded with `tools/record_proxy.py` from qwen-code 0.15.10, the
openai-agents SDK 0.24.0 (chat completions mode) and aider 0.86.2 (docs/agents.md, "Running real agents"); only
qwen-code's 15k-token system prompt is cut, its tool list is cut to two tools, and `max_tokens` is set, so the test
stays fast. Every body must be answered in the shape its client parses, and a tool result must reach the prompt."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from conftest import small_cluster
from shared.tokenizer import Tokenizer

BODIES = json.loads((Path(__file__).parent / "data" / "agent_requests.json").read_text())


@pytest.fixture(scope="module")
def server(tiny_checkpoint) -> str:
    return small_cluster(tiny_checkpoint).url     # shared with the other files of the "api" group (conftest)


def _ask(url: str, body: dict) -> dict:
    """The reply as a client assembles it: the JSON body, or the stream's chunks folded into one message."""
    if not body.get("stream"):
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120, verify=False)
        assert r.status_code == 200, r.text
        return r.json()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120, verify=False) as r:
        assert r.status_code == 200, r.read()
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    content, finish, usage = "", None, None
    for c in chunks:
        for ch in c["choices"]:
            content += ch["delta"].get("content") or ""
            finish = ch["finish_reason"] or finish
        usage = c.get("usage") or usage
    return {"choices": [{"message": {"role": "assistant", "content": content}, "finish_reason": finish}],
            "usage": usage}


@pytest.mark.parametrize("name", sorted(BODIES))
def test_recorded_agent_request_is_answered(server, name):
    body = BODIES[name]
    reply = _ask(server, body)
    choice = reply["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] in ("stop", "length", "tool_calls")
    wants_usage = not body.get("stream") or (body.get("stream_options") or {}).get("include_usage")
    if wants_usage:
        assert 0 < reply["usage"]["completion_tokens"] <= body["max_tokens"]


@pytest.mark.parametrize("first,second", [("qwen_code_first", "qwen_code_tool_result"),
                                          ("openai_agents_first", "openai_agents_tool_result")])
def test_the_tool_result_reaches_the_prompt(server, tiny_checkpoint, first, second):
    """The tool-result turn's prompt is the first turn's plus the call and the result (qwen-code sends the result
    as content parts, the SDK as a string), so it is longer by at least the result's own tokens."""
    tool_msg = BODIES[second]["messages"][-1]
    assert tool_msg["role"] == "tool"
    content = tool_msg["content"]
    text = content if isinstance(content, str) else "".join(p["text"] for p in content)
    tok = Tokenizer.from_dir(tiny_checkpoint)
    stream_off = {"stream": False, "stream_options": None}
    a = _ask(server, {**BODIES[first], **stream_off})["usage"]["prompt_tokens"]
    b = _ask(server, {**BODIES[second], **stream_off})["usage"]["prompt_tokens"]
    assert b - a >= len(tok.encode(text))
