"""Checkpoint and config.json variants a user may have, each against transformers reading the same directory
(`from_pretrained`, the oracle): tiny float32 models, compared in-process (prefill log-probabilities and greedy
decode)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hf_oracle import ROPE, _require_transformers
from shared.model_config import load_config
from stage_worker.checkpoint.loader import LoadOptions, load_model
from test_unseen_checkpoints import assert_matches, qwen3_5_moe, qwen3_next, written  # noqa: E402

# rope_parameters' theta other than transformers' default (10000), so a rope_scaling that replaces them is seen
THETA_5000 = {**ROPE, "rope_theta": 5000.0}


def edit_config(path: Path, edit) -> None:
    f = path / "config.json"
    config = json.loads(f.read_text())
    edit(config)
    f.write_text(json.dumps(config))


def reread(path: Path):
    """transformers' model from the directory as it now is (config.json edited by hand)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager",
                                                experts_implementation="eager").float().eval()


@pytest.mark.parametrize("flat", [{}, {"rope_theta": 20000.0, "partial_rotary_factor": 1.0}], ids=["defaults", "flat"])
def test_rope_scaling_added_to_a_transformers_5_config(flat, tmp_path):
    """Qwen's model cards enable YaRN by adding `rope_scaling` to config.json; a config saved by transformers 5
    already carries `rope_parameters`. transformers lets a non-empty rope_scaling replace rope_parameters whole
    (rope_theta and partial_rotary_factor then from the flat keys, else the defaults); moepipe read rope_parameters
    and ignored rope_scaling: plain RoPE at rope_parameters' theta."""
    written(qwen3_next(rope_parameters=THETA_5000), tmp_path)
    edit_config(tmp_path, lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                           "original_max_position_embeddings": 16}, **flat))
    ref = reread(tmp_path)
    assert ref.config.rope_parameters["rope_type"] == "yarn"
    cfg = load_config(tmp_path)
    assert cfg.rope_scaling["rope_type"] == "yarn"
    assert cfg.rope_theta == ref.config.rope_parameters["rope_theta"]
    assert cfg.partial_rotary_factor == ref.config.rope_parameters["partial_rotary_factor"]
    assert_matches(ref, tmp_path, stages=(1,))


def test_a_bad_rope_scaling_is_named_as_rope_scaling():
    """rope_scaling is what transformers reads when both keys are there, so a problem in it names rope_scaling, not
    the rope_parameters the user did not edit."""
    from shared.model_config import ConfigError, config_from_dict

    raw = {**qwen3_next().to_dict(), "rope_scaling": {"rope_type": "longrope", "factor": 4.0}}
    with pytest.raises(ConfigError, match=r"config field 'rope_scaling\.rope_type': 'longrope'"):
        config_from_dict(raw)
    raw["rope_scaling"] = {"rope_type": "linear"}
    with pytest.raises(ConfigError, match=r"config field 'rope_scaling\.factor'"):
        config_from_dict(raw)
    raw["rope_scaling"] = "yarn"
    with pytest.raises(ConfigError, match=r"config field 'rope_scaling': expected an object"):
        config_from_dict(raw)


def _rewrite_weights(path: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    f = path / "model.safetensors"
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


@pytest.mark.parametrize("lm_head", ["same", "different", "only"])
def test_tied_config_with_an_lm_head_in_the_files(lm_head, tmp_path):
    """tie_word_embeddings true and an `lm_head.weight` in the files (exporters that write both; a fine-tune that
    untied them but kept the flag): transformers loads it into lm_head (and, with other values than the embedding,
    does not tie them); with only lm_head in the files it ties the embedding to it. moepipe refused the tensor as
    unexpected (and, without the embedding, as missing)."""
    written(qwen3_5_moe(tie_word_embeddings=True), tmp_path)

    def edit(t):
        embed = t["model.embed_tokens.weight"]
        t["lm_head.weight"] = embed.clone() if lm_head == "same" else torch.randn_like(embed)
        if lm_head == "only":
            del t["model.embed_tokens.weight"]

    _rewrite_weights(tmp_path, edit)
    ref = reread(tmp_path)
    assert load_config(tmp_path).tie_word_embeddings
    assert torch.equal(ref.model.embed_tokens.weight, ref.lm_head.weight) == (lm_head != "different")
    assert_matches(ref, tmp_path, stages=(1, 3))


def test_an_old_exporter_s_rotary_buffers_are_ignored(tmp_path):
    """Checkpoints from older exporters carry each attention layer's `rotary_emb.inv_freq` (and cos/sin caches) as
    tensors; transformers and vLLM ignore them, moepipe refused them as unexpected. Loaded now, the same logits."""
    written(qwen3_5_moe(), tmp_path)
    attn = [i for i, t in enumerate(load_config(tmp_path).layer_types) if t == "full_attention"]
    assert attn

    def edit(t):
        for i in attn:
            t[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.rand(8)
            t[f"model.layers.{i}.self_attn.rotary_emb.cos_cached"] = torch.rand(4, 8)
        t["model.rotary_emb.inv_freq"] = torch.rand(8)

    _rewrite_weights(tmp_path, edit)
    assert_matches(reread(tmp_path), tmp_path, stages=(1,))


def _truncate(path: Path) -> Path:
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])            # a download cut off half way
    return weights


def test_truncated_file_of_a_quantized_checkpoint_is_named(tmp_path):
    """A compressed-tensors checkpoint with a cut-off weight file: the quantization check (`moepipe serve` runs it
    before starting anything) and the loader's scan for packed experts raised safetensors' bare SafetensorError (a
    traceback, no file named); now the loader's CheckpointError naming the file, as for a plain checkpoint."""
    from shared.checkpoint_files import CheckpointError
    from shared.quant_scheme import refusal

    written(qwen3_5_moe(hidden_size=32, moe_intermediate_size=16), tmp_path)
    scheme = {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 16,
                                                 "symmetric": True}}
    edit_config(tmp_path, lambda c: c.update(quantization_config={
        "quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": scheme}}))
    weights = _truncate(tmp_path)
    want = rf"{weights}: not a readable safetensors file"
    with pytest.raises(CheckpointError, match=want):
        refusal(tmp_path)
    with pytest.raises(CheckpointError, match=want):
        load_model(tmp_path, LoadOptions(dtype=torch.float32))


def test_truncated_file_is_named_by_the_ple_service(tmp_path):
    """Qwen4-Exp: the PLE service scans the files for PLE shards before any stage loads; a cut-off file was a
    SafetensorError traceback from that process (`moepipe serve` showed it), now a CheckpointError naming the file
    (the service prints it as one line and exits 2)."""
    from hf_oracle import save_reference
    from ple_service.tables import open_tables
    from shared.checkpoint_files import CheckpointError

    _require_transformers()
    save_reference("qwen4_exp", tmp_path)
    cfg = load_config(tmp_path)
    weights = _truncate(tmp_path)
    with pytest.raises(CheckpointError, match=rf"{weights}: not a readable safetensors file"):
        open_tables(tmp_path, cfg)
