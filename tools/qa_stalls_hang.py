"""QA exploration: a stage (or the PLE service) stopped past `hang_timeout` under `moepipe serve`: the gateway kills
it, the launcher restarts it, and every request in flight or queued meanwhile must still end with the answer it gets
on an idle server: n>1 seeded sampling, prefix-cache hits, structured output, a forced tool call, the Responses API,
streamed and not; a stream cancelled during the stall must free its resources. Not collected by pytest.

    python tools/qa_stalls_hang.py [--victim stage1|stage0|ple] [--stages 2] [--ple] [--hang 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

from conftest import free_port, stop_server, wait_healthy
from soak import component_pids
from test_qa_stalls import IDLE, metrics, settle

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}, "required": ["a", "b"]}
TOOL = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}
SHARED = "You are a careful assistant. " * 30          # a long shared prefix: later requests hit the prefix cache


def requests() -> list[tuple[str, dict]]:
    chat = lambda k: [{"role": "system", "content": SHARED}, {"role": "user", "content": f"question {k}"}]  # noqa
    return [
        ("/v1/completions", {"prompt": SHARED + "one", "max_tokens": 40, "n": 3, "seed": 5, "temperature": 0.9,
                             "logprobs": 1, "ignore_eos": True}),
        ("/v1/chat/completions", {"messages": chat(1), "max_tokens": 30, "temperature": 0, "logprobs": True,
                                  "top_logprobs": 2, "ignore_eos": True}),
        ("/v1/chat/completions", {"messages": chat(2), "max_tokens": 40, "temperature": 0.7, "seed": 3,
                                  "response_format": {"type": "json_schema",
                                                      "json_schema": {"name": "x", "schema": SCHEMA}}}),
        ("/v1/chat/completions", {"messages": chat(3), "max_tokens": 40, "temperature": 0.7, "seed": 4,
                                  "tools": [TOOL], "tool_choice": "required", "n": 2}),
        ("/v1/responses", {"input": f"{SHARED} question 4", "max_output_tokens": 30, "temperature": 0}),
        ("/v1/chat/completions", {"messages": chat(5), "max_tokens": 40, "temperature": 0.8, "seed": 6,
                                  "stream": True, "n": 2, "ignore_eos": True}),
        ("/v1/completions", {"prompt": SHARED + "six", "max_tokens": 40, "temperature": 0, "stream": True,
                             "logprobs": 2, "ignore_eos": True}),
    ]


def fold(path: str, body: dict, status: int, chunks: list[str], text: str) -> object:
    """A comparable answer: the JSON body's choices / output, or a stream's folded deltas per choice."""
    if status != 200:
        return ("status", status, text[:300])
    if not body.get("stream"):
        j = json.loads(text)
        if path == "/v1/responses":
            return [o.get("content") or o.get("arguments") for o in j["output"]]
        out = []
        for c in sorted(j["choices"], key=lambda c: c["index"]):
            if path == "/v1/completions":
                out.append((c["text"], [round(x, 3) for x in c["logprobs"]["token_logprobs"]], c["finish_reason"]))
            else:
                m = c["message"]
                out.append((m.get("content"), json.dumps([t["function"] for t in m.get("tool_calls") or []]),
                            [round(x["logprob"], 3) for x in (c.get("logprobs") or {}).get("content") or []],
                            c["finish_reason"]))
        return [out, j["usage"]["completion_tokens"]]
    per: dict[int, list] = {}
    done = False
    for data in chunks:
        if data == "[DONE]":
            done = True
            continue
        j = json.loads(data)
        if "error" in j:
            return ("error event", j)
        for c in j.get("choices", []):
            d = c.get("delta") or {}
            per.setdefault(c["index"], []).append(c.get("text") or d.get("content") or "")
            if c.get("logprobs") and c["logprobs"].get("token_logprobs"):
                per[c["index"]] += [round(x, 3) for x in c["logprobs"]["token_logprobs"]]
    return [done, {k: "".join(map(str, v)) for k, v in sorted(per.items())}]


async def send(client, url, path, body, cancel_after: int | None = None):
    body = {"model": "moepipe", **body}
    if not body.get("stream"):
        r = await client.post(url + path, json=body)
        return fold(path, body, r.status_code, [], r.text)
    chunks = []
    async with client.stream("POST", url + path, json=body) as r:
        if r.status_code != 200:
            return fold(path, body, r.status_code, [], (await r.aread()).decode())
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                chunks.append(line[6:])
                if cancel_after is not None and len(chunks) >= cancel_after:
                    return "cancelled"
    return fold(path, body, 200, chunks, "")


async def run(url, stop=None):
    async with httpx.AsyncClient(timeout=180) as client:
        reqs = requests()
        if stop is None:
            return [await send(client, url, p, b) for p, b in reqs]      # alone: the reference

        async def later(k, p, b):
            await asyncio.sleep(0.3 * k)
            return await send(client, url, p, b)

        async def cancelled():
            return await send(client, url, "/v1/completions", {"prompt": SHARED + "left", "max_tokens": 400,
                                                               "stream": True, "ignore_eos": True}, cancel_after=12)

        stop()
        got = await asyncio.gather(*[later(k, p, b) for k, (p, b) in enumerate(reqs)], cancelled())
        return got[:-1]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--victim", default="stage1")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--ple", action="store_true")
    ap.add_argument("--hang", default="4")
    ap.add_argument("--model", default="tiny")
    args = ap.parse_args()
    if args.model == "tiny":
        from stage_worker.checkpoint.make_model import make_model
        model = make_model("tiny", Path(tempfile.mkdtemp(prefix="qa-hang-")), seed=0)
    else:
        model = ROOT / "shared" / "demo_model" if args.model == "demo" else Path(args.model)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(tempfile.mkdtemp(prefix="qa-hang-log-")) / "serve.log"
    cmd = [sys.executable, "-m", "shared.cli", "serve", "--model", str(model), "--stages", str(args.stages),
           "--port", str(port), "--max-num-batched-tokens", "64"] + ([] if args.ple else ["--no-ple-service"])
    with open(log, "w") as err:
        launcher = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True,
                                    env={**os.environ, "MOEPIPE_HANG_TIMEOUT": args.hang})
    try:
        wait_healthy(url, launcher)
        ref = asyncio.run(run(url))
        ref2 = asyncio.run(run(url))               # cached prefixes now: must not change a thing
        assert ref == ref2, "the prefix cache changed an answer"
        before = metrics(url)
        pid = component_pids(launcher.pid)[args.victim]
        t0 = time.time()
        got = asyncio.run(run(url, lambda: os.kill(pid, signal.SIGSTOP)))
        took = time.time() - t0
        new = component_pids(launcher.pid).get(args.victim)
        held = settle(url, 20)
        after = metrics(url)
        bad = [(k, r, g) for k, (r, g) in enumerate(zip(ref, got)) if r != g]
        print(f"victim {args.victim} (pid {pid} -> {new}) stopped past hang_timeout {args.hang} s: "
              f"{len(ref) - len(bad)}/{len(ref)} answers the same in {took:.1f} s; held {held}; requeued "
              f"{after['moepipe_requests_requeued'] - before['moepipe_requests_requeued']:.0f}; "
              f"cache hits {after.get('moepipe_prefix_cache_hits_total', 0) - before.get('moepipe_prefix_cache_hits_total', 0):.0f}")
        for k, r, g in bad:
            print(f"  request {k}:\n    reference {str(r)[:400]}\n    got       {str(g)[:400]}")
        errs = [ln for ln in log.read_text().splitlines() if " ERROR " in ln or "Traceback" in ln]
        for e in errs[:10]:
            print("  log:", e[:300])
        return 1 if bad or any(held[k] for k in IDLE) or new in (None, pid) else 0
    finally:
        for p in component_pids(launcher.pid).values():
            try:
                os.kill(p, signal.SIGCONT)
            except OSError:
                pass
        stop_server(launcher)
        print("log:", log)


if __name__ == "__main__":
    sys.exit(main())
