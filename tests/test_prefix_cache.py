"""Prefix caching (shared/prefix_cache.py): the cache's bookkeeping, and the engine core serving the same tokens and
logprobs with it as without it, across stages, prefill chunks, plan-ahead, evictions and preemption."""

from __future__ import annotations

import random

import pytest
import torch

from shared.block_manager import BlockManager
from shared.engine_core import GenerationRequest
from shared.prefix_cache import PrefixCache
from shared.sampling import SamplingParams, read_generation_config
from stage_worker.inprocess_executor import local_engine_core
from conftest import collect_events


def _cache(blocks: int = 16, states: int = 2, block_size: int = 4, margin: int = 2):
    bm = BlockManager(num_blocks=blocks, num_slots=2)
    return bm, PrefixCache(bm, block_size, [3 + i for i in range(states)], margin=margin)


def test_match_takes_the_longest_cached_prefix_that_leaves_two_tokens():
    bm, cache = _cache()
    a, b = bm.allocate(1), bm.allocate(2)
    cache.add(list(range(4)), a, cache.reserve_state())
    cache.add(list(range(8)), a + b[:1], cache.reserve_state())
    assert bm.refcount(a[0]) == 3 and bm.refcount(b[0]) == 2       # the cache holds its blocks once more
    assert cache.match(list(range(10))).length == 8
    assert cache.match(list(range(9))).length == 4                 # 8 would leave one token
    assert cache.match([0, 1, 2, 9, 9, 9]) is None                 # diverges inside the first block
    assert cache.match([1, 2, 3, 4, 5, 6]) is None
    assert cache.queries == 10 + 9 + 6 + 6 and cache.hits == 12


def test_snapshots_go_before_the_margin_and_where_the_prompt_parts_from_cached_ones():
    bm, cache = _cache(block_size=4, margin=2)
    assert cache.snapshot_positions(list(range(10)), 0) == [8]
    assert cache.snapshot_positions(list(range(9)), 0) == [4]
    assert cache.snapshot_positions(list(range(5)), 0) == []       # boundary 0: nothing to save
    assert cache.snapshot_positions(list(range(10)), 8) == []      # restored at 8 already
    cache.add(list(range(12)), bm.allocate(3), cache.reserve_state())
    for parts_at in range(0, 12):                                  # a prompt that agrees for parts_at tokens
        ids = list(range(parts_at)) + [99] * 20
        assert cache.shared_length(ids) == parts_at // 4 * 4
        assert cache.snapshot_positions(ids, 0) == sorted({p for p in (parts_at // 4 * 4, (len(ids) - 2) // 4 * 4)
                                                           if p})
    assert cache.shared_length(list(range(30))) == 12              # all of the entry (and a hit)


def test_eviction_is_least_recently_used_and_spares_entries_about_to_be_restored():
    bm, cache = _cache(blocks=8, states=2)
    for first in (0, 100):
        blocks = bm.allocate(1)
        cache.add(list(range(first, first + 4)), blocks, cache.reserve_state())
        bm.release(blocks)                                         # its request finished: the cache holds them
    cache.match(list(range(6)))                                    # the first entry is now the most recent
    cache.entries[0].users = 1
    state = cache.reserve_state()                                  # no free slot: evicts the older-used one
    assert state is not None and [e.tokens[0] for e in cache.entries] == [0]
    assert bm.used_blocks == 1                                     # ... and its block (held by nobody else)
    assert cache.reserve_state() is None and not cache.evict_one()  # the other one is in use
    cache.entries[0].users = 0
    assert cache.evict_one() and bm.used_blocks == 0 and cache.cached_blocks == 0


def test_evicting_for_blocks_spares_entries_whose_blocks_requests_share():
    bm, cache = _cache(blocks=8, states=3)
    shared = bm.allocate(1)                                        # a running request's system prompt
    cache.add(list(range(4)), shared, cache.reserve_state())
    own = bm.allocate(1)
    cache.add(list(range(100, 104)), own, cache.reserve_state())
    bm.release(own)                                                # that request finished: only the cache holds it
    cache.match(list(range(100, 106)))                             # ... and it is the most recently used
    assert cache.evict_one(for_blocks=True) and [e.tokens[0] for e in cache.entries] == [0]
    assert bm.used_blocks == 1 and not cache.evict_one(for_blocks=True)   # frees nothing: kept
    assert cache.evict_one() and not cache.entries                 # (a snapshot slot wanted: any entry goes)


def test_the_same_prefix_twice_keeps_one_entry_and_clear_releases_everything():
    bm, cache = _cache(states=3)
    blocks = bm.allocate(2)
    cache.add(list(range(8)), blocks, cache.reserve_state())
    cache.add(list(range(8)), blocks, cache.reserve_state())
    assert len(cache.entries) == 1 and bm.refcount(blocks[0]) == 2
    assert cache.idle_blocks == 0 and cache.cached_blocks == 2      # a running request still holds them
    bm.release(blocks)
    assert cache.idle_blocks == 2                                  # now only the cache: as good as free
    cache.clear()
    assert bm.used_blocks == 0 and cache.reserve_state() is not None and cache.reserve_state() is not None \
        and cache.reserve_state() is not None


# ---- the engine core ------------------------------------------------------------------------------------------------

def _turns(seed: int) -> list[list[int]]:
    """An agent's conversation: each prompt is the one before, plus a reply and a new message (some long enough to
    span several blocks and prefill chunks); then an unrelated prompt, one sharing only a first part, and three that
    share their first 40 tokens: the second saves its state where it parts from the first, the third restores it."""
    rng = random.Random(seed)
    words = lambda n: [rng.randrange(10, 2000) for _ in range(n)]     # noqa: E731
    system = words(37)
    turns = [system + words(12)]
    for n in (23, 41, 5):
        turns.append(turns[-1] + words(9) + words(n))
    other = words(40)               # a second system prompt: three conversations, each parting after it
    return turns + [words(30), system + words(20), other + words(60), other + words(60), other + words(30)]


def _serve(tiny_checkpoint, prompts: list[list[int]], greedy: bool, **keys):
    """Each prompt after the one before has finished (as an agent sends them): their events, and the hits."""
    core = local_engine_core(tiny_checkpoint, max_model_len=256, block_size=16, **keys)
    gen = read_generation_config(tiny_checkpoint)
    try:
        out = []
        for i, ids in enumerate(prompts):
            params = SamplingParams(max_tokens=6, temperature=0.0 if greedy else 0.8, seed=11 + i,
                                    logprobs=2).with_defaults(gen)
            events = collect_events(core, [GenerationRequest(f"r{i}", ids, params)])[0]
            assert not any(isinstance(e, Exception) for e in events), events
            out.append(events)
        prefix = core.scheduler.prefix
        hits = prefix.hits if prefix is not None else 0
        assert core.scheduler.blocks.used_blocks == (prefix.cached_blocks if prefix is not None else 0)
        assert core.scheduler.blocks.used_slots == 0
        return out, hits
    finally:
        core.stop()


def _same(a: list[list], b: list[list]) -> None:
    for ea, eb in zip(a, b, strict=True):
        assert [e.token_id for e in ea] == [e.token_id for e in eb]
        assert [e.logprob for e in ea] == pytest.approx([e.logprob for e in eb], abs=1e-4)


@pytest.mark.parametrize("stages,chunk,plan_ahead,split", [(1, 512, True, -1), (3, 8, True, -1), (2, 16, False, 1024),
                                                          (1, 24, True, 1024)])
def test_cached_prefixes_serve_the_tokens_computing_everything_serves(tiny_checkpoint, stages, chunk, plan_ahead,
                                                                      split):
    """(split 1024: chunks are never cut for a snapshot, as on a GPU; the states saved are chunk starts.)"""
    prompts = _turns(stages)
    keys = dict(stages=stages, max_num_batched_tokens=chunk, async_scheduling=plan_ahead, max_num_seqs=4,
                prefix_cache_split_tokens=split)
    for greedy in (True, False):
        off, _ = _serve(tiny_checkpoint, prompts, greedy, enable_prefix_caching=False, **keys)
        on, hits = _serve(tiny_checkpoint, prompts, greedy, **keys)
        _same(off, on)
        # every later turn restores the turn before's snapshot, later prompts the system prompts'
        assert hits >= 16 * 3 + 32 + 32


def test_evictions_and_preemptions_keep_the_tokens(tiny_checkpoint):
    """Blocks so few that cached prefixes are evicted and running requests preempted, requests sharing prefixes
    admitted together and after each other, one snapshot slot."""
    gen = read_generation_config(tiny_checkpoint)
    prompts = _turns(7)
    requests = lambda: [GenerationRequest(f"r{i}-{j}", ids, SamplingParams(  # noqa: E731
        max_tokens=8, temperature=0.0, logprobs=1).with_defaults(gen)) for j in range(2)
        for i, ids in enumerate(prompts)]
    results = []
    for keys in (dict(enable_prefix_caching=False), dict(prefix_cache_states=1)):
        core = local_engine_core(tiny_checkpoint, stages=2, max_model_len=224, block_size=16, max_num_seqs=4,
                                 max_num_batched_tokens=24, num_blocks=14, **keys)
        try:
            out = collect_events(core, requests()) + collect_events(core, requests())
            for events in out:
                assert not any(isinstance(e, Exception) for e in events), events
            assert core.scheduler.num_preemptions > 0
            if core.scheduler.prefix is not None:
                assert core.scheduler.prefix.hits > 0
                # every prompt counted once, however often its request was preempted and admitted again
                assert core.scheduler.prefix.queries == 2 * sum(2 * len(ids) for ids in prompts)
            results.append(out)
        finally:
            core.stop()
    _same(*results)


def test_served_conversation_restores_prefixes_through_the_ple_service(tiny_checkpoint):
    """The real cluster (two stage processes and the PLE service, whose n-gram contexts start from the restoring
    entries' history): an agent's turns as token prompts, one after the other, serve the tokens and logprobs the
    in-process engine computes without the cache; /metrics counts the hits."""
    import httpx

    from conftest import free_port
    from gateway.launcher import Cluster, ServeOptions

    prompts = _turns(5)
    reference, _ = _serve(tiny_checkpoint, prompts, True, enable_prefix_caching=False, max_num_seqs=4)
    opts = ServeOptions(model=tiny_checkpoint, stages=2, port=free_port(),
                        extra={"max_num_batched_tokens": 24, "block_size": 16, "max_model_len": 256})
    with Cluster(opts) as c:
        served, cached = [], []
        for ids in prompts:
            r = httpx.post(c.url + "/v1/completions", timeout=120, json={
                "model": "moepipe", "prompt": ids, "max_tokens": 6, "temperature": 0, "logprobs": 2})
            assert r.status_code == 200, r.text
            served.append(r.json()["choices"][0]["logprobs"]["token_logprobs"])
            cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        metrics = httpx.get(c.url + "/metrics").text
    for events, logprobs in zip(reference, served, strict=True):
        assert logprobs == pytest.approx([e.logprob for e in events], abs=1e-4)
    hits = [line for line in metrics.splitlines() if line.startswith("moepipe_prefix_cache_hits_total ")]
    assert hits and float(hits[0].split()[1]) == sum(cached) >= 16 * 3 + 32 + 32
    # each later turn of the conversation restores all but the last block or so of the turn before
    assert cached[0] == cached[4] == 0 and all(cached[i] >= len(prompts[i - 1]) - 8 - 16 for i in (1, 2, 3))
    assert cached[5] == 32                                       # the system prompt's first two blocks
    assert cached[6] == cached[7] == 0 and cached[8] == 32       # where the second and first conversations parted


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("stages", [1, 2])
def test_on_a_gpu_cached_prefixes_serve_the_tokens_computing_everything_serves(tiny_checkpoint, stages):
    """The kernels, CUDA graphs and launch-ahead: the state copies queue between replays on the stage's stream, and
    chunks are cut at a snapshot target only where that saves 1,024 tokens (the GPU default): chunk starts."""
    prompts = _turns(stages)
    keys = dict(stages=stages, max_num_batched_tokens=24, max_num_seqs=4, device="cuda")
    off, _ = _serve(tiny_checkpoint, prompts, True, enable_prefix_caching=False, **keys)
    on, hits = _serve(tiny_checkpoint, prompts, True, **keys)
    assert hits >= 16 * 3 + 32 + 32
    for ea, eb in zip(off, on, strict=True):
        assert [e.token_id for e in ea] == [e.token_id for e in eb]
        assert [e.logprob for e in ea] == pytest.approx([e.logprob for e in eb], abs=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_a_served_ple_stage_launched_ahead_restores_prefixes(tiny_checkpoint):
    """One GPU stage with the PLE service: decode graphs wait on the device for the mailbox's rows
    (ple_launch_ahead), whose n-gram contexts a restored request's state slot must hold."""
    import httpx

    from conftest import free_port
    from gateway.launcher import Cluster, ServeOptions

    prompts, runs = _turns(9), []
    for on in (False, True):
        opts = ServeOptions(model=tiny_checkpoint, stages=1, device="cuda", port=free_port(),
                            extra={"max_num_batched_tokens": 24, "block_size": 16, "max_model_len": 256,
                                   "enable_prefix_caching": on})
        with Cluster(opts) as c:
            out = []
            for ids in prompts:
                r = httpx.post(c.url + "/v1/completions", timeout=300, json={
                    "model": "moepipe", "prompt": ids, "max_tokens": 8, "temperature": 0, "logprobs": 1})
                assert r.status_code == 200, r.text
                out.append((r.json()["choices"][0]["text"], r.json()["choices"][0]["logprobs"]["token_logprobs"],
                            r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]))
        runs.append(out)
    assert sum(c for _, _, c in runs[1]) >= 16 * 3 + 32 + 32 and not any(c for _, _, c in runs[0])
    for (ta, la, _), (tb, lb, _) in zip(*runs):
        assert ta == tb and la == pytest.approx(lb, abs=2e-3)
