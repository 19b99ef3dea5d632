"""Cases tools/qa_quant_fuzz.py found: quantized checkpoints (written by `moepipe quantize` or by the
compressed-tensors library) that moepipe refused without naming what it refused, or computed differently from
transformers on the library's decompression."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

pytest.importorskip("compressed_tensors")

from shared.quant_scheme import QuantSchemeError, refusal  # noqa: E402
from stage_worker.checkpoint.loader import LoadOptions, load_model  # noqa: E402


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    from hf_oracle import save_reference

    src = tmp_path_factory.mktemp("src")
    save_reference("qwen3_5_moe", src, seed=0)
    return src


@pytest.fixture(scope="module")
def int4_experts(source, tmp_path_factory):
    from stage_worker.checkpoint.quantize import quantize_checkpoint

    out = tmp_path_factory.mktemp("q") / "q"
    quantize_checkpoint(source, out, "int4-experts")
    return out


NVFP4 = {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16}


@pytest.mark.parametrize("label,weights,extra", [
    ("nvfp4a4", NVFP4, {"format": "nvfp4-pack-quantized", "input_activations": {
        "num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16,
        "dynamic": "local"}}),
    ("w4a8", {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 16},
     {"input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}}),
])
def test_an_unsupported_scheme_is_refused_naming_a_tensor_it_holds(label, weights, extra, int4_experts, tmp_path):
    """A config group moepipe cannot run (activation quantization: NVFP4 W4A4, W4A8) stopped the load with the group
    and the scheme but no tensor (`quantization_config.config_groups.experts_int4_g16: float4 strategy
    'tensor_group' ... is not supported`, when NVFP4A16 was refused too): a user could not tell which weights hold
    it. The loader and `moepipe serve`'s check now name the first tensor the group reaches and how many more."""
    d = tmp_path / label
    shutil.copytree(int4_experts, d)
    config = json.loads((d / "config.json").read_text())
    q = config["quantization_config"]
    group = next(iter(q["config_groups"].values()))
    group["weights"] = weights
    extra = dict(extra)
    if "format" in extra:
        q["format"] = extra.pop("format")
    group.update(extra)
    (d / "config.json").write_text(json.dumps(config))
    tensor = r"it holds tensor 'model\.layers\.\d+\.mlp\.experts\.\d+\.\w+_proj\.weight_packed' and \d+ more"
    with pytest.raises(QuantSchemeError, match=tensor):
        load_model(d, LoadOptions(dtype=torch.float32))
    why = refusal(d)                           # what `moepipe serve` prints before it starts a stage
    assert why is not None and "is not supported" in why
    assert "it holds tensor 'model.layers." in why


def test_an_nvfp4_checkpoint_loads_and_int4_files_under_an_nvfp4_config_are_named(source, int4_experts, tmp_path):
    """NVFP4A16 was the refusal above (`float4 strategy 'tensor_group' in format 'nvfp4-pack-quantized' is not
    supported`); it now loads, dequantized at load, with transformers' log-probs on the library's decompression
    (Qwen3.5-MoE here; tests/test_quantized_checkpoint.py has Qwen3-Next and Qwen4-Exp, decode and two stages).
    INT4 files under an NVFP4 config are metadata that disagrees with the files, named with the tensors."""
    from hf_oracle import reference_logits
    from stage_worker.checkpoint.quantize import quantize_checkpoint
    from test_quantized_checkpoint import PROMPT, TOL, _decompress_with_the_library, _logits_of, _reference

    qdir = tmp_path / "nvfp4"
    quantize_checkpoint(source, qdir, "nvfp4")
    assert refusal(qdir) is None
    _decompress_with_the_library(qdir, tmp_path / "dense")
    want = torch.log_softmax(reference_logits(_reference(tmp_path / "dense"), PROMPT), -1)
    got, _ = _logits_of([load_model(qdir, LoadOptions(dtype=torch.float32))], 0)
    assert (torch.log_softmax(got, -1) - want).abs().max() < TOL

    d = tmp_path / "int4-as-nvfp4"
    shutil.copytree(int4_experts, d)
    config = json.loads((d / "config.json").read_text())
    next(iter(config["quantization_config"]["config_groups"].values())).update(weights=NVFP4,
                                                                               format="nvfp4-pack-quantized")
    (d / "config.json").write_text(json.dumps(config))
    why = refusal(d)
    assert why is not None and "disagrees with its files" in why and "float4 sym tensor_group 16" in why
    assert re.search(r"model\.layers\.\d+\.mlp\.experts\.\d+\.\w+_proj", why)
    with pytest.raises(Exception, match="disagrees with its files"):
        load_model(d, LoadOptions(dtype=torch.float32))


def test_a_tied_model_s_quantized_embedding_is_not_replaced_by_the_float_lm_head(tmp_path):
    """llm-compressor quantizing the embedding (an `Embedding` target) of a tied model with lm_head ignored writes
    the embedding as its parts (`weight_packed`, `weight_scale`) beside a float `lm_head.weight` (seed 3602, case
    6). Seeing no `model.embed_tokens.weight` in the files, the loader filled the embedding from that lm_head too
    (the original float values, 3e-3 off transformers' log-probabilities on the decompressed weights); transformers
    unties them and embeds with the decompressed embedding, and so does moepipe now, on one stage and on two."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    from safetensors.torch import load_file, save_file

    from test_unseen_checkpoints import qwen3_5_moe, written

    written(qwen3_5_moe(hidden_size=32, moe_intermediate_size=16, tie_word_embeddings=True), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    embed = tensors.pop("model.embed_tokens.weight")
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="channel")
    scheme = QuantizationScheme(targets=["Embedding"], weights=args)
    scale, _ = calculate_qparams(embed.amin(-1, keepdim=True), embed.amax(-1, keepdim=True), args)
    parts = PackedQuantizationCompressor.compress({"weight": embed, "weight_scale": scale}, scheme)
    tensors |= {f"model.embed_tokens.{k}": v.contiguous() for k, v in parts.items()}
    tensors["lm_head.weight"] = embed.clone()
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Embedding"], "weights": args.model_dump(mode="json")}}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    want = PackedQuantizationCompressor.decompress(dict(parts), scheme)["weight"].float()
    assert (want - embed).abs().max() > 1e-3                   # the quantization changed it
    whole = load_model(tmp_path, LoadOptions(dtype=torch.float32))
    assert torch.equal(whole.embed_tokens.weight, want)
    assert torch.equal(whole.lm_head.weight, embed)
    first, last = (load_model(tmp_path, LoadOptions(start=s, end=e, dtype=torch.float32)) for s, e in ((0, 1), (1, 3)))
    assert torch.equal(first.embed_tokens.weight, want)
    assert torch.equal(last.lm_head.weight, embed)


def test_int4_experts_of_a_non_silu_model_are_dequantized_at_load(tmp_path):
    """`moepipe quantize --scheme int4-experts` of a gelu model (seed 3715, case 6: Qwen3-Next, gelu_pytorch_tanh)
    writes experts the packed kernels cannot run (they compute SiLU); the load refused with 'use the checkpoint
    unquantized', yet dequantized at load (what `packed_experts` off does) moepipe matches transformers on the
    library's decompression. The loader now does that by itself, on 1 and 2 stages."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from safetensors.torch import load_file

    from stage_worker.checkpoint.quantize import quantize_checkpoint
    from test_unseen_checkpoints import assert_matches, qwen3_5_moe, written

    model = written(qwen3_5_moe(hidden_size=32, moe_intermediate_size=16, hidden_act="gelu_pytorch_tanh"),
                    tmp_path / "src")
    quantize_checkpoint(tmp_path / "src", tmp_path / "q", "int4-experts")
    loaded = load_model(tmp_path / "q", LoadOptions(dtype=torch.float32))        # dequantized at load by itself
    assert not any(m.packed_group for m in loaded.moe_layers().values())
    # transformers on the library's decompression of every expert, loaded as moepipe with packed_experts off
    groups = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["config_groups"]
    tensors = load_file(tmp_path / "q" / "model.safetensors")

    def expert(layer: int, e: int, part: str) -> torch.Tensor:
        module = f"model.layers.{layer}.mlp.experts.{e}.{part}_proj"
        w = next(g["weights"] for g in groups.values() if re.fullmatch(g["targets"][0].removeprefix("re:"), module))
        scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**w))
        parts = {k[len(module) + 1:]: v for k, v in tensors.items() if k.startswith(module + ".")}
        return PackedQuantizationCompressor.decompress(parts, scheme)["weight"].float()

    with torch.no_grad():
        for layer, block in enumerate(model.model.layers):
            experts = block.mlp.experts
            for e in range(experts.gate_up_proj.shape[0]):
                experts.gate_up_proj[e] = torch.cat([expert(layer, e, "gate"), expert(layer, e, "up")])
                experts.down_proj[e] = expert(layer, e, "down")
    assert_matches(model, tmp_path / "q", stages=(1, 2))
