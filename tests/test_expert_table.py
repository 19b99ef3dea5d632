"""Experts in host RAM (issue 16): the expert table's kernels against their references, run-time moves, and whole
models that serve the same greedy tokens with 10% or 50% of their experts in host RAM, moves on and off.

Without CUDA the Triton kernels run on CPU tensors under TRITON_INTERPRET=1 (the model-level tests take the
PyTorch path a CPU cluster runs: the two-table fallback); with CUDA the host rows are pinned and read over PCIe.
"""

from __future__ import annotations

import dataclasses
import time

import httpx
import pytest
import torch

CUDA = torch.cuda.is_available()     # without CUDA: Triton's interpreter (tests/conftest.py turns it on)
pytest.importorskip("triton")

from stage_worker.kernels import expert_moves as M  # noqa: E402
from stage_worker.kernels import moe as K  # noqa: E402
from stage_worker.kernels import moe_prefill as P  # noqa: E402


from shared import cold_set  # noqa: E402
from shared.model_config import load_config  # noqa: E402
from stage_worker.checkpoint.loader import LoadOptions, load_model  # noqa: E402
from stage_worker.kernels.expert_moves_ref import RowSet, swap_rows_ref  # noqa: E402
from stage_worker.kernels.moe_ref import HostRows, RouteCounts, count_ref, fused_moe_ref, route_ref  # noqa: E402
from expert_tables import (fingerprints_hold, graphed_greedy, greedy, permute_slots, random_cold,  # noqa: E402
                           random_move_rounds)

DEV = "cuda" if CUDA else "cpu"
E, TOP_K, H, I = 16, 4, 32, 16


def _host(t: torch.Tensor) -> torch.Tensor:
    """Host rows as the server keeps them: pinned host memory when a GPU reads them."""
    t = t.cpu().clone()
    return t.pin_memory() if CUDA else t


def _split(w13: torch.Tensor, w2: torch.Tensor, hot: int):
    return w13[:hot].contiguous(), w2[:hot].contiguous(), HostRows(_host(w13[hot:]), _host(w2[hot:]), hot)


def _experts(seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5
    w2 = torch.randn(E, H, I, generator=g) / I ** 0.5
    return w13.to(DEV, dtype), w2.to(DEV, dtype), g


@pytest.mark.parametrize("t,hot,shared", [(1, 14, False), (5, 8, True), (70, 4, False), (70, 10, True)])
def test_kernels_read_host_rows_as_if_one_table(t, hot, shared):
    """Decode (T*k small) and prefill (grouped GEMMs, and the per-expert loop): slots >= hot come from the host
    table, and the result equals the reference on the whole table."""
    w13, w2, g = _experts(t + hot)
    x = torch.randn(t, H, generator=g).to(DEV)
    logits = torch.randn(t, E, generator=g)
    logits[:, E - 1] += 10                     # the last slot, a host row, in every token's top-k
    weights, ids = route_ref(logits.to(DEV), TOP_K, True)
    sh = None
    if shared:
        sh = K.SharedExpert(torch.randn(2 * I, H, generator=g).to(DEV) / H ** 0.5,
                            torch.randn(H, I, generator=g).to(DEV) / I ** 0.5)
        weights = torch.cat([weights, torch.full((t, 1), 0.3, device=DEV)], 1)
        ids = torch.cat([ids, torch.full((t, 1), -1, dtype=torch.int32, device=DEV)], 1)
    ref = fused_moe_ref(x, ids, weights, w13, w2, sh)
    dev13, dev2, host = _split(w13, w2, hot)
    outs = [K.fused_moe(x, ids, weights, dev13, dev2, sh, host=host),
            K.grouped_moe(x, ids, weights, dev13, dev2, sh, host=host)]
    if not shared:
        outs.append(P.grouped_moe_triton(x, ids, weights, dev13, dev2, host))
    assert any(ids.flatten() >= hot)           # some selections are host reads
    for out in outs:
        if CUDA:    # on a GPU the grouped GEMMs' tl.dot multiplies float32 as TF32 (10-bit mantissa)
            assert ((out - ref).norm() / ref.norm()).item() < 5e-3
        else:
            torch.testing.assert_close(out, ref, rtol=2e-4, atol=2e-5)


def test_host_rows_must_continue_the_device_table():
    w13, w2, _ = _experts(1)
    dev13, dev2, host = _split(w13, w2, 10)
    ids = torch.zeros(1, TOP_K, dtype=torch.int32, device=DEV)
    x = torch.zeros(1, H, device=DEV)
    with pytest.raises(ValueError, match="do not continue"):
        K.fused_moe(x, ids, torch.ones(1, TOP_K, device=DEV), dev13, dev2, host=HostRows(host.w13, host.w2, 9))


@pytest.mark.parametrize("t", [1, 6])
def test_router_counts_selections_and_host_reads(t):
    logits = torch.randn(t, E, generator=torch.Generator().manual_seed(t)).to(DEV)
    c = RouteCounts(torch.full((E,), 0.5, device=DEV), torch.tensor([7], device=DEV), 11)
    _, ids = K.route(logits, TOP_K, True, counts=c)
    want = RouteCounts(torch.full((E,), 0.5, device=DEV), torch.tensor([7], device=DEV), 11)
    count_ref(ids, want)
    assert torch.equal(c.counts, want.counts) and torch.equal(c.host_reads, want.host_reads)
    assert c.counts.sum().item() == pytest.approx(0.5 * E + t * TOP_K)
    assert c.host_reads.item() == 7 + int((ids >= 11).sum())


@pytest.mark.parametrize("shared", [False, True])
def test_router_through_a_slot_map_returns_and_counts_slots(shared):
    """`route(slot_map=)`: a table's router index -> slot map applied to every selection before it is returned and
    counted (slots past E too: a table may hold more slots than router rows); weights as without it; the kernel
    and the PyTorch path (a CPU without Triton) agree."""
    g = torch.Generator().manual_seed(5)
    t = 6
    logits = torch.randn(t, E + int(shared), generator=g).to(DEV)
    slot_map = torch.randperm(E + 2, generator=g)[:E].to(DEV, torch.int32)
    w_ref, ids_ref = route_ref(logits[:, :E], TOP_K, True)
    want = slot_map.cpu()[ids_ref.cpu().long()]
    for kernel in (True, False):
        c = RouteCounts(torch.zeros(E + 2, device=DEV), torch.zeros(1, dtype=torch.int64, device=DEV), 11)
        if kernel:
            w, ids = K.route(logits, TOP_K, True, shared=shared, counts=c, slot_map=slot_map)
        else:
            real = K.triton_usable
            K.triton_usable = lambda _t: False
            try:
                w, ids = K.route(logits, TOP_K, True, shared=shared, counts=c, slot_map=slot_map)
            finally:
                K.triton_usable = real
        assert torch.equal(ids[:, :TOP_K].cpu().long(), want), kernel
        torch.testing.assert_close(w[:, :TOP_K], w_ref)
        if shared:
            assert (ids[:, TOP_K] == -1).all()
        counted = torch.zeros(E + 2).index_add_(0, want.reshape(-1), torch.ones(want.numel()))
        assert torch.equal(c.counts.cpu(), counted) and c.host_reads.item() == int((want >= 11).sum())
    with pytest.raises(ValueError, match="slot_map"):
        K.route(logits, TOP_K, True, shared=shared, slot_map=slot_map[:-1])


def test_a_slot_map_routes_each_router_row_to_its_experts_new_slot(demo):
    """The demo model with half its experts in host RAM, every table's rows shuffled to other slots and the slot
    map following them: the same greedy tokens and log-probabilities as the model without a table (the PyTorch
    path's sums run in expert order whatever the slots), and every slot still holds its own expert."""
    d, cfg = demo
    prompt = [1, 5, 9, 33, 70, 100, 7, 400]
    plain = load_model(d, LoadOptions(), cfg)
    want, want_lp = greedy(plain, prompt, 10)
    model = load_model(d, LoadOptions(cold_experts=random_cold(cfg, 0.5, seed=2)), cfg)
    assert permute_slots(model, 3) > 0
    got, lp = greedy(model, prompt, 10)
    assert got == want and (lp - want_lp).abs().max().item() < 1e-4
    assert model.experts.host_reads.sum().item() > 0
    fingerprints_hold(model, plain)


def test_decide_moves_only_a_clear_winner():
    # decayed by half, then per layer: least used device slot, most used host slot, move if it leads by > 1
    counts = torch.tensor([[5.0, 1.0, 9.0, 3.0],      # hot 2: 4.5 > 0.5 + 1: slots 1 and 2 trade places
                           [5.0, 4.0, 5.0, 3.0],      # 2.5 > 2.0 + 1? no
                           [0.0, 0.0, 0.0, 0.0]], device=DEV)   # hot 3, all equal: lowest slots, no move
    dec = M.decide(counts, torch.tensor([2, 2, 3], device=DEV), decay=0.5, margin=1.0)
    assert dec.tolist() == [[1, 2, 1], [1, 2, 0], [0, 3, 0]]
    assert counts[0].tolist() == [2.5, 0.5, 4.5, 1.5]        # decayed in place


def test_swap_kernel_matches_the_reference():
    g = torch.Generator().manual_seed(3)
    hots = [10, 4, 15]
    dev = [torch.randn(h, 2 * I, H, generator=g).to(DEV) for h in hots]
    host = [_host(torch.randn(E - h, 2 * I, H, generator=g)) for h in hots]
    gate = [torch.randn(E, H, generator=g).to(DEV) for _ in hots]
    dec = torch.tensor([[2, 12, 1], [0, 15, 0], [14, 15, 1]], device=DEV)
    before = host[0][12 - 10].clone()
    for rows in (RowSet(dev, host, hots), RowSet(gate, gate, [E] * 3)):
        cloned = [t.clone() for t in rows.dev]
        want = RowSet(cloned, cloned if rows.host is rows.dev else [t.clone() for t in rows.host], rows.split)
        swap_rows_ref(want, dec)
        M.swap_rows(M.SwapPlan.build(rows, torch.device(DEV)), dec, block=256)
        for a, b in zip(rows.dev + rows.host, want.dev + want.host):
            assert torch.equal(a.cpu(), b.cpu())
    assert torch.equal(dev[0][2].cpu(), before.cpu())        # the host row came to the device, and the other way


# ---- whole models ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo():
    from shared.cli import ensure_builtin_model

    d = ensure_builtin_model()        # the copy under MOEPIPE_HOME, made if no earlier test made it
    return d, load_config(d)


@pytest.mark.parametrize("share,move_every", [(0.1, 0), (0.5, 0), (0.5, 1)])
def test_demo_model_serves_the_same_greedy_tokens_with_host_experts(demo, share, move_every):
    d, cfg = demo
    prompt = [1, 5, 9, 33, 70, 100, 7, 400]
    plain = load_model(d, LoadOptions(), cfg)
    want, want_lp = greedy(plain, prompt, 12)
    model = load_model(d, LoadOptions(cold_experts=random_cold(cfg, share)), cfg)
    assert model.experts is not None and model.experts.host_bytes() > 0
    got, lp = greedy(model, prompt, 12, move_every)
    assert got == want
    # Routing over slot-ordered router rows sums the softmax in another order: differences at rounding level.
    assert (lp - want_lp).abs().max().item() < 1e-4
    reads = model.experts.host_reads.sum().item()
    assert reads > 0 and model.experts.counts.sum().item() > 0
    if move_every:
        assert model.experts.moves.sum().item() > 0
    fingerprints_hold(model, plain)


def test_thousands_of_moves_keep_every_row_its_own_expert(demo):
    d, cfg = demo
    plain = load_model(d, LoadOptions(), cfg)
    model = load_model(d, LoadOptions(cold_experts=random_cold(cfg, 0.25, seed=4)), cfg)
    assert random_move_rounds(model, 2000) >= 1000
    fingerprints_hold(model, plain)


def test_dummy_weights_fill_the_tables_as_they_fill_the_parameters(tiny_checkpoint):
    """The dummy format generates each [E, ...] expert tensor whole and scatters it into the slots (the path a fused
    on-disk `experts.gate_up_proj` takes too): the rows are the all-in-VRAM model's."""
    cfg = load_config(tiny_checkpoint)
    opts = LoadOptions(load_format="dummy", seed=3)
    plain = load_model(tiny_checkpoint, opts, cfg)
    model = load_model(tiny_checkpoint, dataclasses.replace(opts, cold_experts=random_cold(cfg, 0.25, seed=5)), cfg)
    fingerprints_hold(model, plain)


def test_transformers_written_checkpoint_with_host_experts(reference_checkpoints):
    """A checkpoint transformers itself wrote (its per-expert tensors) loaded into tables, moves on."""
    path, _ = reference_checkpoints["qwen3_5_moe"]
    cfg = load_config(path)
    plain = load_model(path, LoadOptions(), cfg)
    model = load_model(path, LoadOptions(cold_experts=random_cold(cfg, 0.5, seed=2)), cfg)
    prompt = [3, 17, 101, 250, 9]
    want, want_lp = greedy(plain, prompt, 8)
    got, lp = greedy(model, prompt, 8, move_every=1)
    assert got == want and (lp - want_lp).abs().max().item() < 1e-4
    fingerprints_hold(model, plain)


@pytest.mark.gpu
def test_registered_host_memory_is_read_by_the_kernels_on_the_gpu():
    """The server's host rows: an exact-size mapping registered with cudaHostRegister (not torch's pinned pool)."""
    from stage_worker.host_memory import allocate

    w13, w2, g = _experts(21, torch.bfloat16)
    hot = 6
    n13, n2 = w13[hot:].numel() * 2, w2[hot:].numel() * 2
    buf = allocate(n13 + n2, what="test rows", headroom=0)
    assert buf.pinned
    h13 = buf.tensor[:n13].view(torch.bfloat16).view(E - hot, 2 * I, H)
    h2 = buf.tensor[n13:].view(torch.bfloat16).view(E - hot, H, I)
    h13.copy_(w13[hot:])
    h2.copy_(w2[hot:])
    x = torch.randn(3, H, generator=g).to(DEV, torch.bfloat16)
    logits = torch.randn(3, E, generator=g)
    logits[:, E - 1] += 10
    weights, ids = route_ref(logits.to(DEV), TOP_K, True)
    out = K.fused_moe(x, ids, weights.to(torch.bfloat16), w13[:hot].contiguous(), w2[:hot].contiguous(),
                      host=HostRows(h13, h2, hot))
    ref = fused_moe_ref(x, ids, weights.to(torch.bfloat16), w13, w2)
    assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 2e-2
    del h13, h2
    buf.close()


@pytest.mark.gpu
def test_gpu_stage_with_host_experts_graphs_and_moves_serves_the_same_greedy_tokens(tiny_checkpoint):
    """The fast path on the GPU (fused kernels, CUDA graphs, moves between replays) with half the experts in
    registered host memory: the greedy tokens of the all-in-VRAM model, every row still its expert's."""
    from stage_worker.kernels.flags import KernelFlags

    cfg = load_config(tiny_checkpoint)

    def greedy(cold, moves):
        model = load_model(tiny_checkpoint, LoadOptions(device="cuda", cold_experts=cold), cfg)
        model.set_kernels(KernelFlags.parse("all"))
        return (model, *graphed_greedy(model, [1, 5, 9, 33, 70, 100], 16, moves))

    plain, want, want_lp = greedy(None, False)
    for moves in (False, True):
        model, got, lp = greedy(random_cold(cfg, 0.5, seed=3), moves)
        assert got == want
        assert max(abs(a - b) for a, b in zip(lp, want_lp)) < 2e-2
        assert model.experts.host_reads.sum().item() > 0
        if moves:
            assert model.experts.moves.sum().item() > 0
        fingerprints_hold(model, plain)
    # rows shuffled across the split behind a slot map (the router kernel maps each selection, in the graphs too)
    model = load_model(tiny_checkpoint, LoadOptions(device="cuda", cold_experts=random_cold(cfg, 0.5, seed=3)), cfg)
    model.set_kernels(KernelFlags.parse("all"))
    assert permute_slots(model, 11) > 0
    got, lp = graphed_greedy(model, [1, 5, 9, 33, 70, 100], 16, False)
    assert got == want and max(abs(a - b) for a, b in zip(lp, want_lp)) < 2e-2
    fingerprints_hold(model, plain)


# ---- served --------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def host_experts_case(tiny_checkpoint, tmp_path_factory):
    """What the three served cases share: the tiny checkpoint's config, its cold-set file (half of every layer's
    experts in host RAM; the stages only read it), the prompts, and the all-in-VRAM model's greedy tokens and
    log-probabilities for them (in process), made once for the module."""
    cfg = load_config(tiny_checkpoint)
    f = cold_set.write(tmp_path_factory.mktemp("cold") / "cold.json", cfg, str(tiny_checkpoint),
                       random_cold(cfg, 0.5, seed=1), [(0, 3), (3, 6)], cold_set.expert_bytes(cfg), 1 << 30, ["test"])
    prompts = [[5, 17, 101, 250, 9, 33], [40, 41, 42, 7]]
    plain = load_model(tiny_checkpoint, LoadOptions(), cfg)
    return cfg, f, prompts, [greedy(plain, p, 16) for p in prompts]


@pytest.mark.parametrize("spares,claims", [(False, 1), (True, 1), (True, 3)],
                         ids=["in_place", "async", "async_3_claims_tokens"])
def test_served_with_host_experts_equals_all_in_vram_and_reports_metrics(tiny_checkpoint, host_experts_case, spares,
                                                                         claims):
    """The real 2-stage cluster with half of every layer's experts in host RAM and a move round every 2 steps
    serves the greedy tokens and logprobs of the all-in-VRAM model (in process here), and /metrics says how many
    host reads and moves it made; moves in place, or into spare slots committed a round later
    (`expert_move_async`), one claim a step or three with the half-life counted in tokens (`expert_move_claims`,
    `expert_move_half_life_unit`: the config reaches the stages' loader and round)."""
    from conftest import small_cluster_options
    from gateway.launcher import Cluster

    cfg, f, prompts, want = host_experts_case
    opts = small_cluster_options(tiny_checkpoint)
    extra = dict(opts.extra, cold_experts=str(f), expert_move_interval=2, expert_move_async=spares,
                 expert_move_claims=claims, expert_move_half_life_unit="tokens" if claims > 1 else "steps")
    with Cluster(dataclasses.replace(opts, extra=extra)) as c:
        outs = [httpx.post(c.url + "/v1/completions", timeout=120, json={
            "model": "moepipe", "prompt": p, "max_tokens": 16, "temperature": 0, "logprobs": 1,
            "ignore_eos": True}, verify=False).json() for p in prompts]
        deadline = time.time() + 10          # the counters reach the gateway with the next heartbeats
        metrics = ""
        while "moepipe_expert_moves_total{" not in metrics and time.time() < deadline:
            metrics = httpx.get(c.url + "/metrics", timeout=10, verify=False).text
            time.sleep(0.3)
    for (tokens, lp), out in zip(want, outs):
        served = out["choices"][0]["logprobs"]["token_logprobs"]
        assert served == pytest.approx([lp[i, t].item() for i, t in enumerate(tokens)], abs=1e-4)
    reads = sum(float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith("moepipe_expert_host_reads_total{"))
    moves = sum(float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith("moepipe_expert_moves_total{"))
    assert reads > 0 and moves > 0
    assert 'moepipe_expert_bytes{stage="0",tier="host"}' in metrics and 'moepipe_kv_cache_bytes{stage="1"}' in metrics
    host = sum(float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith("moepipe_expert_bytes{") and 'tier="host"' in line)
    cold = random_cold(cfg, 0.5, seed=1)
    slots = sum(len(ids) for ids in cold.values())     # the spare of moves on read is a device slot
    assert host == slots * cold_set.expert_bytes(cfg, "float32")


def test_the_half_life_counted_in_tokens_decays_by_the_tokens_since_the_last_round(monkeypatch):
    """`expert_move_half_life_unit`: "steps" (the default) decays a round by 0.5 ** (interval / half-life) whatever
    the batch, "tokens" by 0.5 ** (decode tokens counted since the last round / half-life), so at batch 4 and a
    round every step a half-life of 128 tokens is 32 steps; a prefill-sized step counts no token (the router does
    not count it). The config key and its variable, and an unknown unit refused."""
    from shared.cluster_config import ClusterConfig, ClusterConfigError, cluster_from_dict, env_overrides  # noqa: E501
    from stage_worker.expert_offload import round_decay
    from stage_worker.model.expert_table import COUNT_MAX_TK, counted_tokens

    assert ClusterConfig.__dataclass_fields__["expert_move_half_life_unit"].default == "steps"
    assert round_decay("steps", 128.0, 1, 4) == 0.5 ** (1 / 128) == round_decay("steps", 128.0, 1, 1)
    assert round_decay("tokens", 128.0, 1, 4) == 0.5 ** (4 / 128) == round_decay("steps", 32.0, 1, 1)
    assert round_decay("tokens", 128.0, 2, 0) == 1.0
    assert counted_tokens(4, 10) == 4 and counted_tokens(COUNT_MAX_TK // 10 + 1, 10) == 0
    with pytest.raises(ValueError):
        round_decay("seconds", 128.0, 1, 4)
    monkeypatch.setenv("MOEPIPE_EXPERT_MOVE_HALF_LIFE_UNIT", " Tokens ")
    assert env_overrides()["expert_move_half_life_unit"] == "tokens"
    monkeypatch.delenv("MOEPIPE_EXPERT_MOVE_HALF_LIFE_UNIT")
    with pytest.raises(ClusterConfigError, match="expert_move_half_life_unit"):
        cluster_from_dict({"model": "m", "stages": [{"start": 0, "end": 1, "endpoint": "ipc:///tmp/s0"}],
                           "gateway_endpoint": "ipc:///tmp/g", "expert_move_half_life_unit": "seconds"})
    # the runner's round: the tokens counted since the last round, then none (a stand-in for its state)
    from types import SimpleNamespace

    from stage_worker.runner import StageRunner

    for unit, want in (("steps", 0.5 ** (1 / 128)), ("tokens", 0.5 ** (8 / 128))):
        r = SimpleNamespace(cluster=SimpleNamespace(expert_move_half_life_unit=unit, expert_move_half_life=128.0,
                                                    expert_move_interval=1),
                            _move_decay=0.5 ** (1 / 128), _move_tokens=8)
        assert StageRunner.move_decay(r) == want
        assert r._move_tokens == (8 if unit == "steps" else 0)
    # expert_move_claims: 1 by default, 1..16 served (2C spares a table), others refused by name
    assert ClusterConfig.__dataclass_fields__["expert_move_claims"].default == 1
    monkeypatch.setenv("MOEPIPE_EXPERT_MOVE_CLAIMS", "4")
    assert env_overrides()["expert_move_claims"] == 4
    monkeypatch.delenv("MOEPIPE_EXPERT_MOVE_CLAIMS")
    base = {"model": "m", "stages": [{"start": 0, "end": 1, "endpoint": "ipc:///tmp/s0"}],
            "gateway_endpoint": "ipc:///tmp/g"}
    assert cluster_from_dict({**base, "expert_move_claims": 4}).expert_move_claims == 4
    for bad in (0, 17):
        with pytest.raises(ClusterConfigError, match="expert_move_claims"):
            cluster_from_dict({**base, "expert_move_claims": bad})
