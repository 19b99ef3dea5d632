"""Quantized checkpoint variants from tools other than `moepipe quantize` (QA, 2026-12-06): each loads and gives
transformers' logits on the weights the compressed-tensors library decompresses, or stops naming the scheme."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("compressed_tensors")

from hf_oracle import reference_logits  # noqa: E402
from stage_worker.checkpoint.loader import LoadOptions, load_model  # noqa: E402
from stage_worker.checkpoint.quantize import quantize_checkpoint  # noqa: E402
from stage_worker.local_engine import LocalEngine  # noqa: E402
from test_quantized_checkpoint import (PROMPT, TOL, _decompress_with_the_library, _reference,  # noqa: E402,F401
                                       originals)


def _logprobs(qdir: Path, **kw) -> torch.Tensor:
    engine = LocalEngine([load_model(qdir, LoadOptions(dtype=torch.float32, **kw))], max_seqs=1, max_tokens=64)
    engine.add(0)
    return torch.log_softmax(engine.step([(0, PROMPT)], all_logits=True), -1)


def test_activation_ordered_groups_with_g_idx_load(originals, tmp_path):
    """GPTQ with `actorder: group` (llm-compressor's recipe before compressed-tensors 0.20 dropped it) writes a
    `weight_g_idx` per module: input j takes scale column g_idx[j]. The loader refused the tensor as unexpected
    ("no part of a qwen3_next model takes it"); now every such module (INT4 experts, INT6 dense layers) is
    dequantized with it, never kept packed, and the logits equal transformers' on the library's decompression with
    each input's scale column spelled out."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    qdir, gdir, dense = tmp_path / "q", tmp_path / "g", tmp_path / "dense"
    quantize_checkpoint(originals["qwen3_next"], qdir, "reports-mixed")
    _decompress_with_the_library(qdir, dense)
    config = json.loads((qdir / "config.json").read_text())
    for group in config["quantization_config"]["config_groups"].values():
        if group["weights"]["strategy"] == "group":
            group["weights"]["actorder"] = "group"
    tensors, ref = load_file(qdir / "model.safetensors"), load_file(dense / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    n = 0
    for name in [k for k in tensors if k.endswith(".weight_scale")]:
        module = name[: -len(".weight_scale")]
        scale = tensors[name]
        if f"{module}.weight_packed" not in tensors or not any(
                module.endswith(p) for p in ("_proj", "fc", "lm_head")):
            continue
        if not any(re.match(t[3:], module) for g in config["quantization_config"]["config_groups"].values()
                   if g["weights"]["strategy"] == "group" for t in g["targets"]):
            continue                                   # per channel: no groups to order
        rows, k = (int(v) for v in tensors[f"{module}.weight_shape"])
        g = torch.randint(0, scale.shape[1], (k,), generator=gen, dtype=torch.int32)
        tensors[f"{module}.weight_g_idx"] = g
        bits = 4 if ".experts." in module else 6
        per_input = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
            num_bits=bits, type="int", symmetric=True, strategy="group", group_size=1))
        ref[f"{module}.weight"] = PackedQuantizationCompressor.decompress(
            {"weight_packed": tensors[f"{module}.weight_packed"], "weight_scale": scale[:, g.long()],
             "weight_shape": tensors[f"{module}.weight_shape"]}, per_input)["weight"].float().contiguous()
        n += 1
    assert n > 20 and any(".experts." in k for k in tensors if k.endswith("g_idx"))
    shutil.copytree(qdir, gdir)
    save_file(tensors, gdir / "model.safetensors", metadata={"format": "pt"})
    (gdir / "config.json").write_text(json.dumps(config))
    save_file(ref, dense / "model.safetensors", metadata={"format": "pt"})
    want = torch.log_softmax(reference_logits(_reference(dense), PROMPT), -1)
    for kw in ({}, {"packed_experts": False, "packed_dense": False}):
        assert (_logprobs(gdir, **kw) - want).abs().max() < TOL, kw
    model = load_model(gdir, LoadOptions(dtype=torch.float32, end=1))
    assert not any(m.packed_group for m in model.moe_layers().values())
    # and the order matters: without g_idx these are other weights
    assert (_logprobs(qdir) - want).abs().max() > 1e-3


def _library_written(family: str, qconfig: dict, out: Path) -> torch.Tensor:
    """A tiny transformers model quantized by compressed-tensors itself (apply the config, min-max scales per
    tensor / channel / group, compress, save, write the config), as llm-compressor's one-shot recipes save it; returns
    the logits of PROMPT the library's quantized forward computes before compression (weights quantized and
    dequantized in place: the oracle)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    from hf_oracle import build_reference

    model = build_reference(family)
    apply_quantization_config(model, QuantizationConfig.model_validate(qconfig), show_progress=False)
    for _, m in model.named_modules():
        s = getattr(m, "quantization_scheme", None)
        if s is None or s.weights is None:
            continue
        w = m.weight.data.float()
        if s.weights.strategy == "group":
            parts = w.split(s.weights.group_size, dim=1)
            lo, hi = torch.stack([p.amin(-1) for p in parts], -1), torch.stack([p.amax(-1) for p in parts], -1)
        elif s.weights.strategy == "channel":
            lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        else:
            lo, hi = w.amin().reshape(1), w.amax().reshape(1)
        scale, zp = calculate_qparams(lo, hi, s.weights)
        m.weight_scale.data.copy_(scale.reshape(m.weight_scale.shape).to(m.weight_scale.dtype))
        if getattr(m, "weight_zero_point", None) is not None:
            m.weight_zero_point.data.copy_(zp.reshape(m.weight_zero_point.shape).to(m.weight_zero_point.dtype))
    want = reference_logits(model, PROMPT)
    comp = ModelCompressor.from_pretrained_model(model, quantization_format=qconfig.get("format"))
    comp.compress_model(model)
    model.save_pretrained(out)
    comp.update_config(out)
    return torch.log_softmax(want, -1)


def _weights(bits: int, strategy: str, targets: list[str], group: int | None = None, **kw) -> dict:
    return {"targets": targets, "weights": {"num_bits": bits, "type": "int", "symmetric": True, "strategy": strategy,
                                            **({"group_size": group} if group else {}), **kw}}


IGNORE = ["lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$"]


def test_a_regex_over_mlp_projections_leaves_transformers_experts_in_float(tmp_path):
    """A recipe targeting `re:.*mlp.*proj$` (the dense MLP and the shared expert) beside a regex for attention: the
    library quantizes the Linear modules it reaches and writes transformers' 3-D routed experts in float under their
    per-expert names, which the regex matches too. moepipe refused the checkpoint it wrote ("plain weight on disk,
    but the config says int8 sym channel: ...experts.0.down_proj"); it loads now, with the library's logits."""
    qconfig = {"config_groups": {"attn": _weights(4, "group", ["re:.*self_attn.*", "re:.*linear_attn.*"], 8),
                                 "mlp": _weights(8, "channel", ["re:.*mlp.*proj$"])},
               "ignore": IGNORE, "format": "pack-quantized"}
    want = _library_written("qwen3_5_moe", qconfig, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    assert "model.layers.0.mlp.shared_expert.down_proj.weight_packed" in tensors
    assert tensors["model.layers.0.mlp.experts.0.down_proj.weight"].dtype == torch.float32
    for kw in ({}, {"packed_experts": False, "packed_dense": False}):
        assert (_logprobs(tmp_path, **kw) - want).abs().max() < TOL, kw


def test_kv_cache_scheme_scales_are_left_unused_as_vllm_does(tmp_path, caplog):
    """llm-compressor's FP8 KV-cache recipes add `kv_cache_scheme` and each attention layer's `self_attn.k_scale` /
    `v_scale`. The loader refused the first scale as an unexpected tensor ("no part of a qwen3_5_moe model takes
    it", no scheme named). vLLM reads them only for an FP8 KV cache and with --kv-cache-dtype auto leaves them unused;
    moepipe does the same now, with a warning naming the scheme (the weights' logits are the library's). Without a
    kv_cache_scheme such a tensor is still unexpected."""
    from shared.checkpoint_files import CheckpointError

    qconfig = {"config_groups": {"g": _weights(4, "group", ["Linear"], 8)}, "ignore": IGNORE,
               "format": "pack-quantized"}
    want = _library_written("qwen3_5_moe", qconfig, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor",
                                                        "dynamic": False, "symmetric": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = load_file(tmp_path / "model.safetensors")
    attn = sorted({k.rsplit(".self_attn.", 1)[0] for k in tensors if ".self_attn.o_proj." in k})
    assert attn
    for layer in attn:
        tensors[f"{layer}.self_attn.k_scale"] = torch.tensor([0.02])
        tensors[f"{layer}.self_attn.v_scale"] = torch.tensor([0.03])
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level("WARNING"):
        assert (_logprobs(tmp_path) - want).abs().max() < TOL
    assert "kv_cache_scheme (float8 tensor) ignored" in caplog.text
    del config["quantization_config"]["kv_cache_scheme"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"unexpected tensor '.*self_attn\.k_scale'"):
        load_model(tmp_path, LoadOptions(dtype=torch.float32))


def test_an_embedding_class_target_gets_its_own_scheme(tmp_path):
    """A recipe with a group for `Linear` and another for `Embedding` (INT8 per channel for the token embedding):
    the library quantizes the embedding with the second. moepipe resolved every module as a `Linear`, read the
    embedding with the first group's scheme and refused the library's checkpoint ("1 scale columns mean 1-8
    inputs, but ... packed int32 columns hold ...: model.embed_tokens"); the embedding is an Embedding now."""
    qconfig = {"config_groups": {"linear": _weights(4, "group", ["Linear"], 8),
                                 "embedding": _weights(8, "channel", ["Embedding"])},
               "ignore": IGNORE, "format": "pack-quantized"}
    want = _library_written("qwen3_5_moe", qconfig, tmp_path)
    assert "model.embed_tokens.weight_packed" in load_file(tmp_path / "model.safetensors")
    assert (_logprobs(tmp_path) - want).abs().max() < TOL


def _ct(**extra) -> dict:
    return {"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                    "config_groups": {"g": _weights(4, "group", ["Linear"], 32)}, **extra}}


@pytest.mark.parametrize("extra,match", [
    ({"sparsity_config": {"format": "sparse-24-bitmask", "sparsity_structure": "2:4", "targets": ["Linear"]}},
     r"sparsity_config: format 'sparse-24-bitmask' \(2:4 sparsity\) is not supported"),
    ({"transform_config": {"config_groups": {"u": {"type": "hadamard", "apply": [
        {"targets": ["re:.*down_proj$"], "location": "weight_input"},
        {"targets": ["re:.*down_proj$"], "location": "input", "inverse": True}]}}}},
     r"transform_config\.config_groups\.u: a hadamard transform at location 'input'"),
])
def test_sparse_and_online_transform_checkpoints_stop_naming_the_scheme(extra, match):
    """A 2:4-sparse compressed checkpoint (its values in bitmask tensors) and an online Hadamard transform (QuIP /
    SpinQuant R4: activations rotated at run time) were accepted by the metadata check, so the first failed later
    on an 'unexpected tensor' and the second would load and compute without the rotation: wrong logits, silently.
    Both stop now, naming the section and the scheme; a dense sparsity config and transforms fused into the
    weights still load."""
    from shared.quant_scheme import QuantSchemeError, parse

    with pytest.raises(QuantSchemeError, match=match):
        parse(_ct(**extra))
    fused = {"config_groups": {"v": {"type": "hadamard", "apply": [
        {"targets": ["re:.*v_proj$"], "location": "weight_output"},
        {"targets": ["re:.*o_proj$"], "location": "weight_input", "inverse": True}]}}}
    assert parse(_ct(sparsity_config={"format": "dense"}, transform_config=fused)).method == "compressed-tensors"


def test_packed_int4_experts_of_a_bf16_checkpoint_round_as_the_library(originals, tmp_path):
    """A bf16 checkpoint's INT4 experts kept packed were dequantized with float32 scales on the CPU (the compute
    dtype), so q * scale was never rounded to bf16 as the library, the dequantize-at-load path and PackedLinear round
    it: up to 6e-4 apart in log-probabilities. The scales now keep the checkpoint's dtype."""
    bf16 = tmp_path / "bf16"
    shutil.copytree(originals["qwen3_next"], bf16)
    weights = bf16 / "model.safetensors"
    save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(weights).items()},
              weights, metadata={"format": "pt"})
    config = json.loads((bf16 / "config.json").read_text())
    config["torch_dtype"] = config["dtype"] = "bfloat16"
    (bf16 / "config.json").write_text(json.dumps(config))
    qdir = tmp_path / "q"
    quantize_checkpoint(bf16, qdir, "int4-experts")
    packed = load_model(qdir, LoadOptions(dtype=torch.float32))
    assert any(m.packed_group for m in packed.moe_layers().values())           # the experts stayed packed
    assert all(m.s13.dtype == torch.bfloat16 for m in packed.moe_layers().values() if m.packed_group)
    diff = (_logprobs(qdir) - _logprobs(qdir, packed_experts=False)).abs().max().item()
    assert diff < 1e-6, diff                                  # before: 3.8e-5 (this model), 0.0 now
