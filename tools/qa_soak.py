"""QA soak of a real `moepipe serve` under a long, mixed, adversarial client load (what a user with coding agents
does to it), watching that it stays up and leaks nothing. Not `bench/soak.py` (which replays agent conversations
and chaos kills for the prefix cache): this one mixes the official openai client and httpx over every sampling
and output option, and samples the processes' resources.

Concurrent clients each pick a scenario at random until the time is up: streamed and non-streamed chat and
completions with random seeds, stop strings, logprobs/top_logprobs, n > 1, max_tokens 1 and large; tool calls
(tools with tool_choice auto/required/named/none, streamed or not); response_format json_schema; greedy and seeded
requests from a fixed set (their text must never change over the run, a stage kill included); token-id prompts
near and over max_model_len (over: 400); clients that disconnect mid-stream; bursts of more than max_num_seqs
requests, some cancelled while still queued. Pollers hit /health, /metrics and /v1/models. One stage worker is
SIGKILLed at `--kill-at` of the run (the launcher must restart it).

Every `--sample` seconds it records each process's RSS, open fds and threads, the /dev/shm files and the /metrics
gauges. After the load: the gauges must be back to 0, the greedy texts unchanged; then SIGTERM to the launcher must
leave no process and no /dev/shm file of the server behind.

    python tools/qa_soak.py --stages 2 --duration 720 --out /tmp/qa-soak-2.json
    python tools/qa_soak.py --stages 1 --duration 720 --kill-at 0.5
    python tools/qa_soak.py --url http://127.0.0.1:8000 --duration 60      # a running server (no kill, no stop)

Exit status 1 when a check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from soak import alive, component_pids  # noqa: E402  (the launcher's children by name, as the chaos soak finds them)

TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "grep", "description": "Search for a pattern.",
        "parameters": {"type": "object", "properties": {"pattern": {"type": "string"},
                                                        "max_count": {"type": "integer"}},
                       "required": ["pattern"]}}},
]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "count": {"type": "integer"},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "count", "ok"], "additionalProperties": False}
WORDS = ("def class return import the a of and in to is for with file function test error value list print "
         "Haus und der die das ist nicht").split()
GREEDY = [  # (key, route, body): sent again and again; the text must never change
    ("chat-hello", "chat", {"messages": [{"role": "user", "content": "Hello, who are you?"}], "max_tokens": 40}),
    ("chat-code", "chat", {"messages": [{"role": "system", "content": "You write Python."},
                                        {"role": "user", "content": "Write a function that sorts a list."}],
                           "max_tokens": 64}),
    ("cmpl-def", "cmpl", {"prompt": "def fibonacci(n):\n", "max_tokens": 48}),
    ("cmpl-de", "cmpl", {"prompt": "Das Haus ist", "max_tokens": 24}),
    ("cmpl-long", "cmpl", {"prompt": " ".join(WORDS * 12), "max_tokens": 32}),
]


def now() -> float:
    return time.monotonic()


# ---- processes ---------------------------------------------------------------------------------------------------

def proc_info(pid: int) -> dict | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None
    vals = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {"pid": pid, "rss_mb": round(int(vals["VmRSS"].split()[0]) / 1024, 1), "fds": fds,
            "threads": int(vals["Threads"])}


def shm_files() -> dict[str, int]:
    out = {}
    for p in Path("/dev/shm").iterdir():
        try:
            out[p.name] = p.stat().st_size
        except OSError:
            pass
    return out


# ---- the soak ----------------------------------------------------------------------------------------------------

class Soak:
    def __init__(self, args, url: str, launcher: subprocess.Popen | None) -> None:
        self.args, self.url, self.launcher = args, url, launcher
        self.model = "moepipe"
        self.max_len = args.max_model_len
        self.outcomes: Counter = Counter()        # "scenario status code" -> count
        self.unexpected: list[dict] = []
        self.greedy: dict[str, str] = {}
        self.greedy_checked = 0
        self.mismatches: list[dict] = []
        self.samples: list[dict] = []
        self.pids_seen: set[int] = set()
        self.kill: dict = {}
        self.outage = (0.0, 0.0)                 # monotonic window in which 503s are expected
        self.requests = 0
        self.deadline = 0.0
        self.shm_before = shm_files()
        self.http = httpx.AsyncClient(base_url=url, timeout=args.timeout, verify=False,
                                      limits=httpx.Limits(max_connections=200, max_keepalive_connections=50))
        self.oai = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=args.timeout,
                                      http_client=openai.DefaultAsyncHttpxClient(verify=False))

    # -- bookkeeping --
    def in_outage(self, t0: float) -> bool:
        a, b = self.outage
        return a and (a - 1 <= t0 <= (b or now()) + 3)

    def record(self, scen: str, status, code=None, t0: float = 0.0, ok: set = frozenset({200}), **kw) -> None:
        self.requests += 1
        key = f"{scen} {status} {code or ''}".strip()
        self.outcomes[key] += 1
        if status in ok:
            return
        if status == 503 and self.in_outage(t0):
            self.outcomes["(503 in outage)"] += 1
            return
        if status == "stream_error" and code in ("component_unavailable",) and self.in_outage(t0):
            return
        self.unexpected.append({"t": round(now() - self.start, 1), "key": key, **kw})
        print(f"  ! {now() - self.start:6.1f}s {key} {json.dumps(kw, default=str)[:400]}", flush=True)

    def bad(self, scen: str, what: str, t0: float = 0.0, **kw) -> None:
        self.record(scen, "malformed", what, t0, **kw)

    def check_greedy(self, key: str, text: str) -> None:
        self.greedy_checked += 1
        first = self.greedy.setdefault(key, text)
        if first != text:
            self.mismatches.append({"key": key, "first": first[:300], "now": text[:300],
                                    "t": round(now() - self.start, 1)})
            print(f"  ! greedy {key} differs: {first[:80]!r} vs {text[:80]!r}", flush=True)

    def prompt(self, rng: random.Random, lo: int = 3, hi: int = 40) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))

    async def call(self, scen: str, coro, t0: float, **ctx):
        """Await an openai call; record its failure (status, code) and return None, or the result."""
        try:
            return await coro
        except openai.APIStatusError as e:
            code = None
            try:
                code = (e.body or {}).get("code") if isinstance(e.body, dict) else None
            except Exception:
                pass
            self.record(scen, e.status_code, code, t0, msg=str(e)[:200], **ctx)
        except openai.APITimeoutError:
            self.record(scen, "timeout", None, t0, **ctx)
        except openai.APIConnectionError as e:
            self.record(scen, "conn", type(e.__cause__).__name__, t0, msg=str(e)[:200], **ctx)
        except openai.APIError as e:                  # an error event inside a stream
            body = e.body if isinstance(e.body, dict) else {}
            self.record(scen, "stream_error", body.get("code") or body.get("type"), t0, msg=str(e)[:200], **ctx)
        return None

    # -- scenarios --
    async def chat_stream(self, rng: random.Random) -> None:
        kw = self.sampling(rng)
        n = rng.choice([1, 1, 1, 2])
        t0 = now()

        async def go():
            stream = await self.oai.chat.completions.create(
                model=self.model, messages=[{"role": "user", "content": self.prompt(rng)}], stream=True, n=n,
                stream_options={"include_usage": True}, **kw)
            texts, finish, lps, usage = [""] * n, [None] * n, [0] * n, None
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                for c in chunk.choices:
                    if finish[c.index] is not None:
                        self.bad("chat_stream", "content after finish", t0, kw=kw)
                    texts[c.index] += c.delta.content or ""
                    if c.logprobs and c.logprobs.content:
                        lps[c.index] += len(c.logprobs.content)
                        for t in c.logprobs.content:
                            if kw.get("top_logprobs") and len(t.top_logprobs) != kw["top_logprobs"]:
                                self.bad("chat_stream", "top_logprobs count", t0, got=len(t.top_logprobs), kw=kw)
                    if c.finish_reason:
                        finish[c.index] = c.finish_reason
            return texts, finish, lps, usage

        out = await self.call("chat_stream", go(), t0, kw=kw)
        if out is None:
            return
        texts, finish, lps, usage = out
        self.check_text("chat_stream", kw, texts, finish, t0)
        if usage is None:
            self.bad("chat_stream", "no usage chunk", t0, kw=kw)
        elif usage.completion_tokens > kw["max_tokens"] * n:
            self.bad("chat_stream", "too many tokens", t0, usage=usage.completion_tokens, kw=kw)
        self.record("chat_stream", 200)

    def sampling(self, rng: random.Random) -> dict:
        kw = {"max_tokens": rng.choice([1, 1, 8, 32, 64, 200, 600]), "temperature": rng.choice([0, 0.7, 1.0, 1.3])}
        if rng.random() < 0.5:
            kw["seed"] = rng.randrange(2 ** 31)
        if rng.random() < 0.4:
            kw["stop"] = rng.sample(["\n\n", "the", "(", "```", " und", "e"], rng.randint(1, 3))
        if rng.random() < 0.4:
            kw["logprobs"] = True
            kw["top_logprobs"] = rng.choice([0, 1, 5, 20])
        if rng.random() < 0.2:
            kw["top_p"] = rng.choice([0.5, 0.9])
        if rng.random() < 0.1:
            kw["presence_penalty"] = 0.5
        return kw

    def check_text(self, scen: str, kw: dict, texts: list[str], finish: list, t0: float) -> None:
        for text, fr in zip(texts, finish):
            if fr not in ("stop", "length", "tool_calls"):
                self.bad(scen, f"finish_reason {fr!r}", t0, kw=kw)
            for s in kw.get("stop") or []:
                if s in text:
                    self.bad(scen, "stop string in output", t0, stop=s, text=text[-200:], kw=kw)

    async def chat(self, rng: random.Random) -> None:
        kw = self.sampling(rng)
        n = rng.choice([1, 2, 3, 4])
        t0 = now()
        r = await self.call("chat", self.oai.chat.completions.create(
            model=self.model, messages=[{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": self.prompt(rng)}], n=n, **kw), t0, kw=kw)
        if r is None:
            return
        if sorted(c.index for c in r.choices) != list(range(n)):
            self.bad("chat", "choice indexes", t0, got=[c.index for c in r.choices], n=n)
        self.check_text("chat", kw, [c.message.content or "" for c in r.choices],
                        [c.finish_reason for c in r.choices], t0)
        if r.usage.completion_tokens > kw["max_tokens"] * n or r.usage.completion_tokens < n:
            self.bad("chat", "usage", t0, usage=r.usage.completion_tokens, n=n, kw=kw)
        if kw.get("logprobs"):
            for c in r.choices:
                if c.logprobs is None or c.logprobs.content is None:
                    self.bad("chat", "no logprobs", t0, kw=kw)
                    continue
                for t in c.logprobs.content:
                    if len(t.top_logprobs) != kw["top_logprobs"] or not t.logprob <= 0:
                        self.bad("chat", "logprob entry", t0, entry=str(t)[:200], kw=kw)
                        break
        self.record("chat", 200)

    async def completion(self, rng: random.Random) -> None:
        kw = self.sampling(rng)
        kw.pop("top_logprobs", None)
        if kw.pop("logprobs", None):
            kw["logprobs"] = rng.choice([0, 1, 5])
        stream = rng.random() < 0.5
        echo = rng.random() < 0.2
        n = rng.choice([1, 1, 2])
        prompt = self.prompt(rng) if rng.random() < 0.7 else [rng.randrange(100, 4000) for _ in range(rng.randint(1, 60))]
        t0 = now()

        async def go():
            r = await self.oai.completions.create(model=self.model, prompt=prompt, stream=stream, echo=echo, n=n, **kw)
            if not stream:
                return [c.text for c in sorted(r.choices, key=lambda c: c.index)], \
                    [c.finish_reason for c in sorted(r.choices, key=lambda c: c.index)], r
            texts, finish = [""] * n, [None] * n
            async for ch in r:
                for c in ch.choices:
                    texts[c.index] += c.text
                    if c.finish_reason:
                        finish[c.index] = c.finish_reason
            return texts, finish, None

        out = await self.call("completion", go(), t0, kw=kw, stream=stream)
        if out is None:
            return
        texts, finish, r = out
        if not echo:
            self.check_text("completion", kw, texts, finish, t0)
        if r is not None and kw.get("logprobs") is not None and not echo:
            for c in r.choices:
                lp = c.logprobs
                if lp is None or len(lp.tokens) != len(lp.token_logprobs) or len(lp.tokens) > kw["max_tokens"]:
                    self.bad("completion", "logprobs shape", t0, kw=kw)
        self.record("completion", 200)

    async def tools(self, rng: random.Random) -> None:
        choice = rng.choice(["auto", "required", "named", "none"])
        tc = {"type": "function", "function": {"name": "grep"}} if choice == "named" else choice
        stream = rng.random() < 0.4
        body = {"model": self.model, "messages": [{"role": "user", "content": "Find the TODOs. " + self.prompt(rng)}],
                "tools": TOOLS, "tool_choice": tc, "max_tokens": rng.choice([48, 100, 200]),
                "temperature": rng.choice([0, 0.8]), "stream": stream}
        if rng.random() < 0.3:
            body["parallel_tool_calls"] = False
        t0 = now()
        status, data = await self.post("tools", "/v1/chat/completions", body, t0)
        if status != 200:
            return
        if stream:
            calls: dict[int, dict] = {}
            finish = None
            for ev in data:
                for c in ev.get("choices", []):
                    for t in (c.get("delta") or {}).get("tool_calls") or []:
                        d = calls.setdefault(t["index"], {"name": "", "arguments": ""})
                        f = t.get("function") or {}
                        d["name"] += f.get("name") or ""
                        d["arguments"] += f.get("arguments") or ""
                    finish = c.get("finish_reason") or finish
            calls_l = list(calls.values())
        else:
            msg = data["choices"][0]["message"]
            finish = data["choices"][0]["finish_reason"]
            calls_l = [{"name": t["function"]["name"], "arguments": t["function"]["arguments"]}
                       for t in msg.get("tool_calls") or []]
        if choice == "none" and calls_l:
            self.bad("tools", "tool call with tool_choice none", t0)
        if choice in ("required", "named") and finish != "length":
            if not calls_l:
                self.bad("tools", f"no tool call for {choice}", t0, finish=finish)
            for c in calls_l:
                try:
                    args = json.loads(c["arguments"])
                except ValueError:
                    self.bad("tools", "arguments not JSON", t0, call=c)
                    continue
                if choice == "named" and (c["name"] != "grep" or "pattern" not in args):
                    self.bad("tools", "named call wrong", t0, call=c)
            if body.get("parallel_tool_calls") is False and len(calls_l) > 1:
                self.bad("tools", "parallel_tool_calls false but several calls", t0, n=len(calls_l))
        if finish not in ("stop", "length", "tool_calls"):
            self.bad("tools", f"finish {finish}", t0)

    async def json_schema(self, rng: random.Random) -> None:
        stream = rng.random() < 0.3
        body = {"model": self.model, "messages": [{"role": "user", "content": "Give JSON. " + self.prompt(rng)}],
                "response_format": {"type": "json_schema", "json_schema": {"name": "a", "strict": True,
                                                                           "schema": SCHEMA}},
                "max_tokens": rng.choice([60, 120, 300]), "temperature": rng.choice([0, 1.0]), "stream": stream,
                "n": rng.choice([1, 1, 2])}
        t0 = now()
        status, data = await self.post("json", "/v1/chat/completions", body, t0)
        if status != 200:
            return
        if stream:
            texts, fins = {}, {}
            for ev in data:
                for c in ev.get("choices", []):
                    texts[c["index"]] = texts.get(c["index"], "") + ((c.get("delta") or {}).get("content") or "")
                    if c.get("finish_reason"):
                        fins[c["index"]] = c["finish_reason"]
            pairs = [(texts.get(i, ""), fins.get(i)) for i in range(body["n"])]
        else:
            pairs = [(c["message"]["content"] or "", c["finish_reason"]) for c in data["choices"]]
        for text, fin in pairs:
            if fin == "stop":
                try:
                    obj = json.loads(text)
                    assert set(obj) == {"name", "count", "ok"}, obj
                    assert isinstance(obj["count"], int) and isinstance(obj["ok"], bool)
                except Exception as e:
                    self.bad("json", "not valid for the schema", t0, text=text[:200], err=repr(e)[:100])
            elif fin != "length":
                self.bad("json", f"finish {fin}", t0)

    async def greedy_req(self, rng: random.Random) -> None:
        key, route, body = rng.choice(GREEDY)
        seeded = rng.random() < 0.3
        body = dict(body, model=self.model, temperature=0)
        if seeded:
            key += "-seeded"
            body.update(temperature=1.0, seed=1234)
        stream = rng.random() < 0.5
        body["stream"] = stream
        t0 = now()
        path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
        status, data = await self.post("greedy", path, body, t0)
        if status != 200:
            return
        if stream:
            text = "".join(((c.get("delta") or {}).get("content") or "") if route == "chat" else c.get("text", "")
                           for ev in data for c in ev.get("choices", []))
        else:
            c = data["choices"][0]
            text = c["message"]["content"] if route == "chat" else c["text"]
        self.check_greedy(key, text)

    async def long(self, rng: random.Random) -> None:
        """Token-id prompts near the limit (fit), just over it (400), or fitting with too large a max_tokens (400)."""
        kind = rng.choice(["near", "near", "over", "room"])
        if kind == "near":
            plen = self.max_len - rng.randint(2, 40)
            mt = rng.randint(1, self.max_len - plen)
        elif kind == "over":
            plen, mt = self.max_len + rng.randint(0, 50), 4
        else:
            plen = self.max_len - rng.randint(5, 30)
            mt = self.max_len - plen + rng.randint(1, 20)
        prompt = [rng.randrange(100, 4000) for _ in range(plen)]
        body = {"model": self.model, "prompt": prompt, "max_tokens": mt, "temperature": 0,
                "stream": rng.random() < 0.5}
        t0 = now()
        status, data = await self.post(f"long_{kind}", "/v1/completions", body, t0,
                                       ok={200} if kind == "near" else {400})
        if kind == "near" and status == 200 and not body["stream"]:
            if data["usage"]["completion_tokens"] > mt or data["usage"]["prompt_tokens"] != plen:
                self.bad("long_near", "usage", t0, usage=data["usage"], mt=mt, plen=plen)

    async def long_chat(self, rng: random.Random) -> None:
        """A chat whose text alone is over the limit: 400 context_length_exceeded."""
        body = {"model": self.model, "messages": [{"role": "user", "content": " ".join(WORDS) * (self.max_len // 10)}],
                "max_tokens": 8, "stream": rng.random() < 0.5}
        t0 = now()
        await self.post("long_chat_over", "/v1/chat/completions", body, t0, ok={400})

    async def disconnect(self, rng: random.Random) -> None:
        chat = rng.random() < 0.5
        body = {"model": self.model, "max_tokens": rng.choice([100, 400]), "stream": True,
                "n": rng.choice([1, 2]), "temperature": 0.8}
        if chat:
            body["messages"] = [{"role": "user", "content": self.prompt(rng, 10, 300)}]
        else:
            body["prompt"] = self.prompt(rng, 10, 300)
        if rng.random() < 0.3:
            body["logprobs"] = True if chat else 2
        path = "/v1/chat/completions" if chat else "/v1/completions"
        after = rng.randint(0, 8)
        t0 = now()
        try:
            async with self.http.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    self.record("disconnect", r.status_code, _code(r), t0)
                    return
                i = 0
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        i += 1
                        if i > after:
                            break
            self.record("disconnect", 200)
        except httpx.TimeoutException:
            self.record("disconnect", "timeout", None, t0)
        except httpx.HTTPError as e:
            self.record("disconnect", "conn", type(e).__name__, t0)

    async def burst(self, rng: random.Random) -> None:
        """More than max_num_seqs requests at once; a few given up while still queued (they are the last sent)."""
        n = self.args.max_num_seqs + rng.randint(4, 12)
        cancel = set(rng.sample(range(n // 2, n), rng.randint(0, n // 3)))
        t0 = now()

        async def one(i: int) -> None:
            body = {"model": self.model, "prompt": self.prompt(rng, 5, 80), "max_tokens": rng.choice([16, 64, 150]),
                    "temperature": 0.9, "seed": i, "stream": rng.random() < 0.5}
            if i in cancel:
                try:
                    await asyncio.wait_for(self.post("burst_cancel", "/v1/completions", body, now()),
                                           rng.uniform(0.05, 1.0))
                except asyncio.TimeoutError:
                    self.record("burst_cancel", "cancelled", None, t0, ok={"cancelled"})
                return
            await self.post("burst", "/v1/completions", body, now())

        await asyncio.gather(*(one(i) for i in range(n)))

    async def post(self, scen: str, path: str, body: dict, t0: float, ok=frozenset({200})):
        """POST with httpx: (status, parsed JSON or list of SSE events); failures recorded."""
        try:
            if body.get("stream"):
                events = []
                async with self.http.stream("POST", path, json=body) as r:
                    if r.status_code != 200:
                        await r.aread()
                        self.record(scen, r.status_code, _code(r), t0, ok=set(ok), body=r.text[:200])
                        return r.status_code, None
                    done = False
                    async for line in r.aiter_lines():
                        if not line.startswith("data:"):
                            continue
                        payload = line[5:].strip()
                        if payload == "[DONE]":
                            done = True
                            continue
                        ev = json.loads(payload)
                        if "error" in ev:
                            self.record(scen, "stream_error", ev["error"].get("code"), t0, ok=set(ok),
                                        msg=str(ev["error"].get("message"))[:200])
                            return "stream_error", None
                        events.append(ev)
                    if not done:
                        self.record(scen, "no_done", None, t0)
                        return "no_done", None
                    fins = [c for ev in events for c in ev.get("choices", []) if c.get("finish_reason")]
                    if not fins:
                        self.record(scen, "no_finish", None, t0)
                        return "no_finish", None
                self.record(scen, 200, None, t0, ok=set(ok))
                return 200, events
            r = await self.http.post(path, json=body)
            data = r.json()
            if r.status_code != 200:
                if "error" not in data or not {"message", "type", "code"} <= set(data["error"]):
                    self.bad(scen, "error body not OpenAI-shaped", t0, body=r.text[:200])
                self.record(scen, r.status_code, _code(r), t0, ok=set(ok), body=r.text[:200])
                return r.status_code, data
            self.record(scen, 200, None, t0, ok=set(ok))
            return 200, data
        except httpx.TimeoutException:
            self.record(scen, "timeout", None, t0, path=path)
        except (httpx.HTTPError, ValueError) as e:
            self.record(scen, "conn", type(e).__name__, t0, msg=str(e)[:200])
        return None, None

    SCENARIOS = {"chat_stream": 3, "chat": 2, "completion": 3, "tools": 2, "json_schema": 1.5, "greedy_req": 3,
                 "long": 1.2, "long_chat": 0.3, "disconnect": 2, "burst": 0.5}

    async def client(self, i: int) -> None:
        rng = random.Random(self.args.seed * 1000 + i)
        names = list(self.SCENARIOS)
        weights = [self.SCENARIOS[n] for n in names]
        while now() < self.deadline:
            name = rng.choices(names, weights)[0]
            try:
                await getattr(self, name)(rng)
            except Exception as exc:
                self.bad(name, f"client exception {exc!r}"[:200], tb=traceback.format_exc()[-600:])

    async def poller(self) -> None:
        rng = random.Random(7)
        while now() < self.deadline:
            path = rng.choice(["/health", "/metrics", "/v1/models", "/v1/models/moepipe", "/version"])
            t0 = now()
            try:
                r = await self.http.get(path, timeout=10)
                if r.status_code != 200 and not (path == "/health" and r.status_code == 503 and self.in_outage(t0)):
                    self.record("poll", r.status_code, path, t0)
                if path == "/v1/models" and r.status_code == 200:
                    assert r.json()["data"][0]["id"] == self.model
            except Exception as e:
                self.record("poll", "exc", f"{path} {type(e).__name__}", t0)
            await asyncio.sleep(rng.uniform(0.3, 1.5))

    # -- resources --
    def components(self) -> dict[str, int]:
        if self.launcher is None:
            return {}
        out = component_pids(self.launcher.pid)
        out["launcher"] = self.launcher.pid
        self.pids_seen.update(out.values())
        return out

    async def gauges(self) -> dict:
        r = await self.http.get("/metrics", timeout=10)
        out = {}
        for line in r.text.splitlines():
            if line.startswith("moepipe_") and "{" not in line and not line.startswith("#"):
                name, val = line.split()[:2]
                if name in ("moepipe_requests_running", "moepipe_requests_waiting", "moepipe_kv_blocks_used",
                            "moepipe_state_slots_used", "moepipe_prefix_cache_entries", "moepipe_prefix_cache_blocks",
                            "moepipe_preemptions"):
                    out[name.removeprefix("moepipe_")] = float(val)
        return out

    async def sample(self, label: str = "") -> dict:
        s = {"t": round(now() - self.start, 1), "label": label,
             "procs": {k: proc_info(p) for k, p in self.components().items()},
             "shm": {k: v for k, v in shm_files().items() if k not in self.shm_before}}
        try:
            s["metrics"] = await self.gauges()
        except Exception as e:
            s["metrics"] = {"error": repr(e)}
        self.samples.append(s)
        procs = " ".join(f"{k}={v['rss_mb']:.0f}M/{v['fds']}fd/{v['threads']}t" for k, v in s["procs"].items() if v)
        print(f"[{s['t']:6.1f}s] req={self.requests} unexpected={len(self.unexpected)} {procs} "
              f"shm={len(s['shm'])} {s['metrics']}", flush=True)
        return s

    async def sampler(self) -> None:
        while now() < self.deadline:
            await asyncio.sleep(self.args.sample)
            await self.sample()

    async def killer(self) -> None:
        if self.launcher is None or self.args.kill_at <= 0:
            return
        await asyncio.sleep(self.args.duration * self.args.kill_at)
        target = f"stage{self.args.stages - 1}" if self.args.kill_stage < 0 else f"stage{self.args.kill_stage}"
        pid = self.components().get(target)
        if pid is None:
            return
        t = now()
        self.outage = (t, 0.0)
        os.kill(pid, signal.SIGKILL)
        print(f"*** SIGKILL {target} pid {pid} at {t - self.start:.1f}s", flush=True)
        while now() - t < 120:
            await asyncio.sleep(0.2)
            new = self.components().get(target)
            try:
                h = (await self.http.get("/health", timeout=5)).status_code
            except httpx.HTTPError:
                h = None
            if new and new != pid and h == 200:
                self.outage = (t, now())
                self.kill = {"target": target, "old_pid": pid, "new_pid": new, "at_s": round(t - self.start, 1),
                             "healthy_after_s": round(now() - t, 2)}
                print(f"*** {target} back as {new}, healthy {now() - t:.2f}s after the kill", flush=True)
                return
        self.kill = {"target": target, "old_pid": pid, "healthy_after_s": None}
        self.unexpected.append({"key": "kill: not healthy within 120 s"})

    def lag_probe(self, stop: threading.Event) -> None:
        """GET /health every 0.1 s from a thread of its own (not this script's busy loop): the gateway's event loop
        answers it, so its latency is how long the loop can stall (a stall delays every stream's tokens)."""
        with httpx.Client(base_url=self.url, timeout=30, verify=False) as c:
            while not stop.is_set():
                t0 = time.perf_counter()
                try:
                    c.get("/health")
                except httpx.HTTPError:
                    pass
                dt = time.perf_counter() - t0
                self.health_lat.append((round(now() - self.start, 2), dt))
                stop.wait(0.1)

    def lag_summary(self) -> dict:
        xs = sorted(d for _, d in self.health_lat)
        if not xs:
            return {}
        worst = sorted(self.health_lat, key=lambda p: -p[1])[:8]
        return {"n": len(xs), "p50_ms": round(xs[len(xs) // 2] * 1e3, 1), "p99_ms": round(xs[int(len(xs) * .99)] * 1e3, 1),
                "max_ms": round(xs[-1] * 1e3, 1), "over_1s": sum(d > 1 for d in xs),
                "worst": [(t, round(d, 2)) for t, d in worst]}

    async def run(self) -> dict:
        self.start = now()
        self.health_lat: list = []
        stop_lag = threading.Event()
        lag = threading.Thread(target=self.lag_probe, args=(stop_lag,), daemon=True)
        lag.start()
        self.deadline = self.start + self.args.duration
        await self.sample("start")
        tasks = [asyncio.create_task(self.client(i)) for i in range(self.args.clients)]
        tasks += [asyncio.create_task(self.poller()), asyncio.create_task(self.sampler()),
                  asyncio.create_task(self.killer())]
        await asyncio.gather(*tasks)
        stop_lag.set()
        load_end = now()
        # idle: gauges back to 0
        idle = {}
        for _ in range(60):
            await asyncio.sleep(1)
            idle = await self.gauges()
            if all(idle.get(k) == 0 for k in ("requests_running", "requests_waiting", "kv_blocks_used",
                                              "state_slots_used")):
                break
        else:
            self.unexpected.append({"key": "gauges not back to 0 when idle", "gauges": idle})
        idle["seconds_to_idle"] = round(now() - load_end, 1)
        # greedy once more, every prompt
        rng = random.Random(1)
        for _ in range(len(GREEDY) * 3):
            await self.greedy_req(rng)
        end = await self.sample("end")
        return {"idle_gauges": idle, "end": end, "health_latency": self.lag_summary()}


def _code(r: httpx.Response):
    try:
        return r.json()["error"].get("code")
    except Exception:
        return None


def start_server(args) -> tuple[subprocess.Popen, str, Path]:
    log = Path(args.log or f"/tmp/qa-soak-{args.stages}st-{os.getpid()}.log")
    cmd = [sys.executable, "-m", "shared.cli", "serve", "--stages", str(args.stages), "--port", str(args.port),
           "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs), *args.serve_arg]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{args.port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, log
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not become healthy")


def stop_server(proc: subprocess.Popen, pids: set[int], shm_before: dict) -> dict:
    t = time.time()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(60)
    except subprocess.TimeoutExpired:
        code = "hung"
        proc.kill()
    time.sleep(1)
    left = sorted(p for p in pids if p != proc.pid and alive(p))
    shm_left = sorted(k for k in shm_files() if k not in shm_before)
    return {"exit_code": code, "seconds": round(time.time() - t, 2), "processes_left": left, "shm_left": shm_left}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--duration", type=float, default=720)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--port", type=int, default=8177)
    ap.add_argument("--url", help="a server already running (no kill, no stop)")
    ap.add_argument("--kill-at", type=float, default=0.4, help="fraction of the run at which a stage is SIGKILLed")
    ap.add_argument("--kill-stage", type=int, default=-1, help="which stage (default the last)")
    ap.add_argument("--timeout", type=float, default=180, help="client timeout of every request (a hang)")
    ap.add_argument("--sample", type=float, default=30, help="seconds between resource samples")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log")
    ap.add_argument("--out")
    ap.add_argument("--serve-arg", action="append", default=[], help="extra `moepipe serve` argument (repeat)")
    args = ap.parse_args()

    shm_before = shm_files()
    proc, log = None, None
    if args.url:
        url = args.url
        args.kill_at = 0
    else:
        proc, url, log = start_server(args)
        print(f"server at {url}, log {log}", flush=True)
    soak = Soak(args, url, proc)
    soak.shm_before = shm_before
    result = asyncio.run(soak.run())
    stop = stop_server(proc, soak.pids_seen, shm_before) if proc else {}
    if stop and (stop["exit_code"] != 0 or stop["processes_left"] or stop["shm_left"]):
        soak.unexpected.append({"key": "unclean stop", **stop})
    errors_in_log = []
    if log:
        errors_in_log = [line for line in log.read_text(errors="replace").splitlines()
                         if "Traceback" in line or " ERROR " in line or "Error" in line][:50]
    out = {"args": vars(args), "requests": soak.requests, "outcomes": dict(sorted(soak.outcomes.items())),
           "unexpected": soak.unexpected, "greedy_checked": soak.greedy_checked, "greedy_mismatches": soak.mismatches,
           "kill": soak.kill, "samples": soak.samples, "stop": stop, "log_errors": errors_in_log, **result}
    print(json.dumps({k: out[k] for k in ("requests", "outcomes", "greedy_checked", "greedy_mismatches", "kill",
                                          "idle_gauges", "health_latency", "stop")}, indent=1))
    print(f"unexpected: {len(soak.unexpected)}; log error lines: {len(errors_in_log)}")
    for line in errors_in_log[:15]:
        print("   ", line[:300])
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    return 1 if soak.unexpected or soak.mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
