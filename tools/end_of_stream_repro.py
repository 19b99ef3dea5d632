"""The h100-32 call 5 request shape against a running server: three streams, then a fourth started once the first
three have a few tokens, so that at the end the fourth decodes alone (the batch shrinks from 4 rows to 1 for the
first time in the server's life when the server is fresh). That server, one full-shape stage on an H100 with every
launch-ahead switch on, stopped all four streams at tokens 255, 255, 255 and 253 of 256 for 113 s with nothing
logged; the same command had run fine three times, none of which had a batch of one (the access logs' TTFTs).

    moepipe serve --model /tmp/fs2 --load-format dummy --device cuda --stages 1 --port 8000 &
    python tools/end_of_stream_repro.py --url http://127.0.0.1:8000 --rounds 3

Each round prints every stream's token count and time; a round that has not finished `--stall` seconds after its
last token is reported as stalled (the engine core's stall report, `stall_report_timeout` 60 s, logs the step and
every component's stacks meanwhile: run it with the server's log in view, and wait past host_wait's MAX_SPINS, see
tools/host_wait_probe.py, before killing anything). Only a fresh server's first round reaches a batch of one without
having sampled one before; later rounds repeat the shape."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

PROMPTS = ["Write a Python function that merges two sorted lists.",
           "Explain what a mixture-of-experts layer does, in two sentences.",
           "List three uses of a hash map in a compiler.",
           "def quicksort(xs):"]


async def stream(client, model: str, prompt: str, max_tokens: int, seed: int, state: dict, name: str) -> None:
    state[name] = {"tokens": 0, "last": time.perf_counter(), "done": False, "finish": None}
    s = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.7,
                                        seed=seed, stream=True, stream_options={"include_usage": True},
                                        extra_body={"ignore_eos": True})
    async for chunk in s:
        st = state[name]
        if chunk.choices:
            st["last"] = time.perf_counter()
            st["chunks"] = st.get("chunks", 0) + 1
            if chunk.choices[0].finish_reason:
                st["finish"] = chunk.choices[0].finish_reason
        if chunk.usage is not None:
            st["tokens"] = chunk.usage.completion_tokens
    state[name]["done"] = True


async def one_round(url: str, model: str, max_tokens: int, late_chunks: int, stall: float) -> bool:
    """True if every stream finished; False if they stalled for `stall` s."""
    from openai import AsyncOpenAI

    state: dict = {}
    async with AsyncOpenAI(base_url=url + "/v1", api_key="x", timeout=3600) as client:
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(stream(client, model, PROMPTS[i], max_tokens, 1000 + i, state, f"s{i}"))
                 for i in range(3)]
        while not all(state.get(f"s{i}", {}).get("chunks", 0) >= late_chunks for i in range(3)):
            await asyncio.sleep(0.001)
        tasks.append(asyncio.create_task(stream(client, model, PROMPTS[3], max_tokens, 1003, state, "late")))
        while not all(t.done() for t in tasks):
            await asyncio.sleep(0.5)
            quiet = time.perf_counter() - max(st["last"] for st in state.values())
            if quiet > stall:
                print(f"  STALLED: no chunk for {quiet:.0f} s, {time.perf_counter() - t0:.0f} s into the round; "
                      "chunks so far " + ", ".join(f"{k} {st.get('chunks', 0)}" for k, st in state.items()))
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                return False
        await asyncio.gather(*tasks, return_exceptions=True)
    print("  " + ", ".join(f"{k}: {st['tokens']} tokens, {st['finish']}" for k, st in state.items())
          + f" in {time.perf_counter() - t0:.1f} s")
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model-name", default="moepipe")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--late-chunks", type=int, default=2, help="chunks each of the first three has before the fourth")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--stall", type=float, default=300.0, help="seconds without a chunk that count as a stall")
    args = ap.parse_args()
    for r in range(args.rounds):
        print(f"round {r + 1}")
        if not asyncio.run(one_round(args.url, args.model_name, args.max_tokens, args.late_chunks, args.stall)):
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
