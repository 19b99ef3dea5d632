"""Decode steps of several sequences do not wait for the PLE service (issue 14, h200-16: `ple_wait_fraction` 0.149 at
4 streams). With `ple_decode_in_stage_max_seqs` at 2, every decode step of 3 or more sequences waited for the
service's round trip after its sampled token (stage -> service: hash, gather into the ring -> stage), ~1.3 ms a step
on the H200 and ~2 ms on this CPU; now (0: no cap) a PLE stage gathers every decode step's rows itself, and
`moepipe_ple_stage_decode_wait_seconds_total` says how long decode steps still waited.

First step by step (a StageRunner and a socket-free PleService sharing a ring, the decode steps' PleReady withheld),
then the real processes: `moepipe serve --stages 1` with its PLE service, four prompts decoding together, the
stage's counters read from /metrics, once with the default and once with the former cap."""

from __future__ import annotations

import time

import pytest

from conftest import OpenAI, free_port, metric
from gateway.launcher import Cluster, ServeOptions
from ple_service.service import PleService
from shared.cluster_config import ClusterConfig, ClusterConfigError, StageSpec
from shared.model_config import load_config
from shared.protocol import Plan, SamplingSpec, SeqEntry
from stage_worker.checkpoint.loader import load_model
from stage_worker.runner import StageRunner

PROMPTS = {"a": [5, 17, 300, 2, 2, 9, 1000], "b": [44, 45, 46, 47, 48, 1, 2, 3, 90], "c": [7, 7, 7],
           "d": [900, 901, 902, 903, 904, 905]}
STEPS = 4


def _cluster(model, tmp, **kw) -> ClusterConfig:
    cfg = load_config(model)
    stages = [StageSpec(0, cfg.num_hidden_layers, f"ipc://{tmp}/s0.sock")]
    cluster = ClusterConfig(model=str(model), stages=stages, gateway_endpoint=f"ipc://{tmp}/gw.sock",
                            ple_endpoint=f"ipc://{tmp}/ple.sock", ple_ring=str(tmp / "ple.ring"),
                            max_num_batched_tokens=64, block_size=16, num_blocks=16, max_num_seqs=4, **kw)
    return cluster.for_model(cfg)


def test_the_default_gathers_every_decode_step_in_the_stage(tiny_checkpoint, tmp_path):
    """Four sequences decoding together run every decode step without the service's PleReady (withheld here), and
    no decode step counts as waiting; the prefill step's rows still come from the service."""
    cluster = _cluster(tiny_checkpoint, tmp_path)
    assert cluster.ple_decode_in_stage and cluster.ple_decode_in_stage_max_seqs == 0
    svc = PleService(tiny_checkpoint, load_config(tiny_checkpoint), cluster)
    runner = StageRunner(load_model(tiny_checkpoint), cluster, 0, svc.ring)
    try:
        specs = [SamplingSpec(r, 0.0, 1.0, 0, 0.0, 0.0, 0.0, 1.0, None, 1, prompt_ids=p) for r, p in PROMPTS.items()]
        entries = [SeqEntry(r, i, 0, len(p), [i], tokens=p, sample=True) for i, (r, p) in enumerate(PROMPTS.items())]
        plans = [Plan(step=0, microbatch=0, new_requests=specs, entries=entries)]
        plans += [Plan(step=s, microbatch=0, entries=[SeqEntry(r, i, len(p) + s - 1, 1, [], sample=True)
                                                      for i, (r, p) in enumerate(PROMPTS.items())])
                  for s in range(1, STEPS + 1)]
        tokens = 0
        for plan in plans:
            runner.on_message(plan)
            ready = svc.on_plan(plan)
            if plan.step == 0:
                assert runner.ready() is None            # the prompts' rows: the service's
                for msg in ready:
                    runner.on_message(msg)
            assert runner.ready() is plan                # decode steps: ready without any PleReady
            for out in runner.run(plan):
                if out.to == "ple":
                    svc.on_sampled(out.message)          # its PleReady for the next step is never delivered
                elif out.to == "gateway":
                    tokens += len(out.message.tokens)
        stats = runner.stats()
    finally:
        svc.close()
    assert tokens == len(PROMPTS) * (STEPS + 1)
    assert stats["ple_stage_gathers"] == STEPS
    assert stats["ple_decode_wait_seconds"] == 0.0
    assert stats["ple_wait_seconds"] > 0.0               # the prefill step did wait for the service


def test_the_cap_still_switches_larger_steps_to_the_service(tiny_checkpoint, tmp_path):
    """`ple_decode_in_stage_max_seqs` = 2 (the former default): a 4-sequence decode step waits for the service's rows,
    and that wait counts as a decode step's; negative caps are refused."""
    cluster = _cluster(tiny_checkpoint, tmp_path, ple_decode_in_stage_max_seqs=2)
    svc = PleService(tiny_checkpoint, load_config(tiny_checkpoint), cluster)
    runner = StageRunner(load_model(tiny_checkpoint), cluster, 0, svc.ring)
    try:
        specs = [SamplingSpec(r, 0.0, 1.0, 0, 0.0, 0.0, 0.0, 1.0, None, 1, prompt_ids=p) for r, p in PROMPTS.items()]
        entries = [SeqEntry(r, i, 0, len(p), [i], tokens=p, sample=True) for i, (r, p) in enumerate(PROMPTS.items())]
        prefill = Plan(step=0, microbatch=0, new_requests=specs, entries=entries)
        decode = Plan(step=1, microbatch=0, entries=[SeqEntry(r, i, len(p), 1, [], sample=True)
                                                     for i, (r, p) in enumerate(PROMPTS.items())])
        runner.on_message(prefill)
        for msg in svc.on_plan(prefill):
            runner.on_message(msg)
        runner.on_message(decode)
        assert svc.on_plan(decode) == []                 # the service waits for the sampled tokens
        later = []
        for out in runner.run(runner.ready()):
            if out.to == "ple":
                later = svc.on_sampled(out.message)
        assert runner.ready() is None                    # the 4-sequence step waits for the service's rows
        time.sleep(0.01)
        for msg in later:
            runner.on_message(msg)
        assert runner.ready() is decode
        runner.run(decode)
        stats = runner.stats()
    finally:
        svc.close()
    assert stats["ple_stage_gathers"] == 0
    assert stats["ple_decode_wait_seconds"] >= 0.01
    with pytest.raises(ClusterConfigError, match="ple_decode_in_stage_max_seqs"):
        _cluster(tiny_checkpoint, tmp_path, ple_decode_in_stage_max_seqs=-1)


@pytest.mark.parametrize("cap", [0, 2])
def test_served_streams_decode_without_waiting_for_the_service(tiny_checkpoint, cap):
    """The real processes (gateway, one stage worker, the PLE service; ipc sockets, the shared-memory ring): four
    prompts in one request decode together. By default the stage gathers every decode step's rows and no decode
    step waits; with the former cap of 2 sequences the same run's 4-sequence decode steps wait for the service's
    round trip (what h200-16 measured as 15% of the 4-stream run)."""
    max_tokens = 12
    opts = ServeOptions(model=tiny_checkpoint, stages=1, port=free_port(),
                        extra={"max_num_batched_tokens": 64, "block_size": 16, "num_blocks": 128,
                               "ple_decode_in_stage_max_seqs": cap})
    with Cluster(opts) as c:
        assert c.cluster.ple_service and c.cluster.ple_endpoint
        client = OpenAI(base_url=c.url + "/v1", api_key="x")
        out = client.completions.create(model="moepipe", prompt=["def add(a, b):", "The quick brown fox", "x = 1",
                                                                 "import numpy as np"],
                                        max_tokens=max_tokens, temperature=0.0, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 4 * max_tokens
        # The stage's totals arrive with its heartbeats (every 0.5 s): wait for the one after the last step.
        deadline = time.time() + 10
        while time.time() < deadline:
            gathers = metric(c.url, "moepipe_ple_stage_gathers_total")
            waited = metric(c.url, "moepipe_ple_stage_decode_wait_seconds_total")
            if (gathers >= max_tokens - 1) if cap == 0 else waited > 0:
                break
            time.sleep(0.2)
        time.sleep(1.0)                                   # one more heartbeat: the counters are final
        gathers = metric(c.url, "moepipe_ple_stage_gathers_total")
        waited = metric(c.url, "moepipe_ple_stage_decode_wait_seconds_total")
        total_wait = metric(c.url, "moepipe_ple_stage_wait_seconds_total")
    if cap == 0:
        assert gathers >= max_tokens - 1                  # every decode step of the longest stream, at least
        assert waited == 0.0                              # no decode step waited for the service
    else:
        assert gathers < max_tokens - 1                   # the 4-sequence steps took the service's rows...
        assert waited > 0.0 and total_wait >= waited      # ... and waited for them
