"""Cases tools/qa_quant_fuzz.py found: quantized checkpoints (written by `moepipe quantize` or by the
compressed-tensors library) that moepipe refused without naming what it refused, or computed differently from
transformers on the library's decompression."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("compressed_tensors")

from shared.quant_scheme import QuantSchemeError, refusal  # noqa: E402
from stage_worker.checkpoint.loader import LoadOptions, load_model  # noqa: E402


@pytest.fixture(scope="module")
def int4_experts(tmp_path_factory):
    from hf_oracle import save_reference
    from stage_worker.checkpoint.quantize import quantize_checkpoint

    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("q") / "q"
    save_reference("qwen3_5_moe", src, seed=0)
    quantize_checkpoint(src, out, "int4-experts")
    return out


@pytest.mark.parametrize("label,weights,extra", [
    ("nvfp4", {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group", "group_size": 16},
     {"format": "nvfp4-pack-quantized"}),
    ("w4a8", {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 16},
     {"input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}}),
])
def test_an_unsupported_scheme_is_refused_naming_a_tensor_it_holds(label, weights, extra, int4_experts, tmp_path):
    """A config group moepipe cannot run (NVFP4, activation quantization) stopped the load with the group and the
    scheme but no tensor (`quantization_config.config_groups.experts_int4_g16: float4 strategy 'tensor_group' ...
    is not supported`): a user could not tell which weights hold it. The loader and `moepipe serve`'s check now
    name the first tensor the group reaches and how many more."""
    d = tmp_path / label
    shutil.copytree(int4_experts, d)
    config = json.loads((d / "config.json").read_text())
    q = config["quantization_config"]
    group = next(iter(q["config_groups"].values()))
    group["weights"] = weights
    if "format" in extra:
        q["format"] = extra["format"]
    else:
        group.update(extra)
    (d / "config.json").write_text(json.dumps(config))
    tensor = r"it holds tensor 'model\.layers\.\d+\.mlp\.experts\.\d+\.\w+_proj\.weight_packed' and \d+ more"
    with pytest.raises(QuantSchemeError, match=tensor):
        load_model(d, LoadOptions(dtype=torch.float32))
    why = refusal(d)                           # what `moepipe serve` prints before it starts a stage
    assert why is not None and "is not supported" in why
    assert "it holds tensor 'model.layers." in why
