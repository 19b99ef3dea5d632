"""Layer-ahead expert prefetch (issue 16, `expert_prefetch`): the predict launch, the copy launch and the router's
redirect against their references (`kernels/expert_prefetch_ref.py`). Without CUDA the kernels run under
TRITON_INTERPRET=1 (tests/conftest.py); on a GPU the same tests run the compiled kernels, and the copy's flag
protocol also from a CUDA graph."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from stage_worker.kernels import expert_prefetch as PF  # noqa: E402
from stage_worker.kernels import moe as K  # noqa: E402
from stage_worker.kernels.expert_prefetch_ref import Prefetch, copy_ref, predict_ref, redirect_ref  # noqa: E402
from stage_worker.kernels.moe_ref import RouteCounts  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def _ints(shape, seed, dtype=torch.float32):
    """Small integers: sums exact in fp32 whatever the order, so the GEMV's logits equal F.linear's."""
    return torch.randint(-3, 4, shape, generator=torch.Generator().manual_seed(seed)).to(DEV, dtype)


def _state(slots: int, first: int, e: int, k: int, max_tokens: int = 8) -> Prefetch:
    return Prefetch.allocate(slots, first, e, k, max_tokens, torch.float32, torch.device(DEV))


@pytest.mark.parametrize("t,e,h,k,slots,mapped,valid", [(1, 32, 64, 4, 3, False, None), (3, 20, 96, 4, 4, True, None),
                                                        (5, 32, 40, 3, 2, True, 3), (4, 16, 130, 2, 8, False, 2)])
def test_predict_names_the_first_distinct_host_slots_rank_major(t, e, h, k, slots, mapped, valid):
    """The launch's GEMV + top-k + host filter equals `predict_ref` on F.linear's logits: E not a power of two, H
    not a multiple of the column block, a slot map, padding rows (`valid`), more slots than host selections."""
    x = _ints((t, h), seed=t)
    gate = _ints((e, h), seed=100 + e)
    first_host = e // 2
    slot_map = torch.randperm(e, generator=torch.Generator().manual_seed(e)).to(DEV, torch.int32) if mapped else None
    pf = _state(slots, first_host - slots, e, k)
    pf.ready.fill_(1)
    v = None if valid is None else torch.tensor([valid], dtype=torch.int32, device=DEV)
    PF.predict(x, gate, k, pf, first_host, slot_map=slot_map, valid=v)
    want = predict_ref(x @ gate.T, k, first_host, slots, slot_map, valid)
    assert torch.equal(pf.slot.cpu(), want)
    assert (pf.ready == 0).all() and pf.lock.item() == 0
    assert pf.issued.item() == int((want >= 0).sum())
    # given logits (the benchmark's replay): one program, the same answer
    pf2 = _state(slots, first_host - slots, e, k)
    PF.predict(x, gate, k, pf2, first_host, slot_map=slot_map, valid=v, logits=(x @ gate.T).contiguous())
    assert torch.equal(pf2.slot.cpu(), want)
    # each token's best two only (`expert_prefetch_top`): the state keeps its top-k scratch
    pf3 = _state(slots, first_host - slots, e, k)
    PF.predict(x, gate, 2, pf3, first_host, slot_map=slot_map, valid=v)
    assert torch.equal(pf3.slot.cpu(), predict_ref(x @ gate.T, 2, first_host, slots, slot_map, valid))


@pytest.mark.parametrize("parts", [2, 4])
def test_copy_moves_the_named_host_rows_and_sets_ready(parts):
    """Every part (INT4-like words int32 and bf16 scales, or two bf16 parts) of each named host slot lands in its
    prefetch slot bit for bit; unnamed entries stay unready and their slots untouched; the counters go back to 0
    (a second copy of other slots works the same)."""
    g = torch.Generator().manual_seed(parts)
    hot, cold, first = 6, 5, 3                       # device rows [0, 6): experts 0-2, prefetch slots 3-5
    shapes = [((3, 40), torch.int32), ((3, 5), torch.bfloat16), ((7, 24), torch.int32), ((7, 3), torch.bfloat16)]
    if parts == 2:
        shapes = [((6, 33), torch.bfloat16), ((9, 17), torch.bfloat16)]

    def rand(n, shape, dt):
        return torch.randint(-1000, 1000, (n, *shape), generator=g).to(dt).to(DEV)

    host = [rand(cold, s, dt) for s, dt in shapes]
    dev = [rand(hot, s, dt) for s, dt in shapes]
    for named in ([hot + 4, -1, hot + 1], [hot, hot + 2, -1]):
        pf = _state(3, first, hot + cold, 2)
        pf.slot.copy_(torch.tensor(named, dtype=torch.int32))
        want_pf = _state(3, first, hot + cold, 2)
        want_pf.slot.copy_(pf.slot)
        ref_dev = [d.cpu().clone() for d in dev]
        copy_ref(want_pf, ref_dev, [h.cpu() for h in host], hot)
        PF.copy(pf, dev, host, hot)
        for d, r in zip(dev, ref_dev):
            assert torch.equal(d.cpu(), r)
        assert pf.ready.tolist() == [int(s >= 0) for s in named] == want_pf.ready.tolist()
        assert (pf.done == 0).all()


def _counts(e: int, first: int, pf: Prefetch | None, claims: bool = False) -> RouteCounts:
    c = RouteCounts(torch.zeros(e, device=DEV), torch.zeros(1, dtype=torch.int64, device=DEV), first)
    if claims:
        c.claim = torch.full((1,), -1, dtype=torch.int32, device=DEV)
        c.threshold = torch.full((1,), -1.0, device=DEV)      # every host selection passes
    c.prefetch = pf
    return c


@pytest.mark.parametrize("fused", [False, True])
def test_router_reads_ready_prefetched_slots_from_vram(fused):
    """A selected host slot that a ready prefetch slot holds comes back as that prefetch slot; one not ready (or
    not selected) does not. Counts go to the host slots as without the prefetch (the moves' statistics); host
    reads, and the claim, only to the host slots read over PCIe; `hits` counts the redirected selections."""
    t, e, h, k = 3, 24, 64, 4
    first_host, slots = 16, 3
    x = _ints((t, h), seed=11)
    router = _ints((e, h), seed=12)
    logits = x @ router.T
    _, plain = K.route(logits, k, True)
    host_sel = [s for s in plain.reshape(-1).tolist() if s >= first_host]
    assert len(set(host_sel)) >= 2, "the inputs must select host slots"
    pf = _state(slots, first_host - slots, e, k)
    a, b = sorted(set(host_sel))[:2]
    pf.slot.copy_(torch.tensor([a, first_host + 7 if first_host + 7 not in host_sel else -1, b], dtype=torch.int32))
    pf.ready.copy_(torch.tensor([1, 1, 0], dtype=torch.int32))       # b named but its copy not done
    with_pf, without = _counts(e, first_host, pf, claims=True), _counts(e, first_host, None)
    if fused:
        _, ids = K.router_route(x, router, k, True, counts=with_pf, fused=True)
    else:
        _, ids = K.route(logits, k, True, counts=with_pf)
    K.route(logits, k, True, counts=without)
    want, hit = redirect_ref(plain, pf, first_host)
    assert torch.equal(ids.cpu(), want.cpu())
    assert (ids == first_host - slots).any() and not (ids == first_host - slots + 2).any()
    assert torch.equal(with_pf.counts, without.counts)
    n_hit = int(hit.sum())
    assert pf.hits.item() == n_hit > 0
    assert with_pf.host_reads.item() == without.host_reads.item() - n_hit
    claimed = with_pf.claim.item()
    assert claimed != a and (claimed == -1 or claimed in host_sel)


def test_prefetch_slots_only_on_a_gpu_stage(tiny_checkpoint):
    """A CPU stage gets no prefetch slots (its decode path neither predicts nor copies); a config asking for
    prefetch with moves in place is refused, naming the fix."""
    from shared.cluster_config import ClusterConfig, ClusterConfigError, StageSpec
    from shared.model_config import load_config
    from stage_worker.checkpoint.loader import LoadOptions, build_empty
    from stage_worker.expert_offload import prefetch_slots

    meta = build_empty(load_config(tiny_checkpoint), LoadOptions(device="meta"))
    assert prefetch_slots(meta, 4, "cpu") == 0 and prefetch_slots(meta, 0, "cuda") == 0
    assert prefetch_slots(meta, 4, "cuda") == 4
    base = dict(model="unused", stages=[StageSpec(0, 1, "ipc:///tmp/s.sock")], gateway_endpoint="ipc:///tmp/g.sock")
    with pytest.raises(ClusterConfigError, match="expert_move_async"):
        ClusterConfig(**base, expert_prefetch=4, expert_move_async=False).validate()
    with pytest.raises(ClusterConfigError, match="MOEPIPE_EXPERT_PREFETCH"):
        ClusterConfig(**base, expert_prefetch=17).validate()
    ClusterConfig(**base, expert_prefetch=4, expert_move_async=False, expert_moves=False).validate()   # no moves


def test_warm_up_steps_leave_the_expert_counters_as_they_were(tiny_checkpoint):
    """Steps inside `StageExperts.uncounted` (graph captures' and the start-up's warm-up runs over scratch rows) count
    no host reads in /metrics; the same steps outside it do (h100-42: a one-token stage with min batch 2 reported 28
    prefetches, all from its batch-2 graph's warm-up)."""
    from shared.model_config import load_config
    from stage_worker.checkpoint.loader import LoadOptions, load_model
    from expert_tables import greedy, random_cold

    cfg = load_config(tiny_checkpoint)
    model = load_model(tiny_checkpoint, LoadOptions(cold_experts=random_cold(cfg, 0.5, seed=3)), cfg)
    x = model.experts
    prompt = [(5 * i + 1) % 2000 + 10 for i in range(12)]
    with x.uncounted():
        greedy(model, prompt, 3)
    assert int(x.host_reads.sum()) == 0 and int(x.moves.sum()) == 0
    greedy(model, prompt, 3)
    counted = int(x.host_reads.sum())
    assert counted > 0
    with x.uncounted():
        greedy(model, prompt, 3)
    assert int(x.host_reads.sum()) == counted
    x.snapshot()
    assert sum(v for k, v in x.stats().items() if k.startswith("expert_host_reads:")) == counted


# ---- on the GPU ----------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_prefetch_serves_the_same_greedy_tokens_and_takes_reads_off_pcie(tiny_checkpoint):
    """INT4 experts (the packed decode path) and bf16 experts (the fused MoE path), half of every layer's in host RAM,
    every kernel, eager and from CUDA graphs, moves on read off and on: with four prefetch slots a layer the greedy
    tokens and log-probabilities are the all-in-VRAM model's, every slot still holds its expert, some selections
    were read from prefetch slots, and without moves each of those is one host read fewer than the same run without
    the prefetch (the same selections: hits + reads equal the reads without it)."""
    from shared.model_config import load_config
    from stage_worker.checkpoint.loader import LoadOptions, load_model
    from stage_worker.kernels.flags import KernelFlags
    from expert_tables import fingerprints_hold, graphed_greedy, greedy, random_cold

    cfg = load_config(tiny_checkpoint)
    prompt = [(7 * i + 3) % 2000 + 10 for i in range(20)]
    cold = random_cold(cfg, 0.5, seed=3)

    def run(prefetch, cold, moves, graphs, min_batch=1):
        model = load_model(tiny_checkpoint, LoadOptions(device="cuda", load_format="dummy", dummy_int4=int4,
                                                        cold_experts=cold, expert_move_async=cold is not None,
                                                        expert_prefetch=prefetch,
                                                        expert_prefetch_min_batch=min_batch), cfg)
        model.set_kernels(KernelFlags.parse("all"))
        if graphs:
            return (model, *graphed_greedy(model, prompt, 24, moves, move_graph=True))
        tokens, lps = greedy(model, prompt, 24, move_every=int(moves))
        return model, tokens, lps.float().max(-1).values.tolist()     # each step's greedy log-probability

    for int4, graphs in ((64, 32), False), ((64, 32), True), (None, True):
        plain, want, want_lp = run(0, None, False, graphs)
        base = run(0, cold, False, graphs)[0].experts
        for moves in (False, True):
            model, got, lp = run(4, cold, moves, graphs)
            x = model.experts
            assert got == want, (graphs, moves)
            assert max(abs(a - b) for a, b in zip(lp, want_lp)) < 1e-3
            hits = int(x.prefetch_hits.sum())
            assert hits > 0 and int(x.prefetch_issued.sum()) >= hits
            assert int(x.prefetch_hits[0]) == 0          # the stage's first MoE layer: nothing predicts it
            if not moves:
                assert int(x.host_reads.sum()) + hits == int(base.host_reads.sum())
            fingerprints_hold(model, plain)
            x.snapshot()
            torch.cuda.synchronize()
            x.snapshot()                                   # the first copy has landed: its values are kept
            stats = x.stats()
            assert sum(v for k, v in stats.items() if k.startswith("expert_prefetch_hits:")) == hits
        # `expert_prefetch_min_batch` 2: this one-token decode never predicts, and reads what it read without slots
        model, got, _ = run(4, cold, False, graphs, min_batch=2)
        assert got == want and int(model.experts.prefetch_issued.sum()) == 0
        assert int(model.experts.host_reads.sum()) == int(base.host_reads.sum())


def test_prefetch_min_batch_is_a_config_key_with_its_variable(monkeypatch):
    """`expert_prefetch_min_batch`: 2 by default (h100-40: at one token the launches cost more than the reads they
    save), `MOEPIPE_EXPERT_PREFETCH_MIN_BATCH` sets it, below 1 is refused by name; the loader's value reaches each
    table's prefetch state (`Prefetch.min_tokens`, which `SparseMoE._prefetch_next` compares with the step's rows)."""
    from shared.cluster_config import ClusterConfig, ClusterConfigError, cluster_from_dict, env_overrides

    assert ClusterConfig.__dataclass_fields__["expert_prefetch_min_batch"].default == 2
    monkeypatch.setenv("MOEPIPE_EXPERT_PREFETCH_MIN_BATCH", "4")
    assert env_overrides()["expert_prefetch_min_batch"] == 4
    monkeypatch.delenv("MOEPIPE_EXPERT_PREFETCH_MIN_BATCH")
    base = {"model": "m", "stages": [{"start": 0, "end": 1, "endpoint": "ipc:///tmp/s0"}],
            "gateway_endpoint": "ipc:///tmp/g"}
    assert cluster_from_dict({**base, "expert_prefetch_min_batch": 1}).expert_prefetch_min_batch == 1
    with pytest.raises(ClusterConfigError, match="expert_prefetch_min_batch"):
        cluster_from_dict({**base, "expert_prefetch_min_batch": 0})
    assert Prefetch.allocate(2, 4, 8, 2, 16, torch.float32, torch.device("cpu"), min_tokens=3).min_tokens == 3
    assert Prefetch.allocate(2, 4, 8, 2, 16, torch.float32, torch.device("cpu")).min_tokens == 1


def test_prefetch_counters_reach_metrics():
    """A stage's heartbeat counters of the prefetch become /metrics' per-layer counters."""
    from prometheus_client import CollectorRegistry, generate_latest

    from gateway.metrics import _StageStatsCollector

    c = _StageStatsCollector()
    c.set("0", {"expert_prefetches:3": 7.0, "expert_prefetch_hits:3": 5.0, "expert_host_reads:3": 2.0})
    reg = CollectorRegistry()
    reg.register(c)
    text = generate_latest(reg).decode()
    assert 'moepipe_expert_prefetches_total{layer="3",stage="0"} 7.0' in text
    assert 'moepipe_expert_prefetch_hits_total{layer="3",stage="0"} 5.0' in text


def test_the_benchmarks_replay_ranks_the_traces_prediction_for_the_next_layer(tiny_checkpoint):
    """`bench/expert_offload.py`'s `Replay.predict` (called by layer L before it routes) ranks the trace's
    prediction for layer L + 1 (staged as forced logits before the step) through the real predict launch: the
    first distinct host slots, rank-major, as `predict_ref` on those predictions."""
    import sys
    from pathlib import Path

    from stage_worker.checkpoint.loader import LoadOptions, load_model

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import expert_offload as bench

    model = load_model(tiny_checkpoint, LoadOptions(device=DEV))   # on a GPU: the compiled launch on CUDA tensors
    E, k, H = model.cfg.num_experts, model.cfg.num_experts_per_tok, model.cfg.hidden_size
    replay = bench.Replay(model, 2, k)
    g = torch.Generator().manual_seed(3)
    layers = len(replay.moes)
    replay.pred[:, :2] = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(layers * 2)]).view(
        layers, 2, k)
    replay.stage_pred()
    for layer in range(layers):
        replay.layer = layer
        pf = Prefetch.allocate(3, 5, E, k, 16, torch.float32, torch.device(DEV))
        replay.predict(torch.randn(2, H, generator=g).to(DEV), torch.randn(E, H, generator=g).to(DEV), k, pf, 8)
        nxt = replay.pred[(layer + 1) % layers, :2]
        want = [s for s in nxt.t().reshape(-1).tolist() if s >= 8]
        want = list(dict.fromkeys(want))[:3]
        assert pf.slot.tolist() == want + [-1] * (3 - len(want))
    assert replay.predict_calls == layers
