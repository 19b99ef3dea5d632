"""Review of the engine core (shared/engine_core.py, scheduler.py, block_manager.py, prefix_cache.py): each test
here failed before the fix it names. The engine-core tests drive the real core over the in-process executor one
turn at a time from the test's thread (`_turn`: what `EngineCore._run` does in one loop), so plan-ahead, failures
and cancellations land at exactly the steps a test chooses."""

from __future__ import annotations

import random

import pytest

from shared.engine_core import EngineCore, GenerationRequest, TokenEvent
from shared.protocol import StageError, StepResult, TokenOut
from shared.sampling import SamplingParams
from shared.scheduler import Request, Scheduler
from stage_worker.inprocess_executor import local_engine_core


def _req(rid: str, ids, max_tokens: int = 4) -> Request:
    return Request(req_id=rid, prompt_ids=list(ids), params=SamplingParams(), stop_token_ids=set(),
                   max_tokens=max_tokens)


def _turn(core: EngineCore) -> None:
    """One loop of `EngineCore._run` on this thread: plan and send, run every ready step, apply the results."""
    for plan in core._plans():
        core._send(plan)
    messages = core.executor.poll(0, core._wake_r)
    drops = []
    with core._lock:
        for msg in messages:
            if isinstance(msg, StepResult):
                core._on_result(msg)
            elif isinstance(msg, StageError):
                drops.extend(core._on_stage_error(msg))
    for plan in drops:
        core._send(plan)


def _until_done(core: EngineCore, turns: int = 300) -> None:
    for _ in range(turns):
        if not core._sinks:
            return
        _turn(core)
    raise AssertionError(f"requests left unfinished: {list(core._sinks)}")


def _greedy(max_tokens: int = 5) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def _tokens(events: list) -> list[int]:
    assert events and all(isinstance(e, TokenEvent) for e in events), events
    return [e.token_id for e in events]


# ---- a restoring entry planned again after a failed step ----------------------------------------------------------

def test_a_restoring_entry_planned_again_after_a_drop_sends_its_whole_block_table():
    """Plan-ahead: r is admitted on a cached prefix in the plan behind a step that fails. `drop_from` rolls r back,
    and its next entry restores again, so stages start its block table afresh from that entry's `new_blocks`; they
    were only the blocks not yet sent (none): the stages' table for r lost its prefix blocks."""
    sched = Scheduler(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, num_microbatches=1,
                      max_model_len=4096, plan_ahead=True, prefix_cache_states=2)
    sched.prefix.margin = 2
    base = list(range(100, 120))
    sched.add(_req("a", base, max_tokens=1))
    while (plan := sched.schedule(0)) is not None and plan.entries:
        sched.on_result(0, [TokenOut(e.req_id, e.context_len + e.num_tokens, 7) for e in plan.entries if e.sample])
    assert [e.length for e in sched.prefix.entries] == [16]
    sched.add(_req("b", range(500, 510)))
    failing = sched.schedule(0)
    sched.add(_req("r", base[:16] + [1, 2, 3, 4, 5]))
    ahead = sched.schedule(0)
    assert [e.restore is not None for e in ahead.entries if e.req_id == "r"] == [True]
    sched.drop_from(failing.step)
    (entry,) = [e for e in sched.schedule(0).entries if e.req_id == "r"]
    assert entry.restore is not None and entry.new_blocks == sched.running["r"].blocks


def test_a_request_restoring_a_prefix_behind_a_failed_step_gets_its_tokens(tiny_checkpoint):
    """The same on the real engine core: r, admitted on a cached prefix in the plan planned ahead behind b's failing
    step, is innocent of the failure and must get the tokens it gets alone. It failed (its next step's plan could
    not be built: an empty block table on the stages)."""
    rng = random.Random(0)
    base = [rng.randrange(10, 2000) for _ in range(40)]
    other = [rng.randrange(10, 2000) for _ in range(20)]
    prompt = base[:32] + [rng.randrange(10, 2000) for _ in range(10)]
    keys = dict(max_model_len=128, block_size=16, max_num_seqs=4, max_num_batched_tokens=64)
    alone = local_engine_core(tiny_checkpoint, enable_prefix_caching=False, **keys)
    try:
        want = [e.token_id for e in alone.stream(GenerationRequest("alone", prompt, _greedy()))]
    finally:
        alone.stop()
    core = local_engine_core(tiny_checkpoint, start=False, async_scheduling=True, prefix_cache_states=2, **keys)
    try:
        events: dict[str, list] = {rid: [] for rid in "abr"}
        core.add(GenerationRequest("a", base, _greedy()), events["a"].append)
        _until_done(core)
        assert [e.length for e in core.scheduler.prefix.entries] == [32]
        core.add(GenerationRequest("b", other, _greedy()), events["b"].append)
        with core._lock:
            failing = core.scheduler.schedule(0)
        core.add(GenerationRequest("r", prompt, _greedy()), events["r"].append)
        with core._lock:
            ahead = core.scheduler.schedule(0)
        assert any(e.req_id == "r" and e.restore is not None for e in ahead.entries)
        core._send(failing)
        core._send(ahead)
        with core._lock:
            drops = core._on_stage_error(StageError(component="stage0", step=failing.step, message="injected"))
        for plan in drops:
            core._send(plan)
        _until_done(core)
        assert isinstance(events["b"][-1], Exception)
        assert _tokens(events["r"]) == want
        assert core.scheduler.blocks.used_blocks == core.scheduler.prefix.cached_blocks
        assert core.scheduler.blocks.used_slots == 0
    finally:
        core.stop()


# ---- a prompt the context cannot hold ------------------------------------------------------------------------------

def test_a_prompt_past_the_context_is_refused_not_left_waiting_for_blocks(tiny_checkpoint):
    """`EngineCore.add` took a prompt longer than max_model_len (the API refuses it; direct callers did not): with a
    pool sized for max_model_len it waited for blocks forever, holding its slot and the blocks of its first chunk.
    A prompt of exactly max_model_len still gets its one token ("length")."""
    core = local_engine_core(tiny_checkpoint, start=False, max_model_len=32, block_size=16, num_blocks=2,
                             max_num_batched_tokens=16, enable_prefix_caching=False)
    try:
        with pytest.raises(ValueError, match="33 tokens; the context is 32"):
            core.add(GenerationRequest("long", list(range(10, 43)), _greedy(3)), lambda ev: None)
        assert not core._sinks and not core.scheduler.waiting
        events: list = []
        core.add(GenerationRequest("full", list(range(10, 42)), _greedy(3)), events.append)
        _until_done(core, turns=50)
        assert len(_tokens(events)) == 1 and events[0].finish_reason == "length"
        assert core.scheduler.blocks.used_blocks == 0 and core.scheduler.blocks.used_slots == 0
    finally:
        core.stop()
