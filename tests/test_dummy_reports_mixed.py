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
    assert packed and set(packed) == set(want) == set(plain_linear_sites(plain, qkv=True))
    assert all((m.bits, m.group) == (want[n].bits, want[n].group) for n, m in packed.items())
    assert {m.bits for m in packed.values()} == {6, 8}
    cache = model.new_cache(CacheSpec(num_blocks=4, block_size=16, num_slots=1))
    batch = StepBatch.build([([5, 6, 7, 8], 0, 0, [0])], 16)
    logits = model.logits(model(batch, cache), batch)
    assert logits.shape[-1] == cfg.vocab_size and bool(torch.isfinite(logits).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_packed_qkv_decode_kernels_equal_the_unfused_path_on_gpu(tiny_checkpoint):
    """`packed_qkv` on a GPU (float32): attention decode through the kernels reads q/k/v as one packed weight
    plus the indexer's rows (`Attention._project`) and gives the logits of the PyTorch path, which calls each
    PackedLinear alone; the same tokens fed to both (prefill, then 8 decode steps)."""
    from stage_worker.kernels.flags import KernelFlags
    from stage_worker.kernels.quant_gemv_ref import PackedWeight
    from stage_worker.local_engine import LocalEngine

    cfg = load_config(tiny_checkpoint)
    feeds = [[5, 6, 7, 8, 9, 10]] + [[11 + i] for i in range(8)]

    def run(kernels: str) -> torch.Tensor:
        model = load_model(tiny_checkpoint, LoadOptions(load_format="dummy", dtype=torch.float32, device="cuda",
                                                        dummy_int4=dummy_groups(cfg), dummy_dense=True), cfg)
        model.set_kernels(KernelFlags.parse(kernels))
        att = next(m for m in model.modules() if hasattr(m, "_project"))
        assert isinstance(att.q_proj, PackedLinear) and isinstance(att._fused_proj()[0], PackedWeight)
        engine = LocalEngine([model], max_seqs=1, max_tokens=64, cuda_graphs=False)
        engine.add(0)
        return torch.cat([engine.step([(0, f)]).reshape(-1, cfg.vocab_size) for f in feeds])

    got, want = run("all"), run("none")
    assert (got - want).abs().max() < 1e-3 * want.abs().max()
