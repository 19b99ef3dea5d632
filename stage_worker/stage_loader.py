"""Load one stage's slice as its cluster config describes it: layers, device, dtype, load format, kernels. The one
way a stage's model is built, for stage worker processes and the in-process executor alike."""

from __future__ import annotations

from shared import cold_set
from shared.cluster_config import ClusterConfig
from shared.model_config import HybridMoeConfig
from stage_worker.checkpoint.loader import DTYPES, LoadOptions, load_model
from stage_worker.checkpoint.packed_experts import dummy_groups
from stage_worker.kernels.flags import KernelFlags
from stage_worker.model.model import StageModel


def load_stage(cluster: ClusterConfig, index: int, cfg: HybridMoeConfig) -> StageModel:
    spec = cluster.stages[index]
    cold = cold_set.load(cluster.cold_experts, cfg) if cluster.cold_experts else None
    opts = LoadOptions(start=spec.start, end=spec.end, device=spec.device, load_format=cluster.load_format,
                       dtype=DTYPES[cluster.dtype] if cluster.dtype else None, seed=cluster.seed, cold_experts=cold,
                       expert_vmm_table=cluster.expert_vmm_table,
                       expert_move_async=cluster.expert_move_async and cluster.expert_moves,
                       expert_move_claims=cluster.expert_move_claims, expert_prefetch=cluster.expert_prefetch,
                       expert_prefetch_top=cluster.expert_prefetch_top,
                       expert_prefetch_min_batch=cluster.expert_prefetch_min_batch,
                       packed_experts=cluster.packed_experts, dummy_ple_file=cluster.dummy_ple_file,
                       packed_fp8_experts=cluster.keeps_fp8_experts(),
                       # a CPU stage dequantizes dense layers at load: unpacking at every call costs more there
                       # than the bytes save (demo model, reports-mixed: 74-94 against 48-56 ms a decode step)
                       packed_dense=cluster.packed_dense and spec.device.startswith("cuda"),
                       packed_qkv=cluster.packed_qkv,
                       # likewise block-FP8 dense layers (their GEMV on the CPU would be a dequantize per call)
                       packed_fp8_dense=cluster.packed_fp8_dense and spec.device.startswith("cuda"))
    if cluster.load_format == "dummy" and cluster.dummy_quant in ("int4-experts", "reports-mixed"):
        opts.dummy_int4 = dummy_groups(cfg)        # random INT4 experts kept packed, as a quantized checkpoint's
        opts.dummy_dense = cluster.dummy_quant == "reports-mixed" and opts.packed_dense   # (GPU stages)
    model = load_model(cluster.model, opts, cfg)
    model.set_kernels(KernelFlags.parse(cluster.kernels))
    return model
