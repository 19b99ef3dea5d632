"""The one engine core (shared/engine_core.py) over its two executors.

- The block manager's reference counts.
- In-process: greedy tokens and logprobs, and seeded draws, do not depend on the stage count, on chunked prefill or
  on preemption (a pool too small for the requests at once); the core's phase stamps on the token events (queued,
  first scheduled, each token's result) are ordered, and a preempted request keeps its first scheduling's.
- The ZeroMQ cluster (real processes) and the in-process executor behind real uvicorn servers give the same greedy
  tokens and logprobs (1e-4, float32), the same seeded tokens and the same structured output for the same requests,
  with the cluster preempting and chunking; both servers' /metrics hold every request's phases, which add up to its
  TTFT and inference time.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import InProcessServer, collect_events, free_port
from gateway.api import create_app
from gateway.engine import AsyncEngine
from gateway.launcher import Cluster, ServeOptions
from gateway.metrics import Metrics
from shared.block_manager import BlockManager, OutOfBlocks
from shared.engine_core import EngineCore, GenerationRequest
from shared.protocol import Plan
from shared.sampling import SamplingParams, read_generation_config
from shared.tokenizer import Tokenizer
from stage_worker.inprocess_executor import local_engine_core

PROMPTS = [list(range(5, 5 + n)) for n in (3, 21, 40, 9)]     # token ids; up to 40 tokens: several 16-token blocks


def test_block_manager_counts_holders():
    bm = BlockManager(num_blocks=4, num_slots=2)
    a = bm.allocate(2)
    assert a == [0, 1] and bm.free_blocks == 2 and bm.used_blocks == 2
    bm.share(a)                                   # a second request holds the same prefix
    bm.release(a)
    assert bm.free_blocks == 2 and bm.refcount(0) == 1
    bm.release(a)
    assert bm.free_blocks == 4 and bm.refcount(0) == 0
    with pytest.raises(ValueError):
        bm.release([0])
    with pytest.raises(ValueError):
        bm.share([3])
    with pytest.raises(OutOfBlocks):
        bm.allocate(5)
    assert not bm.can_allocate(5) and bm.can_allocate(4)
    s = bm.allocate_slot(), bm.allocate_slot()
    with pytest.raises(OutOfBlocks):
        bm.allocate_slot()
    bm.release_slot(s[0])
    with pytest.raises(ValueError):
        bm.release_slot(s[0])
    assert bm.used_slots == 1


def _run_all(core: EngineCore, requests: list[GenerationRequest]) -> list[list]:
    results = collect_events(core, requests)
    for evs in results:
        assert not any(isinstance(e, Exception) for e in evs), evs
    return results


def _requests(gen_cfg: dict) -> list[GenerationRequest]:
    reqs = []
    for i, ids in enumerate(PROMPTS):
        greedy = SamplingParams(max_tokens=10, temperature=0.0, logprobs=2).with_defaults(gen_cfg)
        seeded = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=100 + i).with_defaults(gen_cfg)
        reqs.append(GenerationRequest(f"g{i}", ids, greedy, prompt_logprobs=i == 1))
        reqs.append(GenerationRequest(f"s{i}", ids, seeded))
    # penalties read the device token counts, which launch-ahead advances before the host has the tokens
    penalised = SamplingParams(max_tokens=10, temperature=0.8, seed=7, presence_penalty=0.7,
                               repetition_penalty=1.3).with_defaults(gen_cfg)
    reqs.append(GenerationRequest("p0", PROMPTS[0], penalised))
    return reqs


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    """One stage, every request fits at once, prompts in one chunk, one plan at a time, no step launched ahead."""
    core = local_engine_core(tiny_checkpoint, max_model_len=128, max_num_seqs=8, async_scheduling=False,
                             launch_ahead=False)
    try:
        return _run_all(core, _requests(read_generation_config(tiny_checkpoint)))
    finally:
        core.stop()


def _spy_preemptions(core: EngineCore) -> dict[str, float]:
    """Request id -> when the scheduler first preempted it (or requeued it), recorded as it happens."""
    first: dict[str, float] = {}
    preempt = core.scheduler._preempt

    def spy(req):
        first.setdefault(req.req_id, time.monotonic())
        preempt(req)

    core.scheduler._preempt = spy
    return first


def _assert_phase_stamps(results: list[list], preempted: dict[str, float], ids: list[str]) -> None:
    """Queued <= first scheduled <= first token's result <= every later one (the first event alone carries the
    request's stamps); a preempted request's scheduling stamp predates its preemption: re-admission kept it."""
    for rid, events in zip(ids, results):
        first = events[0]
        assert first.queued_ts <= first.scheduled_ts <= first.token_ts, rid
        stamps = [e.token_ts for e in events]
        assert stamps == sorted(stamps) and None not in stamps, rid
        assert all(e.queued_ts is None and e.scheduled_ts is None for e in events[1:]), rid
        if rid in preempted:
            assert first.scheduled_ts < preempted[rid], rid


def _assert_same(a: list[list], b: list[list]) -> None:
    for ea, eb in zip(a, b):
        assert [e.token_id for e in ea] == [e.token_id for e in eb]
        la = [e.logprob for e in ea if e.logprob is not None]
        lb = [e.logprob for e in eb if e.logprob is not None]
        assert la == pytest.approx(lb, abs=1e-4)
        assert [e.finish_reason for e in ea] == [e.finish_reason for e in eb]
        pa, pb = ea[0].prompt_logprobs, eb[0].prompt_logprobs
        assert (pa is None) == (pb is None)
        if pa is not None:
            assert list(pa.arrays()[0]) == pytest.approx(list(pb.arrays()[0]), abs=1e-4)


@pytest.mark.parametrize("plan_ahead", [True, False])
def test_tokens_do_not_depend_on_stages_chunks_or_preemption(tiny_checkpoint, reference, plan_ahead, monkeypatch):
    # Three stages (three micro-batches), 8-token prefill chunks, and 8 blocks of 16 tokens for eight requests
    # that need up to 4 blocks each: the scheduler must chunk prompts and preempt requests to finish them all.
    # With plan-ahead off too (its switch serves the same tokens). Without the prefix cache, which would spare blocks
    # on the prompts' common prefixes (tests/test_prefix_cache.py preempts with it). Prompt logprobs in slices of
    # 3 rows (`step_sampling.ECHO_ROWS`): the same values as the reference's.
    from stage_worker import step_sampling

    monkeypatch.setattr(step_sampling, "ECHO_ROWS", 3)
    core = local_engine_core(tiny_checkpoint, stages=3, max_model_len=128, max_num_seqs=8,
                             max_num_batched_tokens=8, num_blocks=8, block_size=16, async_scheduling=plan_ahead,
                             enable_prefix_caching=False)
    try:
        preempted = _spy_preemptions(core)
        requests = _requests(read_generation_config(tiny_checkpoint))
        out = _run_all(core, requests)
        assert core.scheduler.num_preemptions > 0
        cached = core.scheduler.prefix.cached_blocks if core.scheduler.prefix is not None else 0
        assert core.scheduler.blocks.used_blocks == cached and core.scheduler.blocks.used_slots == 0
        assert not core._phases                     # every request's stamps went out with its first token
    finally:
        core.stop()
    _assert_same(reference, out)
    assert preempted
    _assert_phase_stamps(out, preempted, [r.request_id for r in requests])
    assert reference[0][0].prompt_logprobs is None and len(reference[2][0].prompt_logprobs) == len(PROMPTS[1]) - 1


def test_one_stage_launching_ahead_gives_the_same_tokens(tiny_checkpoint, reference):
    """One stage with plan-ahead: decode steps are queued before the previous step's tokens reach the host, their
    ids read from that step's tokens on the device; with chunked prefill and preemption too. (The reference runs
    with launch-ahead off. Without the prefix cache: its hits on the prompts' common prefixes save the blocks whose
    shortage this test needs; tests/test_prefix_cache.py preempts with it.)"""
    core = local_engine_core(tiny_checkpoint, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=8,
                             num_blocks=8, block_size=16, launch_ahead=True, enable_prefix_caching=False)
    try:
        out = _run_all(core, _requests(read_generation_config(tiny_checkpoint)))
        fed = core.executor.runners[0].ids_from_device
        assert core.scheduler.num_preemptions > 0
    finally:
        core.stop()
    _assert_same(reference, out)
    assert fed > 0


def test_stream_and_cancel(tiny_checkpoint):
    core = local_engine_core(tiny_checkpoint, max_model_len=128, max_num_seqs=2)
    try:
        params = SamplingParams(max_tokens=50, temperature=0.0)
        for i, ev in enumerate(core.stream(GenerationRequest("a", PROMPTS[0], params))):
            if i == 2:
                break                                # leaving the iterator cancels the request
        deadline = time.monotonic() + 10
        while core.num_running or core.scheduler.blocks.used_blocks:
            assert time.monotonic() < deadline, "a cancelled request kept its blocks"
            time.sleep(0.01)
        events = list(core.stream(GenerationRequest("b", PROMPTS[0], SamplingParams(max_tokens=3,
                                                                                    temperature=0.0))))
        assert [e.finish_reason for e in events] == [None, None, "length"]
    finally:
        core.stop()


def test_a_lost_component_fails_a_request_without_a_token_as_unavailable(tiny_checkpoint):
    """A component lost for good (recovery_timeout 0) failed every running request with EngineFailed: a client
    whose request had no token yet (still in prefill) got a 500, where the server stopping gives it a 503 with
    Retry-After (QA: kill -9 of a stage during two long prefills). Now a request with tokens fails
    (EngineFailed: its stream ends with an error event) and one without is EngineUnavailable (503)."""
    import threading

    from shared.engine_core import EngineFailed, EngineUnavailable

    core = local_engine_core(tiny_checkpoint, stages=2, max_model_len=512, max_num_seqs=4, recovery_timeout=0,
                             max_num_batched_tokens=16)
    events: dict[str, list] = {"a": [], "b": []}
    done = threading.Semaphore(0)
    lost = []

    def sink_for(rid):
        def sink(ev):
            events[rid].append(ev)
            if rid == "a" and not lost:     # a's first token: b (300 prompt tokens, 16 a step) is mid-prefill
                lost.append(True)
                core.executor.restarted = lambda: ["stage1"] if lost.pop() else []
            if isinstance(ev, Exception) or ev.finish_reason is not None:
                done.release()
        return sink

    try:
        params = SamplingParams(max_tokens=100, temperature=0.0)
        core.add(GenerationRequest("a", PROMPTS[0][:4], params), sink_for("a"))
        core.add(GenerationRequest("b", [(7 * i) % 1000 + 10 for i in range(300)], params), sink_for("b"))
        assert done.acquire(timeout=60) and done.acquire(timeout=60)
    finally:
        core.stop()
    assert isinstance(events["a"][-1], EngineFailed) and "stage1 stopped responding" in str(events["a"][-1])
    assert len(events["b"]) == 1 and isinstance(events["b"][0], EngineUnavailable), events["b"]
    assert not isinstance(events["b"][0], EngineFailed)


def test_a_lost_component_with_only_finished_requests_in_flight_frees_their_microbatch(tiny_checkpoint):
    """A component lost for good (recovery_timeout 0) while the only requests in flight had just finished (their
    plans still out): the core failed nothing and returned no plan, so those plans, which never come back, kept
    their micro-batch busy and the restarted pipeline never planned on it again; and requests' state on surviving
    stages was never dropped. Now their steps are dropped and the requests told finished."""
    from shared.scheduler import Request

    core = local_engine_core(tiny_checkpoint, stages=2, start=False, recovery_timeout=0, max_model_len=512,
                             max_num_batched_tokens=16)
    try:
        sched = core.scheduler
        sched.add(Request(req_id="x", prompt_ids=list(range(3, 67)), params=SamplingParams(temperature=0.0),
                          stop_token_ids=set(), max_tokens=4))
        mb = sched.idle_microbatches()[0]
        steps = [sched.schedule(mb).step, sched.schedule(mb).step]     # two chunks in flight (plan-ahead)
        sched.cancel("x")
        assert "x" in sched.draining and mb not in sched.idle_microbatches()
        [plan] = core._fail_all(["stage1"], keep_waiting=True)
        assert plan.dropped == steps and plan.finished == ["x"]
        assert mb in sched.idle_microbatches() and not sched.draining and sched.blocks.used_blocks == 0
    finally:
        core.stop()


def test_a_stall_report_whose_stack_dump_fails_leaves_the_core_running():
    """The stall report only reports: an executor whose `dump_stacks` raises (faulthandler with a stderr that has no
    file descriptor, or none) must not stop the core's loop, which would fail every request."""
    import io

    from shared.engine_core import SchedulerLimits
    from shared.scheduler import Request

    class Executor:
        def send(self, plan) -> None: ...

        def dump_stacks(self) -> list[str]:
            raise io.UnsupportedOperation("fileno")

    core = EngineCore(Executor(), SchedulerLimits(num_blocks=8, block_size=16, max_num_seqs=2,
                                                  max_num_batched_tokens=64, num_microbatches=1, max_model_len=128,
                                                  stall_report=0.01))
    core.scheduler.add(Request(req_id="x", prompt_ids=[3, 4, 5], params=SamplingParams(temperature=0.0),
                               stop_token_ids=set(), max_tokens=4))
    plan = core.scheduler.schedule(0)
    core._send(plan)
    time.sleep(0.1)                        # (a prefill chunk: PREFILL_STALL_FACTOR x 0.01 s)
    core._report_stall()                   # raised: the core's loop stopped on it
    assert core._reported == {plan.step}   # and once only
    core._report_stall()


def test_a_prefill_chunk_gets_longer_before_the_stall_report_than_a_decode_step():
    """A decode step in flight for stall_report_timeout is a stall (h100-32); a prefill chunk of a large model on a
    CPU can take longer than that with nothing wrong, so it is reported only after PREFILL_STALL_FACTOR times it
    (the report used to fire on every such chunk, with every thread's stack)."""
    from shared.engine_core import PREFILL_STALL_FACTOR, SchedulerLimits
    from shared.protocol import SeqEntry

    asked: list[int] = []

    class Executor:
        def send(self, plan) -> None: ...

        def dump_stacks(self) -> list[str]:
            asked.append(1)
            return []

    limit = 0.05
    core = EngineCore(Executor(), SchedulerLimits(num_blocks=8, block_size=16, max_num_seqs=2,
                                                  max_num_batched_tokens=64, num_microbatches=2, max_model_len=128,
                                                  stall_report=limit))
    prefill = Plan(step=1, microbatch=0, entries=[SeqEntry("p", 0, 0, 40, [0, 1, 2], tokens=list(range(40)))])
    decode = Plan(step=2, microbatch=1, entries=[SeqEntry("d", 1, 40, 1, [])])
    for plan in (prefill, decode):
        core.scheduler.in_flight[plan.microbatch].append(plan)
        core._send(plan)
    time.sleep(limit * 2)
    core._report_stall()
    assert core._reported == {2} and len(asked) == 1         # the decode step only
    time.sleep(limit * PREFILL_STALL_FACTOR)
    core._report_stall()
    assert core._reported == {1, 2} and len(asked) == 2


def test_a_plan_that_cannot_go_out_fails_its_step_and_the_core_goes_on(tiny_checkpoint):
    """A plan the executor cannot send (as a value msgpack cannot encode once made the cluster's encode raise and
    the core stop: every later request got 503) fails the requests of its step with an error; the core keeps
    serving the next request and reports itself healthy."""
    core = local_engine_core(tiny_checkpoint, max_model_len=128, max_num_seqs=2)
    real = core.executor.send

    def send(plan):
        if any(e.req_id == "bad" for e in plan.entries):
            raise OverflowError("Integer value out of range")
        real(plan)

    core.executor.send = send
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0)
        (bad,) = collect_events(core, [GenerationRequest("bad", PROMPTS[0], params)])
        assert isinstance(bad[-1], Exception) and "engine_core" in str(bad[-1])
        (ok,) = _run_all(core, [GenerationRequest("ok", PROMPTS[1], params)])
        assert [e.finish_reason for e in ok][-1] == "length" and len(ok) == 4
        assert "engine_core" not in core.health() and core.num_running == 0
    finally:
        core.stop()


# ---- cluster against in-process, through real servers -------------------------------------------------------------
def _budget(ids: list[int]) -> int:
    return 40 if len(ids) >= 40 else 10



# The 40-token prompt runs 40 steps: 80 tokens, the whole of the cluster's 5 blocks, so any request running beside it
# is preempted, however a loaded machine spreads the arrivals (with 10 steps each and 6 blocks, a CI run and 2 of 6
# runs here saw no preemption once prefill steps of several prompts got faster).
BODIES = [{"prompt": ids, "max_tokens": _budget(ids), "temperature": 0, "logprobs": 2, "ignore_eos": True}
          for ids in PROMPTS] \
    + [{"prompt": ids, "max_tokens": _budget(ids), "temperature": 0.9, "seed": 7 + i, "ignore_eos": True}
       for i, ids in enumerate(PROMPTS)] \
    + [{"prompt": PROMPTS[1], "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1}]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["n", "ok"]}


def _exercise(url: str) -> dict:
    def complete(body):
        r = httpx.post(url + "/v1/completions", json={"model": "moepipe", **body}, timeout=120, verify=False)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    with ThreadPoolExecutor(len(BODIES)) as pool:             # at once: they share steps (and preempt)
        out = {"completions": list(pool.map(complete, BODIES))}
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": "moepipe", "max_tokens": 40, "temperature": 0.8, "seed": 3,
        "messages": [{"role": "user", "content": "a number and a flag"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}}, verify=False)
    assert r.status_code == 200, r.text
    out["json"] = r.json()["choices"][0]["message"]["content"]
    out["metrics"] = httpx.get(url + "/metrics", verify=False).text
    return out


def _assert_phases_add_up(metrics_text: str, requests: int, multi_token: int) -> None:
    """Each request observed once in every phase series (time per output token: those of two tokens or more), and
    per request queue + prefill + gateway = TTFT <= e2e, prefill + decode = inference, so also for the sums."""
    from prometheus_client.parser import text_string_to_metric_families

    v = {smp.name: smp.value for fam in text_string_to_metric_families(metrics_text) for smp in fam.samples
         if smp.name.endswith(("_sum", "_count"))}
    names = ["request_queue_time", "request_prefill_time", "request_gateway_time", "time_to_first_token",
             "request_decode_time", "request_inference_time", "e2e_request_latency"]
    s = {n: v[f"moepipe_{n}_seconds_sum"] for n in names}
    for n in names:
        assert v[f"moepipe_{n}_seconds_count"] == requests, n
    assert v["moepipe_request_time_per_output_token_seconds_count"] == multi_token
    assert s["request_queue_time"] + s["request_prefill_time"] + s["request_gateway_time"] == \
        pytest.approx(s["time_to_first_token"], abs=1e-6)
    assert s["request_prefill_time"] + s["request_decode_time"] == pytest.approx(s["request_inference_time"],
                                                                                 abs=1e-6)
    assert 0 < s["request_queue_time"] + s["request_prefill_time"] < s["time_to_first_token"] \
        <= s["e2e_request_latency"]
    assert s["request_inference_time"] < s["e2e_request_latency"]


def _in_process_server(model_dir) -> InProcessServer:
    core = local_engine_core(model_dir, max_model_len=256, max_num_seqs=16)
    metrics = Metrics()
    core.attach_metrics(metrics)
    app = create_app(AsyncEngine(core), Tokenizer.from_dir(model_dir), model_name="moepipe",
                     generation_config=read_generation_config(model_dir), metrics=metrics)
    return InProcessServer(app, core)


def test_cluster_and_in_process_executors_agree(tiny_checkpoint):
    with _in_process_server(tiny_checkpoint) as url:
        local = _exercise(url)
    # Two stage processes, 16-token chunks, 5 blocks for 9 requests of up to 5 blocks: chunking and preemption (see
    # BODIES). No PLE service process (the stages gather their PLE rows; the service's own tests are test_cluster's):
    # ~4 s of CPU less.
    opts = ServeOptions(model=tiny_checkpoint, stages=2, port=free_port(),
                        extra={"max_num_batched_tokens": 16, "block_size": 16, "num_blocks": 5, "ple_service": False,
                               "enable_prefix_caching": False})
    with Cluster(opts) as c:
        served = _exercise(c.url)
    preempted = [line for line in served["metrics"].splitlines() if line.startswith("moepipe_preemptions ")]
    assert preempted and float(preempted[0].split()[1]) > 0
    for out in (local, served):         # the echo request's one token has no time per output token
        _assert_phases_add_up(out["metrics"], len(BODIES) + 1, len(BODIES))
    for a, b in zip(local["completions"], served["completions"]):
        assert a["text"] == b["text"]
        if a["logprobs"] is not None:
            la = [x for x in a["logprobs"]["token_logprobs"] if x is not None]
            lb = [x for x in b["logprobs"]["token_logprobs"] if x is not None]
            assert la == pytest.approx(lb, abs=1e-4)
            for ta, tb in zip(a["logprobs"]["top_logprobs"], b["logprobs"]["top_logprobs"]):
                assert (ta is None) == (tb is None)
                if ta is not None:
                    assert list(ta) == list(tb) and list(ta.values()) == pytest.approx(list(tb.values()), abs=1e-4)
    assert local["json"] == served["json"]
