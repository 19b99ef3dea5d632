"""Cancellation on a GPU cluster (GPU only): stages skip the steps whose requests were all cancelled
(`Plan.cancelled`, `Activations.skipped`, tests/test_cancel_prefill.py on the CPU) while decode graphs, steps
launched ahead (`ple_launch_ahead`, across stages with `ple_launch_ahead_across_stages`) and the CUDA IPC handoff
run. A storm of clients leaving at random moments (mid-prefill of long prompts in small chunks, mid-decode) beside
requests that stay: the ones that stay finish with all their tokens, no stage fails a step, blocks and slots come
back, and afterwards each prompt served alone gives the greedy tokens and logprobs it gave before the storm (a
skipped step that left a graph reading a freed slot, or a launched-ahead step waiting for a token nobody sends,
shows there or as a timeout)."""

from __future__ import annotations

import asyncio
import json
import random
import re
import sys
import time

import httpx
import pytest
import torch

from conftest import free_port, metric

DEVICE = "cuda"             # the module's device (a CPU run of the same storm: set it to "cpu" by hand)
LONG = 3000                 # tokens of a victim's long prompt: 12 chunks of CHUNK
CHUNK = 256


def _prompt(seed: int, n: int) -> list[int]:
    return [3 + (seed * 131 + i * 7) % 2000 for i in range(n)]


async def _complete(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int,
                    stream: bool = False) -> tuple[list[str], list[float], str]:
    """Greedy completion: (tokens, logprobs, finish_reason)."""
    body = {"model": "moepipe", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1,
            "ignore_eos": True, "stream": stream}
    if not stream:
        r = await client.post(url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        return c["logprobs"]["tokens"], c["logprobs"]["token_logprobs"], c["finish_reason"]
    tokens, lps, finish = [], [], ""
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                c = json.loads(line[6:])["choices"][0]
                if c.get("logprobs"):
                    tokens += c["logprobs"]["tokens"]
                    lps += c["logprobs"]["token_logprobs"]
                finish = c.get("finish_reason") or finish
    return tokens, lps, finish


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() != 1, reason="needs exactly one GPU")
@pytest.mark.parametrize("stages,extra", [(1, {}), (2, {}), (2, {"ple_launch_ahead_across_stages": True})])
def test_clients_leaving_at_random_keep_the_others_and_the_state_intact(stages, extra, tmp_path, capfd):
    from gateway.launcher import Cluster, ServeOptions
    from stage_worker.checkpoint.make_model import make_model

    model = make_model("tiny", tmp_path / "tiny", seed=0)
    rng = random.Random(7)
    stayers = [_prompt(100 + i, 5 + 3 * i) for i in range(4)]
    opts = ServeOptions(model=model, stages=stages, device=DEVICE, port=free_port(), verbose=True,
                        extra={"max_num_batched_tokens": CHUNK, "enable_prefix_caching": False, **extra})
    try:
        with Cluster(opts) as cluster:
            url = cluster.url

            async def storm() -> tuple[list, list, list]:
                async with httpx.AsyncClient(timeout=120) as client:
                    before = [await _complete(client, url, p, 24) for p in stayers]
                    stay = [asyncio.ensure_future(_complete(client, url, p, 48, stream=i % 2 == 0))
                            for i, p in enumerate(stayers)]
                    victims = []
                    for i in range(16):
                        long = i % 2 == 0
                        prompt = _prompt(200 + i, LONG if long else 12)
                        victims.append(asyncio.ensure_future(
                            _complete(client, url, prompt, 1 if long else 400, stream=i % 3 != 0)))
                        await asyncio.sleep(rng.uniform(0.0, 0.15))
                        if rng.random() < 0.8:
                            victims[rng.randrange(len(victims))].cancel()
                    await asyncio.sleep(0.3)
                    for v in victims:
                        v.cancel()             # every victim's client leaves (a finished one is not affected)
                    await asyncio.gather(*victims, return_exceptions=True)
                    during = await asyncio.gather(*stay)
                    after = [await _complete(client, url, p, 24) for p in stayers]
                    return before, during, after

            before, during, after = asyncio.run(storm())
            for tokens, _, finish in during:
                assert len(tokens) == 48 and finish == "length"
            for (bt, bl, _), (at, al, _) in zip(before, after):
                assert at == bt
                assert max(abs(x - y) for x, y in zip(al, bl) if x is not None and y is not None) < 1e-3
            end = time.time() + 10
            while time.time() < end and (metric(url, "moepipe_kv_blocks_used") > 0
                                         or metric(url, "moepipe_state_slots_used") > 0):
                time.sleep(0.05)
            assert metric(url, "moepipe_kv_blocks_used") == 0
            assert metric(url, "moepipe_state_slots_used") == 0
            assert metric(url, "moepipe_requests_running") == 0
    except Exception:
        err = capfd.readouterr().err
        with capfd.disabled():
            print(err[-6000:], file=sys.stderr)
        raise
    err = capfd.readouterr().err
    assert not re.search(r"failed step|step \d+ failed", err), err[-4000:]
