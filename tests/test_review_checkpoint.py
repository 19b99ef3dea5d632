"""Review fixes in checkpoint loading: the quantization check reads the files the loader reads (an index's, not every
`*.safetensors` in the directory), and a load reads the files' headers once for every check before it streams the
tensors (a tied lm_head's scan, the packed-layer specs and the quantization check each read them again)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from shared.quant_scheme import refusal
from stage_worker.checkpoint.loader import LoadOptions, load_model
from test_checkpoint_variants_qa import edit_config
from test_unseen_checkpoints import qwen3_5_moe, written

# compressed-tensors metadata whose class target leaves the plain float weights on disk valid
INT4_LINEAR = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 16,
                                       "symmetric": True}}}}


def _quantized_tiny(tmp_path: Path, **kw) -> Path:
    written(qwen3_5_moe(hidden_size=32, moe_intermediate_size=16, **kw), tmp_path)
    edit_config(tmp_path, lambda c: c.update(quantization_config=INT4_LINEAR))
    return tmp_path


def test_quantization_check_reads_only_the_index_s_files(tmp_path):
    """A sharded checkpoint lists its files in model.safetensors.index.json; a repository may hold other
    `*.safetensors` beside them (Mistral's consolidated.safetensors, a partial download). The loader reads the
    index's files only, but the quantization check (`moepipe serve` runs it first, the loader again) opened every
    `*.safetensors` in the directory: a stray file it could not read refused a checkpoint that loads."""
    from safetensors import safe_open

    path = _quantized_tiny(tmp_path)
    with safe_open(path / "model.safetensors", framework="pt") as f:
        names = list(f.keys())
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: "model.safetensors" for n in names}}))
    (path / "consolidated.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\": ")   # not in the index
    assert refusal(path) is None
    model = load_model(path, LoadOptions(dtype=torch.float32))
    assert model.lm_head.weight.shape[0] == 150


def test_a_load_reads_each_file_s_headers_once_before_streaming(tmp_path, monkeypatch):
    """A tied, quantized checkpoint with an lm_head in the files: the tied lm_head's scan, the packed dense specs
    and the quantization check read every file's headers again, each on its own (five opens a file in all); now
    one read serves them, beside the packed-expert scan (cached per directory) and the streaming pass."""
    import safetensors

    path = _quantized_tiny(tmp_path, tie_word_embeddings=True)
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    tensors["lm_head.weight"] = torch.randn_like(tensors["model.embed_tokens.weight"])
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    opens: list[str] = []
    real = safetensors.safe_open

    def counted(p, *args, **kwargs):
        opens.append(Path(p).name)
        return real(p, *args, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", counted)
    model = load_model(path, LoadOptions(dtype=torch.float32))
    assert opens == ["model.safetensors"] * 3, opens
    # the files' lm_head, not the embedding, as transformers loads it
    assert torch.equal(model.lm_head.weight, tensors["lm_head.weight"])
    assert torch.equal(model.embed_tokens.weight, tensors["model.embed_tokens.weight"])
