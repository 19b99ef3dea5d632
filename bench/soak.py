"""Soak test: the real cluster (`moepipe serve`'s gateway, stage workers and PLE service) under a random mix of
realistic traffic for a while, then checks that it is still up, leaked nothing and still answers as it did.

Concurrent asyncio clients (httpx) each pick a scenario at random until the time is up:

- agent: a multi-turn agent conversation. A few system prompts (with tool definitions), each shared by several
  conversations; every turn appends the model's greedy reply, sometimes an assistant tool call and its tool-role
  result, and a new user message. Conversations are drawn from a fixed pool and replayed from the start, so the same
  prompt comes back many times: its greedy reply must be the same every time (`greedy_mismatches`), whether it was
  computed or restored from the prefix cache.
- fanout: 2..4 new conversations on one system prompt (from a pool of long ones) sent at the same moment; greedy, so
  checked as the agent's replies are.
- n: a chat request with n = 2..4 sampled choices (each choice must come back, with text or a finish reason).
- same: one greedy prompt sent 2..4 times at the same moment; the replies must be identical.
- same_cancel: the same, some copies given up by the client after a fraction of a second; the rest must finish.
- abandon: a streamed request (n = 1, 2 or 4) the client closes after a few chunks.
- json: response_format json_schema; a reply that finished with "stop" must parse as JSON.
- ids: a completion with a token-id prompt and logprobs (one logprob per generated token); some with echo.
- long: a token-id prompt near max_model_len (a few over it, which must be a 400).
- long_same: one near-limit prompt sent 2..3 times at once (n = 1 or 2), greedy: all replies equal.
- tiny: a 1..40-token prompt sent 2..4 times at once, greedy.
- timeout: a long-prompt request the client gives up on after a fraction of a second.

Every few seconds /health must be 200 and /metrics must parse. After the load stops: moepipe_requests_running and
_waiting, moepipe_state_slots_used and moepipe_kv_blocks_used must come back to 0, and a fixed greedy request must
return what it returned at the start. Reports counts by scenario and status, errors other than the expected 400s,
TTFT and latency percentiles, the prefix cache's hit rate and the leak checks.

    python bench/soak.py                                     # 180 s, the built-in demo model, two CPU stages
    python bench/soak.py --duration 600 --clients 12 --out bench/results/soak-1/soak-on.json
    MOEPIPE_PREFIX_CACHING=0 python bench/soak.py --out bench/results/soak-1/soak-off.json   # the cache off
    python bench/soak.py --compare bench/results/soak-1/soak-off.json    # greedy replies must equal the other run's
    python bench/soak.py --set num_blocks=600 --set prefix_cache_states=4   # KV pressure: preemption, eviction
    python bench/soak.py --url http://127.0.0.1:8000 --max-model-len N   # a server already running, idle at start

Exit status 1 when a check failed (a 5xx, a hang, a leak, a wrong answer, /health not 200).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import time
import traceback
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the repository.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "run_tests", "description": "Run the test suite, or one test file.",
        "parameters": {"type": "object", "properties": {"target": {"type": "string"},
                                                        "verbose": {"type": "boolean"}}}}},
    {"type": "function", "function": {
        "name": "grep", "description": "Search the repository for a pattern.",
        "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}, "path": {"type": "string"}},
                       "required": ["pattern"]}}},
]

JSON_SCHEMA = {"name": "answer", "strict": True, "schema": {
    "type": "object", "properties": {"name": {"type": "string"}, "count": {"type": "integer"},
                                     "ok": {"type": "boolean"}},
    "required": ["name", "count", "ok"], "additionalProperties": False}}

FIXED = {"messages": [{"role": "user", "content": "Name three prime numbers and say why they are prime."}],
         "max_tokens": 32, "temperature": 0}


class Stats:
    def __init__(self) -> None:
        self.status: Counter = Counter()            # (scenario, status) -> count
        self.errors: list[dict] = []                # unexpected outcomes
        self.ttft: dict[str, list[float]] = defaultdict(list)
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.greedy: dict[str, str] = {}            # prompt key -> first greedy reply
        self.greedy_checked = 0
        self.greedy_mismatches: list[dict] = []
        self.health: Counter = Counter()
        self.metrics_samples: list[dict] = []
        self.cached_tokens = 0
        self.prompt_tokens = 0

    def error(self, scenario: str, what: str, **kw) -> None:
        self.errors.append({"t": time.time(), "scenario": scenario, "what": what, **kw})
        print(f"  ! {scenario}: {what} {json.dumps(kw)[:300]}", flush=True)

    def check_greedy(self, key: str, text: str, scenario: str) -> None:
        first = self.greedy.setdefault(key, text)
        self.greedy_checked += 1
        if first != text:
            self.greedy_mismatches.append({"scenario": scenario, "key": key, "first": first[:200],
                                           "now": text[:200]})
            print(f"  ! {scenario}: greedy reply differs for {key}: {first[:60]!r} vs {text[:60]!r}", flush=True)


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


class Soak:
    def __init__(self, url: str, model: str, args, stats: Stats) -> None:
        import httpx

        self.url, self.model, self.args, self.stats = url, model, args, stats
        self.http = httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(args.request_timeout),
                                      limits=httpx.Limits(max_connections=200, max_keepalive_connections=50))
        from serve import _stdlib_block, unseen_text

        rng = random.Random(args.seed)
        # System prompts shared among conversations; each conversation's user messages are fixed by its seed.
        self.systems = [f"You are coding agent {k}. Use the tools. The project's sources follow.\n\n"
                        + _stdlib_block(args.system_chars, args.seed + k) for k in range(args.systems)]
        self.conversations = [(k % args.systems, [unseen_text(rng.randint(80, 400), 1000 * k + t)
                                                  for t in range(args.turns)]) for k in range(args.conversations)]
        self.same_prompts = [unseen_text(rng.randint(200, 3000), 90_000 + k) for k in range(6)]
        # fanout: several new conversations on one system prompt sent at once (each system prompt of this pool is
        # new to the server the first time, so the conversations wait for one another's saved state)
        self.fanout_systems = [f"You are reviewer {k}. Check the patch against these sources.\n\n"
                               + _stdlib_block(rng.randint(2000, 6000), 50 + k) for k in range(args.fanout_systems)]
        self.fanout_users = [unseen_text(rng.randint(30, 600), 70_000 + k) for k in range(8)]
        self.deadline = 0.0

    # ---- one request --------------------------------------------------------------------------------------------
    async def post(self, scenario: str, path: str, body: dict, *, expect: int = 200, timeout: float | None = None,
                   abandon_after: int | None = None) -> tuple[int, object]:
        """POST; streamed bodies are read as SSE. Returns (status, parsed body or list of events). A status other
        than `expect` is an error, as is an error event inside a stream."""
        import httpx

        t0 = time.perf_counter()
        stream = bool(body.get("stream"))
        status: int | str
        try:
            if not stream:
                r = await self.http.post(path, json=body, timeout=timeout or self.args.request_timeout)
                status = r.status_code
                data = r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text
                if status == 200:
                    self.stats.latency[scenario].append(time.perf_counter() - t0)
                    self._usage(data.get("usage") if isinstance(data, dict) else None)
            else:
                events, first = [], None
                async with self.http.stream("POST", path, json=body,
                                            timeout=timeout or self.args.request_timeout) as r:
                    status = r.status_code
                    if status != 200:
                        await r.aread()
                        data = r.text
                    else:
                        async for line in r.aiter_lines():
                            if not line.startswith("data: "):
                                continue
                            if line == "data: [DONE]":
                                events.append("[DONE]")
                                break
                            ev = json.loads(line[6:])
                            if "error" in ev:
                                self.stats.error(scenario, "error event in stream", event=ev)
                            events.append(ev)
                            if first is None and ev.get("choices"):
                                first = time.perf_counter() - t0
                                self.stats.ttft[scenario].append(first)
                            if abandon_after is not None and len(events) >= abandon_after:
                                break               # leaving the block closes the connection midway
                        data = events
                        if abandon_after is None:
                            self.stats.latency[scenario].append(time.perf_counter() - t0)
                            if events and events[-1] != "[DONE]":
                                self.stats.error(scenario, "stream ended without [DONE]", n=len(events))
                            for ev in events:
                                if isinstance(ev, dict):
                                    self._usage(ev.get("usage"))
        except httpx.TimeoutException:
            status, data = "timeout", None
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            status, data = f"exc:{type(exc).__name__}", repr(exc)
        self.stats.status[(scenario, str(status))] += 1
        if status == "timeout" and timeout is not None:
            return status, data                    # the client's own cancellation
        if status != expect:
            self.stats.error(scenario, f"status {status} (expected {expect})", body=str(data)[:400])
        return status, data

    def _usage(self, usage: dict | None) -> None:
        if usage:
            self.stats.prompt_tokens += usage.get("prompt_tokens") or 0
            self.stats.cached_tokens += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0

    # ---- scenarios ----------------------------------------------------------------------------------------------
    async def agent(self, rng: random.Random) -> None:
        k = rng.randrange(len(self.conversations))
        sys_id, users = self.conversations[k]
        messages = [{"role": "system", "content": self.systems[sys_id]}]
        for t, user in enumerate(users[:rng.randint(1, len(users))]):
            if time.time() > self.deadline:
                return
            messages.append({"role": "user", "content": user})
            body = {"model": self.model, "messages": messages, "tools": TOOLS, "max_tokens": self.args.max_tokens,
                    "temperature": 0, "stream": rng.random() < 0.5}
            if body["stream"]:
                body["stream_options"] = {"include_usage": True}
            status, data = await self.post("agent", "/v1/chat/completions", body)
            if status != 200:
                return
            text = _chat_text(data)
            self.stats.check_greedy(f"conv{k}/turn{t}", text, "agent")
            messages.append({"role": "assistant", "content": text})
            if (k + t) % 2 == 0:               # a tool round trip, the same for every replay of this conversation
                call_id = f"call_{k}_{t}"
                messages.append({"role": "assistant", "content": None, "tool_calls": [
                    {"id": call_id, "type": "function",
                     "function": {"name": "read_file", "arguments": json.dumps({"path": f"src/mod{k}_{t}.py"})}}]})
                messages.append({"role": "tool", "tool_call_id": call_id,
                                 "content": f"# src/mod{k}_{t}.py\n" + users[(t + 1) % len(users)] * 2})

    async def fanout(self, rng: random.Random) -> None:
        k = rng.randrange(len(self.fanout_systems))
        users = rng.sample(range(len(self.fanout_users)), rng.randint(2, 4))

        async def one(u: int) -> None:
            body = {"model": self.model, "messages": [{"role": "system", "content": self.fanout_systems[k]},
                                                      {"role": "user", "content": self.fanout_users[u]}],
                    "tools": TOOLS, "max_tokens": 12, "temperature": 0, "stream": rng.random() < 0.5}
            status, data = await self.post("fanout", "/v1/chat/completions", body)
            if status == 200:
                self.stats.check_greedy(f"fanout{k}/user{u}", _chat_text(data), "fanout")

        await asyncio.gather(*[one(u) for u in users])

    async def n_choices(self, rng: random.Random) -> None:
        n = rng.randint(2, 4)
        body = {"model": self.model, "messages": [{"role": "system", "content": self.systems[0][:4000]},
                                                  {"role": "user", "content": self.same_prompts[rng.randrange(6)]}],
                "n": n, "max_tokens": rng.randint(4, 24), "temperature": 0.8, "seed": rng.randrange(1000),
                "stream": rng.random() < 0.3}
        status, data = await self.post("n", "/v1/chat/completions", body)
        if status == 200:
            idx = ({c["index"] for c in data["choices"]} if not body["stream"] else
                   {c["index"] for ev in data if isinstance(ev, dict) for c in ev.get("choices", [])})
            if idx != set(range(n)):
                self.stats.error("n", "choices missing", got=sorted(idx), n=n)

    async def same(self, rng: random.Random) -> None:
        k = rng.randrange(len(self.same_prompts))
        copies = rng.randint(2, 4)
        body = {"model": self.model, "prompt": self.same_prompts[k], "max_tokens": 16, "temperature": 0}
        results = await asyncio.gather(*[self.post("same", "/v1/completions", body) for _ in range(copies)])
        texts = [d["choices"][0]["text"] for s, d in results if s == 200]
        if len(set(texts)) > 1:
            self.stats.error("same", "identical greedy prompts sent at once got different replies",
                             texts=[t[:60] for t in texts])
        for text in texts:
            self.stats.check_greedy(f"same{k}", text, "same")

    async def same_cancel(self, rng: random.Random) -> None:
        """Identical greedy prompts at once, some of which the client gives up on while the others (which may be
        waiting for the state a cancelled one was computing) must still finish with the usual reply."""
        k = rng.randrange(len(self.same_prompts))
        body = {"model": self.model, "prompt": self.same_prompts[k], "max_tokens": 16, "temperature": 0}
        timeouts = [rng.uniform(0.05, 1.0) if rng.random() < 0.5 else None for _ in range(rng.randint(2, 4))]
        results = await asyncio.gather(*[self.post("same_cancel", "/v1/completions", body, timeout=t)
                                         for t in timeouts])
        for status, data in results:
            if status == 200:
                self.stats.check_greedy(f"same{k}", data["choices"][0]["text"], "same_cancel")

    async def abandon(self, rng: random.Random) -> None:
        body = {"model": self.model, "messages": [{"role": "system", "content": self.systems[rng.randrange(
                    len(self.systems))]}, {"role": "user", "content": self.same_prompts[rng.randrange(6)][:500]}],
                "max_tokens": 64, "stream": True, "temperature": 0.7, "n": rng.choice([1, 1, 2, 4])}
        await self.post("abandon", "/v1/chat/completions", body, abandon_after=rng.randint(1, 4))

    async def json_schema(self, rng: random.Random) -> None:
        body = {"model": self.model, "messages": [{"role": "user", "content": "Describe a widget as JSON."}],
                "response_format": {"type": "json_schema", "json_schema": JSON_SCHEMA},
                "max_tokens": rng.choice([16, 64, 128]), "temperature": rng.choice([0, 0.7])}
        status, data = await self.post("json", "/v1/chat/completions", body)
        if status == 200:
            ch = data["choices"][0]
            if ch["finish_reason"] == "stop":
                try:
                    obj = json.loads(ch["message"]["content"])
                    if set(obj) != {"name", "count", "ok"}:
                        raise ValueError(f"keys {sorted(obj)}")
                except (ValueError, TypeError) as exc:
                    self.stats.error("json", "finished reply is not the schema's JSON", content=ch["message"]
                                     ["content"][:200], why=str(exc))

    async def ids(self, rng: random.Random) -> None:
        n_ids = rng.randint(5, 1500)
        prompt = [rng.randrange(10, 4000) for _ in range(n_ids)]
        want = rng.randint(1, 5)
        echo = rng.random() < 0.3
        body = {"model": self.model, "prompt": prompt, "max_tokens": rng.randint(1, 16), "logprobs": want,
                "echo": echo, "temperature": rng.choice([0, 1.0])}
        status, data = await self.post("ids", "/v1/completions", body)
        if status == 200:
            ch = data["choices"][0]
            lp = ch.get("logprobs") or {}
            got = len(lp.get("token_logprobs") or [])
            gen = data["usage"]["completion_tokens"]
            # a stop token (EOS) counts in completion_tokens but has no logprobs entry (no text)
            stop = 1 if ch["finish_reason"] == "stop" else 0
            if got not in (gen + (n_ids if echo else 0), gen - stop + (n_ids if echo else 0)):
                self.stats.error("ids", "logprobs do not match the tokens", logprobs=got, generated=gen,
                                 prompt=n_ids, echo=echo)

    async def long(self, rng: random.Random) -> None:
        limit = self.args.max_model_len
        over = rng.random() < 0.25
        n_ids = limit + rng.randint(1, 50) if over else limit - rng.randint(2, 200)
        prompt = [rng.randrange(10, 4000) for _ in range(n_ids)]
        body = {"model": self.model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
                "stream": rng.random() < 0.5}
        status, data = await self.post("long_over" if over else "long", "/v1/completions", body,
                                       expect=400 if over else 200)
        if status == 200 and not over:
            if body["stream"]:
                fin = [c.get("finish_reason") for ev in data if isinstance(ev, dict) for c in ev.get("choices", [])
                       if c.get("finish_reason")]
            else:
                fin = [data["choices"][0]["finish_reason"]]
            if not fin:
                self.stats.error("long", "no finish reason", n=n_ids)

    async def long_same(self, rng: random.Random) -> None:
        """One near-limit prompt sent 2..3 times at once (sometimes with n = 2), greedy: all replies equal."""
        k = rng.randrange(4)
        r = random.Random(k)
        prompt = [r.randrange(10, 4000) for _ in range(self.args.max_model_len - 10 - 7 * k)]
        body = {"model": self.model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "n": rng.choice([1, 2])}
        results = await asyncio.gather(*[self.post("long_same", "/v1/completions", body)
                                         for _ in range(rng.randint(2, 3))])
        for status, data in results:
            if status == 200:
                for ch in data["choices"]:
                    self.stats.check_greedy(f"long_same{k}", ch["text"], "long_same")

    async def tiny(self, rng: random.Random) -> None:
        """A short token-id prompt (1..40 tokens, around a block or two) sent 2..4 times at once, greedy."""
        n_ids = rng.randint(1, 40)
        prompt = [random.Random(n_ids).randrange(10, 4000) for _ in range(n_ids)]
        body = {"model": self.model, "prompt": prompt, "max_tokens": 6, "temperature": 0}
        results = await asyncio.gather(*[self.post("tiny", "/v1/completions", body)
                                         for _ in range(rng.randint(2, 4))])
        for status, data in results:
            if status == 200:
                self.stats.check_greedy(f"tiny{n_ids}", data["choices"][0]["text"], "tiny")

    async def timeout(self, rng: random.Random) -> None:
        prompt = [rng.randrange(10, 4000) for _ in range(rng.randint(1000, self.args.max_model_len // 2))]
        body = {"model": self.model, "prompt": prompt, "max_tokens": 32, "stream": rng.random() < 0.5}
        await self.post("timeout", "/v1/completions", body, timeout=rng.uniform(0.05, 1.5))

    SCENARIOS = {"agent": 6, "fanout": 2, "n": 2, "same": 2, "same_cancel": 1.5, "abandon": 2, "json": 1.5, "ids": 2, "long": 1, "long_same": 0.7, "tiny": 1,
                 "timeout": 1.5}

    async def client(self, i: int) -> None:
        rng = random.Random(self.args.seed * 100 + i)
        names = list(self.SCENARIOS)
        weights = [self.SCENARIOS[n] for n in names]
        while time.time() < self.deadline:
            name = rng.choices(names, weights)[0]
            fn = {"n": self.n_choices, "json": self.json_schema}.get(name) or getattr(self, name)
            try:
                await fn(rng)
            except Exception as exc:             # a bug of this script or a malformed reply: both reported
                self.stats.error(name, f"client exception {exc!r}", tb=traceback.format_exc()[-800:])

    # ---- health and metrics -------------------------------------------------------------------------------------
    async def metrics(self) -> dict:
        from prometheus_client.parser import text_string_to_metric_families

        r = await self.http.get("/metrics", timeout=10)
        r.raise_for_status()
        out = {}
        for fam in text_string_to_metric_families(r.text):
            for s in fam.samples:
                if not s.labels:
                    out[s.name] = s.value
        return out

    async def watch(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            try:
                h = await self.http.get("/health", timeout=10)
                self.stats.health[str(h.status_code)] += 1
                if h.status_code != 200:
                    self.stats.error("watch", f"/health {h.status_code}", body=h.text[:300])
                m = await self.metrics()
                sample = {k: m.get(k) for k in ("moepipe_requests_running", "moepipe_requests_waiting",
                                                "moepipe_kv_blocks_used", "moepipe_kv_blocks_total",
                                                "moepipe_state_slots_used", "moepipe_prefix_cache_entries",
                                                "moepipe_prefix_cache_blocks", "moepipe_preemptions")}
                sample["t"], sample["health_s"] = time.time(), time.perf_counter() - t0
                self.stats.metrics_samples.append(sample)
                if sample["moepipe_kv_blocks_used"] is not None and sample["moepipe_kv_blocks_total"] is not None \
                        and not 0 <= sample["moepipe_kv_blocks_used"] <= sample["moepipe_kv_blocks_total"]:
                    self.stats.error("watch", "kv_blocks_used out of range", sample=sample)
            except Exception as exc:
                self.stats.health["exc"] += 1
                self.stats.error("watch", f"/health or /metrics failed: {exc!r}")
            try:
                await asyncio.wait_for(stop.wait(), self.args.watch_interval)
            except asyncio.TimeoutError:
                pass

    async def fixed(self) -> str | None:
        status, data = await self.post("fixed", "/v1/chat/completions", {"model": self.model, **FIXED})
        return _chat_text(data) if status == 200 else None

    async def run(self) -> dict:
        fixed_before = await self.fixed()
        m0 = await self.metrics()
        self.deadline = time.time() + self.args.duration
        stop = asyncio.Event()
        watcher = asyncio.create_task(self.watch(stop))
        t0 = time.time()
        clients = [asyncio.create_task(self.client(i)) for i in range(self.args.clients)]
        done, pending = await asyncio.wait(clients, timeout=self.args.duration + self.args.request_timeout + 60)
        for task in pending:
            self.stats.error("client", "client still running long after the deadline (a hung request?)")
            task.cancel()
        load_s = time.time() - t0
        stop.set()
        await watcher
        # Drain: everything the clients left (abandoned streams, timeouts) must end and give back what it held.
        leak = {}
        t1 = time.time()
        while True:
            m = await self.metrics()
            leak = {k: m.get(k) for k in ("moepipe_requests_running", "moepipe_requests_waiting",
                                          "moepipe_state_slots_used", "moepipe_kv_blocks_used")}
            if all(v == 0 for v in leak.values()) or time.time() - t1 > self.args.drain_timeout:
                break
            await asyncio.sleep(0.5)
        leak["drain_s"] = round(time.time() - t1, 2)
        fixed_after = await self.fixed()
        # The gauges again after the fixed request: it must leave nothing behind either.
        await asyncio.sleep(1.0)
        m = await self.metrics()
        leak_after_fixed = {k: m.get(k) for k in ("moepipe_requests_running", "moepipe_requests_waiting",
                                                  "moepipe_state_slots_used", "moepipe_kv_blocks_used")}
        h = await self.http.get("/health", timeout=10)
        queries = m.get("moepipe_prefix_cache_queries_total", 0) - m0.get("moepipe_prefix_cache_queries_total", 0)
        hits = m.get("moepipe_prefix_cache_hits_total", 0) - m0.get("moepipe_prefix_cache_hits_total", 0)
        checks = {
            "no_leak_after_drain": all(leak[k] == 0 for k in leak if k != "drain_s"),
            "no_leak_after_fixed": all(v == 0 for v in leak_after_fixed.values()),
            "fixed_same": fixed_before is not None and fixed_before == fixed_after,
            "health_200_at_end": h.status_code == 200,
            "no_5xx": not any(s.startswith("5") for (_, s) in self.stats.status),
            "no_hung_clients": not pending,
            "no_greedy_mismatch": not self.stats.greedy_mismatches,
            "no_unexpected_errors": not self.stats.errors,
        }
        return {"load_s": load_s, "leak": leak, "leak_after_fixed": leak_after_fixed, "fixed_before": fixed_before,
                "fixed_after": fixed_after, "prefix_cache": {"queries": queries, "hits": hits,
                                                             "hit_rate": hits / queries if queries else None},
                "preemptions": m.get("moepipe_preemptions"), "restarts": {k: v for k, v in m.items()
                                                                         if "restart" in k},
                "checks": checks}


def _chat_text(data) -> str:
    """A chat reply's content, reasoning and tool calls (name and arguments) as one string, the same whether it
    was streamed or not."""
    parts = []
    if isinstance(data, dict):
        msg = data["choices"][0]["message"]
        parts += [msg.get("reasoning_content") or "", msg.get("content") or ""]
        for call in msg.get("tool_calls") or []:
            parts += ["<call>", call["function"]["name"] or "", call["function"]["arguments"] or ""]
        return "".join(parts)
    reasoning, content, calls = [], [], {}
    for ev in data or []:
        if isinstance(ev, dict):
            for c in ev.get("choices", []):
                d = c.get("delta") or {}
                reasoning.append(d.get("reasoning_content") or "")
                content.append(d.get("content") or "")
                for call in d.get("tool_calls") or []:
                    fn = call.get("function") or {}
                    calls.setdefault(call.get("index", 0), []).extend(
                        (["<call>"] if call.get("id") else []) + [fn.get("name") or "", fn.get("arguments") or ""])
    return "".join(reasoning) + "".join(content) + "".join("".join(v) for _, v in sorted(calls.items()))


def report(stats: Stats, result: dict, args) -> dict:
    by_status: dict[str, dict[str, int]] = defaultdict(dict)
    for (scenario, status), n in sorted(stats.status.items()):
        by_status[scenario][status] = n
    lat = {s: {"n": len(v), "p50": pct(v, 50), "p90": pct(v, 90), "p99": pct(v, 99), "max": max(v)}
           for s, v in stats.latency.items() if v}
    ttft = {s: {"n": len(v), "p50": pct(v, 50), "p90": pct(v, 90), "p99": pct(v, 99), "max": max(v)}
            for s, v in stats.ttft.items() if v}
    print(f"\nsoak: {result['load_s']:.0f} s of load, {args.clients} clients, prefix caching "
          f"{os.environ.get('MOEPIPE_PREFIX_CACHING', 'default (on)')}")
    print(f"{'scenario':<10} {'status counts':<40} {'lat p50':>8} {'p90':>8} {'p99':>8} {'TTFT p50':>9} {'p90':>8}")
    f = lambda x: f"{x:8.2f}" if x is not None else f"{'-':>8}"      # noqa: E731
    for s in sorted(by_status):
        counts = " ".join(f"{k}:{v}" for k, v in by_status[s].items())
        lt, tt = lat.get(s, {}), ttft.get(s, {})
        print(f"{s:<10} {counts:<40} {f(lt.get('p50'))} {f(lt.get('p90'))} {f(lt.get('p99'))} "
              f"{f(tt.get('p50')):>9} {f(tt.get('p90'))}")
    pc = result["prefix_cache"]
    print(f"prefix cache: {pc['hits']:.0f} of {pc['queries']:.0f} prompt tokens hit "
          f"({(pc['hit_rate'] or 0) * 100:.1f}%); usage cached_tokens {stats.cached_tokens} of "
          f"{stats.prompt_tokens}")
    print(f"greedy replies compared: {stats.greedy_checked}, mismatches {len(stats.greedy_mismatches)}")
    print(f"health: {dict(stats.health)}; preemptions {result['preemptions']}")
    print(f"after drain: {result['leak']}; after the fixed request: {result['leak_after_fixed']}")
    print(f"fixed greedy request: before {result['fixed_before']!r:.60} after {result['fixed_after']!r:.60}")
    print(f"errors: {len(stats.errors)}")
    for e in stats.errors[:20]:
        print(f"  {e['scenario']}: {e['what']} {str({k: v for k, v in e.items() if k not in ('t', 'scenario', 'what')})[:200]}")
    for k, v in result["checks"].items():
        print(f"  {'ok  ' if v else 'FAIL'} {k}")
    return {"args": {k: str(v) for k, v in vars(args).items()}, "host": platform.node(),
            "prefix_caching_env": os.environ.get("MOEPIPE_PREFIX_CACHING"), "by_status": by_status,
            "latency_s": lat, "ttft_s": ttft, "errors": stats.errors, "greedy_checked": stats.greedy_checked,
            "greedy_mismatches": stats.greedy_mismatches, "greedy_replies": stats.greedy, "health": dict(stats.health),
            "usage_cached_tokens": stats.cached_tokens, "usage_prompt_tokens": stats.prompt_tokens,
            "metrics_samples": stats.metrics_samples, **result}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="an already running server (default: start one)")
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the built-in demo model)")
    ap.add_argument("--model-name", default="moepipe")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--port", type=int, default=8021)
    ap.add_argument("--duration", type=float, default=180.0, help="seconds of load")
    ap.add_argument("--clients", type=int, default=10, help="concurrent clients")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=24, help="tokens per agent turn")
    ap.add_argument("--systems", type=int, default=3, help="system prompts, shared among the conversations")
    ap.add_argument("--system-chars", type=int, default=5000)
    ap.add_argument("--fanout-systems", type=int, default=12, help="system prompts of the fanout scenario")
    ap.add_argument("--conversations", type=int, default=9)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--drain-timeout", type=float, default=30.0)
    ap.add_argument("--watch-interval", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a cluster config key")
    ap.add_argument("--compare", type=Path, default=None,
                    help="another run's JSON (same seed): its greedy replies must equal this run's")
    ap.add_argument("--out", type=Path, default=Path("bench/results/soak.json"))
    args = ap.parse_args()

    stats = Stats()

    async def go(url: str) -> dict:
        soak = Soak(url, args.model_name, args, stats)
        try:
            return await soak.run()
        finally:
            await soak.http.aclose()

    if args.url:
        result = asyncio.run(go(args.url))
    else:
        from cluster_sets import parse_sets
        from gateway.launcher import Cluster, ServeOptions
        from shared.cli import ensure_builtin_model

        model = Path(args.model) if args.model else ensure_builtin_model()
        extra = {"max_model_len": args.max_model_len, **parse_sets(args.set, ap.error)}
        with Cluster(ServeOptions(model=model, stages=args.stages, device=args.device, port=args.port,
                                  extra=extra)) as cluster:
            result = asyncio.run(go(cluster.url))
    out = report(stats, result, args)
    if args.compare:
        other = json.loads(args.compare.read_text()).get("greedy_replies", {})
        common = sorted(set(other) & set(stats.greedy))
        differ = [k for k in common if other[k] != stats.greedy[k]]
        out["compare"] = {"with": str(args.compare), "common": len(common), "differ": differ}
        result["checks"]["same_greedy_as_compared_run"] = not differ
        print(f"greedy replies vs {args.compare}: {len(common)} prompts in common, {len(differ)} differ"
              + (f": {differ[:10]}" if differ else ""))
        for k in differ[:5]:
            print(f"  {k}: {other[k][:70]!r}\n  {'':>{len(k)}}  {stats.greedy[k][:70]!r}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1, default=str))
    print(f"wrote {args.out}")
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
