"""Expert moves off the forward's stream (`expert_move_async`): a spare slot per tier, the router through a slot
map, a round's chosen rows copied into the spares (on a side stream on a GPU) and committed at the next round by
rewriting the slot map. The copy kernel against its reference, the commit's bookkeeping, and whole models that
serve the all-in-VRAM greedy tokens with a round after every token, every row still its own expert after
thousands of rounds.

Without CUDA the copy kernel runs on CPU tensors under TRITON_INTERPRET=1 (tests/conftest.py); the model-level
tests take the PyTorch path a CPU cluster runs (copies by `copy_rows_ref`, committed the next round as on a GPU).
"""

from __future__ import annotations

import pytest
import torch

CUDA = torch.cuda.is_available()
pytest.importorskip("triton")

from shared.model_config import load_config  # noqa: E402
from stage_worker.checkpoint.loader import LoadOptions, load_model  # noqa: E402
from stage_worker.kernels import expert_moves as M  # noqa: E402
from stage_worker.kernels.expert_moves_ref import RowSet, copy_rows_ref  # noqa: E402
from expert_tables import fingerprints_hold, graphed_greedy, greedy, random_cold, random_move_rounds  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
PROMPT = [1, 5, 9, 33, 70, 100, 7, 400]


def _rows(g: torch.Generator, hots: list[int], S: int, shape=(3, 5), dtype=torch.float32) -> RowSet:
    dev = [torch.randn(h, *shape, generator=g).to(DEV, dtype) for h in hots]
    host = [torch.randn(S - h, *shape, generator=g) for h in hots]
    host = [t.pin_memory() if CUDA else t for t in host]
    return RowSet(dev, host, list(hots))


def test_copy_kernel_matches_the_reference():
    """`copy_rows`: where a layer moves, its host slot's row into the device spare and its device slot's into the
    host spare; nothing else written (layers that stay, live rows); the indexed form (`layers`) reads a stage-wide
    decision row per layer."""
    g = torch.Generator().manual_seed(1)
    S, hots = 10, [4, 6, 3]
    dec = torch.tensor([[1, 7, 1, 3, 9], [2, 8, 0, 5, 9], [0, 4, 1, 2, 5]], dtype=torch.int64)
    for layers in (None, torch.tensor([2, 0], dtype=torch.int64)):
        rows = _rows(g, hots if layers is None else [hots[2], hots[0]], S)
        want = RowSet([t.clone() for t in rows.dev], [t.clone() for t in rows.host], rows.split)
        copy_rows_ref(want, dec if layers is None else dec[layers])
        if layers is None:      # layer 0: host slot 7 (host row 3) into the device spare 3, device slot 1 into
            assert torch.equal(want.dev[0][3], rows.host[0][3].to(DEV))     # the host spare 9 (host row 5)
            assert torch.equal(want.host[0][5], rows.dev[0][1].cpu()) and torch.equal(want.dev[1], rows.dev[1])
        plan = M.SwapPlan.build(rows, torch.device(DEV))      # rows of 15 elements: 4 blocks of 4, 2 programs loop
        M.copy_rows(plan, dec.to(DEV), block=4, layers=None if layers is None else layers.to(DEV), programs=2)
        for a, b in zip(rows.dev + rows.host, want.dev + want.host):
            assert torch.equal(a.cpu(), b.cpu())


def test_commit_routes_the_moved_experts_to_the_spares():
    """`decide_spares` then `commit_spares` on a stage of three layers (one with nothing to move): the slot map
    stays a bijection from router rows onto the live slots and every router row still leads to its own expert, the
    moved experts' router rows lead to the old spares, the slots they left are the new spares (expert -1, count 0,
    no router row), counts followed, moves counted."""
    S = 10                                                         # 8 experts and two spares a layer
    hot = torch.tensor([4, 6, 1], dtype=torch.int64)               # device slots, each layer's spare among them
    spares = torch.tensor([[3, 9], [5, 9], [0, 9]], dtype=torch.int64)
    orders = [[0, 1, 2, -1, 3, 4, 5, 6, 7, -1], [0, 1, 2, 3, 4, -1, 5, 6, 7, -1], [-1, 0, 1, 2, 3, 4, 5, 6, 7, -1]]
    expert_of_slot = torch.tensor(orders, dtype=torch.int32)
    live = [[s for s, e in enumerate(o) if e >= 0] for o in orders]
    slot_map = torch.tensor(live, dtype=torch.int32)
    expert_of_row = [[o[s] for s in slots] for o, slots in zip(orders, live)]     # fixed: gate rows never move
    counts = torch.tensor([[5, 1, 3, 0, 2, 9, 0, 0, 0, 0], [5, 5, 5, 5, 5, 0, 6, 0, 0, 0],
                           [0, 0, 0, 0, 0, 0, 0, 0, 9, 0]], dtype=torch.float32)
    moves = torch.zeros(3, dtype=torch.int64)
    dec = M.decide_spares(counts, hot, spares, 1.0, 0.5)
    assert dec.tolist() == [[1, 5, 1, 3, 9], [0, 6, 1, 5, 9], [0, 8, 0, 0, 9]]   # layer 2: no live device slot
    before = slot_map.clone()
    M.commit_spares(dec, counts, expert_of_slot, slot_map, spares, moves)
    assert moves.tolist() == [1, 1, 0] and spares.tolist() == [[1, 5], [0, 6], [0, 9]]
    # layer 0: expert 4 (host slot 5, router row 4) now in slot 3; expert 1 (device slot 1, row 1) in slot 9
    assert slot_map[0, 4].item() == 3 and slot_map[0, 1].item() == 9
    assert expert_of_slot[0].tolist() == [0, -1, 2, 4, 3, -1, 5, 6, 7, 1]
    assert counts[0].tolist() == [5, 0, 3, 9, 2, 0, 0, 0, 0, 1]
    assert torch.equal(slot_map[2], before[2]) and torch.equal(expert_of_slot[2], torch.tensor(orders[2],
                                                                                               dtype=torch.int32))
    for layer in range(3):
        slots = slot_map[layer].tolist()
        assert sorted(slots) == sorted(set(range(S)) - set(spares[layer].tolist()))
        assert [expert_of_slot[layer, s].item() for s in slots] == expert_of_row[layer]   # each row: its expert
        assert all(expert_of_slot[layer, s].item() == -1 for s in spares[layer].tolist())


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
    assert x.spares is not None and all(t.num_slots == cfg.num_experts + 2 for t in x.tables.values())
    got, lp = greedy(model, PROMPT, 12, move_every=1)
    assert got == want and (lp - want_lp).abs().max().item() < 1e-4
    assert x.moves.sum().item() > 0 and x.host_reads.sum().item() > 0
    fingerprints_hold(model, plain)


def test_thousands_of_rounds_off_the_forward_keep_every_row_its_own_expert(demo):
    d, cfg = demo
    plain = load_model(d, LoadOptions(), cfg)
    model = load_model(d, LoadOptions(cold_experts=random_cold(cfg, 0.25, seed=4), expert_move_async=True), cfg)
    assert random_move_rounds(model, 2000) >= 1000
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
    """With `expert_move_async` the plan's VRAM weights and host column each hold one more expert a table (its
    spares), which is what the loader's tables hold."""
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
                         cold_experts=str(f), gpu_memory_utilization=1.0, measure_reserve=False)
    off = stage_needs(cfg, base)[0]
    on = stage_needs(cfg, dataclasses.replace(base, expert_move_async=True))[0]
    model = load_model(tiny_checkpoint, LoadOptions(dtype=torch.float32, cold_experts=cold, expert_move_async=True),
                       cfg)
    spare = len(model.experts.tables) * cold_set.expert_bytes(cfg, "float32")
    assert on.host_experts == off.host_experts + spare == model.experts.host_bytes()
    assert on.weights == off.weights + spare and on.routed_experts == off.routed_experts
    assert model.experts.device_bytes() == off.routed_experts + spare


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("vmm", [False, True], ids=["two_tables", "vmm_range"])
def test_gpu_graphs_with_moves_off_the_forward_serve_the_same_greedy_tokens(tiny_checkpoint, vmm):
    """On the GPU: fused kernels, CUDA graphs, a round after every replay whose copies run on the side stream
    while the next step runs: the all-in-VRAM greedy tokens, every row its expert's; the tables as two tensors
    or as one VRAM + host range per part (`expert_vmm_table`, the spares at the end of each tier)."""
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
