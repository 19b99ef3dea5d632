"""Prefix caching at its edges: admissions undone, restarts, failed steps, cancellations between a hit's admission
and its first result (shared/prefix_cache.py, shared/scheduler.py)."""

from __future__ import annotations

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
