"""INT4 experts kept packed (issue 17) in expert tables with cold experts in host RAM (issue 16): an INT4 checkpoint
written by `moepipe quantize --scheme int4-experts` (compressed-tensors' own compressor) served with 10% and 50% of
its experts in host RAM, moves off and after every step, against the same checkpoint with every expert in VRAM;
the swap of packed rows (words and scales of both projections, one pinned host allocation) against its reference;
the memory plan and `--cold-experts auto` at the packed size.

Without CUDA the model-level tests take the PyTorch path a CPU cluster runs (`ExpertTable.moe_int4`, the reference
swap) and the swap kernel runs under TRITON_INTERPRET=1; the GPU test runs the INT4 decode kernel reading
registered host memory inside CUDA graphs, with moves between replays.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import subprocess

import pytest
import torch

CUDA = torch.cuda.is_available()
pytest.importorskip("triton")

from shared import cold_set  # noqa: E402
from shared.cluster_config import ClusterConfig, StageSpec  # noqa: E402
from shared.model_config import load_config  # noqa: E402
from stage_worker.checkpoint.loader import LoadOptions, build_empty, load_model  # noqa: E402
from stage_worker.checkpoint.random_init import fill_random  # noqa: E402
from stage_worker.expert_offload import SPARES, fill_random_tables, gates, order_gates  # noqa: E402
from stage_worker.kernels import expert_moves as M  # noqa: E402
from stage_worker.kernels.expert_moves_ref import RowSet, swap_rows_ref  # noqa: E402
from expert_tables import (fingerprints_hold, graphed_greedy, greedy, permute_slots, random_cold,  # noqa: E402
                           random_move_rounds)
from stage_worker.model.expert_table import PACKED_PARTS, PARTS  # noqa: E402

PROMPT = [1, 5, 9, 33, 70, 100, 7, 400]
GROUPS = (64, 32)        # the tiny preset's INT4 groups (128 does not divide H 64 / I 32: the largest power of two)


def _quantized(tiny_checkpoint, tmp_path_factory, scheme: str):
    pytest.importorskip("compressed_tensors")
    from stage_worker.checkpoint.quantize import quantize_checkpoint

    out = tmp_path_factory.mktemp(scheme) / "q"
    quantize_checkpoint(tiny_checkpoint, out, scheme)
    return out, load_config(out)


@pytest.fixture(scope="module")
def int4(tiny_checkpoint, tmp_path_factory):
    """The tiny model quantized by `moepipe quantize --scheme int4-experts`."""
    return _quantized(tiny_checkpoint, tmp_path_factory, "int4-experts")


@pytest.fixture(scope="module")
def all_in_vram(int4):
    """The INT4 checkpoint with every expert in VRAM (packed), and its greedy tokens and logprobs."""
    q, cfg = int4
    plain = load_model(q, LoadOptions(), cfg)
    assert all(m.packed_group and m.table is None for m in plain.moe_layers().values())
    return plain, greedy(plain, PROMPT, 12)


@pytest.mark.parametrize("share,move_every", [(0.1, 0), (0.1, 1), (0.5, 0), (0.5, 1)])
def test_packed_experts_in_host_ram_serve_the_all_in_vram_greedy_tokens(int4, all_in_vram, share, move_every):
    """Each layer's table holds the INT4 words and scales (never a dequantized copy): hot slots on the device, the
    cold ones in one pinned host allocation at the packed size, written by the loader straight into their slots.
    Greedy tokens equal all-in-VRAM, logprobs within 1e-4, moves on or off; /metrics bytes at the packed size."""
    q, cfg = int4
    plain, (want, want_lp) = all_in_vram
    cold = random_cold(cfg, share)
    model = load_model(q, LoadOptions(cold_experts=cold), cfg)
    x = model.experts
    assert x is not None and sorted(x.tables) == sorted(cold)
    per_expert = cold_set.packed_expert_bytes(cfg, *GROUPS, dtype="float32")
    for layer, moe in model.moe_layers().items():
        t = moe.table
        assert t.packed and t.parts == PACKED_PARTS and t.groups == GROUPS
        assert not any(hasattr(moe, p) for p in PACKED_PARTS + PARTS)       # the table is the only copy
        assert t.host["q13"].dtype == torch.int32 and t.host["q13"].shape[0] == len(cold[layer])
        assert sum(r.nbytes for r in t.slot_rows(0)) == per_expert
    n_cold = sum(len(v) for v in cold.values())
    stats = x.stats()
    assert x.host_bytes() == stats["expert_bytes_host"] == n_cold * per_expert
    assert stats["expert_bytes_vram"] == (len(cold) * cfg.num_experts - n_cold) * per_expert
    assert x.host_bytes() <= x.host.nbytes < x.host_bytes() + 256 * len(PACKED_PARTS) * len(cold)   # one allocation
    got, lp = greedy(model, PROMPT, 12, move_every)
    assert got == want
    assert (lp - want_lp).abs().max().item() < 1e-4
    assert x.host_reads.sum().item() > 0 and x.counts.sum().item() > 0
    assert (x.moves.sum().item() > 0) == bool(move_every)
    assert fingerprints_hold(model, plain) == len(cold)


@pytest.fixture(scope="module")
def int4_asym(tiny_checkpoint, tmp_path_factory):
    """The tiny model quantized by `moepipe quantize --scheme int4-experts-asym` (zero points)."""
    return _quantized(tiny_checkpoint, tmp_path_factory, "int4-experts-asym")


def test_asymmetric_packed_experts_in_host_ram_with_moves_serve_the_all_in_vram_greedy_tokens(int4_asym):
    """Asymmetric INT4 experts: the zero points ride in the scale rows, so a slot's rows (device or host), the
    moves and the fingerprints carry them with no part of their own; 50% of the experts in host RAM, a move after
    every step: the greedy tokens of all-in-VRAM, logprobs within 1e-4; each slot at the packed size with zero
    points (as the memory plan counts it)."""
    q, cfg = int4_asym
    plain = load_model(q, LoadOptions(), cfg)
    assert all(m.packed_group and m.packed().asym for m in plain.moe_layers().values())
    want, want_lp = greedy(plain, PROMPT, 12)
    cold = random_cold(cfg, 0.5, seed=11)
    model = load_model(q, LoadOptions(cold_experts=cold), cfg)
    per_expert = cold_set.packed_expert_bytes(cfg, *GROUPS, True, dtype="float32")
    assert per_expert > cold_set.packed_expert_bytes(cfg, *GROUPS, dtype="float32")
    for moe in model.moe_layers().values():
        assert moe.table.packed_experts()[1].asym and sum(r.nbytes for r in moe.table.slot_rows(0)) == per_expert
    got, lp = greedy(model, PROMPT, 12, 1)
    assert got == want and (lp - want_lp).abs().max().item() < 1e-4
    assert model.experts.moves.sum().item() > 0 and model.experts.host_reads.sum().item() > 0
    assert fingerprints_hold(model, plain) == len(cold)


@pytest.fixture(scope="module")
def nvfp4(tiny_checkpoint, tmp_path_factory):
    """The tiny model quantized by `moepipe quantize --scheme nvfp4` (FP4 codes, float8 scales, a global scale)."""
    return _quantized(tiny_checkpoint, tmp_path_factory, "nvfp4")


def test_fp4_packed_experts_in_host_ram_with_moves_serve_the_all_in_vram_greedy_tokens(nvfp4):
    """NVFP4 experts kept packed (E2M1 words, float32 scale rows): the loader writes each cold expert's words and
    effective scales straight into its host slot; 50% of the experts in host RAM, a move after every step: the
    greedy tokens of all-in-VRAM, logprobs within 1e-4; each slot at FP4's packed size."""
    q, cfg = nvfp4
    plain = load_model(q, LoadOptions(), cfg)
    assert all(m.packed_group == 16 and m.packed().fp4 for m in plain.moe_layers().values())
    want, want_lp = greedy(plain, PROMPT, 12)
    cold = random_cold(cfg, 0.5, seed=12)
    model = load_model(q, LoadOptions(cold_experts=cold), cfg)
    per_expert = cold_set.packed_expert_bytes(cfg, 16, 16, False, True, dtype="float32")
    for moe in model.moe_layers().values():
        dev, host = moe.table.packed_experts()
        assert dev.fp4 and host.fp4 and host.s13.dtype == torch.float32
        assert sum(r.nbytes for r in moe.table.slot_rows(0)) == per_expert
    got, lp = greedy(model, PROMPT, 12, 1)
    assert got == want and (lp - want_lp).abs().max().item() < 1e-4
    assert model.experts.moves.sum().item() > 0 and model.experts.host_reads.sum().item() > 0
    assert fingerprints_hold(model, plain) == len(cold)


def test_fp4_scales_before_their_global_scale_load_the_same(nvfp4, tmp_path):
    """NVFP4 files in another order (every `weight_scale` in a first file, the global scales after): the placer
    holds each module's scales until its global scale comes and writes the same rows; a global scale missing for
    good is named (by the check of the files against the config, before any tensor is read)."""
    from safetensors.torch import load_file, save_file

    from stage_worker.checkpoint.loader import CheckpointError

    q, cfg = nvfp4
    tensors = load_file(q / "model.safetensors")
    out = tmp_path / "split"
    out.mkdir()
    for f in q.iterdir():
        if f.suffix != ".safetensors" and f.is_file():
            (out / f.name).write_bytes(f.read_bytes())
    first = {n: t for n, t in tensors.items() if n.endswith(".weight_scale")}
    save_file(first, out / "a.safetensors", metadata={"format": "pt"})
    save_file({n: t for n, t in tensors.items() if n not in first}, out / "b.safetensors", metadata={"format": "pt"})
    want = load_model(q, LoadOptions(), cfg)
    got = load_model(out, LoadOptions(), cfg)
    for layer, moe in want.moe_layers().items():
        assert torch.equal(moe.s13, got.moe_layers()[layer].s13) and torch.equal(moe.s2, got.moe_layers()[layer].s2)
    lost = next(n for n in tensors if ".experts.3.up_proj.weight_global_scale" in n)
    save_file({n: t for n, t in tensors.items() if n not in first and n != lost}, out / "b.safetensors",
              metadata={"format": "pt"})
    module = lost[:-len(".weight_global_scale")]
    with pytest.raises(CheckpointError, match=re.escape(f"no weight_global_scale: {module}")):
        load_model(out, LoadOptions(), cfg)


def test_packed_slots_behind_a_slot_map_serve_the_all_in_vram_greedy_tokens(int4, all_in_vram):
    """INT4 tables with their words and scales shuffled to other slots (across the device / host split) and the
    slot map following them (`ExpertTable.slot_map`, applied by the router): the all-in-VRAM greedy tokens."""
    q, cfg = int4
    plain, (want, want_lp) = all_in_vram
    model = load_model(q, LoadOptions(cold_experts=random_cold(cfg, 0.5, seed=6)), cfg)
    assert permute_slots(model, 7) == len(model.experts.tables)
    got, lp = greedy(model, PROMPT, 12)
    assert got == want and (lp - want_lp).abs().max().item() < 1e-4
    fingerprints_hold(model, plain)


def test_many_move_rounds_keep_every_packed_slot_its_own_expert(int4, all_in_vram):
    q, cfg = int4
    plain, _ = all_in_vram
    model = load_model(q, LoadOptions(cold_experts=random_cold(cfg, 0.25, seed=4)), cfg)
    assert random_move_rounds(model, 1000) >= 500
    fingerprints_hold(model, plain)


def test_swap_kernel_moves_packed_rows_as_the_reference(int4):
    """The move kernel on a real stage's packed tables (device slots, and host slots at their offsets in the one
    pinned allocation): each kind of row (q13/s13/q2/s2 and the router) swapped as `swap_rows_ref` swaps it."""
    q, cfg = int4
    model = load_model(q, LoadOptions(cold_experts=random_cold(cfg, 0.5, seed=2)), cfg)
    x = model.experts
    sets = x.row_sets(gates(model))
    assert [(r.dev[0].dtype, idx) for r, idx in sets] == [(torch.int32, None), (torch.float32, None),
                                                          (torch.int32, None), (torch.float32, None),
                                                          (torch.float32, None)]
    lo, hi = x.host.tensor.data_ptr(), x.host.tensor.data_ptr() + x.host.nbytes
    assert all(lo <= h.data_ptr() and h.data_ptr() + h.nbytes <= hi for r, _ in sets[:4] for h in r.host)
    L, E = x.counts.shape
    g = torch.Generator().manual_seed(5)
    hot = x.hot.tolist()
    rng = random.Random(5)
    dec = torch.tensor([[rng.randrange(hot[i]), rng.randrange(hot[i], E), int(i % 3 != 1)] for i in range(L)],
                       dtype=torch.int64, device=x.counts.device)
    dec[0, :2] = torch.tensor([hot[0] - 1, E - 1])                 # the last device slot and the last host slot
    for rows, _ in sets:
        for t in rows.dev + (rows.host if rows.host is not rows.dev else []):   # rows unlike each other
            t.copy_(torch.randint(-1000, 1000, t.shape, generator=g).to(t.dtype))
        clones = [t.clone() for t in rows.dev]
        want = RowSet(clones, clones if rows.host is rows.dev else [t.clone() for t in rows.host], rows.split)
        before = rows.host[0][E - 1 - hot[0]].clone() if rows.host is not rows.dev else None
        swap_rows_ref(want, dec)
        M.swap_rows(M.SwapPlan.build(rows, x.counts.device), dec, block=64)
        for a, b in zip(rows.dev + rows.host, want.dev + want.host):
            assert torch.equal(a, b)
        if before is not None:                                     # the host row came to the device
            assert torch.equal(rows.dev[0][hot[0] - 1], before)


def _dummy_stage(cfg, packed_layers: list[int], cold: dict[int, list[int]] | None):
    """A dummy-weight stage whose listed MoE layers keep INT4 experts packed (the others in the compute dtype),
    filled as the loader's dummy format fills it."""
    opts = LoadOptions(load_format="dummy", cold_experts=cold)
    model = build_empty(cfg, opts, {layer: GROUPS for layer in packed_layers})
    fill_random(model, 0)
    fill_random_tables(model, 0)
    order_gates(model)
    return model


def test_move_kernel_rounds_on_a_stage_of_packed_and_bf16_tables(tiny_checkpoint, monkeypatch):
    """`move_round` through the Triton swap (interpreted) on a stage whose tables hold different parts: packed
    layers and compute-dtype layers each swap their own kinds of row in one launch per kind, the router rows of all;
    afterwards every slot still holds its expert (the dummy fill of the tables equals fill_random's of the
    parameters and buffers), and the kernel's decisions equal the reference path's."""
    cfg = load_config(tiny_checkpoint)
    moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_sparse_moe(i)]
    packed = moe_layers[::2]
    cold = random_cold(cfg, 0.25, seed=6)
    plain = _dummy_stage(cfg, packed, None)
    runs = {}
    for kernel in (True, False):
        model = _dummy_stage(cfg, packed, cold)
        kinds = {(r.dev[0].dtype, idx is None) for r, idx in model.experts.row_sets(gates(model))}
        assert (torch.int32, False) in kinds and (torch.float32, False) in kinds      # subsets of the layers
        monkeypatch.setattr(M, "swap_usable", lambda t, kernel=kernel: kernel)
        x = model.experts
        g = torch.Generator().manual_seed(1)
        decs = []
        for _ in range(12):
            x.counts.add_(torch.rand(x.counts.shape, generator=g) * 8)
            decs.append(x.move_round(gates(model), decay=0.7, margin=0.5))
        assert x.moves.sum().item() >= 12
        fingerprints_hold(model, plain)
        runs[kernel] = (torch.stack(decs), x.expert_of_slot.clone())
    assert torch.equal(runs[True][0], runs[False][0]) and torch.equal(runs[True][1], runs[False][1])


# ---- the memory plan and --cold-experts auto -----------------------------------------------------------------------

def _cluster(q, cfg, cold_experts: str = "") -> ClusterConfig:
    return ClusterConfig(model=str(q), gateway_endpoint="", max_num_seqs=4, block_size=16, max_model_len=256,
                         dtype="float32", stages=[StageSpec(0, cfg.num_hidden_layers, "", "cuda:0")],
                         cold_experts=cold_experts, gpu_memory_utilization=1.0)


def test_the_plan_counts_packed_cold_experts_at_their_packed_size(int4, tmp_path):
    """The plan's host column and VRAM weights with a cold set of packed experts are what the loader's tables hold."""
    from stage_worker.memory_needs import stage_needs

    q, cfg = int4
    cold = random_cold(cfg, 0.5, seed=1)
    n = cfg.num_hidden_layers
    f = cold_set.write(tmp_path / "cold.json", cfg, str(q), cold, [(0, n)], cold_set.expert_bytes(cfg), 1 << 30,
                       ["test"])
    need = stage_needs(cfg, _cluster(q, cfg, str(f)))[0]
    base = stage_needs(cfg, _cluster(q, cfg))[0]
    # as the server loads it: moves on read (the default) add two spare device slots a table
    model = load_model(q, LoadOptions(dtype=torch.float32, cold_experts=cold, expert_move_async=True), cfg)
    per_slot = sum(r.nbytes for r in model.moe_layers()[0].table.slot_rows(0))
    spares = 2 * len(model.experts.tables) * per_slot
    assert need.expert_bytes == per_slot == cold_set.packed_expert_bytes(cfg, *GROUPS, dtype="float32")
    assert need.host_experts == model.experts.host_bytes() > 0
    assert need.weights == base.weights - need.host_experts + spares
    assert need.routed_experts == base.routed_experts - need.host_experts == model.experts.device_bytes() - spares
    assert per_slot * 5 < cold_set.expert_bytes(cfg, "float32")      # 4-bit words + scales against float32


def test_auto_cold_experts_moves_out_packed_experts_by_their_packed_size(int4, tmp_path, monkeypatch):
    """`--cold-experts auto` on an INT4 checkpoint whose packed experts do not fit: the needs (the real
    `stage_needs`, in process) say one expert's packed size, so auto moves out enough packed experts and the plan
    starts. Sized in the compute dtype (the gap this closes) it would move out too few and be refused."""
    from gateway import launcher
    from stage_worker.memory_needs import stage_needs

    q, cfg = int4
    base = stage_needs(cfg, _cluster(q, cfg))[0]
    packed = base.expert_bytes
    assert packed == cold_set.packed_expert_bytes(cfg, *GROUPS, dtype="float32")
    all_in = base.weights + base.state + base.reserve + (256 // 16 + 1) * base.block
    size = all_in - 10 * packed                     # ten packed experts too many for the device
    now = [_cluster(q, cfg, "auto")]

    def run(cmd, **kw):
        needs = stage_needs(cfg, now[0])
        return subprocess.CompletedProcess(cmd, 0, json.dumps({"stages": [vars(n) for n in needs],
                                                               "devices": {"cuda:0": {"total": size, "free": size}}}),
                                           "")

    monkeypatch.setattr(launcher.subprocess, "run", run)
    resolved = launcher.auto_cold_experts(now[0], tmp_path / "c.toml", tmp_path)
    cold = cold_set.load(resolved.cold_experts, cfg)
    layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_sparse_moe(i)]
    # moves on read (the default) keep two spare device slots a table: auto moves out that many more
    assert {len(v) for v in cold.values()} == {-(-10 // len(layers)) + SPARES} and sorted(cold) == layers
    assert json.loads(open(resolved.cold_experts).read())["stages"][0]["expert_bytes"] == packed
    now[0] = resolved
    assert launcher.memory_plan(resolved, tmp_path / "c.toml").num_blocks >= 256 // 16
    # the compute dtype's size would have chosen this many per layer, and the plan refuses that
    few = cold_set.spread(cfg, [(0, cfg.num_hidden_layers)], [10 * packed], cold_set.expert_bytes(cfg, "float32"))
    assert sum(len(v) for v in few.values()) < 10
    now[0] = dataclasses.replace(resolved, cold_experts=str(cold_set.write(
        tmp_path / "few.json", cfg, str(q), few, [(0, cfg.num_hidden_layers)], packed, 0, ["test"])))
    with pytest.raises(RuntimeError, match="does not fit"):
        launcher.memory_plan(now[0], tmp_path / "c.toml")


# ---- served ------------------------------------------------------------------------------------------------------

def test_served_packed_host_experts_equal_all_in_vram_with_moves_and_metrics(int4, tmp_path):
    """`moepipe serve` end to end (two stage processes, `cold_experts` file, packed_experts on, a move round every
    2 steps): the INT4 checkpoint's greedy logprobs as in-process all-in-VRAM generation, and /metrics' host bytes
    at the packed size with host reads and moves counted."""
    import time

    import httpx

    from conftest import small_cluster_options
    from gateway.launcher import Cluster

    q, cfg = int4
    n = cfg.num_hidden_layers
    cold = random_cold(cfg, 0.5, seed=1)
    f = cold_set.write(tmp_path / "cold.json", cfg, str(q), cold, [(0, n // 2), (n // 2, n)],
                       cold_set.packed_expert_bytes(cfg, *GROUPS), 1 << 30, ["test"])
    prompt = [5, 17, 101, 250, 9, 33]
    tokens, lp = greedy(load_model(q, LoadOptions(), cfg), prompt, 16)
    opts = small_cluster_options(q)
    with Cluster(dataclasses.replace(opts, extra=dict(opts.extra, cold_experts=str(f), expert_move_interval=2))) as c:
        out = httpx.post(c.url + "/v1/completions", timeout=120, json={
            "model": "moepipe", "prompt": prompt, "max_tokens": 16, "temperature": 0, "logprobs": 1,
            "ignore_eos": True}, verify=False).json()
        deadline = time.time() + 10          # the counters reach the gateway with the next heartbeats
        metrics = ""
        while "moepipe_expert_moves_total{" not in metrics and time.time() < deadline:
            metrics = httpx.get(c.url + "/metrics", timeout=10, verify=False).text
            time.sleep(0.3)
    served = out["choices"][0]["logprobs"]["token_logprobs"]
    assert served == pytest.approx([lp[i, t].item() for i, t in enumerate(tokens)], abs=1e-4)

    def total(prefix: str) -> float:
        return sum(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(prefix))

    assert total("moepipe_expert_host_reads_total{") > 0 and total("moepipe_expert_moves_total{") > 0
    host = total('moepipe_expert_bytes{stage="0",tier="host"}') + total('moepipe_expert_bytes{stage="1",tier="host"}')
    assert host == sum(len(v) for v in cold.values()) * cold_set.packed_expert_bytes(cfg, *GROUPS, dtype="float32")


# ---- on the GPU ----------------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_stage_with_packed_host_experts_graphs_and_moves_serves_the_same_greedy_tokens(tiny_checkpoint):
    """The fast path on the GPU: INT4 decode kernels reading half of every layer's packed experts from registered
    host memory, CUDA graphs, moves between replays, a prompt long enough for the table's prefill path (70 tokens x
    top-4 > the decode kernel's 256): the greedy tokens of the all-in-VRAM packed model (the same dummy INT4
    weights), every slot still its expert's. Also the decode kernel on a real table against the table's prefill
    path."""
    from stage_worker.kernels.flags import KernelFlags
    from stage_worker.kernels.moe_int4 import fused_moe_int4

    cfg = load_config(tiny_checkpoint)
    prompt = [(7 * i + 3) % 2000 + 10 for i in range(70)]

    def greedy(cold, moves, spares=False):
        model = load_model(tiny_checkpoint, LoadOptions(device="cuda", load_format="dummy", dummy_int4=GROUPS,
                                                        cold_experts=cold, expert_move_async=spares), cfg)
        model.set_kernels(KernelFlags.parse("all"))
        return (model, *graphed_greedy(model, prompt, 16, moves, move_graph=spares))

    plain, want, want_lp = greedy(None, False)
    assert all(m.packed_group for m in plain.moe_layers().values())
    # moves off the forward's stream (spare slots, the router's slot map in the INT4 decode path's router launch
    # and in the prefill path, the round's two parts from their graphs), then in place (the table the kernel check
    # below reads: no spares)
    for moves, spares in ((False, False), (True, True), (True, False)):
        model, got, lp = greedy(random_cold(cfg, 0.5, seed=3), moves, spares)
        x = model.experts
        assert x.host.pinned and all(t.packed for t in x.tables.values())
        assert got == want
        assert max(abs(a - b) for a, b in zip(lp, want_lp)) < 1e-3
        assert x.host_reads.sum().item() > 0
        if moves:
            assert x.moves.sum().item() > 0
        fingerprints_hold(model, plain)
    # the decode kernel on a real table (words and scales of host slots in the registered allocation) against the
    # same kernel on the all-in-VRAM experts those slots hold, and against the table's prefill path
    t, every = model.moe_layers()[0].table, plain.moe_layers()[0].packed()
    g = torch.Generator(device="cuda").manual_seed(0)
    for T in (1, 4):
        xs = torch.randn(T, cfg.hidden_size, device="cuda", generator=g)
        # per token: one host slot, then three distinct device slots
        ids = torch.stack([torch.cat([t.hot + torch.randperm(cfg.num_experts - t.hot, device="cuda", generator=g)[:1],
                                      torch.randperm(t.hot, device="cuda", generator=g)[:3]]) for _ in range(T)]).int()
        w = torch.softmax(torch.randn(T, 4, device="cuda", generator=g), -1)
        dev, host = t.packed_experts()
        out = fused_moe_int4(xs, ids, w, dev, host=host, first_host=t.hot)
        same = fused_moe_int4(xs, t.experts_of(ids), w, every)
        torch.testing.assert_close(out, same, rtol=1e-5, atol=1e-6)
        ref = t.moe_int4(xs, ids, w)
        assert ((out - ref).norm() / ref.norm()).item() < 2e-2


def test_cold_set_fills_its_budget_with_packed_experts(int4, tmp_path):
    """`moepipe cold-set` on an INT4 checkpoint sizes each expert as the stage keeps it (packed): the budget holds
    about four times the experts that bf16 sizing would give it."""
    from shared import cold_set
    from stage_worker.cli import main

    q, cfg = int4
    layers = [layer for layer in range(cfg.num_hidden_layers) if cfg.is_sparse_moe(layer)]
    usage = tmp_path / "usage.json"
    usage.write_text(json.dumps({"usage": {"code": {str(layer): list(range(cfg.num_experts, 0, -1))
                                                    for layer in layers}}, "meta": {"tokens_per_kind": {"code": 9}}}))
    packed = cold_set.packed_expert_bytes(cfg, *GROUPS)
    budget = 5 * packed
    assert budget // cold_set.expert_bytes(cfg) < 5
    out = tmp_path / "cold.json"
    assert main(["cold-set", "--model", str(q), "--usage", str(usage), "--gib-per-stage", str(budget / (1 << 30)),
                 "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["expert_bytes"] == packed
    assert sum(len(ids) for ids in data["layers"].values()) == 5
    assert cold_set.load(out, cfg)


@pytest.mark.parametrize("switch", ["1", "0"])
def test_cold_set_sizes_experts_as_the_packed_experts_switch_keeps_them(nvfp4, tmp_path, monkeypatch, switch):
    """(QA 2026-12-07) `moepipe cold-set` sized an FP4 / INT4 checkpoint's experts packed even with
    MOEPIPE_PACKED_EXPERTS=0, where the stages dequantize them at load (the memory plan honoured the switch): the
    file's budget then held ~2.7x (FP4) to ~4x (INT4) the bytes it was given."""
    from shared import cold_set
    from shared.quant_scheme import plan_of
    from stage_worker.checkpoint.packed_experts import packed_layers
    from stage_worker.cli import main

    q, cfg = nvfp4
    monkeypatch.setenv("MOEPIPE_PACKED_EXPERTS", switch)
    layers = [layer for layer in range(cfg.num_hidden_layers) if cfg.is_sparse_moe(layer)]
    usage = tmp_path / "usage.json"
    usage.write_text(json.dumps({"usage": {"code": {str(layer): list(range(cfg.num_experts, 0, -1))
                                                    for layer in layers}}, "meta": {"tokens_per_kind": {"code": 9}}}))
    out = tmp_path / "cold.json"
    assert main(["cold-set", "--model", str(q), "--usage", str(usage), "--gib-per-stage", "0.0001",
                 "--out", str(out)]) == 0
    packed = packed_layers(plan_of(q), cfg, 0, cfg.num_hidden_layers, q)[layers[0]]
    want = cold_set.packed_expert_bytes(cfg, *packed) if switch == "1" else cold_set.expert_bytes(cfg)
    assert json.loads(out.read_text())["expert_bytes"] == want
    assert cold_set.expert_bytes(cfg) > cold_set.packed_expert_bytes(cfg, *packed)
