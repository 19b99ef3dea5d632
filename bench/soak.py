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

Chaos (`--chaos N`): the same load on a real `moepipe serve` (the launcher's supervisor restarts what dies) while
N random SIGKILLs hit the stages and the PLE service (and a probe client sends a short greedy request every
0.3-1.5 s, so some arrive during each outage), each 2-15 s after the cluster was healthy again; some are two
kills in quick succession, some hit a component the launcher has just restarted (still loading). Then: every request
ends (an answer, 503 `component_unavailable` for a request arriving during an outage, never a hang or a stream
without its finish reason), /health is 200 again within `--heal-bound` s of each kill (plus the launcher's backoff),
the component logs hold few ERROR lines per kill, no process is left after the launcher's Ctrl-C, and the checks
above. Compare its greedy replies with an undisturbed run of the same seed:

    python bench/soak.py --duration 150 --out bench/results/chaos-1/undisturbed.json
    python bench/soak.py --chaos 10 --duration 240 --compare bench/results/chaos-1/undisturbed.json \
        --out bench/results/chaos-1/chaos.json
    python bench/soak.py --chaos 10 --set num_blocks=600 --set prefix_cache_states=4 ...   # KV pressure too

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
        self.error_kinds: Counter = Counter()       # unexpected status or stream error code -> count
        self.outage_503 = 0                         # chaos: 503 component_unavailable answers (expected)
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


# ---- chaos ----------------------------------------------------------------------------------------------------------
VICTIMS = ("stage0", "stage1", "ple")


def component_pids(launcher_pid: int) -> dict[str, int]:
    """The launcher's children by component name (tests/test_self_healing.py uses this too)."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) != launcher_pid:
                continue
            cmd = (d / "cmdline").read_text().split("\0")
        except (OSError, IndexError, ValueError):
            continue
        if "stage_worker" in cmd:
            out[f"stage{cmd[cmd.index('--stage') + 1]}"] = int(d.name)
        elif "ple_service" in cmd:
            out["ple"] = int(d.name)
        elif "gateway" in cmd:
            out["gateway"] = int(d.name)
    return out


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Chaos:
    """SIGKILLs random stages / the PLE service of a `moepipe serve` (its launcher `launcher_pid`, its components'
    stderr in `log`) while the soak's clients run: each episode waits 2-15 s, kills one component (sometimes a
    second one 0.1-2 s later, sometimes the victim's successor again while it loads), then times the way back to
    /health 200 with every killed component's restart reported (its restart count, which only a new process sends
    in its heartbeat, has gone up)."""

    def __init__(self, soak: "Soak", launcher_pid: int, log: Path, rng: random.Random) -> None:
        self.soak, self.launcher_pid, self.log, self.rng = soak, launcher_pid, log, rng
        self.episodes: list[dict] = []
        self.pids_seen: set[int] = set()

    def pids(self) -> dict[str, int]:
        out = component_pids(self.launcher_pid)
        self.pids_seen.update(out.values())
        return out

    async def restarts(self) -> dict[str, float]:
        r = await self.soak.http.get("/metrics", timeout=10)
        out = dict.fromkeys(VICTIMS, 0.0)
        for line in r.text.splitlines():
            if line.startswith("moepipe_component_restarts{"):
                name = line.split('component="', 1)[1].split('"', 1)[0]
                out[name] = float(line.rsplit(" ", 1)[1])
        return out

    def kill(self, name: str, episode: dict) -> bool:
        pid = self.pids().get(name)
        if pid is None:
            return False
        os.kill(pid, 9)
        episode["kills"].append({"component": name, "pid": pid, "t": round(time.time() - episode["t0"], 3)})
        print(f"  chaos: SIGKILL {name} (pid {pid})", flush=True)
        return True

    async def run(self, n: int, deadline: float) -> None:
        for i in range(n):
            await asyncio.sleep(self.rng.uniform(2, 15))
            if time.time() > deadline - 5:
                print(f"  chaos: {n - i} kill(s) left undone: the load ended", flush=True)
                return
            await self.episode(i)

    async def episode(self, i: int) -> None:
        rng = self.rng
        before = await self.restarts()
        kind = rng.choices(["one", "two", "again"], [0.5, 0.3, 0.2])[0]
        ep = {"i": i, "kind": kind, "t0": time.time(), "kills": [], "log_offset": self.log.stat().st_size}
        first = rng.choice(VICTIMS)
        self.kill(first, ep)
        if kind == "two":                     # a second component in quick succession
            await asyncio.sleep(rng.uniform(0.1, 2.0))
            self.kill(rng.choice([v for v in VICTIMS if v != first]), ep)
        elif kind == "again":                 # the victim's successor, once the launcher has started it
            old = ep["kills"][0]["pid"]
            t = time.time()
            while time.time() - t < 40:
                new = self.pids().get(first)
                if new is not None and new != old:
                    await asyncio.sleep(rng.uniform(0.0, 3.0))      # loading, or just heartbeating
                    self.kill(first, ep)
                    break
                await asyncio.sleep(0.05)
        last_kill = ep["t0"] + ep["kills"][-1]["t"]
        want = Counter(k["component"] for k in ep["kills"])
        healed = None
        while time.time() - last_kill < 120:
            try:
                up = (await self.soak.http.get("/health", timeout=5)).status_code == 200
                if up:
                    now = await self.restarts()
                    # (a PLE restart brings stage 0 with it, counted only as the PLE service's restart)
                    if all(now[c] >= before[c] + k for c, k in want.items()):
                        healed = time.time() - last_kill
                        break
            except Exception as exc:        # the gateway is never killed: /health must answer
                self.soak.stats.error("chaos", f"/health or /metrics failed: {exc!r}")
            await asyncio.sleep(0.1)
        await asyncio.sleep(2.0)            # the ERROR lines of the recovery, then the count
        with self.log.open("rb") as f:
            f.seek(ep.pop("log_offset"))
            lines = f.read().decode(errors="replace").splitlines()
        errors = [ln for ln in lines if " ERROR " in ln or ln.startswith("Traceback")]
        backoff = [float(ln.rsplit("restarting it in ", 1)[1].split()[0]) for ln in lines
                   if "restarting it in " in ln]
        ep.update(healed_s=None if healed is None else round(healed, 2), backoff_s=max(backoff, default=0.0),
                  error_lines=len(errors), error_samples=sorted(set(e[24:200] for e in errors))[:8],
                  log_lines=len(lines))
        ep["t0"] = round(ep["t0"], 3)
        self.episodes.append(ep)
        print(f"  chaos {i}: {kind} {[k['component'] for k in ep['kills']]} healed in {ep['healed_s']} s "
              f"(backoff {ep['backoff_s']:.0f} s), {len(errors)} ERROR lines", flush=True)
        if healed is None:
            self.soak.stats.error("chaos", "not healthy again within 120 s", episode=ep)

    def summary(self, bound: float, flood: int) -> dict:
        heal = [e["healed_s"] for e in self.episodes if e["healed_s"] is not None]
        return {"episodes": self.episodes, "kills": sum(len(e["kills"]) for e in self.episodes),
                "kills_by_component": dict(Counter(k["component"] for e in self.episodes for k in e["kills"])),
                "heal_s": {"n": len(heal), "p50": pct(heal, 50), "max": max(heal, default=None)},
                "heal_over_bound": [e["i"] for e in self.episodes
                                    if e["healed_s"] is None or e["healed_s"] - e["backoff_s"] > bound],
                "error_lines": sum(e["error_lines"] for e in self.episodes),
                "flooded": [e["i"] for e in self.episodes if e["error_lines"] > flood]}


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
        self.chaos: Chaos | None = None

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
                    self._finished(scenario, body, data)
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
                                self.stats.error_kinds[f"stream:{(ev['error'] or {}).get('code')}"] += 1
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
                            self._finished(scenario, body, events)
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
        if status != expect and self.args.chaos and status == 503 and "component_unavailable" in str(data):
            self.stats.outage_503 += 1             # documented: a request arriving while a component is down
            await asyncio.sleep(0.5)               # (a client retrying at once would spin through the outage)
            return status, data
        if status != expect:
            self.stats.error_kinds[str(status) if not str(data).startswith("{") else
                                   f"{status}:{_error_code(data)}"] += 1
            self.stats.error(scenario, f"status {status} (expected {expect})", body=str(data)[:400])
        return status, data

    def _finished(self, scenario: str, body: dict, data) -> None:
        """Every choice of a complete answer has a finish reason (a stream cut short without one, or ended by an
        error event, is reported elsewhere)."""
        want = set(range(body.get("n") or 1))
        if isinstance(data, dict):
            got = {c["index"] for c in data.get("choices", []) if c.get("finish_reason")}
        else:
            if not data or data[-1] != "[DONE]" or any(isinstance(ev, dict) and "error" in ev for ev in data):
                return
            got = {c.get("index", 0) for ev in data if isinstance(ev, dict) for c in ev.get("choices", [])
                   if c.get("finish_reason")}
        if got != want:
            self.stats.error(scenario, "choices without a finish reason", missing=sorted(want - got))

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
                if h.status_code != 200 and not self.args.chaos:     # (chaos: the outages are timed by Chaos)
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

    async def probe(self) -> None:
        """Chaos: a short greedy request every 0.3-1.5 s, so some arrive during every outage (503) and right after
        a restart."""
        rng = random.Random(self.args.seed + 3)
        while time.time() < self.deadline:
            body = {"model": self.model, "prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0,
                    "stream": rng.random() < 0.5}
            status, data = await self.post("probe", "/v1/completions", body)
            if status == 200:
                text = (data["choices"][0]["text"] if isinstance(data, dict) else
                        "".join(c.get("text") or "" for ev in data if isinstance(ev, dict)
                                for c in ev.get("choices", [])))
                self.stats.check_greedy("probe", text, "probe")
            await asyncio.sleep(rng.uniform(0.3, 1.5))

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
        chaos = (asyncio.create_task(self.chaos.run(self.args.chaos, self.deadline)) if self.chaos else None)
        if chaos is not None:
            clients.append(asyncio.create_task(self.probe()))
        done, pending = await asyncio.wait(clients, timeout=self.args.duration + self.args.request_timeout + 60)
        for task in pending:
            self.stats.error("client", "client still running long after the deadline (a hung request?)")
            task.cancel()
        load_s = time.time() - t0
        if chaos is not None:
            await chaos                         # (its last episode waits for the cluster to be healthy again)
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
            # (chaos: a 503 component_unavailable for a request arriving during an outage is documented)
            "no_5xx": sum(n for (_, s), n in self.stats.status.items() if s.startswith("5")) == self.stats.outage_503,
            "no_hung_clients": not pending,
            "no_greedy_mismatch": not self.stats.greedy_mismatches,
            "no_unexpected_errors": not self.stats.errors,
        }
        return {"load_s": load_s, "leak": leak, "leak_after_fixed": leak_after_fixed, "fixed_before": fixed_before,
                "fixed_after": fixed_after, "prefix_cache": {"queries": queries, "hits": hits,
                                                             "hit_rate": hits / queries if queries else None},
                "preemptions": m.get("moepipe_preemptions"), "restarts": {k: v for k, v in m.items()
                                                                         if "restart" in k},
                "checks": checks, "chaos": self.chaos_summary(checks)}

    def chaos_summary(self, checks: dict) -> dict | None:
        if self.chaos is None:
            return None
        out = self.chaos.summary(self.args.heal_bound, self.args.flood_lines)
        checks["chaos_all_episodes_done"] = len(out["episodes"]) >= self.args.chaos
        checks["heal_within_bound"] = not out["heal_over_bound"]
        checks["no_error_flood"] = not out["flooded"]
        return out


def _error_code(data) -> str | None:
    try:
        return json.loads(data)["error"]["code"] if isinstance(data, str) else data["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


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
    print(f"errors: {len(stats.errors)} by kind {dict(stats.error_kinds)}; 503 during outages {stats.outage_503}")
    if result.get("chaos"):
        c = result["chaos"]
        print(f"\nchaos: {c['kills']} kills {c['kills_by_component']}; heal p50 {c['heal_s']['p50']} s, "
              f"max {c['heal_s']['max']} s; ERROR lines {c['error_lines']}")
        print(f"{'#':>3} {'kind':<6} {'killed':<26} {'healed s':>9} {'backoff s':>10} {'ERROR lines':>12}")
        for e in c["episodes"]:
            print(f"{e['i']:>3} {e['kind']:<6} {','.join(k['component'] for k in e['kills']):<26} "
                  f"{e['healed_s'] if e['healed_s'] is not None else '-':>9} {e['backoff_s']:>10.0f} "
                  f"{e['error_lines']:>12}")
    for e in stats.errors[:20]:
        print(f"  {e['scenario']}: {e['what']} {str({k: v for k, v in e.items() if k not in ('t', 'scenario', 'what')})[:200]}")
    for k, v in result["checks"].items():
        print(f"  {'ok  ' if v else 'FAIL'} {k}")
    return {"args": {k: str(v) for k, v in vars(args).items()}, "host": platform.node(),
            "prefix_caching_env": os.environ.get("MOEPIPE_PREFIX_CACHING"), "by_status": by_status,
            "latency_s": lat, "ttft_s": ttft, "errors": stats.errors, "greedy_checked": stats.greedy_checked,
            "greedy_mismatches": stats.greedy_mismatches, "greedy_replies": stats.greedy, "health": dict(stats.health),
            "error_kinds": dict(stats.error_kinds), "outage_503": stats.outage_503,
            "usage_cached_tokens": stats.cached_tokens, "usage_prompt_tokens": stats.prompt_tokens,
            "metrics_samples": stats.metrics_samples, **result}


def serve_with_chaos(args, go) -> dict:
    """`moepipe serve` (its supervisor restarts what the chaos kills) with the components' stderr in a file next to
    --out; after the load, Ctrl-C, and no component process may be left."""
    import subprocess

    from shared.cli import ensure_builtin_model

    model = Path(args.model) if args.model else ensure_builtin_model()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log = args.out.with_suffix(".stderr.log")
    url = f"http://127.0.0.1:{args.port}"
    with log.open("wb") as err:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "shared.cli", "serve", "--model", str(model), "--stages", str(args.stages),
             "--device", args.device, "--port", str(args.port), "--max-model-len", str(args.max_model_len),
             "--restart-limit", str(args.restart_limit), "--no-access-log",
             # --set KEY=VALUE as serve's --key value (num_blocks, prefix_cache_states, max_num_seqs ...)
             *[a for item in args.set for a in (f"--{item.partition('=')[0].replace('_', '-')}",
                                                item.partition("=")[2])]],
            cwd=Path(__file__).resolve().parents[1], stdout=subprocess.DEVNULL, stderr=err)
        seen: set[int] = set()
        try:
            import urllib.request

            t0 = time.time()
            while True:
                if launcher.poll() is not None or time.time() - t0 > 300:
                    raise RuntimeError(f"moepipe serve did not start; see {log}")
                try:
                    with urllib.request.urlopen(url + "/health", timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                time.sleep(0.5)
            seen.update(component_pids(launcher.pid).values())
            result = asyncio.run(go(url, launcher.pid, log))
        finally:
            seen.update(component_pids(launcher.pid).values())
            launcher.send_signal(2)
            try:
                launcher.wait(timeout=30)
            except subprocess.TimeoutExpired:
                launcher.kill()
                launcher.wait()
    time.sleep(1.0)
    for ep in (result.get("chaos") or {}).get("episodes", []):
        seen.update(k["pid"] for k in ep["kills"])
    left = sorted(p for p in seen if alive(p))
    strays = [d.name for d in Path("/proc").iterdir() if d.name.isdigit() and _has_arg(d, f"{launcher.pid}")]
    result["leftover_processes"] = {"launcher_exit": launcher.returncode, "alive": left, "strays": strays,
                                    "components_seen": len(seen)}
    result["checks"]["no_leftover_processes"] = not left and not strays
    print(f"after shutdown: launcher exited {launcher.returncode}; {len(seen)} component pids seen, alive "
          f"{left}, strays {strays}")
    return result


def _has_arg(proc: Path, parent_pid: str) -> bool:
    """A process started with `--parent-pid parent_pid` (a component of that launcher)."""
    try:
        cmd = (proc / "cmdline").read_text().split("\0")
    except OSError:
        return False
    return "--parent-pid" in cmd and cmd[cmd.index("--parent-pid") + 1:][:1] == [parent_pid] and alive(int(proc.name))


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
    ap.add_argument("--chaos", type=int, default=0, metavar="N",
                    help="N random SIGKILLs of the stages / PLE service under `moepipe serve` during the load")
    ap.add_argument("--chaos-seed", type=int, default=7, help="chaos: its own seed (victims, moments)")
    ap.add_argument("--restart-limit", type=int, default=10, help="chaos: the launcher's restarts in a row")
    ap.add_argument("--heal-bound", type=float, default=20.0,
                    help="chaos: s from a kill to /health 200 with the restart reported, beyond the backoff")
    ap.add_argument("--flood-lines", type=int, default=50, help="chaos: ERROR lines per kill that are a flood")
    ap.add_argument("--out", type=Path, default=Path("bench/results/soak.json"))
    args = ap.parse_args()

    stats = Stats()

    async def go(url: str, launcher: int | None = None, log: Path | None = None) -> dict:
        soak = Soak(url, args.model_name, args, stats)
        if launcher is not None:
            soak.chaos = Chaos(soak, launcher, log, random.Random(args.seed * 1000 + args.chaos_seed))
        try:
            return await soak.run()
        finally:
            await soak.http.aclose()

    if args.chaos and args.url:
        ap.error("--chaos starts its own `moepipe serve` (no --url)")
    if args.chaos:
        result = serve_with_chaos(args, go)
    elif args.url:
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
