"""`dummy_quant = "reports-mixed"`: a served benchmark of the reports' mixed release without its files (issue 17's
"served through the cluster"). Routed experts are random INT4 words and, where `packed_dense` applies (GPU stages),
the plain-linear layers are packed as `quant_linear.dummy_specs` says (`packed_dense`, off by default, on); the memory plan counts both at their packed
size, and a CPU stage keeps its dense layers in the compute dtype as it would a real checkpoint's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shared.cluster_config import ClusterConfig, ClusterConfigError, StageSpec
from shared.model_config import load_config
from stage_worker.checkpoint.loader import LoadOptions, load_model
from stage_worker.checkpoint.packed_experts import dummy_groups
from stage_worker.memory_needs import stage_needs
from stage_worker.model.batch import StepBatch
from stage_worker.model.cache import CacheSpec
from stage_worker.model.quant_linear import PackedLinear, dummy_specs, plain_linear_sites
from stage_worker.stage_loader import load_stage


def test_the_plan_counts_packed_dense_layers_and_a_cpu_stage_keeps_them_dequantized(tiny_checkpoint):
    cfg = load_config(tiny_checkpoint)
    gpu = ClusterConfig(model=str(tiny_checkpoint), gateway_endpoint="", load_format="dummy", measure_reserve=False,
                        stages=[StageSpec(0, cfg.num_hidden_layers, "", "cuda:0")])
    experts = stage_needs(cfg, dataclasses.replace(gpu, dummy_quant="int4-experts"))[0]
    mixed = stage_needs(cfg, dataclasses.replace(gpu, dummy_quant="reports-mixed", packed_dense=True))[0]
    unpacked = stage_needs(cfg, dataclasses.replace(gpu, dummy_quant="reports-mixed", packed_dense=False))[0]
    assert mixed.expert_bytes == experts.expert_bytes            # the same INT4 experts
    assert mixed.weights < experts.weights == unpacked.weights   # fewer dense bytes, only with packed_dense
    cpu = dataclasses.replace(gpu, dummy_quant="reports-mixed", packed_dense=True,
                              stages=[StageSpec(0, cfg.num_hidden_layers, "", "cpu")])
    model = load_stage(cpu, 0, cfg)
    assert all(m.packed_group for m in model.moe_layers().values())
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    with pytest.raises(ClusterConfigError, match="reports-mixed"):
        dataclasses.replace(gpu, dummy_quant="int5").validate()


def test_dummy_dense_layers_are_packed_as_the_release_and_compute(tiny_checkpoint):
    """The loader's `dummy_dense` (what a GPU stage gets) on the CPU: every plain-linear site a PackedLinear of
    `dummy_specs`' bits and groups, and a step gives finite logits from the random words."""
    cfg = load_config(tiny_checkpoint)
    # with INT4 experts the shared expert's projections are plain-linear sites too
    plain = load_model(tiny_checkpoint, LoadOptions(load_format="dummy", dtype=torch.float32,
                                                    dummy_int4=dummy_groups(cfg)), cfg)
    want = dummy_specs(plain, torch.float32)
    model = load_model(tiny_checkpoint, LoadOptions(load_format="dummy", dtype=torch.float32,
                                                    dummy_int4=dummy_groups(cfg), dummy_dense=True), cfg)
    packed = {name: m for name, m in model.named_modules() if isinstance(m, PackedLinear)}
    assert packed and set(packed) == set(want) == set(plain_linear_sites(plain))
    assert all((m.bits, m.group) == (want[n].bits, want[n].group) for n, m in packed.items())
    assert {m.bits for m in packed.values()} == {6, 8}
    cache = model.new_cache(CacheSpec(num_blocks=4, block_size=16, num_slots=1))
    batch = StepBatch.build([([5, 6, 7, 8], 0, 0, [0])], 16)
    logits = model.logits(model(batch, cache), batch)
    assert logits.shape[-1] == cfg.vocab_size and bool(torch.isfinite(logits).all())
