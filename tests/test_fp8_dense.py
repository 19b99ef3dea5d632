"""Block-FP8 checkpoints with `packed_fp8_dense` on (issue 17): the plain-linear dense weights (o_proj, DeltaNet's
out_proj and in-projections, ...) stay float8 with their block scales (`Fp8Linear`) and the model's logits equal
those of the same checkpoint dequantized at load (the key off) within float32 rounding, a prompt and 8 greedy
decode steps, for the Qwen3-Next and Qwen4-Exp layouts; also through the GEMV kernel under the interpreter. The
memory plan counts the float8 bytes, the switch parses from the environment and reaches GPU stages only. The
checkpoints are test_fp8_experts.py's (`fp8_dirs`: transformers' tiny models through `moepipe quantize --scheme
fp8-block`); the kernel's own tests are tests/test_kernel_fp8_gemv.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

pytest.importorskip("compressed_tensors")

from shared.cluster_config import ClusterConfig, ClusterConfigError, StageSpec, env_overrides  # noqa: E402
from shared.model_config import load_config  # noqa: E402
from stage_worker.checkpoint.loader import LoadOptions, load_model  # noqa: E402
from stage_worker.kernels.fp8_gemv_ref import dequantize_rows  # noqa: E402
from stage_worker.model.fp8_linear import Fp8Linear, fp8_specs  # noqa: E402
from test_fp8_experts import _logits  # noqa: E402  (the fixture `fp8_dirs` is conftest's)


def _fp8_modules(model: nn.Module) -> dict[str, Fp8Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Fp8Linear)}


@pytest.mark.parametrize("family", ["qwen3_next", "qwen4_exp"])
def test_fp8_dense_layers_stay_float8_and_give_the_dequantized_models_logits(family, fp8_dirs):
    qdir = fp8_dirs[family]
    on = load_model(qdir, LoadOptions(dtype=torch.float32, packed_fp8_dense=True))
    off = load_model(qdir, LoadOptions(dtype=torch.float32))
    held = _fp8_modules(on)
    assert held and not _fp8_modules(off)
    kinds = {n.rsplit(".", 1)[-1] for n in held}
    # (Qwen3-Next's DeltaNet in-projections are regrouped from in_proj_qkvz / in_proj_ba: dequantized at load)
    assert "o_proj" in kinds and (family != "qwen3_next" or "out_proj" in kinds)
    for name, m in held.items():          # the same weights the key-off load holds, in half the bytes
        assert m.weight_fp8.dtype == torch.uint8 and m.weight_scale_inv.dtype == torch.float32
        assert m.block == (128, 128)
        assert torch.equal(dequantize_rows(m.fp8(), torch.float32), off.get_submodule(name).weight), name
    # fused bf16 kernels read q/k/v and the shared expert: they stay dequantized
    assert all(type(m) is nn.Linear for n, m in on.named_modules() if n.endswith(("q_proj", "k_proj", "v_proj")))
    ref = _logits([off])
    assert (_logits([on]) - ref).abs().max() < 1e-5
    both = load_model(qdir, LoadOptions(dtype=torch.float32, packed_fp8_dense=True, packed_fp8_experts=True))
    assert _fp8_modules(both) and all(m.fp8_block for m in both.moe_layers().values())
    assert (_logits([both]) - ref).abs().max() < 1e-5


def test_the_gemv_kernel_in_the_model_gives_the_same_logits(fp8_dirs, monkeypatch):
    """The float8 layers through `fp8_gemv` (the interpreter on the CPU: the prompt's 14 tokens on the tl.dot path,
    decode on the FMA path) give the key-off load's logits."""
    if torch.cuda.is_available():
        pytest.skip("the GPU tests cover the kernel path on CUDA")
    pytest.importorskip("triton")
    qdir = fp8_dirs["qwen3_next"]
    on = load_model(qdir, LoadOptions(dtype=torch.float32, packed_fp8_dense=True))
    ref = _logits([load_model(qdir, LoadOptions(dtype=torch.float32))])
    calls = []
    from stage_worker.kernels import fp8_gemv

    real = fp8_gemv.fp8_gemv
    monkeypatch.setattr(fp8_gemv, "fp8_gemv", lambda x, fw, *a, **k: calls.append(x.shape[0]) or real(x, fw, *a, **k))
    monkeypatch.setattr(Fp8Linear, "interpret_on_cpu", True)
    assert (_logits([on]) - ref).abs().max() < 1e-5
    assert 1 in calls and max(calls) <= fp8_gemv.DECODE_MAX_T


def test_modules_to_not_convert_and_other_forms_stay_dequantized():
    """Only float8_e4m3fn weights with block scales of their shape, outside `modules_to_not_convert`, are kept."""
    from shared.quant_scheme import parse

    plan = parse({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                                          "modules_to_not_convert": ["model.layers.1.self_attn.o_proj"]}})
    sites = {f"layers.{i}.self_attn.o_proj": (200, 300) for i in range(4)}
    disk = {f"model.layers.{i}.self_attn.o_proj.weight": ((200, 300), "F8_E4M3") for i in range(4)}
    disk |= {f"model.layers.{i}.self_attn.o_proj.weight_scale_inv": ((2, 3), "F32") for i in range(4)}
    disk["model.layers.2.self_attn.o_proj.weight"] = ((200, 300), "F8_E5M2")
    disk["model.layers.3.self_attn.o_proj.weight_scale_inv"] = ((1, 3), "F32")
    assert fp8_specs(plan, sites, disk) == {"layers.0.self_attn.o_proj": (128, 128)}


def test_the_memory_plan_counts_fp8_dense_layers_at_their_size(fp8_dirs):
    """A GPU stage with the key on is planned at what the loader keeps: the float8 bytes and float32 block scales of
    the Fp8Linear layers, the rest in the compute dtype."""
    from stage_worker.memory_needs import stage_needs

    qdir = fp8_dirs["qwen3_next"]
    cfg = load_config(qdir)
    cluster = ClusterConfig(model=str(qdir), gateway_endpoint="", max_num_seqs=2, block_size=16, dtype="float32",
                            stages=[StageSpec(0, cfg.num_hidden_layers, "", "cuda:0")], packed_fp8_dense=True,
                            packed_fp8_experts=False, measure_reserve=False)
    planned = stage_needs(cfg, cluster)[0]
    model = load_model(qdir, LoadOptions(dtype=torch.float32, packed_fp8_dense=True))
    held = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if "ngram_embedding" not in name
               and ".ple.ple_embedding" not in name)
    layers = _fp8_modules(model).values()
    fp8 = sum(m.weight_fp8.numel() + m.weight_scale_inv.numel() * 4 for m in layers)
    assert planned.weights == held + fp8
    off = stage_needs(cfg, dataclasses.replace(cluster, packed_fp8_dense=False))[0]
    assert off.weights - planned.weights == sum(m.weight_fp8.numel() * 4 for m in layers) - fp8


def test_the_switch_is_off_by_default_parses_and_reaches_gpu_stages_only(fp8_dirs, monkeypatch):
    from stage_worker import stage_loader

    assert ClusterConfig.__dataclass_fields__["packed_fp8_dense"].default is False
    monkeypatch.setenv("MOEPIPE_PACKED_FP8_DENSE", "1")
    assert env_overrides()["packed_fp8_dense"] is True
    monkeypatch.setenv("MOEPIPE_PACKED_FP8_DENSE", "ture")
    with pytest.raises(ClusterConfigError, match="MOEPIPE_PACKED_FP8_DENSE"):
        env_overrides()
    monkeypatch.delenv("MOEPIPE_PACKED_FP8_DENSE")
    qdir = fp8_dirs["qwen4_exp"]
    cfg = load_config(qdir)
    n = cfg.num_hidden_layers
    cluster = ClusterConfig(model=str(qdir), gateway_endpoint="", max_num_seqs=1, dtype="float32",
                            stages=[StageSpec(0, n, "", "cpu")], packed_fp8_dense=True)
    assert not _fp8_modules(stage_loader.load_stage(cluster, 0, cfg))      # a CPU stage dequantizes at load
    seen = []
    monkeypatch.setattr(stage_loader, "load_model", lambda model, opts, cfg: seen.append(opts) or
                        load_model(model, dataclasses.replace(opts, device="cpu"), cfg))
    gpu = dataclasses.replace(cluster, stages=[StageSpec(0, n, "", "cuda:0")])
    assert _fp8_modules(stage_loader.load_stage(gpu, 0, cfg)) and seen[-1].packed_fp8_dense
    stage_loader.load_stage(dataclasses.replace(gpu, packed_fp8_dense=False), 0, cfg)
    assert not seen[-1].packed_fp8_dense
