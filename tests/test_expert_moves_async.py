"""Expert moves on read (`expert_move_async`): a spare device slot per layer, the router through a slot map; the
router kernel claims a host slot past the layer's threshold, the decode kernels that read it store its rows into the
spare (tests/test_kernel_moe_claim.py), and the round commits the claim and writes the least-used device slot back
into the host slot the claimed expert left (on a side stream on a GPU), that slot the next spare. The round and
write-back kernels against their references, the router's claim, and whole models that serve the all-in-VRAM greedy
tokens with a round after every token, every row still its own expert after thousands of rounds.

Without CUDA the kernels run on CPU tensors under TRITON_INTERPRET=1 (tests/conftest.py); the model-level tests take
the PyTorch path a CPU cluster runs (`claim_ref`, `ExpertTable.copy_claimed`, `claim_round_ref`, `write_back_ref`).
"""

from __future__ import annotations

import pytest
import torch

CUDA = torch.cuda.is_available()
pytest.importorskip("triton")

from shared.model_config import load_config  # noqa: E402
from stage_worker.checkpoint.loader import LoadOptions, load_model  # noqa: E402
from stage_worker.kernels import expert_moves as M  # noqa: E402
from stage_worker.kernels.expert_moves_ref import RowSet, claim_round_ref, write_back_ref  # noqa: E402
from stage_worker.kernels.moe import route  # noqa: E402
from stage_worker.kernels.moe_ref import RouteCounts, count_ref  # noqa: E402
from expert_tables import fingerprints_hold, graphed_greedy, greedy, random_cold, random_move_rounds  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
PROMPT = [1, 5, 9, 33, 70, 100, 7, 400]


def _rows(g: torch.Generator, hots: list[int], S: int, shape=(3, 5), dtype=torch.float32) -> RowSet:
    dev = [torch.randn(h, *shape, generator=g).to(DEV, dtype) for h in hots]
    host = [torch.randn(S - h, *shape, generator=g) for h in hots]
    host = [t.pin_memory() if CUDA else t for t in host]
    return RowSet(dev, host, list(hots))


def test_write_back_kernel_matches_the_reference():
    """`write_back`: where a layer has a pending victim, its device row into the host slot; nothing else written;
    the indexed form (`layers`) reads a stage-wide state row per layer."""
    g = torch.Generator().manual_seed(1)
    S, hots = 10, [4, 6, 3]
    state = torch.tensor([[-1, -1, 1, 7], [5, 4, -1, -1], [2, -1, 0, 4]], dtype=torch.int64)
    for layers in (None, torch.tensor([2, 0], dtype=torch.int64)):
        rows = _rows(g, hots if layers is None else [hots[2], hots[0]], S)
        want = RowSet([t.clone() for t in rows.dev], [t.clone() for t in rows.host], rows.split)
        write_back_ref(want, state if layers is None else state[layers])
        if layers is None:      # layer 0: device slot 1 into host slot 7 (host row 3); layer 1 nothing
            assert torch.equal(want.host[0][3], rows.dev[0][1].cpu()) and torch.equal(want.host[1], rows.host[1])
        plan = M.SwapPlan.build(rows, torch.device(DEV))      # rows of 15 elements: 4 blocks of 4, 2 programs loop
        M.write_back(plan, state.to(DEV), block=4, layers=None if layers is None else layers.to(DEV), programs=2)
        for a, b in zip(rows.dev + rows.host, want.dev + want.host):
            assert torch.equal(a.cpu(), b.cpu())


def _stage(E: int, hots_live: list[int]):
    """A stage's claim state at load: per layer the live device experts, the two spares, then the host experts."""
    L = len(hots_live)
    orders = [list(range(h)) + [-1, -1] + list(range(h, E)) for h in hots_live]
    eos = torch.tensor(orders, dtype=torch.int32)
    smap = torch.tensor([[s for s, e in enumerate(o) if e >= 0] for o in orders], dtype=torch.int32)
    return dict(counts=torch.zeros(L, E + 2), expert_of_slot=eos, slot_map=smap,
                hot=torch.tensor([h + 2 for h in hots_live], dtype=torch.int64),
                moves=torch.zeros(L, dtype=torch.int64),
                state=torch.tensor([[h, h + 1, -1, -1] for h in hots_live], dtype=torch.int64),
                claim=torch.full((L,), -1, dtype=torch.int32), threshold=torch.full((L,), float("inf")))


def test_claim_round_kernel_matches_the_reference_over_many_rounds():
    """`claim_round` against `claim_round_ref` over 24 rounds of random counts and claims (a layer whose only
    device slot is the spare never claims; ties in the victim's count): the same counts, slot maps, experts,
    states, thresholds and moves bit for bit, and the slot map always a bijection onto the live slots with every
    expert present once."""
    g = torch.Generator().manual_seed(3)
    E, live = 9, [4, 0, 6]
    ref = _stage(E, live)
    ker = {k: v.clone().to(DEV) for k, v in ref.items()}
    order = ["counts", "expert_of_slot", "slot_map", "hot", "moves", "state", "claim", "threshold"]
    moved = 0
    for r in range(24):         # some 30 moves (each round a launch to interpret)
        inc = torch.randint(0, 3, ref["counts"].shape, generator=g).float()       # integer counts: ties happen
        ref["counts"] += inc
        ker["counts"] += inc.to(DEV)
        for layer in range(len(live)):
            if ref["threshold"][layer] < float("inf") and torch.rand((), generator=g) < 0.6:
                host = [s for s in range(int(ref["hot"][layer]), E + 2) if ref["expert_of_slot"][layer, s] >= 0]
                c = host[int(torch.randint(len(host), (), generator=g))]
                ref["claim"][layer] = c
                ker["claim"][layer] = c
        claim_round_ref(*(ref[k] for k in order), 0.75, 0.5)
        M.claim_round(*(ker[k] for k in order), 0.75, 0.5)
        for k in order:
            assert torch.equal(ker[k].cpu(), ref[k]), (r, k)
        for layer in range(len(live)):
            eos, smap = ref["expert_of_slot"][layer].tolist(), ref["slot_map"][layer].tolist()
            assert sorted(e for e in eos if e >= 0) == list(range(E))
            assert [eos[s] for s in smap] == list(range(E))                # router row i leads to expert i
        moved = int(ref["moves"].sum())
    assert moved >= 10 and int(ref["moves"][1]) == 0
    assert float(ref["threshold"][1]) == float("inf")


def _stage_c(E: int, hots_live: list[int], C: int):
    """`_stage` with C claims a layer a step: 2C spares after the live device experts, state [L, 4C]."""
    L = len(hots_live)
    orders = [list(range(h)) + [-1] * (2 * C) + list(range(h, E)) for h in hots_live]
    eos = torch.tensor(orders, dtype=torch.int32)
    smap = torch.tensor([[s for s, e in enumerate(o) if e >= 0] for o in orders], dtype=torch.int32)
    return dict(counts=torch.zeros(L, E + 2 * C), expert_of_slot=eos, slot_map=smap,
                hot=torch.tensor([h + 2 * C for h in hots_live], dtype=torch.int64),
                moves=torch.zeros(L, dtype=torch.int64),
                state=torch.tensor([[h + s for s in range(2 * C)] + [-1] * (2 * C) for h in hots_live],
                                   dtype=torch.int64),
                claim=torch.full((L, C), -1, dtype=torch.int32), threshold=torch.full((L,), float("inf")))


@pytest.mark.parametrize("C", [2, 4])
def test_claim_round_kernel_with_c_claims_matches_the_reference(C):
    """`claim_round` with C claims a layer a step (state [L, 4C]) against `claim_round_ref` over 12 rounds of random
    counts and up to C distinct claims a layer (only where a free slot backs the entry, as the router claims): the
    same tables bit for bit; up to C moves a layer a round, C at once seen; C distinct victims, each with its own
    host slot; the free list compact; the slot map a bijection onto the live slots throughout (a layer with two live
    device experts commits at most two claims a round: a victim for each)."""
    g = torch.Generator().manual_seed(11)
    E, live = 12, [5, 0, 7, 2]
    ref = _stage_c(E, live, C)
    ker = {k: v.clone().to(DEV) for k, v in ref.items()}
    order = ["counts", "expert_of_slot", "slot_map", "hot", "moves", "state", "claim", "threshold"]
    most = 0
    for r in range(12):         # C moves in one round by the third, 50+ moves in all (each round a launch to interpret)
        inc = torch.randint(0, 3, ref["counts"].shape, generator=g).float()
        ref["counts"] += inc
        ker["counts"] += inc.to(DEV)
        for layer in range(len(live)):
            if ref["threshold"][layer] < float("inf"):
                host = [s for s in range(int(ref["hot"][layer]), E + 2 * C)
                        if ref["expert_of_slot"][layer, s] >= 0]
                pick = torch.randperm(len(host), generator=g)[:C].tolist()
                for j in range(C):
                    if j < len(pick) and ref["state"][layer, j] >= 0 and torch.rand((), generator=g) < 0.7:
                        ref["claim"][layer, j] = host[pick[j]]
        ker["claim"].copy_(ref["claim"].to(DEV))
        before = ref["moves"].clone()
        claim_round_ref(*(ref[k] for k in order), 0.75, 0.5)
        M.claim_round(*(ker[k] for k in order), 0.75, 0.5)
        for k in order:
            assert torch.equal(ker[k].cpu(), ref[k]), (r, k)
        most = max(most, int((ref["moves"] - before).max()))
        assert int((ref["moves"] - before).max()) <= C
        for layer in range(len(live)):
            eos, smap = ref["expert_of_slot"][layer].tolist(), ref["slot_map"][layer].tolist()
            assert sorted(e for e in eos if e >= 0) == list(range(E))
            assert [eos[s] for s in smap] == list(range(E))
            free, victims, dests = (ref["state"][layer, a * C:b * C].tolist() for a, b in ((0, 2), (2, 3), (3, 4)))
            n = sum(f >= 0 for f in free)
            assert all(f >= 0 for f in free[:n]) and all(f < 0 for f in free[n:])
            pend = [v for v in victims if v >= 0]
            assert len(set(pend)) == len(pend) == sum(d >= 0 for d in dests) and n + len(pend) == 2 * C
    assert most == C and int(ref["moves"][1]) == 0 and int(ref["moves"].sum()) >= 30


def test_write_back_kernel_copies_every_pending_victim():
    """`write_back` with C = 2 (state [L, 8]): each pending victim's row into its own host slot."""
    g = torch.Generator().manual_seed(2)
    S, hots = 12, [6, 8]
    state = torch.tensor([[-1, -1, 4, -1, 1, 3, 9, 7], [5, -1, -1, -1, 2, -1, 10, -1]], dtype=torch.int64)
    rows = _rows(g, hots, S)
    want = RowSet([t.clone() for t in rows.dev], [t.clone() for t in rows.host], rows.split)
    write_back_ref(want, state)
    assert torch.equal(want.host[0][3], rows.dev[0][1].cpu()) and torch.equal(want.host[0][1], rows.dev[0][3].cpu())
    assert torch.equal(want.host[1][2], rows.dev[1][2].cpu())
    plan = M.SwapPlan.build(rows, torch.device(DEV))
    M.write_back(plan, state.to(DEV), block=4, programs=2)
    for a, b in zip(rows.dev + rows.host, want.dev + want.host):
        assert torch.equal(a.cpu(), b.cpu())


def test_the_router_claims_a_host_slot_past_the_threshold():
    """The router kernel's claim: the best-ranked selected host slot whose count passes the threshold, once (a
    claim already made stays), none at an infinite threshold; the reference path claims the same at one token."""
    g = torch.Generator().manual_seed(5)
    E, first = 16, 10
    logits = torch.randn(1, E, generator=g)
    order = logits[0].argsort(descending=True).tolist()
    host_ranked = [s for s in order[:4] if s >= first]
    for thr, held in ((0.5, -1), (float("inf"), -1), (0.5, 3)):
        got = []
        for on_device in (True, False):
            counts = RouteCounts(torch.zeros(E), torch.zeros(1, dtype=torch.int64), first,
                                 torch.tensor([held], dtype=torch.int32), torch.tensor([thr]))
            if on_device:
                dc = RouteCounts(counts.counts.to(DEV), counts.host_reads.to(DEV), first, counts.claim.to(DEV),
                                 counts.threshold.to(DEV))
                route(logits.to(DEV), 4, True, counts=dc)
                got.append(int(dc.claim))
            else:
                from stage_worker.kernels.moe_ref import route_ref

                _, ids = route_ref(logits, 4, True)
                count_ref(ids, counts)
                got.append(int(counts.claim))
        want = held if held >= 0 else (host_ranked[0] if thr < float("inf") and host_ranked else -1)
        assert got == [want, want], (thr, held, got, host_ranked)


@pytest.mark.parametrize("held", [False, True])
def test_four_tokens_claim_up_to_four_distinct_host_slots(held):
    """C = 4 claims (`expert_move_claims`): a step of 4 tokens claims up to 4 distinct selected host slots past the
    threshold, one an entry whose spare is a slot (an entry without one, spare -1, stays empty), a slot already
    claimed never twice; the reference (`claims_ref`) takes them first come first, token by token, best first, and
    the kernel under the interpreter (programs in order) the same; on a GPU the tokens race: the same number, all
    distinct, all qualifying."""
    g = torch.Generator().manual_seed(8)
    E, first, k, C = 24, 8, 4, 4
    logits = torch.randn(4, E, generator=g)
    from stage_worker.kernels.moe_ref import route_ref

    _, ids = route_ref(logits, k, True)
    flat = ids.reshape(-1).tolist()
    host = list(dict.fromkeys(s for s in flat if s >= first))
    assert len(host) >= 4
    spare = torch.tensor([20, -1, 21, 22] if held else [20, 21, -1, 23], dtype=torch.int64)
    start = torch.tensor([host[2], -1, -1, -1] if held else [-1] * C, dtype=torch.int32)
    open_ = [j for j in range(C) if spare[j] >= 0 and start[j] < 0]
    want = start.clone()
    left = [s for s in host if s not in start.tolist()]
    for j, s in zip(open_, left):
        want[j] = s
    got = []
    for on_device in (True, False):
        counts = RouteCounts(torch.zeros(E), torch.zeros(1, dtype=torch.int64), first, start.clone(),
                             torch.tensor([0.5]), spare.clone())
        if on_device:
            dc = RouteCounts(*(t.to(DEV) if isinstance(t, torch.Tensor) else t for t in (
                counts.counts, counts.host_reads, counts.first, counts.claim, counts.threshold, counts.spare)))
            route(logits.to(DEV), k, True, counts=dc)
            got.append(dc.claim.cpu())
        else:
            count_ref(ids, counts)
            got.append(counts.claim)
    assert torch.equal(got[1], want), (got[1], want, host)
    if not CUDA:
        assert torch.equal(got[0], want)
    c = [x for x in got[0].tolist() if x >= 0]
    assert len(c) == len(set(c)) == int((want >= 0).sum()) and set(c) <= set(host)
    assert int(got[0][1 if held else 2]) == -1           # the entry without a spare


def test_kernels_end_to_end_with_four_claims_at_four_tokens():
    """The GPU path of C = 4 claims with its kernels only (under the interpreter without CUDA): a layer of 16
    experts, 6 on the device, 8 spares, 10 in host memory; 4 tokens a step routed by the route kernel through the
    slot map (claiming), the bf16 decode kernels (storing the claims), then `claim_round` and `write_back`, 12
    steps. Every step's output equals the kernels' on the plain table (router indices as experts); some round moves
    more than one expert, none more than four; every live slot holds its expert's rows throughout."""
    from stage_worker.kernels.moe import fused_moe
    from stage_worker.kernels.moe_ref import HostRows

    g = torch.Generator().manual_seed(21)
    E, H, I, k, T, C, live = 16, 32, 16, 2, 4, 4, 6
    hot = live + 2 * C
    S = E + 2 * C
    w13 = torch.randn(E, 2 * I, H, generator=g).to(DEV)
    w2 = torch.randn(E, H, I, generator=g).to(DEV)
    dev13 = torch.zeros(hot, 2 * I, H, device=DEV)
    dev2 = torch.zeros(hot, H, I, device=DEV)
    dev13[:live], dev2[:live] = w13[:live], w2[:live]
    host = HostRows(_host_copy(w13[live:]), _host_copy(w2[live:]), hot)
    smap = torch.tensor([e if e < live else hot + e - live for e in range(E)], dtype=torch.int32, device=DEV)
    eos = torch.tensor(list(range(live)) + [-1] * (2 * C) + list(range(live, E)), dtype=torch.int32, device=DEV)
    counts = torch.zeros(1, S, device=DEV)
    state = torch.tensor([list(range(live, hot)) + [-1] * (2 * C)], dtype=torch.int64, device=DEV)
    claim = torch.full((1, C), -1, dtype=torch.int32, device=DEV)
    thr = torch.full((1,), float("inf"), device=DEV)
    moves = torch.zeros(1, dtype=torch.int64, device=DEV)
    reads = torch.zeros(1, dtype=torch.int64, device=DEV)
    hot_t = torch.tensor([hot], dtype=torch.int64, device=DEV)
    plans = [M.SwapPlan.build(RowSet([d], [h], [hot]), torch.device(DEV)) for d, h in ((dev13, host.w13),
                                                                                      (dev2, host.w2))]
    most = 0
    for step in range(12):        # some 20 moves, several rounds of more than one (a step: seven interpreted launches)
        logits = torch.randn(T, E, generator=g).to(DEV)
        logits[:, live:] += 1.0                            # the host experts chosen often: claims pass
        rc = RouteCounts(counts[0], reads, hot, claim[0], thr, state[0, :C])
        w, ids = route(logits, k, True, counts=rc, slot_map=smap)
        x = torch.randn(T, H, generator=g).to(DEV)
        out = fused_moe(x, ids, w, dev13, dev2, host=host, claim=(claim[0], state[0, :C]))
        _, rids = route(logits, k, True)
        assert torch.equal(eos[ids.long()], rids)          # the slots hold the router's experts
        want = fused_moe(x, rids, w, w13, w2)
        assert torch.allclose(out, want, rtol=1e-5, atol=1e-5), step
        before = int(moves)
        M.claim_round(counts, eos.view(1, S), smap.view(1, E), hot_t, moves, state, claim, thr, 0.8, 0.0)
        for plan in plans:
            M.write_back(plan, state, block=64)
        most = max(most, int(moves) - before)
        for s_, e in enumerate(eos.tolist()):
            if e >= 0:
                assert int(smap[e]) == s_
                r13 = dev13[s_] if s_ < hot else host.w13[s_ - hot]
                r2 = dev2[s_] if s_ < hot else host.w2[s_ - hot]
                assert torch.equal(r13.cpu(), w13[e].cpu()) and torch.equal(r2.cpu(), w2[e].cpu()), (step, s_, e)
    assert 1 < most <= C, most


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().pin_memory() if CUDA else t.clone()


@pytest.fixture(scope="module")
def demo():
    from shared.cli import ensure_builtin_model

    d = ensure_builtin_model()
    return d, load_config(d)


@pytest.mark.parametrize("share", [0.1, 0.5])
def test_demo_model_with_moves_off_the_forward_serves_the_same_greedy_tokens(demo, share):
    d, cfg = demo
    plain = load_model(d, LoadOptions(), cfg)
    want, want_lp = greedy(plain, PROMPT, 12)
    model = load_model(d, LoadOptions(cold_experts=random_cold(cfg, share), expert_move_async=True), cfg)
    x = model.experts
    assert x.state is not None and all(t.num_slots == cfg.num_experts + 2 for t in x.tables.values())
    got, lp = greedy(model, PROMPT, 12, move_every=1)
    assert got == want and (lp - want_lp).abs().max().item() < 1e-4
    assert x.moves.sum().item() > 0 and x.host_reads.sum().item() > 0
    fingerprints_hold(model, plain)


def test_thousands_of_rounds_off_the_forward_keep_every_row_its_own_expert(tiny_checkpoint):
    """2000 rounds of the reference path over random counts and claims, every slot its own expert after them: on
    the tiny checkpoint (6 tables of 16 experts), whose rounds cost under half the demo model's (8 of 32)."""
    cfg = load_config(tiny_checkpoint)
    plain = load_model(tiny_checkpoint, LoadOptions(), cfg)
    model = load_model(tiny_checkpoint, LoadOptions(cold_experts=random_cold(cfg, 0.25, seed=4),
                                                    expert_move_async=True), cfg)
    assert random_move_rounds(model, 2000) >= 1000
    fingerprints_hold(model, plain)


def test_four_claims_at_batch_four_move_up_to_four_experts_a_round_and_change_no_token(tiny_checkpoint):
    """C = 4 claims a layer a step (`expert_move_claims`, 8 spares a table): four streams decoding together (a CPU
    cluster's path: `claims_ref`, `copy_claimed`, `claim_round_ref`, `write_back_ref`) with a round after every
    step serve each stream's all-in-VRAM greedy tokens; some layer moves more than one expert in a round, none
    more than four; then a thousand random rounds leave every slot holding its own expert. On the tiny checkpoint
    (6 tables of 16 experts against the demo model's 8 of 32: half the CPU time)."""
    from stage_worker.expert_offload import gates
    from stage_worker.local_engine import LocalEngine

    d, cfg = tiny_checkpoint, load_config(tiny_checkpoint)
    plain = load_model(d, LoadOptions(), cfg)
    model = load_model(d, LoadOptions(cold_experts=random_cold(cfg, 0.5, seed=2), expert_move_async=True,
                                      expert_move_claims=4), cfg)
    x = model.experts
    assert x.state.shape[1] == 16 and x.claim.shape[1] == 4
    assert all(t.num_slots == cfg.num_experts + 8 and t.claim.shape == (4,) for t in x.tables.values())
    prompts = [PROMPT, PROMPT[::-1], [3, 1, 4, 1, 5, 9, 2, 6], [200, 30, 4, 77, 5]]

    def run(m, rounds: bool) -> tuple[list[list[int]], list[int]]:
        eng = LocalEngine([m], max_seqs=4)
        last = []
        for i, p in enumerate(prompts):
            eng.add(i)
            last.append(eng.step([(i, p)])[-1])
        toks, most = [[] for _ in prompts], []
        for _ in range(10):
            for i in range(4):
                toks[i].append(int(last[i].argmax()))
            before = m.experts.moves.clone() if rounds else None
            if rounds:
                m.experts.move_round(gates(m), decay=0.9, margin=0.0)
                most.append(int((m.experts.moves - before).max()))
            out = eng.step([(i, [toks[i][-1]]) for i in range(4)])
            last = [out[i] for i in range(4)]
        return toks, most

    want, _ = run(plain, False)
    got, most = run(model, True)
    assert got == want
    assert max(most) > 1 and max(most) <= 4, most
    fingerprints_hold(model, plain)
    assert random_move_rounds(model, 1000) >= 1000
    fingerprints_hold(model, plain)


def test_int4_experts_with_moves_off_the_forward(tiny_checkpoint, tmp_path):
    """INT4 tables (words and scales, four kinds of row) with spares: the all-in-VRAM greedy tokens with a round
    after every token, rows their experts' after many rounds."""
    pytest.importorskip("compressed_tensors")
    from stage_worker.checkpoint.quantize import quantize_checkpoint

    q = tmp_path / "q"
    quantize_checkpoint(tiny_checkpoint, q, "int4-experts")
    cfg = load_config(q)
    plain = load_model(q, LoadOptions(), cfg)
    want, want_lp = greedy(plain, PROMPT, 10)
    model = load_model(q, LoadOptions(cold_experts=random_cold(cfg, 0.5, seed=2), expert_move_async=True), cfg)
    assert all(t.packed for t in model.experts.tables.values())
    got, lp = greedy(model, PROMPT, 10, move_every=1)
    assert got == want and (lp - want_lp).abs().max().item() < 1e-4
    assert random_move_rounds(model, 300) > 0
    fingerprints_hold(model, plain)


def test_the_plan_counts_the_spare_slots(tiny_checkpoint, tmp_path):
    """With `expert_move_async` the plan's VRAM weights hold two more experts a table (its spares) and host RAM
    the same as without, which is what the loader's tables hold."""
    import dataclasses

    from shared import cold_set
    from shared.cluster_config import ClusterConfig, StageSpec
    from stage_worker.memory_needs import stage_needs

    cfg = load_config(tiny_checkpoint)
    cold = random_cold(cfg, 0.25, seed=1)
    n = cfg.num_hidden_layers
    f = cold_set.write(tmp_path / "cold.json", cfg, str(tiny_checkpoint), cold, [(0, n)], cold_set.expert_bytes(cfg),
                       1 << 30, ["test"])
    base = ClusterConfig(model=str(tiny_checkpoint), gateway_endpoint="", max_num_seqs=4, block_size=16,
                         max_model_len=256, dtype="float32", stages=[StageSpec(0, n, "", "cuda:0")],
                         cold_experts=str(f), gpu_memory_utilization=1.0, measure_reserve=False,
                         expert_move_async=False)
    off = stage_needs(cfg, base)[0]
    on = stage_needs(cfg, dataclasses.replace(base, expert_move_async=True))[0]
    # without a cold set the spares are not in the weights yet, but the refusal's advice counts them
    none = stage_needs(cfg, dataclasses.replace(base, expert_move_async=True, cold_experts=""))[0]
    moe = [layer for layer in range(n) if cfg.is_sparse_moe(layer)]
    assert none.spare_bytes == 2 * len(moe) * cold_set.expert_bytes(cfg, "float32") and off.spare_bytes == 0
    assert on.spare_bytes == 2 * len([layer for layer in moe if not cold.get(layer)]) * \
        cold_set.expert_bytes(cfg, "float32")
    model = load_model(tiny_checkpoint, LoadOptions(dtype=torch.float32, cold_experts=cold, expert_move_async=True),
                       cfg)
    spare = 2 * len(model.experts.tables) * cold_set.expert_bytes(cfg, "float32")
    assert on.host_experts == off.host_experts == model.experts.host_bytes()
    assert on.weights == off.weights + spare and on.routed_experts == off.routed_experts
    assert model.experts.device_bytes() == off.routed_experts + spare
    # C claims a step (expert_move_claims): 2C spares a table, counted by the plan as the loader allocates them
    three = stage_needs(cfg, dataclasses.replace(base, expert_move_async=True, expert_move_claims=3))[0]
    model3 = load_model(tiny_checkpoint, LoadOptions(dtype=torch.float32, cold_experts=cold, expert_move_async=True,
                                                     expert_move_claims=3), cfg)
    assert three.weights == off.weights + 3 * spare and three.spare_bytes == 3 * on.spare_bytes
    assert model3.experts.device_bytes() == off.routed_experts + 3 * spare


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("vmm", [False, True], ids=["two_tables", "vmm_range"])
def test_gpu_graphs_with_moves_off_the_forward_serve_the_same_greedy_tokens(tiny_checkpoint, vmm):
    """On the GPU: fused kernels that claim and store inside CUDA graphs, a round after every replay whose
    write-backs run on the side stream while the next step runs: the all-in-VRAM greedy tokens, every row its
    expert's; the tables as two tensors or as one VRAM + host range per part (`expert_vmm_table`, the spare at the
    end of the device tier)."""
    from stage_worker.kernels.flags import KernelFlags

    cfg = load_config(tiny_checkpoint)

    def run(cold, spares, move_graph=False):
        model = load_model(tiny_checkpoint, LoadOptions(device="cuda", cold_experts=cold, expert_move_async=spares,
                                                        expert_vmm_table=vmm and cold is not None), cfg)
        model.set_kernels(KernelFlags.parse("all"))
        return (model, *graphed_greedy(model, [1, 5, 9, 33, 70, 100], 24, cold is not None, move_graph))

    plain, want, want_lp = run(None, False)
    for move_graph in (False, True):           # the round's two parts eager, then replayed from their graphs
        model, got, lp = run(random_cold(cfg, 0.5, seed=3), True, move_graph)
        assert got == want and max(abs(a - b) for a, b in zip(lp, want_lp)) < 2e-2, move_graph
        torch.cuda.synchronize()
        assert model.experts.moves.sum().item() > 0
        assert (model.experts._graph is not None) == move_graph
        fingerprints_hold(model, plain)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_gpu_hundreds_of_graphed_rounds_move_on_read_and_change_no_token(tiny_checkpoint):
    """300 graphed decode steps with a graphed round after each, half the experts in host RAM: the claims the
    router kernel makes inside the decode graph and the rows the decode kernels store are the whole mechanism here
    (no reference path runs), and the tokens stay the all-in-VRAM ones (moves on read change no bits: the router
    ranks router indices, the kernels read the same bytes wherever they are), every row its expert's at the end."""
    from stage_worker.kernels.flags import KernelFlags

    cfg = load_config(tiny_checkpoint)
    prompt = [3, 17, 99, 250, 4, 61]

    def run(cold):
        model = load_model(tiny_checkpoint, LoadOptions(device="cuda", cold_experts=cold,
                                                        expert_move_async=cold is not None), cfg)
        model.set_kernels(KernelFlags.parse("all"))
        return (model, *graphed_greedy(model, prompt, 300, cold is not None, move_graph=True))

    plain, want, want_lp = run(None)
    model, got, lp = run(random_cold(cfg, 0.5, seed=7))
    torch.cuda.synchronize()
    moves = int(model.experts.moves.sum())
    assert got == want and max(abs(a - b) for a, b in zip(lp, want_lp)) < 1e-5, moves
    assert moves > 50
    fingerprints_hold(model, plain)
