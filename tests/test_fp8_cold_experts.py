"""Float8 experts (issue 17, `packed_fp8_experts`) in expert tables with cold experts in host RAM (issue 16): a
block-FP8 checkpoint (the `fp8_dirs` fixture: `moepipe quantize --scheme fp8-block` of transformers' tiny Qwen3-Next
and Qwen4-Exp) loaded with 10% and 50% of every MoE layer's experts in host RAM gives the logits of the same
checkpoint with every expert in VRAM (float8) and of its dequantized load, a prompt and 8 greedy decode steps; the
tables hold the float8 bytes and block scales at their size (never a bf16 copy); forced moves (uint8 and float32
rows through the swap kernel) keep every slot its own expert; the memory plan counts float8 host slots at theirs.

Without CUDA the model runs the PyTorch path a CPU cluster runs (`ExpertTable.moe_fp8`) and the kernels (the FP8
decode pair with host slots, the swap) run under TRITON_INTERPRET=1; the kernel's GPU test is in
tests/test_kernel_moe_fp8.py.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("compressed_tensors")

from expert_tables import fingerprints_hold, greedy, random_cold, random_move_rounds  # noqa: E402
from shared import cold_set  # noqa: E402
from shared.model_config import load_config  # noqa: E402
from stage_worker.checkpoint.loader import LoadOptions, load_model  # noqa: E402
from stage_worker.expert_offload import SPARES, gates  # noqa: E402
from stage_worker.kernels import expert_moves as M  # noqa: E402
from stage_worker.kernels.expert_moves_ref import RowSet, swap_rows_ref  # noqa: E402
from stage_worker.local_engine import LocalEngine  # noqa: E402
from stage_worker.model.expert_table import FP8_PARTS, PARTS  # noqa: E402

PROMPT = [40, 7, 200, 13, 5, 99, 101, 250, 3, 17, 88, 61, 120, 300]
STEPS = 8
BLOCK = (128, 128)


def _load(qdir, cold=None, fp8: bool = True, on_read: bool = False):
    return load_model(qdir, LoadOptions(dtype=torch.float32, packed_fp8_experts=fp8, cold_experts=cold,
                                        expert_move_async=on_read))


def _run(model, move_every: int = 0) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and every step's logits: the prompt, then STEPS decode steps (a move round before every
    `move_every`-th step when set)."""
    engine = LocalEngine([model], max_seqs=1, max_tokens=64)
    engine.add(0)
    logits = [engine.step([(0, PROMPT)], all_logits=True)]
    tokens = []
    for i in range(STEPS):
        tokens.append(int(logits[-1][-1].argmax()))
        if move_every and i % move_every == 0:
            model.experts.move_round(gates(model), decay=0.9, margin=0.0)
        logits.append(engine.step([(0, [tokens[-1]])]))
    return tokens, torch.cat([lg.reshape(-1, lg.shape[-1]) for lg in logits])


@pytest.fixture(scope="module", params=["qwen3_next", "qwen4_exp"])
def family(request, fp8_dirs):
    """(checkpoint, config, all-in-VRAM float8 model, its run, the dequantized load's run) of one layout."""
    qdir = fp8_dirs[request.param]
    plain = _load(qdir)
    assert all(m.fp8_block == BLOCK and m.table is None for m in plain.moe_layers().values())
    return qdir, load_config(qdir), plain, _run(plain), _run(_load(qdir, fp8=False))


@pytest.mark.parametrize("share,move_every", [(0.1, 0), (0.5, 0), (0.5, 1)])
def test_fp8_experts_in_host_ram_give_the_all_in_vram_and_the_dequantized_logits(family, share, move_every):
    """Each layer's table holds the float8 bytes (uint8) and float32 block scales, hot slots on the device and the
    cold ones in one host allocation at their size, written by the loader straight into their slots; greedy tokens
    and logits (1e-5) as all-in-VRAM float8 and as the dequantized load, moves off or every step."""
    qdir, cfg, plain, (want, want_logits), (deq, deq_logits) = family
    cold = random_cold(cfg, share, seed=int(share * 10))
    model = _load(qdir, cold)
    x = model.experts
    assert x is not None and sorted(x.tables) == sorted(cold)
    per_expert = cold_set.fp8_expert_bytes(cfg, BLOCK)
    for layer, moe in model.moe_layers().items():
        t = moe.table
        assert t.fp8 and not t.packed and t.fp8_block == BLOCK and t.parts == FP8_PARTS
        assert not any(hasattr(moe, p) for p in FP8_PARTS + PARTS)          # the table is the only copy
        assert t.host["q13"].dtype == torch.uint8 and t.host["s13"].dtype == torch.float32
        assert t.host["q13"].shape[0] == len(cold[layer]) and t.hot == cfg.num_experts - len(cold[layer])
        assert sum(r.nbytes for r in t.slot_rows(0)) == per_expert
    n_cold = sum(len(v) for v in cold.values())
    assert x.host_bytes() == x.stats()["expert_bytes_host"] == n_cold * per_expert
    assert x.device_bytes() == (len(cold) * cfg.num_experts - n_cold) * per_expert
    got, logits = _run(model, move_every)
    assert got == want == deq
    assert (logits - want_logits).abs().max().item() < 1e-5
    assert (logits - deq_logits).abs().max().item() < 1e-5
    assert x.host_reads.sum().item() > 0
    assert (x.moves.sum().item() > 0) == bool(move_every)
    assert fingerprints_hold(model, plain) == len(cold)


def test_many_forced_moves_keep_every_fp8_slot_its_own_expert(family):
    """1000 move rounds with random counts (the reference swap a CPU cluster runs), then greedy decoding with moves:
    every slot's bytes, scales and router row are its expert's, and the tokens are all-in-VRAM's."""
    qdir, cfg, plain, (want, _), _ = family
    model = _load(qdir, random_cold(cfg, 0.25, seed=4))
    assert random_move_rounds(model, 1000) >= 500
    fingerprints_hold(model, plain)
    assert greedy(model, PROMPT, STEPS, move_every=2)[0] == want


def test_fp8_moves_on_read_keep_the_tokens_and_every_slot_its_expert(family):
    """Moves on read (`expert_move_async`) over float8 tables: the step that reads a claimed host slot copies its
    bytes and block scales into a spare (the CPU path's `copy_claimed`), the round commits it and writes the victim
    back; greedy tokens and logits as all in VRAM with a round every step, then 300 random rounds, rows and router
    rows their experts'."""
    qdir, cfg, plain, (want, want_logits), _ = family
    model = _load(qdir, random_cold(cfg, 0.5, seed=5), on_read=True)
    x = model.experts
    assert x.state is not None and all(t.fp8 and t.claim is not None for t in x.tables.values())
    got, logits = _run(model, move_every=1)
    assert got == want and (logits - want_logits).abs().max().item() < 1e-5
    assert x.moves.sum().item() > 0
    fingerprints_hold(model, plain)
    assert random_move_rounds(model, 300) > 0
    fingerprints_hold(model, plain)


def test_swap_kernel_moves_fp8_rows_as_the_reference(fp8_dirs, monkeypatch):
    """The move kernel (interpreted) on a real stage's float8 tables: uint8 byte rows and float32 scale rows of
    device slots and of host slots in the one host allocation, and the router rows, swapped as `swap_rows_ref`
    swaps them; then move rounds through the kernel make the reference path's decisions, every slot its expert's."""
    qdir = fp8_dirs["qwen3_next"]
    cfg = load_config(qdir)
    plain = _load(qdir)
    model = _load(qdir, random_cold(cfg, 0.5, seed=2))
    x = model.experts
    sets = x.row_sets(gates(model))
    assert [(r.dev[0].dtype, idx) for r, idx in sets] == [(torch.uint8, None), (torch.float32, None),
                                                          (torch.uint8, None), (torch.float32, None),
                                                          (torch.float32, None)]
    lo, hi = x.host.tensor.data_ptr(), x.host.tensor.data_ptr() + x.host.nbytes
    assert all(lo <= h.data_ptr() and h.data_ptr() + h.nbytes <= hi for r, _ in sets[:4] for h in r.host)
    L, E = x.counts.shape
    hot = x.hot.tolist()
    dec = torch.tensor([[hot[i] - 1 - i % hot[i], E - 1 - i % (E - hot[i]), int(i % 3 != 1)] for i in range(L)],
                       dtype=torch.int64)
    for rows, _ in sets:
        clones = [t.clone() for t in rows.dev]
        want = RowSet(clones, clones if rows.host is rows.dev else [t.clone() for t in rows.host], rows.split)
        swap_rows_ref(want, dec)
        M.swap_rows(M.SwapPlan.build(rows, x.counts.device), dec, block=64)
        for a, b in zip(rows.dev + rows.host, want.dev + want.host):
            assert torch.equal(a, b)
        swap_rows_ref(rows, dec)                  # back: the slot map still says the load-time order
    fingerprints_hold(model, plain)
    monkeypatch.setattr(M, "swap_usable", lambda t: True)
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        x.counts.add_(torch.rand(x.counts.shape, generator=g) * 8)
        x.move_round(gates(model), decay=0.7, margin=0.5)
    assert x.moves.sum().item() >= 6
    fingerprints_hold(model, plain)


def test_the_fp8_decode_kernel_reads_a_real_table_s_host_slots(fp8_dirs):
    """The FP8 decode pair (interpreted) on a real table, host slots' bytes and scales from the host allocation:
    the same bits as the pair on the all-in-VRAM experts those slots hold, and the table's loop within rounding;
    the layer's own decode launches with a table against its PyTorch path."""
    from stage_worker.kernels.flags import KernelFlags
    from stage_worker.kernels.moe import fused_moe_fp8

    if torch.cuda.is_available():
        pytest.skip("the GPU test of the kernel with host slots is in tests/test_kernel_moe_fp8.py")
    qdir = fp8_dirs["qwen3_next"]
    cfg = load_config(qdir)
    plain = _load(qdir)
    model = _load(qdir, random_cold(cfg, 0.5, seed=3))
    layer, moe = next(iter(model.moe_layers().items()))
    t, every = moe.table, plain.moe_layers()[layer].packed()
    g = torch.Generator().manual_seed(0)
    for T in (1, 3):
        xs = torch.randn(T, cfg.hidden_size, generator=g)
        ids = torch.stack([torch.cat([t.hot + torch.randperm(cfg.num_experts - t.hot, generator=g)[:1],
                                      torch.randperm(t.hot, generator=g)[:2]]) for _ in range(T)]).int()
        w = torch.softmax(torch.randn(T, 3, generator=g), -1)
        dev, host = t.fp8_experts()
        out = fused_moe_fp8(xs, ids, w, dev, host=host, first_host=t.hot)
        assert torch.equal(out, fused_moe_fp8(xs, t.experts_of(ids), w, every))
        torch.testing.assert_close(out, t.moe_fp8(xs, ids, w), rtol=1e-4, atol=1e-5)
    # the layer's decode launches (router + shared gate GEMV, router kernel counting, the shared expert's bf16 pair,
    # the FP8 pair with host slots adding it) against its PyTorch path (the table's loop)
    model.set_kernels(KernelFlags.parse("all"))
    moe = next(m for m in model.moe_layers().values() if m.shared_expert is not None)
    assert moe.table.fp8 and moe._packed_router() is not None and moe._packed_shared() is not None
    xs = torch.randn(3, cfg.hidden_size, generator=g)
    reads = moe.table.host_reads.clone()
    with torch.inference_mode():
        fast = moe._packed_decode(xs, moe.table.route_counts(3, moe.top_k))
        ref = moe(xs)                                    # CPU: the PyTorch path
    torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-5)
    assert moe.table.host_reads.item() > reads.item()


def test_the_memory_plan_counts_fp8_host_slots_at_their_size(family, tmp_path):
    """A GPU stage of the FP8 checkpoint with a cold set: the plan's host column and VRAM weights are what the
    loader's float8 tables hold, and the switch keeps the experts float8 with cold experts."""
    from shared.cluster_config import ClusterConfig, StageSpec
    from stage_worker.memory_needs import stage_needs

    qdir, cfg, _, _, _ = family
    n = cfg.num_hidden_layers
    cold = random_cold(cfg, 0.5, seed=1)
    f = cold_set.write(tmp_path / "cold.json", cfg, str(qdir), cold, [(0, n)], cold_set.expert_bytes(cfg), 1 << 30,
                       ["test"])

    def cluster(cold_experts: str = "") -> ClusterConfig:
        return ClusterConfig(model=str(qdir), gateway_endpoint="", max_num_seqs=2, block_size=16, dtype="float32",
                             stages=[StageSpec(0, n, "", "cuda:0")], packed_fp8_experts=True,
                             fp8_expert_tables=True, measure_reserve=False, cold_experts=cold_experts)

    assert cluster(str(f)).keeps_fp8_experts() and cluster("auto").keeps_fp8_experts()
    need, base = stage_needs(cfg, cluster(str(f)))[0], stage_needs(cfg, cluster())[0]
    model = _load(qdir, cold)
    per_slot = sum(r.nbytes for r in next(iter(model.moe_layers().values())).table.slot_rows(0))
    assert need.expert_bytes == per_slot == cold_set.fp8_expert_bytes(cfg, BLOCK)
    assert need.host_experts == model.experts.host_bytes() > 0
    spares = SPARES * len(model.experts.tables) * per_slot     # moves on read's spare device slots (the default)
    assert need.weights == base.weights - need.host_experts + spares
    assert need.routed_experts == base.routed_experts - need.host_experts == model.experts.device_bytes()
    assert 2 * per_slot < cold_set.expert_bytes(cfg, "float32")       # a byte a weight + scales against float32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fp8_tables_with_graphs_and_moves_serve_the_all_in_vram_tokens(fp8_dirs):
    """The fast path on a GPU: the FP8 decode pair reading half of every layer's float8 experts (bytes and block
    scales) from the registered host allocation, inside CUDA graphs, moves between replays (in place, and on read
    with graphed rounds), a prompt long enough for
    the table's prefill loop (100 tokens x top-3 > the decode kernels' 256): the greedy tokens of the all-in-VRAM
    float8 model, every slot still its expert's."""
    from expert_tables import graphed_greedy
    from stage_worker.kernels.flags import KernelFlags

    qdir = fp8_dirs["qwen3_next"]
    cfg = load_config(qdir)
    prompt = [(7 * i + 3) % 300 + 10 for i in range(100)]

    def run(cold, moves: bool, on_read: bool = False):
        model = load_model(qdir, LoadOptions(device="cuda", packed_fp8_experts=True, cold_experts=cold,
                                             expert_move_async=on_read))
        model.set_kernels(KernelFlags.parse("all"))
        return (model, *graphed_greedy(model, prompt, 16, moves, move_graph=on_read))

    plain, want, want_lp = run(None, False)
    assert all(m.fp8_block and m.table is None for m in plain.moe_layers().values())
    for moves, on_read in ((False, False), (True, False), (True, True)):      # in place, then on read
        model, got, lp = run(random_cold(cfg, 0.5, seed=3), moves, on_read)
        x = model.experts
        assert x.host.pinned and all(t.fp8 for t in x.tables.values())
        assert got == want, moves
        assert max(abs(a - b) for a, b in zip(lp, want_lp)) < 1e-3
        assert x.host_reads.sum().item() > 0
        if moves:
            assert x.moves.sum().item() > 0
        fingerprints_hold(model, plain)
