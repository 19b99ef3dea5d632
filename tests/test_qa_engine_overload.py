"""Overload of a `moepipe serve --stages 2` cluster whose KV pool holds one long request at a time: concurrent
requests must all finish with the tokens each gets alone, without the scheduler throwing work away over and over."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from conftest import free_port, metric
from gateway.launcher import Cluster, ServeOptions

BLOCK = 16
NUM_BLOCKS = 12              # 192 tokens: one of the long prompts below (and its answer) at a time


@pytest.fixture(scope="module")
def cluster(tiny_checkpoint):
    opts = ServeOptions(model=tiny_checkpoint, stages=2, port=free_port(),
                        extra={"max_num_batched_tokens": 32, "block_size": BLOCK, "num_blocks": NUM_BLOCKS,
                               "max_num_seqs": 8, "ple_service": False})
    with Cluster(opts) as c:
        yield c


async def _complete(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> str:
    r = await client.post(url + "/v1/completions", json={"model": "moepipe", "prompt": prompt,
                                                         "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_requests_the_pool_holds_one_at_a_time_do_not_thrash(cluster):
    """Pairs of prompts of ~165 tokens (and 16 more each) in a 192-token pool, each pair sent together. Each
    request preempted the other whenever the other's micro-batch was not computing (a younger request could evict
    an older one), so each threw the other's prefill away again and again: 27 to 72 preemptions for one pair on
    the tiny model, and on the demo model 641 preemptions and 80 s for what takes 1.3 s one after the other. Now a
    request only preempts younger ones: the older finishes, then the younger runs (2 preemptions a pair: each
    admission of the younger one while the older still grows)."""
    url = cluster.url
    rounds = [[f"alpha beta gamma {2 * r + i} " * 16 for i in range(2)] for r in range(4)]

    async def run():
        async with httpx.AsyncClient(timeout=120, verify=False) as client:
            out = []
            for prompts in rounds:
                solo = [await _complete(client, url, p, 16) for p in prompts]
                before = metric(url, "moepipe_preemptions")
                together = await asyncio.gather(*[_complete(client, url, p, 16) for p in prompts])
                out.append((solo, together, metric(url, "moepipe_preemptions") - before))
            return out

    results = asyncio.run(run())
    for solo, together, _ in results:
        assert together == solo
    preemptions = [n for _, _, n in results]
    assert sum(preemptions) <= 4 * len(rounds), f"preemptions per pair: {preemptions}"
    assert metric(url, "moepipe_kv_blocks_used") == 0


def test_a_request_never_preempts_an_older_one():
    """The same race without processes: B (younger) needs a block while A (older) waits for B's step; B must wait
    for A, not preempt it (it did: then A, admitted again, preempted B, and so on)."""
    from shared.protocol import TokenOut
    from shared.sampling import SamplingParams
    from shared.scheduler import Request, Scheduler

    sched = Scheduler(num_blocks=4, block_size=4, max_num_seqs=4, max_num_batched_tokens=8, num_microbatches=2,
                      max_model_len=16)
    a, b = (Request(req_id=name, prompt_ids=list(range(3, 15)), params=SamplingParams(), stop_token_ids=set(),
                    max_tokens=2) for name in "ab")
    sched.add(a)
    sched.add(b)
    first = [sched.schedule(0), sched.schedule(1)]          # A's and B's first 8 tokens: every block is taken
    assert [[e.req_id for e in p.entries] for p in first] == [["a"], ["b"]]
    sched.on_result(0, [])
    assert sched.schedule(0) is None                        # A needs a block; B's step still holds its blocks
    sched.on_result(1, [])
    plan = sched.schedule(1)                                # B needs a block; only the older A could give one
    assert plan is None or not plan.entries
    assert set(sched.running) == {"a", "b"} and sched.num_preemptions == 0
    plan = sched.schedule(0)                                # A takes B's blocks
    assert [e.req_id for e in plan.entries] == ["a"] and [r.req_id for r in sched.waiting] == ["b"]
    sched.on_result(0, [TokenOut("a", 12, 7)])
