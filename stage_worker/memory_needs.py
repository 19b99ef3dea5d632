"""What each GPU stage of a cluster config needs in device memory, and what its devices have: the inputs of the
start-up memory plan (`shared/memory_plan.py`).

`python -m stage_worker.memory_needs --config cluster.toml` prints them as JSON. The launcher runs it as a child
process because asking CUDA for free memory creates a context (~0.5 GiB a device) that would otherwise stay in the
launcher for the server's life.

Weights and per-slot state are exact: the stage's modules and caches are built on the meta device (no memory) in
the stage's compute dtype and summed (an INT4 checkpoint's routed experts at their packed size, as the loader keeps
them); the cold experts of a `cold_experts` file are host RAM, not VRAM (INT4 and float8 experts at their own size
there too, as their expert table holds them; with `expert_vmm_table` the device part of each table part's VRAM +
host range is rounded up to the 2 MiB granularity, counted with the weights), and so is the QSA K/V of
`qsa_kv_offload` (`StageNeeds.host_block`); the VRAM row cache over it (`kv_row_cache`) is counted apart
(`StageNeeds.row_cache`). The reserve (the largest step's activations, CUDA-graph pools, kernel workspace) is
measured: one prefill chunk of `max_num_batched_tokens` tokens through one layer of each kind the stage holds, on
its device (`activation_peak.py`), plus the logits of a step in fp32 (an echo request takes every row's) and
`WORKSPACE` for the decode graphs' pool, cuBLAS and Triton workspaces and the allocator's slack. Attention
layers are measured again at the contexts up to `max_model_len` where their chunk may peak (the QSA selection's
and the dense path's scores grow with the context; host K/V keeps them flat): `StageNeeds.reserve_context` is what
that adds, named by a refusal. With `measure_reserve` off it is the former estimate: 1 GiB plus 96 bytes per
hidden unit and batched token (about 2x what a full-shape 512-token prefill chunk was seen to allocate) plus the
logits, plus the context's growth by the formula (`activation_peak.attention_chunk_bytes`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from shared.cluster_config import ClusterConfig, ClusterConfigError, load_cluster_config
from shared.cold_set import AUTO, ColdSetError, expert_bytes, fp8_expert_bytes, packed_expert_bytes
from shared.cold_set import load as load_cold_set
from shared.kv_layout import block_bytes, compute_dtype, host_block_bytes
from shared.memory_plan import GIB, StageNeeds
from shared.model_config import HybridMoeConfig, load_config
from shared.quant_scheme import plan_of
from stage_worker.activation_peak import context_growth, has_indexer
from stage_worker.checkpoint.loader import fp8_dense_specs, packed_dense_specs
from stage_worker.checkpoint.packed_experts import dummy_groups, fp8_layers, packed_layers
from stage_worker.expert_offload import SPARES, vmm_round_up
from stage_worker.kernels.flags import KernelFlags
from stage_worker.model.cache import CacheSpec
from stage_worker.model.meta_build import on_meta
from stage_worker.model.model import StageModel
from stage_worker.model.fp8_linear import use_fp8_dense
from stage_worker.model.quant_linear import dummy_specs, use_packed_dense

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WORKSPACE = GIB // 2
_PACKED = (".mlp.q13", ".mlp.s13", ".mlp.q2", ".mlp.s2")      # SparseMoE.use_packed's buffers
_PACKED_DENSE = (".weight_packed", ".weight_scale")             # PackedLinear's
_FP8_DENSE = (".weight_fp8", ".weight_scale_inv")                # Fp8Linear's


def _tensor_bytes(obj, seen: set[int] | None = None) -> int:
    """Bytes of every tensor reachable through `obj`'s attributes, lists and dicts (each tensor once)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v, seen) for v in obj)
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        return sum(_tensor_bytes(v, seen) for v in vars(obj).values())
    return 0


def stage_needs(cfg: HybridMoeConfig, cluster: ClusterConfig, measure=None) -> list[StageNeeds]:
    """The needs of every stage on a CUDA device (CPU stages are not planned: host RAM is the OS's to share).
    `measure(cluster, cfg, stage, dtype)`: a stage's measured prefill activations in bytes (default: on the device,
    `activation_peak.prefill_peak`, when `measure_reserve` is on and CUDA is there; else the estimate)."""
    if measure is None and cluster.measure_reserve and torch.cuda.is_available():
        from stage_worker.activation_peak import prefill_peak as measure
    out = []
    max_len = cluster.model_len(cfg)
    qsa = any(has_indexer(cfg, layer) for layer in range(cfg.num_hidden_layers))
    cold = load_cold_set(cluster.cold_experts, cfg) if cluster.cold_experts not in ("", AUTO) else {}
    plan = plan_of(cluster.model) if cluster.load_format != "dummy" else None
    for i, spec in enumerate(cluster.stages):
        if not spec.device.startswith("cuda"):
            continue
        dtype = compute_dtype(cfg, spec.device, cluster.dtype)
        with on_meta():
            model = StageModel(cfg, spec.start, spec.end).to(_DTYPES[dtype])
            packed = packed_layers(plan, cfg, spec.start, spec.end, cluster.model) if cluster.packed_experts else {}
            if cluster.load_format == "dummy" and cluster.dummy_quant in ("int4-experts", "reports-mixed"):
                packed = {layer: dummy_groups(cfg) for layer in range(spec.start, spec.end) if cfg.is_sparse_moe(layer)}
            for layer, groups in packed.items():
                model.moe_layers()[layer].use_packed(*groups)      # INT4 / FP4 experts at their packed size
            fp8 = fp8_layers(plan, cfg, spec.start, spec.end, cluster.model) if cluster.keeps_fp8_experts() else {}
            for layer, fp8_block in fp8.items():
                model.moe_layers()[layer].use_fp8(fp8_block)       # float8 experts: bytes and block scales
            if cluster.packed_dense and plan is not None:         # dense layers kept packed (PackedLinear)
                use_packed_dense(model, packed_dense_specs(model, cfg, Path(cluster.model), cluster.packed_qkv))
            elif cluster.packed_dense and cluster.load_format == "dummy" and cluster.dummy_quant == "reports-mixed":
                use_packed_dense(model, dummy_specs(model, _DTYPES[dtype], cluster.packed_qkv))
            if cluster.packed_fp8_dense and plan is not None:     # dense layers kept float8 (Fp8Linear)
                use_fp8_dense(model, fp8_dense_specs(model, cfg, Path(cluster.model)))
            cache = model.new_cache(CacheSpec(num_blocks=0, block_size=cluster.block_size or 16,
                                              num_slots=cluster.max_num_seqs + 1, dtype=_DTYPES[dtype],
                                              device="meta", kv_offload=cluster.qsa_kv_offload,
                                              row_cache_bytes=cluster.row_cache_bytes))
        weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                      if ".ple.ple_embedding" not in n and "ngram_embedding" not in n)
        weights += sum(b.numel() * b.element_size() for n, b in model.named_buffers()
                       if n.endswith(_PACKED) or n.endswith(_PACKED_DENSE) or n.endswith(_FP8_DENSE))
        sizes = {layer: packed_expert_bytes(cfg, *packed[layer], dtype=dtype) if layer in packed else
                 fp8_expert_bytes(cfg, fp8[layer]) if layer in fp8 else
                 expert_bytes(cfg, dtype) for layer in range(spec.start, spec.end) if cfg.is_sparse_moe(layer)}
        host = sum(len(cold.get(layer, ())) * size for layer, size in sizes.items())
        weights -= host                            # cold experts live in pinned host RAM, not on the device
        routed = sum(cfg.num_experts * size for size in sizes.values()) - host
        spare = 0                                  # the spares of MoE layers with no cold expert yet
        spares = SPARES * cluster.expert_move_claims   # 2C spare slots a table: C claims a step (expert_move_claims)
        if cluster.expert_move_async and cluster.expert_moves:
            # the spare device slots of every table with cold experts (`--cold-experts auto`, not chosen yet: every
            # MoE layer) are in the weights; the other layers' would be once theirs go to host RAM
            tabled = sum(size for layer, size in sizes.items() if cold.get(layer) or cluster.cold_experts == AUTO)
            weights += spares * tabled
            spare = spares * (sum(sizes.values()) - tabled)
        # the prefetch slots of every table (`expert_prefetch`, GPU stages: `expert_offload.prefetch_slots`)
        prefetch = cluster.expert_prefetch if spec.device.startswith("cuda") else 0
        if prefetch:
            weights += prefetch * sum(size for layer, size in sizes.items()
                                      if cold.get(layer) or cluster.cold_experts == AUTO)
        if cluster.expert_vmm_table:
            # each table part one VRAM + host range whose device part ends on the 2 MiB granularity: the hot rows'
            # bytes rounded up, up to 2 MiB more a layer and part (`--cold-experts auto`: a granule each)
            weights += vmm_round_up(model, None if cluster.cold_experts == AUTO else cold,
                                    spare=prefetch + (spares if cluster.expert_move_async and cluster.expert_moves
                                                      else 0))
        tokens = cluster.max_num_batched_tokens
        width = cfg.hidden_size * max(getattr(cfg, "hc_count", 1) or 1, 1)
        logits = tokens * cfg.vocab_size * 4 if model.has_head else 0
        if measure is not None:
            measured = measure(cluster, cfg, i, dtype)
            peak, context = measured if isinstance(measured, tuple) else (measured, 0)
            reserve = peak + logits + WORKSPACE
        else:
            # the estimate covers a short chunk; long context adds the formula's growth to the worst chunk
            context = context_growth(cfg, spec.start, spec.end, tokens, max_len, _DTYPES[dtype].itemsize,
                                     cluster.qsa_kv_offload, cluster.qsa_sparse_prefill,
                                     KernelFlags.parse(cluster.kernels).section_attention)
            reserve = GIB + tokens * width * 96 + logits + context
        bs, offload = cluster.block_size or 16, cluster.qsa_kv_offload
        block = block_bytes(cfg, spec.start, spec.end, bs, dtype, offload)      # QSA K/V in host RAM: not here
        row_cache = cache.row_cache_bytes()        # the VRAM row cache over host K/V (kv_row_cache)
        state = _tensor_bytes(cache) - row_cache   # (no KV blocks here: the per-slot states, for max_num_seqs + 1)
        out.append(StageNeeds(stage=i, layers=(spec.start, spec.end), device=spec.device, weights=weights,
                              state=state, row_cache=row_cache, block=block,
                              host_state=state // (cluster.max_num_seqs + 1) * cluster.prefix_states,
                              reserve=reserve, reserve_context=context, host_experts=host, routed_experts=routed,
                              expert_bytes=min(sizes.values(), default=0),
                              host_block=host_block_bytes(cfg, spec.start, spec.end, bs, dtype, offload),
                              offload_helps=qsa and not offload, spare_bytes=spare))
    return out


def device_memory(names: list[str]) -> dict[str, tuple[int, int]]:
    """(total, free) bytes of each named CUDA device."""
    out = {}
    for name in names:
        free, total = torch.cuda.mem_get_info(torch.device(name))
        out[name] = (total, free)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m stage_worker.memory_needs", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    args = ap.parse_args(argv)
    try:
        cluster = load_cluster_config(args.config)
        cfg = load_config(cluster.model)
    except (ClusterConfigError, ColdSetError, ValueError) as exc:
        print(f"memory_needs: {exc}", file=sys.stderr)
        return 2
    needs = stage_needs(cfg, cluster)
    devices = device_memory(sorted({n.device for n in needs})) if needs else {}
    from stage_worker.host_memory import available_bytes

    print(json.dumps({"stages": [vars(n) for n in needs],
                      "devices": {k: {"total": t, "free": f} for k, (t, f) in devices.items()},
                      "host_available": available_bytes()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
