"""The expert tables' parts as one VRAM + host range each (`expert_vmm_table`, issue 16, 000 §4.2;
`stage_worker/expert_offload.py` over `stage_worker/vmm_range.py`).

On the CPU the driver refuses (no CUDA): the stage falls back to the two tables with one warning and serves what the
switch-off model serves. A CPU stand-in for `tiered_rows` (one plain tensor per part, a fake range whose device part
ends on a 4-row "granule") checks the layout itself: every table's device and host rows are views of one tensor, the
stage reports the ranges' bytes, no pinned allocation is made, and moves swap rows inside the range. On a GPU the
real ranges serve the switch-off model's greedy tokens through CUDA graphs with moves.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import pytest
import torch

pytest.importorskip("triton")

from shared import cold_set  # noqa: E402
from shared.cluster_config import ClusterConfig, StageSpec, cluster_from_dict, env_overrides  # noqa: E402
from shared.model_config import load_config  # noqa: E402
from stage_worker import expert_offload  # noqa: E402
from stage_worker.checkpoint.loader import LoadOptions, load_model  # noqa: E402
from stage_worker.kernels import expert_moves as M  # noqa: E402
from stage_worker.vmm_range import TieredRange  # noqa: E402
from expert_tables import fingerprints_hold, graphed_greedy, greedy, random_cold, random_move_rounds  # noqa: E402

PROMPT = [1, 5, 9, 33, 70, 100, 7, 400]
REFUSED = "expert tables: one VRAM+host range refused"


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    cfg = load_config(tiny_checkpoint)
    # 5 of 16 experts cold: 11 hot rows, not a multiple of the fake granule's 4 (so ranges round up)
    return tiny_checkpoint, cfg, random_cold(cfg, 0.3, seed=7)


@pytest.fixture(scope="module")
def all_in_memory(tiny):
    d, cfg, _ = tiny
    model = load_model(d, LoadOptions(), cfg)
    return model, greedy(model, PROMPT, 6)


def test_refused_on_the_cpu_falls_back_to_two_tables_with_one_warning(tiny, all_in_memory, caplog):
    d, cfg, cold = tiny
    off = load_model(d, LoadOptions(cold_experts=cold), cfg)
    with caplog.at_level(logging.WARNING, logger="stage_worker.expert_offload"):
        on = load_model(d, LoadOptions(cold_experts=cold, expert_vmm_table=True), cfg)
    warnings = [r for r in caplog.records if REFUSED in r.getMessage()]
    assert len(warnings) == 1 and "needs a CUDA device" in warnings[0].getMessage()
    assert "two tables instead" in warnings[0].getMessage()
    x = on.experts
    assert x.ranges == [] and x.host is not None                      # today's layout: one host allocation
    assert x.host_bytes() == off.experts.host_bytes() and x.device_bytes() == off.experts.device_bytes()
    want, want_lp = greedy(off, PROMPT, 6)
    got, lp = greedy(on, PROMPT, 6)
    assert got == want == all_in_memory[1][0]
    assert torch.equal(lp, want_lp)


def _fake_tiered_rows(made: list):
    """`tiered_rows` on the CPU: one plain [rows, ...] tensor, its device part `hot` rounded up to 4 rows."""
    def fake(rows, row_shape, dtype, hot, device):
        t = torch.zeros(rows, *row_shape, dtype=dtype, device=device)
        row_bytes = math.prod(row_shape) * t.element_size()
        dev_rows = min(rows, -(-hot // 4) * 4)
        rng = TieredRange(base=t.data_ptr(), size=rows * row_bytes, device_bytes=dev_rows * row_bytes,
                          host_bytes=(rows - dev_rows) * row_bytes, device_rows=dev_rows, handles=())
        made.append((t, rng, hot))
        return t, rng
    return fake


def test_one_range_per_part_holds_both_tiers_and_moves_swap_inside_it(tiny, all_in_memory, monkeypatch, caplog):
    d, cfg, cold = tiny
    made: list = []
    monkeypatch.setattr(expert_offload, "tiered_rows", _fake_tiered_rows(made))

    def no_pinned(*a, **k):
        raise AssertionError("the pinned allocator was called for parts in VMM ranges")

    monkeypatch.setattr(expert_offload, "allocate", no_pinned)
    with caplog.at_level(logging.WARNING, logger="stage_worker.expert_offload"):
        model = load_model(d, LoadOptions(cold_experts=cold, expert_vmm_table=True), cfg)
    assert not [r for r in caplog.records if REFUSED in r.getMessage()]
    x = model.experts
    assert x.host is None and len(x.ranges) == len(made) == 2 * len(x.tables)       # w13 and w2 of every layer
    for (rows, rng), (t, fake_rng, _) in zip(x.ranges, made):
        assert rows is t and rng is fake_rng
    i = 0
    for layer, table in x.tables.items():
        hot = cfg.num_experts - len(cold[layer])
        assert table.hot == hot
        for part in table.parts:
            rows, rng, made_hot = made[i]
            i += 1
            dev, host = table.dev[part], table.host[part]
            assert made_hot == hot and rng.device_rows > hot          # 11 hot rows: the range's device part is 12
            assert dev.untyped_storage().data_ptr() == host.untyped_storage().data_ptr() == rows.data_ptr()
            assert dev.data_ptr() == rows.data_ptr() and host.data_ptr() == rows.data_ptr() + hot * rows[0].nbytes
            assert dev.shape[0] == hot and host.shape[0] == cfg.num_experts - hot
    assert x.host_bytes() == sum(rng.host_bytes for _, rng, _ in made)
    assert x.device_bytes() == sum(rng.device_bytes for _, rng, _ in made)
    tables = x.tables.values()
    assert x.device_bytes() > sum(t.device_bytes() for t in tables)                # the round-up is reported
    assert x.host_bytes() + x.device_bytes() == sum(t.host_bytes() + t.device_bytes() for t in tables)
    assert x.stats()["expert_bytes_host"] == x.host_bytes()

    plain, (want, want_lp) = all_in_memory
    got, lp = greedy(model, PROMPT, 6, move_every=1)            # a move round every token (the reference swap)
    assert got == want and (lp - want_lp).abs().max().item() < 1e-4
    assert x.moves.sum().item() > 0
    # the Triton swap (interpreted) on the same views: offsets inside one range per part
    monkeypatch.setattr(M, "swap_usable", lambda t: True)
    before = x.moves.sum().item()
    assert random_move_rounds(model, 4) > before
    fingerprints_hold(model, plain)
    for layer, table in x.tables.items():                         # still views of their range
        for part in table.parts:
            assert table.dev[part].untyped_storage().data_ptr() == table.host[part].untyped_storage().data_ptr()
    got, lp = greedy(model, PROMPT, 6)
    assert got == want and (lp - want_lp).abs().max().item() < 1e-4


def test_the_switch_parses_and_the_plan_counts_the_round_up(tiny, tmp_path, monkeypatch):
    from stage_worker.memory_needs import stage_needs

    d, cfg, cold = tiny
    monkeypatch.setenv("MOEPIPE_EXPERT_VMM_TABLE", "1")
    assert env_overrides()["expert_vmm_table"] is True
    raw = dict(model=str(d), gateway_endpoint="", stages=[dict(start=0, end=cfg.num_hidden_layers, endpoint="",
                                                                device="cpu")])
    assert cluster_from_dict(raw).expert_vmm_table is True
    monkeypatch.setenv("MOEPIPE_EXPERT_VMM_TABLE", "off")
    assert cluster_from_dict(raw).expert_vmm_table is False
    monkeypatch.delenv("MOEPIPE_EXPERT_VMM_TABLE")
    assert cluster_from_dict(raw).expert_vmm_table is False                      # off by default

    n = cfg.num_hidden_layers
    f = cold_set.write(tmp_path / "cold.json", cfg, str(d), cold, [(0, n)], cold_set.expert_bytes(cfg), 1 << 30,
                       ["test"])

    def needs(cold_experts, vmm):
        return stage_needs(cfg, ClusterConfig(
            model=str(d), gateway_endpoint="", max_num_seqs=2, block_size=16, max_model_len=256, dtype="float32",
            stages=[StageSpec(0, n, "", "cuda:0")], cold_experts=cold_experts, measure_reserve=False,
            expert_vmm_table=vmm))[0]

    off, on = needs(str(f), False), needs(str(f), True)
    granule, H, I = 2 << 20, cfg.hidden_size, cfg.moe_intermediate_size
    want = 0
    for layer, ids in cold.items():
        hot = cfg.num_experts - len(ids) + expert_offload.SPARES     # moves on read's spares (the default)
        for row in (2 * I * H * 4, H * I * 4):                 # float32 w13 and w2 rows
            want += -(-hot * row // granule) * granule - hot * row
    assert 0 < want < granule * 2 * len(cold)
    assert on.weights == off.weights + want
    assert dataclasses.replace(on, weights=off.weights) == off                  # nothing else changes
    # --cold-experts auto (the layers' hot counts not chosen yet): a granule per MoE layer and part
    auto_off, auto_on = needs("auto", False), needs("auto", True)
    moe = [layer for layer in range(n) if cfg.is_sparse_moe(layer)]
    assert auto_on.weights == auto_off.weights + granule * 2 * len(moe)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_stage_with_vmm_tables_graphs_and_moves_serves_the_same_greedy_tokens(tiny_checkpoint, caplog):
    """The real ranges on a GPU: the tiny model with experts of 1 MiB (w13) and 0.5 MiB (w2) rows, so each part's
    range has a device part of 11 hot rows rounded up to 2 MiB and a host part of several MiB; CUDA graphs, the
    fused kernels reading the host part over PCIe, moves between replays: the greedy tokens of the same cold set in
    two tables and of the all-in-VRAM model, every slot still its expert's."""
    from stage_worker.kernels.flags import KernelFlags

    cfg = dataclasses.replace(load_config(tiny_checkpoint), moe_intermediate_size=2048)
    cold = random_cold(cfg, 0.3, seed=7)
    prompt = [(7 * i + 3) % 2000 + 10 for i in range(70)]       # long enough for the table's prefill path

    def run(cold, vmm, moves):
        model = load_model(tiny_checkpoint, LoadOptions(device="cuda", load_format="dummy", seed=1,
                                                        cold_experts=cold, expert_vmm_table=vmm), cfg)
        model.set_kernels(KernelFlags.parse("all"))
        return (model, *graphed_greedy(model, prompt, 16, moves))

    plain, want, want_lp = run(None, False, False)
    for moves in (False, True):
        _, two, two_lp = run(cold, False, moves)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="stage_worker.expert_offload"):
            model, got, lp = run(cold, True, moves)
        refused = [r.getMessage() for r in caplog.records if REFUSED in r.getMessage()]
        if refused:
            pytest.skip(f"the driver refused: {refused[0]}")
        x = model.experts
        print(f"\nmoves {moves}: {len(x.ranges)} ranges, device {x.device_bytes() / 2**20:.1f} MiB, host "
              f"{x.host_bytes() / 2**20:.1f} MiB (two tables: device "
              f"{sum(t.device_bytes() for t in x.tables.values()) / 2**20:.1f}, host "
              f"{sum(t.host_bytes() for t in x.tables.values()) / 2**20:.1f}); per range "
              + ", ".join(sorted({f'{r.device_bytes >> 20}+{r.host_bytes >> 20} MiB ({r.device_rows} device rows)'
                                  for _, r in x.ranges})))
        assert x.host is None and len(x.ranges) == 2 * len(x.tables)
        assert all(r.host_bytes > 0 and r.device_rows < cfg.num_experts for _, r in x.ranges)
        for table in x.tables.values():
            for part in table.parts:
                dev, host = table.dev[part], table.host[part]
                assert dev.is_cuda and host.is_cuda
                assert host.data_ptr() == dev.data_ptr() + table.hot * dev[0].nbytes
        assert got == two == want
        assert max(abs(a - b) for a, b in zip(lp, two_lp)) < 1e-5
        assert max(abs(a - b) for a, b in zip(lp, want_lp)) < 2e-2
        assert x.host_reads.sum().item() > 0
        if moves:
            assert x.moves.sum().item() > 0
        fingerprints_hold(model, plain)
