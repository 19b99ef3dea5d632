"""`device_sampling` on a real 2-stage cluster (the batched sampler of stage_worker/batch_sampler.py on the last
stage): greedy tokens and logprobs equal the per-row sampler's, seeded requests reproduce when batched with others
and alone, and grammar masks still hold (the unit tests in test_batch_sampler.py cover every parameter)."""

from __future__ import annotations

import dataclasses
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import small_cluster, small_cluster_options
from gateway.launcher import Cluster

PROMPTS = ["The quick brown fox", "def parse(argv):", "Once upon a time"]


def _complete(url: str, **body) -> dict:
    r = httpx.post(url + "/v1/completions", json={"model": "moepipe", "max_tokens": 12, **body}, timeout=120,
                   verify=False)
    assert r.status_code == 200, r.text
    return r.json()


def _run(url: str) -> dict:
    out = {}
    out["greedy"] = [_complete(url, prompt=p, temperature=0, logprobs=2) for p in PROMPTS]
    with ThreadPoolExecutor(3) as pool:    # three streams in one step: each draw its own
        out["seeded"] = list(pool.map(lambda p: _complete(url, prompt=p, temperature=0.9, seed=11), PROMPTS))
    out["again"] = _complete(url, prompt=PROMPTS[0], temperature=0.9, seed=11)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": "moepipe", "max_tokens": 40, "temperature": 0.8, "seed": 3,
        "messages": [{"role": "user", "content": "a number"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}, verify=False)
    assert r.status_code == 200, r.text
    out["json"] = r.json()["choices"][0]["message"]["content"]
    return out


@pytest.fixture(scope="module")
def both(tiny_checkpoint):
    """_run on the small cluster with device_sampling off, and on: the default, so the "api" group's shared
    small_cluster (conftest.SHARED_GROUPS)."""
    opts = small_cluster_options(tiny_checkpoint)
    opts = dataclasses.replace(opts, extra=dict(opts.extra, device_sampling=False))
    with Cluster(opts) as c:
        assert not c.cluster.device_sampling
        results = {False: _run(c.url)}
    on = small_cluster(tiny_checkpoint)
    assert on.cluster.device_sampling
    results[True] = _run(on.url)
    return results


def test_greedy_tokens_and_logprobs_equal_the_per_row_sampler(both):
    for off, on in zip(both[False]["greedy"], both[True]["greedy"]):
        a, b = off["choices"][0], on["choices"][0]
        assert a["text"] == b["text"]
        assert a["logprobs"]["token_logprobs"] == pytest.approx(b["logprobs"]["token_logprobs"], abs=1e-4)


def test_seeded_draws_reproduce_and_structured_output_still_holds(both):
    on = both[True]
    assert on["again"]["choices"][0]["text"] == on["seeded"][0]["choices"][0]["text"]
    texts = [r["choices"][0]["text"] for r in on["seeded"]]
    assert len(set(texts)) == len(texts)
    assert isinstance(json.loads(on["json"])["n"], int)
    assert isinstance(json.loads(both[False]["json"])["n"], int)
