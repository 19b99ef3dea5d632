"""A cancelled request stops costing the pipeline at once: no chunk of it is planned after the cancel, and a step in
flight whose entries are all cancelled requests is skipped by every stage that has not started it (`Plan.cancelled`,
`Activations.skipped`), while its blocks stay allocated until the plans holding them are back.

Measured before the fix: a 21k-token prompt with --max-num-batched-tokens 8192, cancelled by its client after 2 s,
kept the pipeline busy 6.6 s more (its chunk planned ahead ran on every stage, and a CPU stage computed both plans
in flight back to back before reading its inbox), so other requests waited for a dead prompt.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from conftest import free_port, metric
from gateway.launcher import Cluster, ServeOptions
from shared.protocol import Activations, Plan, Sampled, StepResult, TokenOut
from shared.sampling import SamplingParams
from shared.scheduler import Request, Scheduler

LONG = 8000                  # prompt tokens of the long request (the tiny checkpoint serves 8192)
CHUNK = 2736                 # --max-num-batched-tokens: the long prompt is three chunks, two of them in flight
BLOCK = 16


@pytest.fixture(scope="module")
def cluster(tiny_checkpoint):
    opts = ServeOptions(model=tiny_checkpoint, stages=2, port=free_port(),
                        extra={"max_num_batched_tokens": CHUNK, "block_size": BLOCK, "num_blocks": 1400,
                               "max_num_seqs": 4, "ple_service": False})
    with Cluster(opts) as c:
        yield c


def _prompt(seed: int, n: int) -> list[int]:
    """Token ids no other prompt of the module starts with (the prefix cache would serve a shared start)."""
    return [3 + (seed * 131 + i * 7) % 2000 for i in range(n)]


async def _complete(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int, stream: bool) -> str:
    body = {"model": "moepipe", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "ignore_eos": True}
    if not stream:
        r = await client.post(url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    import json

    text = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                text.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(text)


@pytest.mark.parametrize("stream", [True, False])
def test_a_cancelled_prefill_stops_holding_the_pipeline(cluster, stream):
    """The long prompt uncancelled is the baseline; then another long prompt, its client gone 10% into it (the
    connection closed: a streamed request too, before any token), and a short request sent at once must finish in
    well under what was left of the long prefill. Before the fix it waited for the chunks in flight: 0.84-0.91 s
    of the 1.1-1.5 s left (2 stages on the 2-core VM, 3 chunks of 2736 tokens); now 0.17-0.20 s (the rest of the
    chunk stage 0 is computing)."""
    url = cluster.url
    seed = 10 if stream else 20
    short = _prompt(seed + 1, 8)

    async def run() -> tuple[float, float, float, str, str]:
        async with httpx.AsyncClient(timeout=120) as client:
            alone = await _complete(client, url, short, 4, stream)
            t = time.perf_counter()
            await _complete(client, url, _prompt(seed + 2, LONG), 1, stream)
            full = time.perf_counter() - t
            task = asyncio.ensure_future(_complete(client, url, _prompt(seed + 3, LONG), 1, stream))
            delay = 0.1 * full
            await asyncio.sleep(delay)
            task.cancel()                     # the client goes away: httpx closes the connection
            await asyncio.gather(task, return_exceptions=True)
            t = time.perf_counter()
            after_text = await _complete(client, url, short, 4, stream)
            return full, delay, time.perf_counter() - t, alone, after_text

    full, delay, after, alone, after_text = asyncio.run(run())
    left = full - delay                      # what the long prefill still had to run, uncancelled
    print(f"uncancelled prefill {full:.2f} s; cancelled after {delay:.2f} s; short request after it {after:.3f} s")
    assert after_text == alone
    assert after < 0.4 * left, f"short request {after:.2f} s after the cancel; the prefill had {left:.2f} s left " \
                               f"(uncancelled prompt: {full:.2f} s)"
    # The cancelled request's blocks and slot come back once its steps in flight are (skipped and) back.
    deadline = time.time() + 10
    while time.time() < deadline and (metric(url, "moepipe_kv_blocks_used") > 0
                                      or metric(url, "moepipe_state_slots_used") > 0):
        time.sleep(0.05)
    assert metric(url, "moepipe_kv_blocks_used") == 0
    assert metric(url, "moepipe_state_slots_used") == 0
    assert metric(url, "moepipe_requests_running") == 0


# ---- the rule, without processes ------------------------------------------------------------------------------------

def _request(rid: str, n: int, max_tokens: int = 4) -> Request:
    return Request(req_id=rid, prompt_ids=list(range(3, 3 + n)), params=SamplingParams(temperature=0.0, seed=1),
                   stop_token_ids=set(), max_tokens=max_tokens)


def test_the_scheduler_plans_nothing_more_of_a_cancelled_request_and_frees_it_late():
    sched = Scheduler(num_blocks=32, block_size=16, max_num_seqs=4, max_num_batched_tokens=32, num_microbatches=1,
                      max_model_len=256, plan_ahead=True)
    sched.add(_request("x", 128))
    p0, p1 = sched.schedule(0), sched.schedule(0)           # two chunks in flight (plan-ahead)
    assert [e.context_len for e in p0.entries + p1.entries] == [0, 32]
    assert not sched.idle_microbatches()
    sched.cancel("x")
    assert sched.take_cancelled() == ["x"] and sched.take_cancelled() == []
    held = sched.blocks.used_blocks
    assert held == 4 and sched.blocks.used_slots == 1        # the plans in flight still write them
    sched.on_result(0, [])
    assert sched.blocks.used_blocks == held and "x" in sched.draining
    nxt = sched.schedule(0)
    assert nxt is None                                       # no chunk of x, and nothing to tell yet
    sched.on_result(0, [])
    assert sched.blocks.used_blocks == 0 and sched.blocks.used_slots == 0 and not sched.draining
    assert sched.take_cancelled() == []
    nxt = sched.schedule(0)
    assert nxt.entries == [] and nxt.finished == ["x"]


def test_with_skip_cancelled_steps_off_nothing_is_sent_early_and_blocks_are_still_freed_late():
    """`skip_cancelled_steps` off (the A/B switch): the stages hear of the cancel only through `finished`, once the
    plans in flight came back, and compute those steps as before."""
    sched = Scheduler(num_blocks=32, block_size=16, max_num_seqs=4, max_num_batched_tokens=32, num_microbatches=1,
                      max_model_len=256, plan_ahead=True, skip_cancelled=False)
    sched.add(_request("x", 128))
    sched.schedule(0), sched.schedule(0)
    sched.cancel("x")
    assert sched.take_cancelled() == [] and "x" in sched.draining
    assert sched.blocks.used_blocks == 4
    sched.on_result(0, [])
    sched.on_result(0, [])
    assert sched.blocks.used_blocks == 0 and not sched.draining
    nxt = sched.schedule(0)
    assert nxt.entries == [] and nxt.finished == ["x"] and nxt.cancelled == []


def test_the_switch_reaches_the_scheduler_and_the_cpu_stage_loop(tiny_checkpoint, monkeypatch):
    """MOEPIPE_SKIP_CANCELLED_STEPS=0 turns both halves off: the scheduler sends no `Plan.cancelled` and a CPU stage
    launches up to its depth instead of computing one step at a time."""
    from shared.cluster_config import env_overrides
    from stage_worker.inprocess_executor import local_engine_core

    monkeypatch.setenv("MOEPIPE_SKIP_CANCELLED_STEPS", "0")
    keys = env_overrides()
    assert keys["skip_cancelled_steps"] is False
    for skip in (True, False):
        core = local_engine_core(tiny_checkpoint, stages=2, start=False, skip_cancelled_steps=skip)
        try:
            assert core.scheduler.skip_cancelled is skip
            assert [r.computes_in_launch for r in core.executor.runners] == [skip, skip]
        finally:
            core.stop()


def test_a_request_cancelled_while_its_step_is_in_flight_leaves_no_snapshot():
    """Stages may have skipped its steps since the cancel: the state a later step of it copied was maybe never
    computed, so the prefix cache must not keep it (a request finished by a token keeps its snapshots)."""
    for cancel in (False, True):
        sched = Scheduler(num_blocks=32, block_size=16, max_num_seqs=4, max_num_batched_tokens=32,
                          num_microbatches=1, max_model_len=256, plan_ahead=True, prefix_cache_states=2)
        sched.add(_request("x", 100, max_tokens=1))
        plans = []
        while not any(p.snapshots for p in plans):
            if not sched.idle_microbatches():
                sched.on_result(0, [])
                plans.pop(0)
            plan = sched.schedule(0)
            plans.append(plan)
        if cancel:
            sched.cancel("x")
        for plan in plans:
            sched.on_result(0, [TokenOut("x", e.context_len + e.num_tokens, 5) for e in plan.entries if e.sample])
        assert len(sched.prefix.entries) == (0 if cancel else 1)
        assert len(sched.prefix._free_states) == (2 if cancel else 1)     # the slot went back


@pytest.fixture(scope="module")
def runners(tiny_checkpoint):
    from stage_worker.inprocess_executor import InProcessExecutor, inprocess_cluster

    cluster = inprocess_cluster(tiny_checkpoint, stages=2, max_model_len=256, max_num_seqs=4, block_size=16,
                                num_blocks=32, max_num_batched_tokens=32, enable_prefix_caching=False)
    return InProcessExecutor.load(cluster).runners


def _step(runner, failures: list) -> list:
    """Launch the runner's next ready step and finish it: its outgoing messages."""
    assert runner.launch_ready(lambda step, exc: failures.append((step, exc)), limit=1) == 1
    return runner.finish()


def test_stages_skip_a_step_of_cancelled_requests_only(runners):
    """Two chunks of x in flight, the first computed by stage 0 when x is cancelled: stage 0 skips the second,
    stage 1 both (the first because it knows of the cancel, the second because stage 0 skipped it, even without the
    cancel); the last stage still answers each step (token 0 for a sampling entry, for whatever waits on it). A
    step holding a live request too is computed."""
    first, last = runners
    sched = Scheduler(num_blocks=32, block_size=16, max_num_seqs=4, max_num_batched_tokens=32, num_microbatches=1,
                      max_model_len=256, plan_ahead=True)
    sched.add(_request("x", 64))
    p0, p1 = sched.schedule(0), sched.schedule(0)
    failures: list = []
    for r in runners:
        r.on_message(p0)
        r.on_message(p1)
    steps = [r.steps for r in runners]
    [act0] = _step(first, failures)
    sched.cancel("x")
    cancel = Plan(step=-1, microbatch=0, entries=[], cancelled=sched.take_cancelled())
    first.on_message(cancel)                                  # stage 1 gets it only after the first activations
    [act1] = _step(first, failures)
    assert isinstance(act1.message, Activations) and act1.message.skipped and first.steps == steps[0] + 1
    last.on_message(act0.message)
    last.on_message(cancel)
    last.on_message(act1.message)
    out0, out1 = _step(last, failures), _step(last, failures)
    assert last.steps == steps[1] and last.skipped_steps >= 2 and not failures
    results = [o.message for o in out0 + out1 if o.to == "gateway"]
    assert all(isinstance(m, StepResult) and m.tokens == [] for m in results)
    sampled = [o.message for o in out1 if o.to == "first"]
    assert isinstance(sampled[0], Sampled) and sampled[0].tokens == [TokenOut("x", 64, 0)]
    for m in results:
        sched.on_result(0, m.tokens)
    assert sched.blocks.used_blocks == 0
    done = sched.schedule(0)
    for r in runners:
        r.on_message(done)
        assert r.cancelled == set()                           # forgotten with `finished`

    # A plan holding a cancelled request and a live one runs (the live one's token is real).
    sched.add(_request("y", 20))
    sched.add(_request("z", 20))
    plan = sched.schedule(0)
    assert {e.req_id for e in plan.entries} == {"y", "z"}
    for r in runners:
        r.on_message(plan)
        r.on_message(Plan(step=-1, microbatch=0, entries=[], cancelled=["y"]))
    [act] = _step(first, failures)
    assert not act.message.skipped
    last.on_message(act.message)
    out = _step(last, failures)
    [result] = [o.message for o in out if o.to == "gateway"]
    assert {t.req_id for t in result.tokens} == {"y", "z"} and not failures
