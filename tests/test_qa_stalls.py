"""QA of a served cluster under short stalls: a process stopped (SIGSTOP) for a few seconds, as a loaded machine
starves one. Every request must end with exactly the tokens, logprobs and usage it gets on an idle cluster, and
nothing may be recomputed for a component that was only late (its process ran all along).

The default suite runs one stall on a 2-stage tiny cluster (~12 s). tools/qa_stalls.py runs the wider exploration
(1 and 2 stages, the PLE service, the gateway stopped, busy-loop starvation). The helpers here are shared with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time

import httpx
import pytest
from conftest import all_metrics as metrics
from conftest import HELD, free_port, settle_held

from gateway.launcher import Cluster, ServeOptions

TIMEOUT = 120
HEARTBEAT_TIMEOUT = 1.5     # a stall just past it makes a component late, at less test time than the default 2.5 s


# ---- helpers (also used by tools/qa_stalls.py) ----------------------------------------------------------------------

def workload(tokens: int, delays=(0.0, 0.0, 0.0, 1.0)) -> list[tuple[float, str, dict]]:
    """(start delay s, path, body): greedy and seeded sampling, n=2, logprobs, streamed and not, chat and
    completions. A request with a delay starts that long after the first: it arrives during the stall."""
    out = []
    for k, delay in enumerate(delays):
        stream = k % 2 == 0
        common = {"model": "moepipe", "max_tokens": tokens, "ignore_eos": True, "stream": stream}
        if stream:
            common["stream_options"] = {"include_usage": True}
        if k % 3 == 0:
            out.append((delay, "/v1/completions", {**common, "prompt": f"stall probe {k} the quick brown fox",
                                                   "temperature": 0, "logprobs": 2}))
        elif k % 3 == 1:
            out.append((delay, "/v1/completions", {**common, "prompt": f"seeded {k} jumps over", "n": 2,
                                                   "temperature": 0.9, "seed": 100 + k, "logprobs": 1}))
        else:
            out.append((delay, "/v1/chat/completions", {**common, "messages": [{"role": "user",
                                                                                "content": f"hello {k}"}],
                                                        "temperature": 0.7, "seed": 200 + k, "logprobs": True,
                                                        "top_logprobs": 2}))
    return out


def _choices(path: str, j: dict) -> list:
    out = []
    for c in sorted(j["choices"], key=lambda c: c["index"]):
        if path == "/v1/completions":
            lp = c["logprobs"]
            out.append((c["text"], lp["tokens"], lp["token_logprobs"], c["finish_reason"]))
        else:
            content = c["logprobs"]["content"]
            out.append((c["message"]["content"] or "", [x["token"] for x in content],
                        [x["logprob"] for x in content], c["finish_reason"]))
    return out


async def call(client: httpx.AsyncClient, url: str, path: str, body: dict, started: list | None = None) -> dict:
    """One request: {status, choices: [(text, tokens, logprobs, finish reason)], usage}; a stream's chunks are
    folded, and what a stream must not do (an error event, a chunk after its choice's finish, no [DONE]) goes to
    `errors`. `started` gets the time of the first chunk (of the answer, not streamed)."""
    if not body.get("stream"):
        r = await client.post(url + path, json=body)
        if started is not None:
            started.append(time.time())
        if r.status_code != 200:
            return {"status": r.status_code, "error": r.text}
        j = r.json()
        return {"status": 200, "choices": _choices(path, j), "usage": j["usage"]}
    n = body.get("n", 1)
    text, toks, lps, fin = [""] * n, [[] for _ in range(n)], [[] for _ in range(n)], [None] * n
    usage, errors, done = None, [], False
    async with client.stream("POST", url + path, json=body) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "error": (await r.aread()).decode()}
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if started is not None and not started:
                started.append(time.time())
            if line == "data: [DONE]":
                done = True
                continue
            j = json.loads(line[6:])
            if "error" in j:
                errors.append(j["error"])
                continue
            usage = j.get("usage") or usage
            for c in j.get("choices", []):
                i = c["index"]
                if fin[i] is not None:
                    errors.append(f"choice {i}: a chunk after its finish_reason")
                if path == "/v1/completions":
                    text[i] += c["text"]
                    if c.get("logprobs"):
                        toks[i] += c["logprobs"]["tokens"]
                        lps[i] += c["logprobs"]["token_logprobs"]
                else:
                    text[i] += c["delta"].get("content") or ""
                    for x in (c.get("logprobs") or {}).get("content") or []:
                        toks[i].append(x["token"])
                        lps[i].append(x["logprob"])
                fin[i] = c.get("finish_reason") or fin[i]
    if not done:
        errors.append("no [DONE]")
    return {"status": 200, "choices": list(zip(text, toks, lps, fin)), "usage": usage, "errors": errors}


def check(ref: dict, got: dict, tokens: int) -> list[str]:
    """How an answer differs from its reference (empty: the same): status, stream errors, text, tokens, logprobs,
    finish reason, `tokens` tokens a choice, and usage."""
    if got["status"] != 200:
        return [f"status {got['status']}: {got.get('error', '')[:300]}"]
    bad = [f"stream error: {e}" for e in got.get("errors", [])]
    for i, (a, b) in enumerate(zip(ref["choices"], got["choices"], strict=True)):
        if a[0] != b[0]:
            bad.append(f"choice {i} text {b[0]!r} != {a[0]!r}")
        if a[1] != b[1] or len(b[1]) != tokens:
            bad.append(f"choice {i}: tokens differ ({len(b[1])}, reference {len(a[1])}, asked {tokens})")
        if len(a[2]) != len(b[2]) or any(abs(x - y) > 1e-4 for x, y in zip(a[2], b[2])):
            bad.append(f"choice {i}: logprobs differ")
        if a[3] != b[3]:
            bad.append(f"choice {i}: finish {b[3]} != {a[3]}")
    u, r = got.get("usage") or {}, ref.get("usage") or {}
    if (u.get("prompt_tokens"), u.get("completion_tokens")) != (r.get("prompt_tokens"), r.get("completion_tokens")) \
            or u.get("completion_tokens") != tokens * len(got["choices"]):
        bad.append(f"usage {u}, reference {r}")
    return bad


async def run_workload(url: str, work, disturb=None) -> list[dict]:
    """The workload's answers (each with `done_s`, seconds from the start to its end); `disturb` (a coroutine
    function) starts once the first request has its first chunk."""
    started: list[float] = []
    t0 = time.time()
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        async def one(k, delay, path, body):
            await asyncio.sleep(delay)
            out = await call(client, url, path, body, started if k == 0 else None)
            out["done_s"] = time.time() - t0
            return out

        async def trigger():
            if disturb is not None:
                while not started:
                    await asyncio.sleep(0.01)
                await disturb()

        got = await asyncio.gather(*[one(k, *w) for k, w in enumerate(work)], trigger())
    return list(got[:-1])


def healthy_within(url: str, seconds: float) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return False


def stop_for(proc, seconds: float):
    """A `disturb` for run_workload: SIGSTOP `proc` for `seconds`."""
    async def disturb():
        proc.send_signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(seconds)
        finally:
            proc.send_signal(signal.SIGCONT)
    return disturb


# ---- tests ----------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(tiny_checkpoint):
    opts = ServeOptions(model=tiny_checkpoint, stages=2, port=free_port(),
                        extra={"max_num_batched_tokens": 64, "block_size": 16, "num_blocks": 128,
                               "ple_service": False, "heartbeat_timeout": HEARTBEAT_TIMEOUT})
    with Cluster(opts) as c:
        yield c


def test_a_stage_stopped_past_its_heartbeat_deadline_loses_no_work(cluster):
    """A stage stopped just past heartbeat_timeout while four requests run (greedy and seeded, n=2, logprobs,
    streamed and not, one arriving during the stop; two streams left during it). Its process ran all along, so it held every step in flight
    and every request's state: the engine core used to requeue all running requests anyway and recompute their
    prompts and outputs (QA: 2.4 s more on the demo model after a 3 s stop; under CPU starvation, at every late
    heartbeat). Now they wait: the same answers as on the idle cluster, nothing requeued, /health 200 again and
    every KV block and slot back."""
    tokens = 24
    work = workload(tokens)
    ref = asyncio.run(run_workload(cluster.url, work))
    assert all(r["status"] == 200 and not r.get("errors") for r in ref), ref
    before = metrics(cluster.url)["moepipe_requests_requeued"]
    stop = stop_for(cluster.procs["stage1"], HEARTBEAT_TIMEOUT + 0.8)

    async def stall_and_leave():
        """The stop, and two streams whose clients leave while it lasts: one that had a token before it, one sent
        during it (their blocks and slots must come back once the stage runs again)."""
        async with httpx.AsyncClient(timeout=TIMEOUT) as client:
            async def leave(prompt: str, after_s: float, first: asyncio.Event | None = None):
                body = {"model": "moepipe", "prompt": prompt, "max_tokens": 400, "ignore_eos": True, "stream": True}
                async with client.stream("POST", cluster.url + "/v1/completions", json=body) as r:
                    lines = r.aiter_lines()
                    while first is not None and not (await anext(lines)).startswith("data: {"):
                        pass
                    if first is not None:
                        first.set()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(_drain(lines), after_s)

            async def _drain(lines):
                async for _ in lines:
                    pass

            async def stop_when(first: asyncio.Event):
                await first.wait()
                await asyncio.gather(stop(), leave("left during the stop", 0.5))

            first = asyncio.Event()
            await asyncio.gather(stop_when(first), leave("left after a token", 1.0, first))

    got = asyncio.run(run_workload(cluster.url, work, stall_and_leave))
    bad = [f"request {k}: {b}" for k, (r, g) in enumerate(zip(ref, got)) for b in check(r, g, tokens)]
    assert not bad, "\n".join(bad)
    assert healthy_within(cluster.url, 10)
    assert settle_held(cluster.url, 15.0) == dict.fromkeys(HELD, 0.0)
    assert metrics(cluster.url)["moepipe_requests_requeued"] == before, "a late stage's requests were recomputed"
    assert not {n: p.returncode for n, p in cluster.procs.items() if p.poll() is not None}


def test_with_restarts_off_a_late_component_fails_no_request():
    """With restarts off (`--restart-limit 0`: recovery_timeout 0 in the core) a component past its heartbeat
    deadline failed every running and queued request at once, though its process still ran: QA stopped a stage of
    `moepipe serve --restart-limit 0` for 3.5 s and four of four requests failed (a stream's error event, three
    503s), as a loaded machine would make them. A late component is now waited for (`late_timeout`); only one
    whose process is gone fails them at once."""
    from shared.engine_core import EngineCore, EngineUnavailable, GenerationRequest, SchedulerLimits
    from shared.sampling import SamplingParams

    class Executor:
        late, gone = ["stage1"], []

        def lost(self) -> list[str]:
            return self.late + self.gone

        def down(self) -> list[str]:
            return self.gone

        def send(self, plan) -> None: ...

        def stop(self) -> None: ...

    ex = Executor()
    core = EngineCore(ex, SchedulerLimits(num_blocks=8, block_size=16, max_num_seqs=2, max_num_batched_tokens=64,
                                          num_microbatches=1, max_model_len=128, recovery_timeout=0.0))
    events: dict[str, list] = {"running": [], "queued": []}
    for rid in events:
        core.add(GenerationRequest(rid, [3, 4, 5], SamplingParams(max_tokens=4, temperature=0.0)),
                 events[rid].append)
        if rid == "running":
            assert core.scheduler.schedule(0) is not None
    assert core._watchdog() == [] and events == {"running": [], "queued": []}
    assert (core.scheduler.num_running, core.scheduler.num_waiting) == (1, 1)
    ex.late, ex.gone = [], ["stage1"]                 # its process is gone now: nothing will bring it back
    [plan] = core._watchdog()
    # (no token yet: both are answered 503, as the server stopping would)
    assert plan.dropped and all(isinstance(e[-1], EngineUnavailable) for e in events.values())
    core.stop()
