"""Quantized checkpoints' metadata (shared/quant_scheme.py, issue 17): resolved as compressed-tensors resolves it,
checked against the tensors on disk, on a checkpoint the compressed-tensors library itself wrote."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from shared.quant_scheme import QuantSchemeError, check, parse

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _scheme(bits: int, group: int = 8, **kw) -> dict:
    return {"targets": kw.pop("targets", ["Linear"]), "input_activations": None,
            "weights": {"num_bits": bits, "type": "int", "symmetric": True, "strategy": "group", "group_size": group,
                        **kw}}


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Path:
    """A tiny Qwen3.5-MoE whose Linear layers compressed-tensors quantized to INT4, group 8, and packed."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    from hf_oracle import build_reference

    model = build_reference("qwen3_5_moe")
    cfg = QuantizationConfig.model_validate({"config_groups": {"g0": _scheme(4)}, "format": "pack-quantized",
                                             "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$"]})
    apply_quantization_config(model, cfg, show_progress=False)
    for _, m in model.named_modules():
        s = getattr(m, "quantization_scheme", None)
        if s is not None:
            w = m.weight.data.view(m.weight.shape[0], -1, s.weights.group_size)
            scale, _ = calculate_qparams(w.amin(-1), w.amax(-1), s.weights)
            m.weight_scale.data.copy_(scale.to(m.weight_scale.dtype))
    comp = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    comp.compress_model(model)
    out = tmp_path_factory.mktemp("ct")
    model.save_pretrained(out)
    comp.update_config(out)
    return out


def _shapes(path: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(path / "model.safetensors", "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def test_a_library_written_checkpoint_agrees_with_its_metadata(written):
    plan = parse(json.loads((written / "config.json").read_text()))
    assert plan.method == "compressed-tensors"
    assert check(plan, _shapes(written)) == []
    q = plan.for_module("model.layers.0.linear_attn.in_proj_qkv")
    assert (q.bits, q.kind, q.strategy, q.group_size, q.symmetric) == (4, "int", "group", 8, True)
    assert plan.for_module("model.layers.0.mlp.gate") is None and plan.for_module("lm_head") is None
    # a regex naming the experts does promise them quantized: transformers' writer left them in float
    config = json.loads((written / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["targets"].append("re:.*experts\\.\\d+\\..*")
    found = check(parse(config), _shapes(written))
    assert len(found) == 1 and "plain weight on disk" in found[0] and "mlp.experts.0.down_proj" in found[0]


def test_groups_that_all_target_linear_are_found_and_so_is_the_bit_width_they_get_wrong(written):
    """The reports' release: every group targets `Linear`, so only the last one's scheme applies (here INT8 over
    tensors that hold INT4): both findings name what they hit."""
    config = json.loads((written / "config.json").read_text())
    groups = config["quantization_config"]["config_groups"]
    first = next(iter(groups.values()))
    groups.clear()
    groups.update({"experts_int4": first, "dense_int8": {**first, "weights": {**first["weights"], "num_bits": 8}}})
    plan = parse(config)
    found = check(plan, _shapes(written))
    assert any("experts_int4 and dense_int8 all target 'Linear'" in f for f in found), found
    wrong = [f for f in found if "scale columns" in f]
    assert wrong and "int8" in wrong[0] and "model.layers.0.linear_attn" in wrong[0]


def test_the_most_specific_target_decides_and_ignore_wins():
    plan = parse({"quantization_config": {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["re:.*router$"],
        "config_groups": {"dense": _scheme(6, 32), "experts": _scheme(4, 128, targets=["re:.*experts\\.\\d+\\..*"]),
                          "one": _scheme(8, 64, targets=["model.layers.3.mlp.experts.7.down_proj"])}}})
    assert plan.for_module("model.layers.0.self_attn.q_proj").bits == 6
    assert plan.for_module("model.layers.0.mlp.experts.5.up_proj").bits == 4
    assert plan.for_module("model.layers.3.mlp.experts.7.down_proj").bits == 8
    assert plan.for_module("model.layers.0.mlp.router") is None


def _fp4(strategy: str, group: int = 16, symmetric: bool = True) -> dict:
    return {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "strategy": strategy,
                                               "group_size": group, "symmetric": symmetric}}


@pytest.mark.parametrize("q,match", [
    ({"quant_method": "hqq", "bits": 4}, "'hqq' is not supported"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {**_scheme(8), "input_activations": {
        "num_bits": 8, "type": "float"}}}}, "activation quantization"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": _scheme(4, strategy="block")}},
     "strategy 'block'"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": _scheme(4, group=0)}}, "group_size"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": _fp4("tensor_group")}},
     "float4 sym strategy 'tensor_group' in format 'pack-quantized'"),        # FP4 only in its own format
    ({"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
      "config_groups": {"g": _fp4("tensor_group")}}, "strategy 'tensor_group' in format 'mxfp4-pack-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
      "config_groups": {"g": _fp4("tensor_group", symmetric=False)}}, "float4 asym"),
])
def test_unsupported_schemes_stop_with_the_scheme_named(q, match):
    with pytest.raises(QuantSchemeError, match=match):
        parse({"quantization_config": q})


@pytest.mark.parametrize("fmt,strategy,group", [("nvfp4-pack-quantized", "tensor_group", 16),
                                                ("mxfp4-pack-quantized", "group", 32)])
def test_fp4_parts_are_checked_against_the_scheme(fmt, strategy, group):
    """NVFP4 / MXFP4 modules: `weight_packed` [rows, in / 2], `weight_scale` [rows, in / group] and (NVFP4) a
    one-value `weight_global_scale` agree with the scheme; a wrong scale shape or a missing global scale is named
    with the module (the loader would read garbage or stop half way)."""
    plan = parse({"quantization_config": {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
                                          "config_groups": {"g": _fp4(strategy, group)}}})
    wq = plan.for_module("model.layers.0.mlp.experts.3.down_proj")
    assert (wq.kind, wq.bits, wq.strategy, wq.group_size, wq.fp4) == ("float", 4, strategy, group, True)
    m = "model.layers.0.mlp.experts.3.down_proj"
    ok = {f"{m}.weight_packed": (7, 2 * group), f"{m}.weight_scale": (7, 4), "lm_head.weight": (320, 64)}
    if strategy == "tensor_group":
        ok[f"{m}.weight_global_scale"] = (1,)
    assert check(plan, ok) == []
    found = check(plan, dict(ok, **{f"{m}.weight_scale": (7, 2)}))
    assert len(found) == 1 and "weight_scale is [7, 2], expected [7, 4]" in found[0] and m in found[0]
    if strategy == "tensor_group":
        found = check(plan, {k: v for k, v in ok.items() if not k.endswith("global_scale")})
        assert len(found) == 1 and "no weight_global_scale" in found[0] and m in found[0]
        found = check(plan, dict(ok, **{f"{m}.weight_global_scale": (2,)}))
        assert len(found) == 1 and "expected one value" in found[0]


def test_block_fp8_scales_are_checked_against_the_weight_shape():
    plan = parse({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                                          "modules_to_not_convert": ["lm_head"]}})
    ok = {"model.layers.0.mlp.down_proj.weight": (300, 256), "model.layers.0.mlp.down_proj.weight_scale_inv": (3, 2),
          "lm_head.weight": (320, 256)}
    assert check(plan, ok) == []                               # 300 rows: the last block is partial (ceil)
    bad = dict(ok, **{"model.layers.0.mlp.down_proj.weight_scale_inv": (2, 2)})
    assert any("expected [3, 2]" in f and "down_proj" in f for f in check(plan, bad))
    assert parse({"num_hidden_layers": 2}) is None            # not quantized at all


def test_metadata_that_disagrees_with_the_files_stops_serve_and_the_loader_by_name(written, tmp_path):
    """The reports' release (groups all targeting `Linear`, the last one INT8 over INT4 tensors): `moepipe serve` and
    the loader name the finding and the tensors, rather than read INT4 planes as INT8."""
    import shutil
    import subprocess

    from stage_worker.checkpoint.loader import CheckpointError, load_model

    bad = tmp_path / "bad"
    shutil.copytree(written, bad)
    config = json.loads((bad / "config.json").read_text())
    groups = config["quantization_config"]["config_groups"]
    first = next(iter(groups.values()))
    groups.clear()
    groups.update({"experts_int4": first, "dense_int8": {**first, "weights": {**first["weights"], "num_bits": 8}}})
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="metadata disagrees with its files: .*experts_int4 and dense_int8"):
        load_model(bad)
    r = subprocess.run([sys.executable, "-m", "shared.cli", "serve", "--model", str(bad), "--port", "1"],
                       capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 2 and "int8 sym group 8" in r.stderr and "linear_attn.in_proj_qkv" in r.stderr, r.stderr


def test_experts_a_linear_target_left_in_float_load_with_packed_experts_on(written):
    """compressed-tensors' usual W4A16 recipe (a `Linear` target) leaves transformers' 3-D experts in float on disk;
    the loader kept them packed because the plan named INT4 groups, and stopped on missing `weight_packed` tensors
    (QA). What the files hold decides: the same logits as with packed_experts off, at one and two stages."""
    import torch

    from stage_worker.checkpoint.loader import LoadOptions, load_model
    from stage_worker.checkpoint.packed_experts import packed_layers
    from stage_worker.local_engine import LocalEngine
    from shared.model_config import load_config
    from shared.quant_scheme import plan_of

    cfg = load_config(written)
    assert packed_layers(plan_of(written), cfg, 0, cfg.num_hidden_layers) != {}        # the plan alone says INT4
    assert packed_layers(plan_of(written), cfg, 0, cfg.num_hidden_layers, written) == {}

    def logits(packed: bool, stages: list[tuple[int, int]]) -> torch.Tensor:
        parts = [load_model(written, LoadOptions(start=s, end=e, dtype=torch.float32, packed_experts=packed))
                 for s, e in stages]
        engine = LocalEngine(parts, max_seqs=1, max_tokens=32)
        engine.add(0)
        return engine.step([(0, [5, 17, 3, 40, 8])], all_logits=True)

    want = logits(False, [(0, cfg.num_hidden_layers)])
    assert torch.equal(logits(True, [(0, cfg.num_hidden_layers)]), want)
    assert torch.allclose(logits(True, [(0, 1), (1, cfg.num_hidden_layers)]), want, atol=1e-5)
