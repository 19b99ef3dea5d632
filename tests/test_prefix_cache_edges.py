"""Prefix caching at its edges: admissions undone, restarts, failed steps, cancellations between a hit's admission
and its first result (shared/prefix_cache.py, shared/scheduler.py)."""

from __future__ import annotations

import random

import pytest

from shared.protocol import TokenOut
from shared.sampling import SamplingParams
from shared.scheduler import Request, Scheduler


def _req(rid: str, ids: list[int], max_tokens: int = 4) -> Request:
    return Request(req_id=rid, prompt_ids=list(ids), params=SamplingParams(), stop_token_ids={0},
                   max_tokens=max_tokens)


def _sched(**kw) -> Scheduler:
    keys = dict(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, num_microbatches=1,
                max_model_len=4096, prefix_cache_states=2)
    return Scheduler(**{**keys, **kw})


def _step(sched: Scheduler, flying: list) -> bool:
    """Plan every idle micro-batch, then return the oldest plan in flight (token 7 for every sample)."""
    for mb in sched.idle_microbatches():
        plan = sched.schedule(mb)
        if plan is not None and plan.entries:
            flying.append(plan)
    if not flying:
        return False
    plan = flying.pop(0)
    sched.on_result(plan.microbatch, [TokenOut(e.req_id, e.context_len + e.num_tokens, 7)
                                      for e in plan.entries if e.sample])
    return True


def _run(sched: Scheduler, limit: int = 500) -> None:
    flying: list = []
    for _ in range(limit):
        if not _step(sched, flying) and not sched.waiting and not sched.running:
            return
    raise AssertionError("requests left unfinished")


# ---- usage and metrics --------------------------------------------------------------------------------------------

def test_an_admission_undone_for_want_of_blocks_neither_counts_nor_reports_its_hit():
    """A request that hits a cached prefix but finds no blocks for the rest stays queued; while it waits, the entry
    is evicted (a running request's decode wants the blocks) and the request is computed from its first token.
    Its usage must not report the prefix as cached, and the hits counter must equal the tokens really restored."""
    sched = _sched(num_blocks=8, prefix_cache_states=1)
    cached = list(range(100, 120))
    sched.add(_req("a", cached, max_tokens=1))
    _run(sched)
    assert [e.length for e in sched.prefix.entries] == [12]
    queries = sched.prefix.queries
    b = _req("b", list(range(500, 511)), max_tokens=12)        # 3 blocks, 3 more while it decodes
    r = _req("r", cached[:12] + list(range(200, 210)), max_tokens=2)   # hits, but wants 3 blocks more
    sched.add(b)
    sched.add(r)
    flying: list = []
    _step(sched, flying)
    assert r in sched.waiting and sched.prefix.entries[0].users == 0    # admission undone
    _run(sched)
    assert b.finished == r.finished == "length" and r.cached_tokens == 0     # the entry went before r's turn
    assert sched.prefix.hits == 0 and sched.prefix.queries == queries + 11 + 22    # each prompt looked up once


# ---- a simulated pipeline with cancellations, failed steps, per-request errors and restarts -----------------------

def _token(rid: str, pos: int) -> int:
    return pos * 7 % 50 + 1 + len(rid) % 3


def _fuzz(seed: int) -> int:
    """Requests sharing prefixes through a simulated pipeline whose stages run plans in plan order, with every plan's
    state effects (restores, snapshots, tokens fed) applied when the stages run it: a failed step runs nowhere. Now
    and then a request is cancelled, a step fails (`drop_from`), a request fails inside a step, or every stage
    restarts (`requeue_running`). Each entry must find its request's state holding exactly its tokens so far, and a
    request that ends normally must have exactly its tokens. Returns the tokens restored."""
    rng = random.Random(seed)
    base = [rng.randrange(60, 90) for _ in range(40)]
    reqs = []
    for i in range(16):
        cut = rng.choice([0, 4, 8, 9, 12, 16, 20, 24, 30])
        prompt = base[:cut] + [rng.randrange(60, 90) for _ in range(rng.randint(1, 30))]
        if rng.random() < 0.25 and reqs:
            prompt = list(rng.choice(reqs).prompt_ids)          # the same prompt again (n > 1, a retry)
        reqs.append(_req(f"r{i}", prompt, max_tokens=rng.randint(1, 12)))
        reqs[-1].want_prompt_logprobs = rng.random() < 0.1
    sched = _sched(num_blocks=rng.choice([12, 16, 40]), max_num_seqs=rng.choice([2, 4]),
                   max_num_batched_tokens=rng.choice([1, 6, 16, 40]), num_microbatches=rng.choice([1, 2]),
                   plan_ahead=rng.random() < 0.6, prefix_cache_states=rng.choice([1, 2, 4]),
                   prefix_split_tokens=rng.choice([0, 0, 12]))
    sched.prefix.margin = rng.choice([2, 8])
    pending = list(reqs)
    truth = {r.req_id: r.prompt_ids + [_token(r.req_id, len(r.prompt_ids) + k) for k in range(r.max_tokens)]
             for r in reqs}
    state: dict[int, list] = {}                 # slot -> tokens its state holds (None: garbage)
    flying: list = []                           # plans in flight, oldest first
    applied: set[int] = set()
    outputs = {r.req_id: [] for r in reqs}
    errored: set[str] = set()

    def apply_upto(step: int) -> None:
        for p in sorted((p for p in flying if p.step <= step and p.step not in applied), key=lambda p: p.step):
            applied.add(p.step)
            for e in p.entries:
                if e.restore is not None:
                    state[e.slot] = None if state.get(e.restore) is None else list(state[e.restore])
                    assert e.history == truth[e.req_id][:e.context_len][-32:]
                elif e.context_len == 0:
                    state[e.slot] = []
            for e in p.entries:
                for slot, snap in p.snapshots:
                    if slot == e.slot:
                        state[snap] = None if state.get(slot) is None else list(state[slot])
            for e in p.entries:
                if state.get(e.slot) is None and e.req_id in errored:
                    continue                    # a later plan of a request that failed inside a step
                assert state.get(e.slot) == truth[e.req_id][:e.context_len], (seed, e.req_id, e.context_len)
                state[e.slot] = state[e.slot] + (e.tokens if e.tokens is not None
                                                 else [_token(e.req_id, e.context_len)])

    for _ in range(3000):
        while pending and rng.random() < 0.5:
            sched.add(pending.pop(0))
        for _ in range(sched.depth):
            for mb in sched.idle_microbatches():
                plan = sched.schedule(mb)
                if plan is not None and plan.entries:
                    flying.append(plan)
        live = [r for r in reqs if r.req_id in sched.running or r in sched.waiting]
        if live and rng.random() < 0.03:
            sched.cancel(rng.choice(live).req_id)
        if not flying:
            if not pending and not sched.waiting and not sched.running:
                break
            continue
        roll = rng.random()
        if roll < 0.02:
            sched.requeue_running()
            flying.clear()
            applied.clear()
            state.clear()
            continue
        heads = [p for i, p in enumerate(flying) if all(q.microbatch != p.microbatch for q in flying[:i])]
        plan = rng.choice(heads)
        if roll < 0.06 and plan.step not in applied:
            steps, failed = sched.drop_from(plan.step)
            for r in failed:
                outputs[r.req_id].append("failed")
            flying[:] = [p for p in flying if p.step not in steps]
            continue
        apply_upto(plan.step)
        flying.remove(plan)
        outs = [TokenOut(e.req_id, e.context_len + e.num_tokens, _token(e.req_id, e.context_len + e.num_tokens))
                for e in plan.entries if e.sample]
        if outs and roll < 0.09:
            bad = rng.choice(outs)
            bad.token, bad.error = -1, "failed inside the step"
            slot = next(e.slot for e in plan.entries if e.req_id == bad.req_id)
            state[slot] = None                  # whatever the failed step left
            errored.add(bad.req_id)
        for r in sched.on_result(plan.microbatch, outs):
            outputs[r.req_id].extend(o.token for o in r.events if not o.error)
            r.events.clear()
    else:
        raise AssertionError("requests left unfinished")
    for r in reqs:
        got = [t for t in outputs[r.req_id] if t != "failed"]
        n = len(r.prompt_ids)
        assert got == truth[r.req_id][n:n + len(got)], (seed, r.req_id)
        if r.finished in ("stop", "length"):
            assert len(got) == r.max_tokens, (seed, r.req_id)
    assert sched.blocks.used_slots == 0 and sched.blocks.used_blocks == sched.prefix.cached_blocks
    assert not any(e.users for e in sched.prefix.entries)
    assert len(sched.prefix.entries) + len(sched.prefix._free_states) == sched.prefix.num_states
    return sched.prefix.hits


# ---- a stage restarted under cached prefixes ----------------------------------------------------------------------

@pytest.mark.parametrize("core_clears", [True, False])
def test_a_stage_restarted_while_idle_never_serves_from_snapshots_it_lost(tiny_checkpoint, core_clears):
    """With `recovery_timeout` 0 a component that comes back while nothing runs has nothing to fail, but its
    snapshots are gone: the engine core clears the prefix cache (`Scheduler.forget_cached_states`), so the restarted
    stage (a fresh runner: empty snapshot slots and KV) computes the next requests from their first token. Should a
    plan still restore from a slot the stage never saved (`core_clears` off: a plan queued to the new process before
    the core saw the restart), the stage refuses that step, the request fails naming it, the entry is dropped, and
    the same request again gets the tokens computed without the cache."""
    import time

    from shared.engine_core import EngineFailed, GenerationRequest
    from shared.sampling import read_generation_config
    from stage_worker.inprocess_executor import local_engine_core
    from stage_worker.runner import StageRunner
    from conftest import collect_events

    gen = read_generation_config(tiny_checkpoint)
    rng = random.Random(3)
    first = [rng.randrange(10, 2000) for _ in range(50)]
    second = first + [rng.randrange(10, 2000) for _ in range(10)]
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=1).with_defaults(gen)
    keys = dict(stages=2, max_model_len=256, block_size=16, max_num_seqs=4, recovery_timeout=0)

    def serve(core, rid, ids):
        return collect_events(core, [GenerationRequest(rid, ids, params)])[0]

    core = local_engine_core(tiny_checkpoint, enable_prefix_caching=False, **keys)
    try:
        want = serve(core, "ref", second)
    finally:
        core.stop()
    core = local_engine_core(tiny_checkpoint, **keys)
    try:
        serve(core, "a", first)
        assert [e.length for e in core.scheduler.prefix.entries] == [32]
        if not core_clears:
            core.scheduler.forget_cached_states = lambda: None
        executor = core.executor
        with core._lock:                         # stage 1 comes back as a new process
            old = executor.runners[1]
            executor.runners[1] = StageRunner(old.model, old.cluster, 1)
            back = [["stage1"]]
            executor.restarted = lambda: back.pop() if back else []
        deadline = time.monotonic() + 10
        while back and time.monotonic() < deadline:
            time.sleep(0.01)
        out = [serve(core, "b", second), serve(core, "c", second)]
    finally:
        core.stop()
    if not core_clears:
        assert isinstance(out[0][-1], EngineFailed) and "stage1 failed a step" in str(out[0][-1])
        out = out[1:]                            # the entry went with the failure
    for events in out:                           # nothing computed from a state the stage lost
        assert not isinstance(events[-1], Exception), events
        assert [e.token_id for e in events] == [e.token_id for e in want]
        assert [e.logprob for e in events] == pytest.approx([e.logprob for e in want], abs=1e-4)


@pytest.mark.parametrize("seed", range(24))
def test_cancellations_failed_steps_and_restarts_keep_every_request_s_tokens(seed):
    _fuzz(seed)


def test_the_fuzzed_runs_restore_prefixes():
    assert sum(1 for seed in range(24, 40) if _fuzz(seed) > 0) >= 8


# ---- the engine core: cache on against cache off ------------------------------------------------------------------

def _waves(seed: int) -> list[list[tuple[list[int], bool, float, int]]]:
    """Waves of (prompt, echo, temperature, max_tokens) sent at once, each wave after the one before has ended: the
    same prompt four times at once (n=4), then again; prompts one short of a block, a block, a block and one and
    two past what is cached; a prompt equal to a cached prefix; echo requests on cached prefixes; seeded draws; a
    prompt that reaches max_model_len."""
    rng = random.Random(seed)
    words = lambda n: [rng.randrange(10, 2000) for _ in range(n)]     # noqa: E731
    system = words(40)
    turn = system + words(9)
    return [
        [(turn, False, 0.0, 5)] * 4 + [(words(15), False, 0.0, 3), (words(16), True, 0.0, 3)],
        [(turn, False, 0.8, 4)] * 4 + [(turn + words(1), False, 0.0, 4), (turn + words(2), True, 0.0, 3),
                                       (system[:32], False, 0.0, 3), (system[:33], False, 0.0, 3),
                                       (system[:34], False, 0.8, 3), (system[:16], True, 0.0, 2)],
        [(turn + words(20), False, 0.0, 6), (system + words(30), True, 0.0, 2), (system[:32] + words(2), False, 0.0, 3),
         (turn + words(128 - len(turn) - 6), False, 0.0, 6)],
    ]


def _serve_waves(tiny_checkpoint, waves, **keys):
    from shared.engine_core import GenerationRequest
    from shared.sampling import read_generation_config
    from stage_worker.inprocess_executor import local_engine_core
    from conftest import collect_events

    gen = read_generation_config(tiny_checkpoint)
    core = local_engine_core(tiny_checkpoint, **{"max_model_len": 128, "block_size": 16, **keys})
    try:
        out = []
        for w, wave in enumerate(waves):
            reqs = [GenerationRequest(f"w{w}-{i}", ids, SamplingParams(
                max_tokens=n, temperature=t, seed=100 * w + i, logprobs=1).with_defaults(gen), prompt_logprobs=echo)
                for i, (ids, echo, t, n) in enumerate(wave)]
            out += collect_events(core, reqs)
        prefix = core.scheduler.prefix
        assert core.scheduler.blocks.used_slots == 0
        assert core.scheduler.blocks.used_blocks == (prefix.cached_blocks if prefix is not None else 0)
        return out, prefix
    finally:
        core.stop()


@pytest.mark.parametrize("stages,chunk,plan_ahead", [(2, 12, True), (1, 40, False)])
def test_concurrent_repeats_block_edges_and_echo_serve_the_uncached_tokens(tiny_checkpoint, stages, chunk,
                                                                           plan_ahead):
    waves = _waves(stages)
    keys = dict(stages=stages, max_num_batched_tokens=chunk, async_scheduling=plan_ahead, max_num_seqs=6,
                prefix_cache_states=3)
    off, _ = _serve_waves(tiny_checkpoint, waves, enable_prefix_caching=False, **keys)
    on, prefix = _serve_waves(tiny_checkpoint, waves, **keys)
    cached = []
    for a, b in zip(off, on, strict=True):
        assert not any(isinstance(e, Exception) for e in a + b), (a, b)
        assert [e.token_id for e in a] == [e.token_id for e in b]
        assert [e.logprob for e in a] == pytest.approx([e.logprob for e in b], abs=1e-4)
        if a[0].prompt_logprobs is not None:
            assert list(a[0].prompt_logprobs.arrays()[0]) == pytest.approx(list(b[0].prompt_logprobs.arrays()[0]),
                                                                           abs=1e-4)
        cached.append(b[0].cached_tokens or 0)
    assert prefix.hits == sum(cached) > 0


def test_a_one_token_step_budget_still_admits_requests():
    """max_num_batched_tokens = 1 (valid, and served without the cache): a restoring chunk needs two tokens, so
    requests are admitted without a hit rather than never."""
    sched = _sched(max_num_batched_tokens=1)
    reqs = [_req("a", list(range(100, 120)), max_tokens=2), _req("b", list(range(100, 122)), max_tokens=2)]
    for r in reqs:
        sched.add(r)
        _run(sched)
        assert r.finished == "length" and r.output_ids == [7, 7]


def test_one_prompt_sent_four_times_at_once_is_computed_once(tiny_checkpoint):
    """n = 4 (or four clients with one prompt): the first request computes and saves the prefix, the other three
    wait for it (`Scheduler._held`) and restore it, instead of four prefills side by side each reserving a snapshot
    slot; the tokens are those computed without the cache."""
    rng = random.Random(11)
    ids = [rng.randrange(10, 2000) for _ in range(100)]
    waves = [[(ids, False, 0.8, 5)] * 4]
    keys = dict(stages=2, max_num_batched_tokens=24, async_scheduling=True, max_num_seqs=6, prefix_cache_states=3)
    off, _ = _serve_waves(tiny_checkpoint, waves, enable_prefix_caching=False, **keys)
    on, prefix = _serve_waves(tiny_checkpoint, waves, **keys)
    for a, b in zip(off, on, strict=True):
        assert [e.token_id for e in a] == [e.token_id for e in b]
        assert [e.logprob for e in a] == pytest.approx([e.logprob for e in b], abs=1e-4)
    assert sorted(b[0].cached_tokens or 0 for b in on) == [0, 80, 80, 80] and prefix.hits == 240
    assert len(prefix.entries) == 1


def test_parallel_conversations_with_one_system_prompt_compute_it_once(tiny_checkpoint):
    """Three conversations sent at once that share a 300-token system prompt and part after it: the first saves its
    state where the others part from it (a target `_held` adds), and they restore it."""
    rng = random.Random(12)
    system = [rng.randrange(10, 2000) for _ in range(300)]
    waves = [[(system + [rng.randrange(10, 2000) for _ in range(40)], False, 0.0, 4) for _ in range(3)]]
    keys = dict(stages=1, max_num_batched_tokens=64, async_scheduling=True, max_num_seqs=6, prefix_cache_states=4,
                max_model_len=512)
    off, _ = _serve_waves(tiny_checkpoint, waves, enable_prefix_caching=False, **keys)
    on, prefix = _serve_waves(tiny_checkpoint, waves, **keys)
    for a, b in zip(off, on, strict=True):
        assert [e.token_id for e in a] == [e.token_id for e in b]
        assert [e.logprob for e in a] == pytest.approx([e.logprob for e in b], abs=1e-4)
    assert sorted(b[0].cached_tokens or 0 for b in on) == [0, 288, 288]
