"""bench/expert_cache_sim.py: the residency policies on traces whose answers are known, and the CLI on the shipped
demo-model traces."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import expert_cache_sim as sim  # noqa: E402


def test_usage_counts_selections_per_layer():
    rng = np.random.default_rng(0)
    ids = np.stack([np.stack([rng.choice(8, 3, replace=False) for _ in range(2)]) for _ in range(50)])   # [50, 2, 3]
    counts = sim.usage(ids, 8)
    for layer in range(2):
        assert counts[layer].tolist() == np.bincount(ids[:, layer].ravel(), minlength=8).tolist()


def test_a_working_set_that_fits_is_all_hits_after_warm_up():
    T = 200
    ids = np.stack([np.array([[t % 4, (t + 1) % 4]]) for t in range(T)])            # experts 0-3 only, k = 2
    static = sim.replay(ids, 16, 4, sim.Policy("s", "static"), sim.usage(ids, 16))
    assert static == {"hit_rate": 1.0, "moves_per_token": 0.0}
    lru = sim.replay(ids, 16, 4, sim.Policy("lru", "recency"))
    # cold start: tokens 0 and 1 miss all their four selections, token 2 misses none (experts 2, 3 loaded at t=1)
    assert lru["hit_rate"] == (2 * T - 4) / (2 * T)
    assert lru["moves_per_token"] == 4 / T                                           # four loads, never an eviction


def test_lru_thrashes_on_a_cycle_one_larger_than_the_cache_and_decayed_counts_do_not():
    C = 4
    ids = np.array([[[t % (C + 1)]] for t in range(1000)])                             # k = 1, cycle over C + 1
    assert sim.replay(ids, 8, C, sim.Policy("lru", "recency"))["hit_rate"] == 0.0
    decay = sim.replay(ids, 8, C, sim.Policy("d", "decay", half_life=10_000, every=50))
    assert decay["hit_rate"] > 0.7                                   # a fixed 4 of the 5 stay resident
    assert decay["moves_per_token"] < 0.05


def test_cli_on_the_demo_traces(tmp_path):
    out = tmp_path / "sim.json"
    assert sim.main(["--capacity", "8", "--tokens", "600", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["meta"]["num_experts"] == 32 and res["meta"]["top_k"] == 4
    rows = res["results"]
    kinds = {"code", "prose", "docs", "german"}
    assert {r["workload"] for r in rows} == kinds | {"switch", "interleave4"}
    assert len(rows) == 4 * 8 + 2 * 7                               # static-kind needs a single-kind workload
    assert all(0.0 <= r["hit_rate"] <= 1.0 and r["tokens"] == 600 for r in rows)
    # the demo model's routing is skewed and local: 8 of 32 experts chosen at random would serve 0.25
    static_kind = [r["hit_rate"] for r in rows if r["policy"] == "static-kind"]
    assert np.mean(static_kind) > 0.35, static_kind
    assert all(r["hit_rate"] > 0.4 for r in rows if r["policy"] == "decay-64/1" and r["workload"] in kinds)


def test_swap_policy_moves_a_new_working_set_in_one_pair_per_round():
    """The server's policy: starting from a static set, a workload that moved to other experts is followed one
    swap per layer per round, and a stable workload stops moving."""
    T, E, C = 400, 8, 2
    ids = np.array([[[4 + t % 2]] for t in range(T)])                  # k = 1: experts 4 and 5 only
    start = np.zeros((1, E))
    start[0, :2] = 10.0                                                 # the static set: experts 0 and 1
    r = sim.replay(ids, E, C, sim.Policy("swap", "swap", half_life=64, every=8, margin=2), start)
    assert r["moves_per_token"] * T == 2                                # two moves, then nothing more to gain
    assert r["hit_rate"] > 0.9


def test_swap_moves_per_round_and_warm_up_tokens_are_not_counted():
    """Two new experts appear at once: one move a round brings them in over two rounds, two moves a round in one;
    `skip` leaves the warm-up tokens out of both the hits and the moves."""
    E, T = 8, 40
    ids = np.array([[[0, 1]]] * 10 + [[[4, 5]]] * (T - 10))                      # [T, 1, 2]: experts 0-1, then 4-5
    start = np.zeros((1, E))
    start[0, :4] = [4, 3, 2, 1]                                                   # resident: 0-3 (capacity 4)
    one = sim.replay(ids, E, 4, sim.Policy("s1", "swap", 4.0, 1, 0.5, 1), start)
    two = sim.replay(ids, E, 4, sim.Policy("s2", "swap", 4.0, 1, 0.5, 2), start)
    # token 10 misses both in either; with one move a round, token 11 still misses the second
    assert one["hit_rate"] == (2 * T - 3) / (2 * T) and two["hit_rate"] == (2 * T - 2) / (2 * T)
    assert one["moves_per_token"] == two["moves_per_token"] == 2 / T
    late = sim.replay(ids, E, 4, sim.Policy("s2", "swap", 4.0, 1, 0.5, 2), start, skip=12)
    assert late == {"hit_rate": 1.0, "moves_per_token": 0.0}


def _skewed_trace(seed: int, L: int, E: int, k: int, T: int):
    """Selections [T, L, k] from skewed per-layer expert popularity, four random cold experts a layer, and the
    resident mask they leave."""
    rng = np.random.default_rng(seed)
    weights = rng.dirichlet(np.full(E, 0.3), size=L)
    ids = np.stack([np.stack([rng.choice(E, k, replace=False, p=weights[layer]) for layer in range(L)])
                    for _ in range(T)])
    cold = [sorted(rng.choice(E, 4, replace=False).tolist()) for _ in range(L)]
    resident = np.ones((L, E), dtype=bool)
    for layer, c in enumerate(cold):
        resident[layer, c] = False
    return ids, cold, resident


def test_the_swap_replay_is_the_servers_move_round():
    """The simulation's `swap` policy (what `bench/expert_offload.py --simulate` and the policy defaults rest on)
    gives the host reads and moves the server's own round gives on the same selections: `expert_moves.decide` and
    `settle_ref` over slot-ordered counts, the router's selections counted at the slots their experts hold, a round
    after every `every` tokens (as `StageRunner.launch` and the benchmark run it). Ties included: integer counts."""
    import torch

    from stage_worker.kernels.expert_moves import decide
    from stage_worker.kernels.expert_moves_ref import settle_ref

    L, E, k, T = 3, 16, 2, 600
    ids, cold, resident = _skewed_trace(3, L, E, k, T)
    for every, half_life, margin in ((1, 16.0, 0.5), (4, 64.0, 1.0), (2, 8.0, 0.0)):
        want = sim._replay_swap(ids, E, resident, sim.Policy("s", "swap", half_life=half_life, every=every,
                                                             margin=margin))
        hot = torch.full((L,), E - 4, dtype=torch.int64)
        order = [[e for e in range(E) if e not in c] + c for c in cold]        # slot -> expert, as attach_tables
        expert_of_slot = torch.tensor(order, dtype=torch.int32)
        counts = torch.zeros(L, E)
        moves = torch.zeros(L, dtype=torch.int64)
        reads = 0
        for t in range(T):
            slot_of = torch.empty(L, E, dtype=torch.int64).scatter_(1, expert_of_slot.long(),
                                                                    torch.arange(E).expand(L, E).contiguous())
            slots = slot_of.gather(1, torch.from_numpy(ids[t]))                # [L, k]
            reads += int((slots >= hot[:, None]).sum())
            counts.scatter_add_(1, slots, torch.ones(L, k))
            if (t + 1) % every == 0:
                dec = decide(counts, hot, 0.5 ** (every / half_life), margin)
                settle_ref(counts, expert_of_slot, moves, dec)
        assert reads == round((1 - want["hit_rate"]) * T * L * k), (every, half_life, margin)
        assert int(moves.sum()) == round(want["moves_per_token"] * T * L), (every, half_life, margin)
        assert int(moves.sum()) > 0


def test_the_claim_replay_is_the_servers_moves_on_read():
    """`_replay_claim` (what `bench/expert_offload.py --simulate --async-moves` rests on) gives the host reads and
    moves of the server's moves on read on the same selections: the router's claim (`count_ref` with a claim, as
    the reference path and the benchmark's replay make it) and `claim_round_ref` over a stage laid out as
    `attach_tables` lays it out (live device experts, the spare, the host experts; slot map by expert id)."""
    import torch

    from stage_worker.kernels.expert_moves_ref import claim_round_ref
    from stage_worker.kernels.moe_ref import RouteCounts, count_ref

    L, E, k, T = 3, 16, 2, 600
    ids, cold, resident = _skewed_trace(4, L, E, k, T)
    for every, half_life, margin in ((1, 16.0, 0.5), (4, 64.0, 1.0), (2, 8.0, 0.0)):
        want = sim._replay_claim(ids, E, resident, sim.Policy("c", "swap", half_life=half_life, every=every,
                                                              margin=margin))
        S = E + 2
        orders = [[e for e in range(E) if e not in c] + [-1, -1] + c for c in cold]
        eos = torch.tensor(orders, dtype=torch.int32)
        smap = torch.tensor([[o.index(e) for e in range(E)] for o in orders], dtype=torch.int32)
        counts, moves = torch.zeros(L, S), torch.zeros(L, dtype=torch.int64)
        hot = torch.full((L,), E - 4 + 2, dtype=torch.int64)
        state = torch.tensor([[E - 4, E - 3, -1, -1]] * L, dtype=torch.int64)
        claim, thr = torch.full((L,), -1, dtype=torch.int32), torch.full((L,), float("inf"))
        reads = torch.zeros(L, dtype=torch.int64)
        for t in range(T):
            for layer in range(L):
                slots = smap[layer][torch.from_numpy(ids[t, layer])]
                count_ref(slots[None], RouteCounts(counts[layer], reads[layer:layer + 1], int(hot[layer]),
                                                   claim[layer:layer + 1], thr[layer:layer + 1]))
            if (t + 1) % every == 0:
                claim_round_ref(counts, eos, smap, hot, moves, state, claim, thr, 0.5 ** (every / half_life),
                                margin)
        assert int(reads.sum()) == round((1 - want["hit_rate"]) * T * L * k), (every, half_life, margin)
        assert int(moves.sum()) == round(want["moves_per_token"] * T * L), (every, half_life, margin)
        assert int(moves.sum()) > 0


def test_prefetched_experts_leave_the_critical_path():
    """`_replay_claim(predicted=)` (bench/expert_prefetch_sim.py): no prediction leaves every miss on the critical
    path; predicting the actual selections leaves none and prefetches exactly the misses; predicting one of each
    token's selections per layer leaves the others. Moves and residency hits never depend on the prediction."""
    L, E, k, T = 3, 16, 2, 400
    ids, _, resident = _skewed_trace(5, L, E, k, T)
    for margin in (1e9, 0.5):                                  # no moves; the server's moves
        policy = sim.Policy("c", "swap", half_life=16.0, every=1, margin=margin)
        base = sim._replay_claim(ids, E, resident, policy, skip=50)
        misses = (1 - base["hit_rate"]) * L * k
        assert base["critical_reads_per_token"] == pytest.approx(misses) and misses > 0
        assert base["prefetches_per_token"] == 0
        none = sim._replay_claim(ids, E, resident, policy, skip=50, predicted=np.full((T, L, 3), -1))
        assert none == base
        oracle = sim._replay_claim(ids, E, resident, policy, skip=50, predicted=ids)
        assert oracle["critical_reads_per_token"] == 0
        assert oracle["prefetches_per_token"] == pytest.approx(oracle["prefetches_used_per_token"])
        assert oracle["prefetches_used_per_token"] == pytest.approx(misses)
        first = sim._replay_claim(ids, E, resident, policy, skip=50, predicted=ids[:, :, :1])
        assert 0 < first["critical_reads_per_token"] < misses
        assert first["critical_reads_per_token"] + first["prefetches_used_per_token"] == pytest.approx(misses)
        for r in (none, oracle, first):
            assert (r["hit_rate"], r["moves_per_token"]) == (base["hit_rate"], base["moves_per_token"])


def test_the_claims_replay_with_one_claim_and_two_spares_is_the_claim_replay():
    """`_replay_claims` (bench/expert_moves_batch.py: C claims a layer a step, S spares, B streams) at C 1, S 2 gives
    exactly `_replay_claim`'s hits and moves, one token a step and two streams' tokens a step alike."""
    L, E, k, T = 3, 16, 2, 600
    for seed in (6, 7):
        ids, _, resident = _skewed_trace(seed, L, E, k, T)
        two = ids.reshape(T // 2, 2, L, k).transpose(0, 2, 1, 3).reshape(T // 2, L, 2 * k)   # [steps, L, B * k]
        for every, half_life, margin in ((1, 16.0, 0.5), (4, 64.0, 1.0), (2, 8.0, 0.0), (1, 128.0, 1e30)):
            policy = sim.Policy("c", "swap", half_life=half_life, every=every, margin=margin)
            for trace, streams, skip in ((ids, 1, 0), (ids, 1, 50), (two, 2, 25)):
                old = sim._replay_claim(trace, E, resident, policy, skip=skip)
                new = sim._replay_claims(trace, E, resident, policy, skip=skip, streams=streams)
                assert (new["hit_rate"], new["moves_per_token"]) == (old["hit_rate"], old["moves_per_token"])
                assert new["reads_per_token"] * streams == pytest.approx((1 - old["hit_rate"]) * L * trace.shape[2])


def test_more_claims_take_a_new_working_set_in_one_round_given_the_spares():
    """Three host experts appear at once: one claim a step moves them over three rounds (reads 3 + 2 + 1), four
    claims with eight spares in one (3), four claims with two spares two at a time, the third waiting for a spare
    (3 + 1 + 1: the round after a double move has no free spare, so no threshold)."""
    E, T = 12, 20
    ids = np.array([[[0, 1, 2]]] * 10 + [[[9, 10, 11]]] * (T - 10))        # [T, 1, 3]; host: 9-11
    resident = np.zeros((1, E), dtype=bool)
    resident[0, :9] = True                                              # 3-8 never selected: the victims
    policy = sim.Policy("c", "swap", half_life=4.0, every=1, margin=0.5)
    for claims, spares, reads in ((1, 2, 6), (4, 8, 3), (4, 2, 5), (2, 4, 4)):
        r = sim._replay_claims(ids, E, resident, policy, spares=spares, claims=claims)
        assert r["reads_per_step"] * T == pytest.approx(reads), (claims, spares)
        assert r["moves_per_step"] * T == pytest.approx(3), (claims, spares)
    # two tokens of a step selecting one host expert: two reads (as the kernels count), one distinct expert
    both = np.array([[[9, 0, 9, 1]]])                                    # one step, two streams of k = 2
    r = sim._replay_claims(both, E, resident, policy, streams=2)
    assert (r["reads_per_step"], r["distinct_reads_per_token"] * 2) == (2, 1)


def test_batch_steps_takes_the_benchmarks_streams():
    """Stream i of a step replays kind i mod 4 (sorted) from row s + 997 * (i // 4), as bench/expert_offload.py
    builds its batch; a step's selections are its streams' tokens one after the other."""
    rng = np.random.default_rng(0)
    trace = {kind: rng.integers(0, 64, (1500 + 10 * n, 2, 3)) for n, kind in enumerate("dcab")}
    kinds = sorted(trace)
    steps = sim.batch_steps(trace, 6, 40)
    assert steps.shape == (40, 2, 18)
    for s in (0, 17, 39):
        for i in range(6):
            a = trace[kinds[i % 4]]
            assert (steps[s, :, 3 * i:3 * i + 3] == a[(s + 997 * (i // 4)) % len(a)]).all()
    assert (sim.batch_steps(trace, 1, 40) == trace["a"][:40]).all()


def _four_full_shape_layers():
    """(the bench module, the full-shape config cut to 4 layers, its replayed trace of 64 + 32 + 1000 tokens, the
    cold-set fit trace from demo token 100,000) for the simulation tests."""
    import expert_offload as bench

    raw = bench.preset("full-shape")
    raw.update(num_hidden_layers=4, layer_types=raw["layer_types"][:4])
    raw["ple_layer_ids"] = [i for i in raw.get("ple_layer_ids", []) if i <= 4]
    cfg = bench.config_from_dict(raw)
    trace = bench.full_shape_trace(4, cfg.num_experts, cfg.num_experts_per_tok, 64 + 32 + 1000)
    fit = bench.full_shape_trace(4, cfg.num_experts, cfg.num_experts_per_tok, 4000, start=100000)
    return bench, cfg, trace, fit


def test_the_benchmarks_simulation_takes_claims_and_a_half_life_in_tokens():
    """`bench/expert_offload.py --simulate --async-moves --claims C --half-life-unit tokens`: C > 1 replays
    `_replay_claims` with C claims and 2C spares a layer a step, a half-life in tokens is half-life / batch steps;
    C 1 in steps is today's `_replay_claim` row unchanged. (The study's 5.61 -> 3.31 reads a token at batch 4, 10%
    host, 16 full-shape layers, is the same call at --warmup 1024 --steps 256.)"""
    bench, cfg, trace, fit = _four_full_shape_layers()
    args = (cfg, trace, fit, [0.25], [4], [(1, 128.0, 0.0)], 32, 64, 49.0, 0.0, 100.0, {4: 4.0})
    rows = {(c, u): bench.simulate(*args, on_read=True, claims=c, half_life_unit=u)[-1]
            for c, u in ((1, "steps"), (4, "steps"), (4, "tokens"))}
    cold = bench.cold_sets(cfg, 0.25, fit)
    resident = np.ones((4, cfg.num_experts), dtype=bool)
    for layer, ids in cold.items():
        resident[layer, ids] = False
    kinds = sorted(trace)
    r = np.arange(96)
    ids = np.concatenate([trace[kinds[i % 4]][(r + 997 * (i // 4)) % len(trace[kinds[i % 4]])] for i in range(4)], 2)
    k = ids.shape[1] * ids.shape[2] / 4
    one = sim._replay_claim(ids, cfg.num_experts, resident, sim.Policy("swap", "swap", 128.0, 1, 0.0), 64)
    four = sim._replay_claims(ids, cfg.num_experts, resident, sim.Policy("swap", "swap", 32.0, 1, 0.0), 64,
                              spares=8, claims=4, streams=4)
    assert rows[(1, "steps")]["host_reads_per_token"] == pytest.approx((1 - one["hit_rate"]) * k)
    assert rows[(4, "tokens")]["host_reads_per_token"] == pytest.approx((1 - four["hit_rate"]) * k)
    assert rows[(4, "tokens")]["host_reads_per_token"] < rows[(4, "steps")]["host_reads_per_token"]


def test_a_capped_prefetch_takes_the_first_host_predictions_and_p_0_is_none():
    """`_replay_claim(prefetch_slots=P)`: P 0 is no prefetch, a P no step reaches is the uncapped replay; in between
    at most P prefetches a layer a step, the first host experts in the columns' order (resident or repeated
    predictions do not take a slot), and moves never depend on it."""
    L, E, k, T = 3, 16, 2, 400
    ids, _, resident = _skewed_trace(8, L, E, k, T)
    rng = np.random.default_rng(3)
    pred = np.where(rng.random((T, L, 6)) < 0.6, np.concatenate([ids, ids, ids], 2), rng.integers(-1, E, (T, L, 6)))
    for margin in (1e9, 0.5):
        policy = sim.Policy("c", "swap", half_life=16.0, every=1, margin=margin)
        base = sim._replay_claim(ids, E, resident, policy, skip=50)
        assert sim._replay_claim(ids, E, resident, policy, skip=50, predicted=pred, prefetch_slots=0) == base
        free = sim._replay_claim(ids, E, resident, policy, skip=50, predicted=pred)
        assert free["prefetches_per_token"] > 1
        assert sim._replay_claim(ids, E, resident, policy, skip=50, predicted=pred, prefetch_slots=6) == free
        one = sim._replay_claim(ids, E, resident, policy, skip=50, predicted=pred, prefetch_slots=1)
        assert one["prefetches_per_token"] <= L and one["prefetches_per_token"] < free["prefetches_per_token"]
        assert free["critical_reads_per_token"] < one["critical_reads_per_token"] < base["critical_reads_per_token"]
        assert (one["hit_rate"], one["moves_per_token"]) == (base["hit_rate"], base["moves_per_token"])
    # order: one slot, host experts 9 and 10 predicted behind a resident 0 and a repeated 9: 9 is fetched, 10 is not
    resident = np.zeros((1, 12), dtype=bool)
    resident[0, :9] = True
    step = np.array([[[9, 10]]])
    policy = sim.Policy("c", "swap", half_life=4.0, every=1, margin=1e9)
    for order, critical in (([0, 9, 9, 10], 1), ([0, 10, 9, -1], 1), ([-1, 0, 3], 2)):
        r = sim._replay_claim(step, 12, resident, policy, predicted=np.array([[order]]), prefetch_slots=1)
        assert r["critical_reads_per_token"] == critical and r["prefetches_per_token"] == (critical < 2), order


def test_full_shape_predictions_take_the_ids_mapping(tmp_path):
    """`full_shape_trace(predictions=True)` maps a trace's `pred:` keys exactly as it maps `ids:` (collisions too):
    the predictions of a trace equal the ids of a trace whose ids are those predictions."""
    import expert_offload as bench

    rng = np.random.default_rng(4)
    ids = {k: rng.integers(0, 32, (300, 8, 4)).astype(np.uint8) for k in ("a", "b")}
    pred = {k: rng.integers(0, 32, (300, 8, 4)).astype(np.uint8) for k in ("a", "b")}
    pred["a"][:, :, 1] = pred["a"][:, :, 0]          # collisions within a token's ten
    np.savez_compressed(tmp_path / "x.npz", **{f"ids:{k}": v for k, v in ids.items()},
                        **{f"pred:{k}": v for k, v in pred.items()})
    np.savez_compressed(tmp_path / "y.npz", **{f"ids:{k}": v for k, v in pred.items()})
    got_ids, got_pred = bench.full_shape_trace(16, 512, 10, 200, start=50, predictions=True, path=tmp_path / "x.npz")
    want = bench.full_shape_trace(16, 512, 10, 200, start=50, path=tmp_path / "y.npz")
    assert got_ids.keys() == got_pred.keys() == {"a", "b"}
    for k in ("a", "b"):
        assert (got_pred[k] == want[k]).all()
        assert (got_ids[k] == bench.full_shape_map(ids[k][50:253], 16, 512, 10, 200)).all()
        assert (np.diff(np.sort(got_pred[k], -1), axis=-1) > 0).all()      # ten distinct a token and layer
    with pytest.raises(SystemExit):
        bench.full_shape_trace(4, 512, 10, 10, predictions=True, path=tmp_path / "y.npz")


def test_member_predictions_name_a_slot_when_both_its_demo_selections_are_predicted(tmp_path):
    """`--pred-mapping member`: a full-shape slot's guess is its selection exactly where both demo selections it is
    built from are among their layers' predictions (any rank), else the rank mapping's guess: predictions that are
    the selections reordered give the selections everywhere; with one demo layer's predictions disjoint from its
    selections, every slot built from that layer keeps the rank guess."""
    import expert_offload as bench

    rng = np.random.default_rng(5)
    ids = np.stack([rng.permutation(32)[:4] for _ in range(300 * 8)]).reshape(300, 8, 4).astype(np.uint8)
    shuffled = ids[:, :, ::-1].copy()                       # the same sets, other ranks
    disjoint = shuffled.copy()
    for t in range(300):                                    # layer 3's never contain one of its selections
        disjoint[t, 3] = [e for e in range(32) if e not in ids[t, 3]][:4]
    for name, pred in (("same", shuffled), ("off", disjoint)):
        np.savez_compressed(tmp_path / f"{name}.npz", **{"ids:a": ids, "pred:a": pred})
    full, rank = bench.full_shape_trace(16, 512, 10, 200, predictions=True, path=tmp_path / "same.npz")
    _, member = bench.full_shape_trace(16, 512, 10, 200, predictions=True, path=tmp_path / "same.npz",
                                       mapping="member")
    assert (member["a"] == full["a"]).all() and not (rank["a"] == full["a"]).all()
    _, rank_off = bench.full_shape_trace(16, 512, 10, 200, predictions=True, path=tmp_path / "off.npz")
    _, member_off = bench.full_shape_trace(16, 512, 10, 200, predictions=True, path=tmp_path / "off.npz",
                                           mapping="member")
    for L in range(16):
        a, b = L % 8, (L + 1) % 8
        if 3 in (a, b):
            assert (member_off["a"][:, L] == rank_off["a"][:, L]).all()
        else:
            assert (member_off["a"][:, L] == full["a"][:, L]).all()


def test_the_benchmarks_simulation_prefetches_the_predicted_host_experts():
    """`bench/expert_offload.py --simulate --prefetch P`: predictions equal to the selections leave no host
    read on the critical path when P never binds (every read then a used prefetch), and some at P 1; moves on read
    and the rows' other numbers are those without prefetch."""
    bench, cfg, trace, fit = _four_full_shape_layers()
    args = (cfg, trace, fit, [0.25], [1, 4], [(1, 128.0, 0.5)], 32, 64, 49.0, 0.0, 100.0, {1: 3.6, 4: 4.8})
    plain = bench.simulate(*args, on_read=True)
    full = bench.simulate(*args, on_read=True, pred=trace, prefetch_slots=1000)
    one = bench.simulate(*args, on_read=True, pred=trace, prefetch_slots=1)
    assert len(plain) == len(full) == 4
    for p, f, o in zip(plain, full, one):
        assert {key: f[key] for key in p} == p
        assert f["critical_reads_per_token"] == 0
        assert f["prefetches_used_per_token"] == pytest.approx(p["host_reads_per_token"])
        assert p["host_reads_per_token"] > 0
        assert 0 < o["critical_reads_per_token"] < p["host_reads_per_token"]
        assert o["prefetches_per_token"] <= 4 / p["batch"] + 1e-9
    with pytest.raises(ValueError):
        bench.simulate(*args, pred=trace, prefetch_slots=1)            # in-place moves: not replayed
