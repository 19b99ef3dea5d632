"""The scheduler's policies without processes: a simulated pipeline completes steps in any order the stages allow."""

from __future__ import annotations

import random

import pytest

from shared.scheduler import Request, Scheduler
from shared.protocol import TokenOut
from shared.sampling import SamplingParams


def _req(i: int, prompt_len: int, max_tokens: int) -> Request:
    return Request(req_id=f"r{i}", prompt_ids=list(range(3, 3 + prompt_len)), params=SamplingParams(),
                   stop_token_ids={0}, max_tokens=max_tokens)


def _token(req_id: str, position: int, stops: dict[str, int]) -> int:
    """The simulated model: token = (position * 7 + len(req id)) % 50 + 1, or the stop token 0 where `stops` says."""
    return 0 if stops.get(req_id) == position else position * 7 % 50 + 1 + len(req_id) % 3


def _simulate(sched: Scheduler, reqs: list[Request], seed: int, max_steps: int = 5000,
              stops: dict[str, int] | None = None, crash_every: int = 0) -> dict[str, list[int]]:
    """Run plans to completion, a micro-batch's steps in plan order (as stages run them), micro-batches in any
    order; returns each request's tokens. With `crash_every`, every n-th result (while requests run) is lost with
    every plan in flight and all the stages' state, and the scheduler told (`requeue_running`)."""
    stops = stops or {}
    rng = random.Random(seed)
    for r in reqs:
        sched.add(r)
    # Every stage's per-sequence state (DeltaNet, n-gram context) as the tokens it has taken in, by slot (running
    # requests' and the prefix cache's snapshot slots): stages apply plans in plan order, so applying each plan's
    # state effects when it is made is what they do. Each entry must find its request's tokens so far.
    truth = {r.req_id: r.prompt_ids + _expected(r, stops) for r in reqs}
    state: dict[int, list[int]] = {}
    outputs: dict[str, list[int]] = {r.req_id: [] for r in reqs}
    flying: list = []
    stage0: dict[tuple[str, int], int] = {}          # what stage 0 holds from the last stage's Sampled messages
    fed: dict[str, int] = {}                         # tokens each request has fed, as the PLE service counts them
    tables: dict[str, list[int]] = {}                # each request's block table, as the stages hold it
    results = 0
    for _ in range(max_steps):
        for _ in range(sched.depth):
            for mb in sched.idle_microbatches():
                plan = sched.schedule(mb)
                if plan is None:
                    continue
                # Consumers apply a plan's `finished` on arrival, before any earlier step runs: nothing in
                # flight may still need what they drop.
                in_flight = {e.req_id for p in flying for e in p.entries}
                assert not set(plan.finished) & in_flight, plan.finished
                for rid in plan.finished:
                    fed.pop(rid, None)
                    tables.pop(rid, None)
                    for key in [k for k in stage0 if k[0] == rid]:
                        del stage0[key]
                for e in plan.entries:
                    if e.restore is not None:        # prefix cache: a first entry after a cached prefix
                        assert e.req_id not in fed and e.history == truth[e.req_id][:e.context_len][-32:]
                        fed[e.req_id] = e.context_len
                    # Every entry continues where the request's previous one ended (n-gram context, state slots).
                    assert e.context_len == fed.get(e.req_id, 0), (e.req_id, e.context_len, fed.get(e.req_id))
                    fed[e.req_id] = e.context_len + e.num_tokens
                    if e.restore is not None:
                        state[e.slot] = list(state[e.restore])
                    elif e.context_len == 0:
                        state[e.slot] = []
                    assert state[e.slot] == truth[e.req_id][:e.context_len], e.req_id
                    for slot, snapshot in plan.snapshots:        # the state the entry starts from
                        if slot == e.slot:
                            state[snapshot] = list(state[slot])
                    state[e.slot] += e.tokens if e.tokens is not None else [_token(e.req_id, e.context_len, stops)]
                if plan.entries:
                    # Invariants: block tables cover the tokens; each block is held as often as requests and
                    # cached prefixes list it (once, without the prefix cache), and every other one is free.
                    holders = [b for r in [*sched.running.values(), *sched.draining.values()] for b in r.blocks]
                    if sched.prefix is not None:
                        holders += [b for c in sched.prefix.entries for b in c.blocks]
                    else:
                        assert len(holders) == len(set(holders))
                    assert all(sched.blocks.refcount(b) == holders.count(b) for b in set(holders))
                    assert len(set(holders)) + sched.blocks.free_blocks == sched.blocks.num_blocks
                    for e in plan.entries:
                        # Stages grow each request's table by the entry's new blocks (all of them at position 0).
                        tables[e.req_id] = (tables.get(e.req_id, []) if e.context_len and e.restore is None
                                            else []) + e.new_blocks
                        assert len(tables[e.req_id]) * sched.block_size >= e.context_len + e.num_tokens
                        assert tables[e.req_id] == sched.running[e.req_id].blocks
                    flying.append(plan)
        if not flying:
            break
        results += 1
        if crash_every and results % crash_every == 0 and sched.running:
            steps, _ = sched.requeue_running()
            assert sorted(steps) == sorted(p.step for p in flying)
            flying.clear()
            stage0.clear()
            fed.clear()
            tables.clear()
            state.clear()
            continue
        heads = [p for i, p in enumerate(flying) if all(q.microbatch != p.microbatch for q in flying[:i])]
        plan = rng.choice(heads)
        flying.remove(plan)
        for e in plan.entries:
            # A decode without explicit tokens relies on stage 0 having the sampled token by now.
            assert e.tokens is not None or (e.req_id, e.context_len) in stage0, (e.req_id, e.context_len)
        outs = [TokenOut(e.req_id, e.context_len + e.num_tokens, _token(e.req_id, e.context_len + e.num_tokens,
                                                                        stops))
                for e in plan.entries if e.sample]
        for o in outs:
            stage0[(o.req_id, o.position)] = o.token
        for r in sched.on_result(plan.microbatch, outs):
            outputs[r.req_id].extend(o.token for o in r.events)
            r.events.clear()
    assert not sched.running and not sched.waiting and not sched.draining, "requests left unfinished"
    cached = sched.prefix.cached_blocks if sched.prefix is not None else 0     # held by the prefix cache alone
    assert sched.blocks.used_blocks == cached and sched.blocks.used_slots == 0
    if sched.prefix is not None:
        assert sched.prefix.idle_blocks == cached and not any(c.users for c in sched.prefix.entries)
    return outputs


def _expected(r: Request, stops: dict[str, int] | None = None) -> list[int]:
    n = len(r.prompt_ids)
    out = []
    for i in range(r.max_tokens):
        out.append(_token(r.req_id, n + i, stops or {}))
        if out[-1] == 0:
            break
    return out


@pytest.mark.parametrize("seed", range(12))
def test_every_request_completes_with_its_tokens_under_preemption(seed):
    rng = random.Random(seed)
    reqs = [_req(i, rng.randint(1, 70), rng.randint(1, 30)) for i in range(12)]
    sched = Scheduler(num_blocks=10, block_size=16, max_num_seqs=8, max_num_batched_tokens=32,
                      num_microbatches=2, max_model_len=4096)
    outputs = _simulate(sched, reqs, seed)
    for r in reqs:
        assert outputs[r.req_id] == _expected(r), r.req_id
    assert sched.num_preemptions > 0
    assert sched.blocks.used_blocks == 0 and sched.blocks.used_slots == 0


def _plan_ahead_run(seed: int) -> int:
    """Two plans per micro-batch: requests decode the token a step in flight is sampling; one that hits its stop
    token while the next plan holds it drops the extra token and keeps its blocks until that plan is back.
    Returns the preemptions."""
    rng = random.Random(seed)
    reqs = [_req(i, rng.randint(1, 70), rng.randint(1, 30)) for i in range(12)]
    stops = {r.req_id: len(r.prompt_ids) + rng.randint(0, 12) for r in reqs if rng.random() < 0.5}
    sched = Scheduler(num_blocks=10, block_size=16, max_num_seqs=8, max_num_batched_tokens=32,
                      num_microbatches=rng.choice([1, 2]), max_model_len=4096, plan_ahead=True)
    planned_ahead = []
    schedule = sched.schedule

    def spy(mb):
        ahead = bool(sched.in_flight[mb])
        plan = schedule(mb)
        if plan is not None and plan.entries and ahead:
            planned_ahead.append(plan.step)
        return plan

    sched.schedule = spy
    outputs = _simulate(sched, reqs, seed, stops=stops)
    for r in reqs:
        assert outputs[r.req_id] == _expected(r, stops), r.req_id
    assert planned_ahead
    return sched.num_preemptions


@pytest.mark.parametrize("seed", range(12))
def test_plan_ahead_keeps_every_request_s_tokens_with_stops_and_preemption(seed):
    _plan_ahead_run(seed)


def test_plan_ahead_still_preempts():
    """Blocks run out while plans are ahead in several of those runs (victims: requests no plan in flight
    holds)."""
    assert sum(1 for seed in range(12) if _plan_ahead_run(seed) > 0) >= 3


def test_a_request_preempted_while_planning_restarts_in_the_same_plan():
    """The case the PLE service once got wrong (a long-prompt benchmark on the H200 lost a request's n-gram
    context): r0's decode needs a block, r1 is preempted for it, and r1's fresh first chunk fits in what is left, so
    one plan both finishes r1 and feeds it from position 0. Stages and the PLE service drop first, then run."""
    sched = Scheduler(num_blocks=3, block_size=16, max_num_seqs=4, max_num_batched_tokens=8,
                      num_microbatches=1, max_model_len=4096)
    r0, r1 = _req(0, 1, 20), _req(1, 2, 20)
    outputs = _simulate(sched, [r0, r1], seed=0)
    assert sched.num_preemptions >= 1
    assert outputs == {r.req_id: _expected(r) for r in (r0, r1)}
    sched = Scheduler(num_blocks=3, block_size=16, max_num_seqs=4, max_num_batched_tokens=8,
                      num_microbatches=1, max_model_len=4096)
    for r in (_req(0, 1, 20), _req(1, 2, 20)):
        sched.add(r)
    for _ in range(40):
        plan = sched.schedule(0)
        if set(plan.finished) & {e.req_id for e in plan.entries}:
            (entry,) = [e for e in plan.entries if e.req_id in plan.finished]
            assert entry.context_len == 0 and entry.req_id in {s.req_id for s in plan.new_requests}
            break
        sched.on_result(0, [TokenOut(e.req_id, e.context_len + e.num_tokens, 5) for e in plan.entries if e.sample])
    else:
        pytest.fail("no plan re-admitted the request it preempted")


def test_microbatches_split_requests_and_every_plan_is_disjoint():
    sched = Scheduler(num_blocks=64, block_size=16, max_num_seqs=8, max_num_batched_tokens=64,
                      num_microbatches=2, max_model_len=4096)
    for i in range(4):
        sched.add(_req(i, 5, 4))
    a = sched.schedule(0)
    b = sched.schedule(1)
    ids_a = {e.req_id for e in a.entries}
    ids_b = {e.req_id for e in b.entries}
    assert ids_a and ids_b and not ids_a & ids_b
    with pytest.raises(AssertionError):
        sched.schedule(0)


def test_chunked_prefill_respects_the_token_budget():
    sched = Scheduler(num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=10,
                      num_microbatches=1, max_model_len=4096)
    sched.add(_req(0, 25, 2))
    sizes = []
    while True:
        plan = sched.schedule(0)
        if plan is None or not plan.entries:
            break
        sizes.append(sum(e.num_tokens for e in plan.entries))
        outs = [TokenOut(e.req_id, e.context_len + e.num_tokens, 5) for e in plan.entries if e.sample]
        sched.on_result(0, outs)
    assert sizes == [10, 10, 5, 1]


def test_cancel_frees_blocks_and_slot_at_once_when_idle():
    sched = Scheduler(num_blocks=8, block_size=16, max_num_seqs=2, max_num_batched_tokens=64,
                      num_microbatches=1, max_model_len=4096)
    sched.add(_req(0, 20, 5))
    plan = sched.schedule(0)
    sched.on_result(0, [TokenOut("r0", 20, 9)])
    assert sched.blocks.used_blocks == 2 and sched.blocks.used_slots == 1
    sched.cancel("r0")
    assert sched.blocks.used_blocks == 0 and sched.blocks.used_slots == 0
    assert "r0" in sched.schedule(0).finished
    assert plan.entries[0].tokens == list(range(3, 23))


def test_full_queue_is_refused():
    sched = Scheduler(num_blocks=8, block_size=16, max_num_seqs=1, max_num_batched_tokens=64,
                      num_microbatches=1, max_model_len=4096, max_queue=2)
    sched.add(_req(0, 3, 1))
    sched.add(_req(1, 3, 1))
    with pytest.raises(OverflowError):
        sched.add(_req(2, 3, 1))


def test_plans_carry_only_new_block_ids():
    sched = Scheduler(num_blocks=64, block_size=16, max_num_seqs=2, max_num_batched_tokens=64,
                      num_microbatches=1, max_model_len=4096)
    sched.add(_req(0, 20, 30))
    sent = []
    while (plan := sched.schedule(0)) is not None and plan.entries:
        (e,) = plan.entries
        sent.append((e.context_len, list(e.new_blocks)))
        sched.on_result(0, [TokenOut("r0", e.context_len + e.num_tokens, 5)])
    assert sent[0] == (0, [0, 1])                   # the prompt's two blocks
    # then one block each time a position starts a new block (50 tokens in all: blocks at 32 and 48)
    assert [(pos, len(new)) for pos, new in sent if new] == [(0, 2), (32, 1), (48, 1)]


@pytest.mark.parametrize("seed", range(8))
def test_requests_requeued_after_a_component_died_complete_with_their_tokens(seed):
    """Now and then every plan in flight is lost (a stage died) and every stage forgets everything:
    `requeue_running` puts the running requests back to be recomputed, and each still gets exactly its tokens."""
    rng = random.Random(seed)
    reqs = [_req(i, rng.randint(1, 70), rng.randint(1, 30)) for i in range(10)]
    sched = Scheduler(num_blocks=12, block_size=16, max_num_seqs=6, max_num_batched_tokens=32,
                      num_microbatches=rng.choice([1, 2]), max_model_len=4096, plan_ahead=rng.random() < 0.5)
    outputs = _simulate(sched, reqs, seed, crash_every=7)
    for r in reqs:
        assert outputs[r.req_id] == _expected(r), r.req_id
    assert sched.num_requeued > 0


def _prefix_cache_run(seed: int) -> int:
    """Prompts sharing prefixes (every `_req` prompt starts 3, 4, 5, ...), few blocks and snapshot slots, plan-ahead
    or not, chunks cut at every snapshot target or only where that saves 24 tokens, stops, and now and then a crash: each restoring entry finds a state holding exactly its prompt's first
    tokens, evictions and preemptions keep every request's tokens, and the cache ends holding only its own blocks.
    Returns the tokens restored."""
    rng = random.Random(seed)
    reqs = [_req(i, rng.randint(1, 90), rng.randint(1, 20)) for i in range(14)]
    stops = {r.req_id: len(r.prompt_ids) + rng.randint(0, 12) for r in reqs if rng.random() < 0.3}
    sched = Scheduler(num_blocks=rng.choice([14, 18, 60]), block_size=8, max_num_seqs=rng.choice([3, 6]),
                      max_num_batched_tokens=rng.choice([16, 40]), num_microbatches=rng.choice([1, 2]),
                      max_model_len=4096, plan_ahead=rng.random() < 0.5, prefix_cache_states=rng.choice([1, 3]),
                      prefix_split_tokens=rng.choice([0, 24]))
    outputs = _simulate(sched, reqs, seed, stops=stops, crash_every=rng.choice([0, 0, 11]))
    for r in reqs:
        assert outputs[r.req_id] == _expected(r, stops), r.req_id
    assert sched.prefix.queries > sched.prefix.hits
    return sched.prefix.hits


@pytest.mark.parametrize("seed", range(16))
def test_prefix_cache_restores_states_that_hold_each_request_s_tokens(seed):
    _prefix_cache_run(seed)


def test_prefix_cache_hits_in_most_runs():
    """(Those runs restore prefixes: in some, preemptions under 14 blocks leave nothing cached long enough.)"""
    assert sum(1 for seed in range(16) if _prefix_cache_run(seed) > 0) >= 12


def test_request_ids_slice_prompt_and_output_without_joining_them():
    """`Request.ids(start, end)` is (prompt + output)[start:end] across the boundary, and `num_ids` its length: the
    scheduler never builds the joined list (a 250k-token prompt made each use ~1 ms, several a step)."""
    req = Request(req_id="r", prompt_ids=[10, 11, 12], params=SamplingParams(), stop_token_ids=set(), max_tokens=8)
    req.output_ids = [20, 21]
    joined = req.prompt_ids + req.output_ids
    assert req.num_ids == 5
    for start in range(6):
        for end in range(start, 7):
            assert req.ids(start, end) == joined[start:end], (start, end)


def test_a_request_failed_inside_a_step_ends_with_the_stage_message_and_the_others_go_on():
    """`TokenOut.error` (a request's sampling failed, or its step's PLE rows never reached the GPU): that request
    is released with the stage's message as its error; the step's other request keeps its token."""
    sched = Scheduler(num_blocks=8, block_size=16, max_num_seqs=2, max_num_batched_tokens=64,
                      num_microbatches=1, max_model_len=4096)
    sched.add(_req(0, 3, 5))
    sched.add(_req(1, 3, 5))
    sched.schedule(0)
    msg = "the server did not prepare this step's inputs in time; retry the request"
    touched = sched.on_result(0, [TokenOut("r0", 3, -1, error=msg), TokenOut("r1", 3, 9)])
    failed, ok = (next(r for r in touched if r.req_id == rid) for rid in ("r0", "r1"))
    assert failed.error == msg and failed.output_ids == [] and failed.finished == "error"
    assert ok.error is None and ok.output_ids == [9] and ok.finished is None
    assert "r0" in sched.schedule(0).finished


def test_a_token_the_grammar_refuses_fails_the_request_with_the_matcher_s_reason():
    """A matcher that gives up (llguidance's parser limits on a huge schema) says why; the message names it."""
    class Refusing:
        error = None

        def mask_bytes(self) -> bytes:
            return b"\xff"

        def accept(self, token: int) -> bool:
            self.error = "max_items_in_row exceeded"
            return False

        def is_finished(self) -> bool:
            return False

    sched = Scheduler(num_blocks=8, block_size=16, max_num_seqs=2, max_num_batched_tokens=64,
                      num_microbatches=1, max_model_len=4096)
    req = _req(0, 3, 5)
    req.grammar = Refusing()
    sched.add(req)
    sched.schedule(0)
    sched.on_result(0, [TokenOut("r0", 3, 9)])
    assert req.finished == "error" and req.error == "token 9 was sampled outside the grammar: max_items_in_row exceeded"
