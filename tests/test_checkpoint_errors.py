"""Broken checkpoints and configs fail with errors that name what is wrong; sharded and nested (released-style)
checkpoints load and give the plain checkpoint's logits.

Every case copies the Qwen4-Exp reference checkpoint (config.json + model.safetensors, written by transformers) into
tmp_path and rewrites it with safetensors.torch.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shared.model_config import ConfigError, config_from_dict
from stage_worker.checkpoint.loader import CheckpointError, LoadOptions, load_model
from stage_worker.local_engine import LocalEngine



FAMILY = "qwen4_exp"
PROMPT = [9, 17, 250, 5, 33, 81, 81, 140, 6, 77, 310, 12, 44]


@pytest.fixture(scope="module")
def ref(reference_checkpoints):
    path, _ = reference_checkpoints[FAMILY]
    return path, load_file(path / "model.safetensors"), json.loads((path / "config.json").read_text())


def _write(dst: Path, tensors: dict, config: dict, name: str = "model.safetensors") -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(config))
    save_file(tensors, dst / name, metadata={"format": "pt"})
    return dst


def _load(path: Path, **kw):
    return load_model(path, LoadOptions(dtype=torch.float32, **kw))


def _logits(model) -> torch.Tensor:
    engine = LocalEngine([model], block_size=8)
    engine.add(0)
    return torch.cat([engine.step([(0, PROMPT)], all_logits=True), engine.step([(0, [3])])])


@pytest.fixture(scope="module")
def ref_logits(ref):
    return _logits(_load(ref[0]))


# ---- (a) a removed tensor -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", [
    "model.layers.2.self_attn.k_proj.weight",
    "model.layers.4.self_attn.indexer.index_qk_proj.weight",
    "model.embed_tokens.weight",
    "lm_head.weight",
    "model.layers.1.ple.ple_embedding.ngram_embedding.shard_2.weight",
    "model.layers.0.ple.ple_embedding.ngram_embedding.shard_0.weight",
    "model.layers.0.mlp.experts.3.up_proj.weight",
    "model.layers.3.mlp.experts.7.down_proj.weight",
])
def test_removed_tensor_is_named(ref, tmp_path, name):
    _, tensors, config = ref
    tensors = dict(tensors)
    del tensors[name]
    path = _write(tmp_path / "ckpt", tensors, config)
    with pytest.raises(CheckpointError) as err:
        _load(path)
    msg = str(err.value)
    assert name in msg
    assert str(path) in msg
    # Only the missing tensor is blamed, not present neighbours.
    present = [n for n in tensors if n.rsplit(".", 2)[0] == name.rsplit(".", 2)[0]]
    assert not any(repr(n) in msg for n in present), msg


def test_removed_tensor_of_another_stage_is_fine(ref, tmp_path):
    """A stage checks only its own layers: a tensor of layer 4 missing does not stop the slice [0, 2)."""
    _, tensors, config = ref
    tensors = {n: t for n, t in tensors.items() if n != "model.layers.4.self_attn.k_proj.weight"}
    path = _write(tmp_path / "ckpt", tensors, config)
    _load(path, start=0, end=2)
    with pytest.raises(CheckpointError, match=r"model\.layers\.4\.self_attn\.k_proj\.weight"):
        _load(path, start=2)


# ---- (b) a renamed (unexpected) tensor ------------------------------------------------------------------------------

@pytest.mark.parametrize("old,new", [
    ("model.layers.2.self_attn.k_proj.weight", "model.layers.2.self_attn.key_proj.weight"),
    ("model.layers.0.mlp.experts.3.up_proj.weight", "model.layers.0.mlp.experts.8.up_proj.weight"),
    ("model.layers.1.mlp.gate.weight", "model.layers.9.mlp.gate.weight"),
    ("model.layers.1.ple.ple_embedding.ngram_embedding.shard_3.weight",
     "model.layers.1.ple.ple_embedding.ngram_embedding.shard_3.bias"),
])
def test_renamed_tensor_is_named_with_its_file(ref, tmp_path, old, new):
    _, tensors, config = ref
    tensors = dict(tensors)
    tensors[new] = tensors.pop(old)
    path = _write(tmp_path / "ckpt", tensors, config)
    with pytest.raises(CheckpointError) as err:
        _load(path)
    msg = str(err.value)
    assert new in msg and str(path / "model.safetensors") in msg, msg


def test_extra_ple_shard_is_named_with_its_file(ref, tmp_path):
    _, tensors, config = ref
    tensors = dict(tensors)
    prefix = "model.layers.1.ple.ple_embedding.ngram_embedding"
    tensors[f"{prefix}.shard_4.weight"] = tensors[f"{prefix}.shard_3.weight"].clone()
    path = _write(tmp_path / "ckpt", tensors, config)
    with pytest.raises(CheckpointError) as err:
        _load(path)
    msg = str(err.value)
    assert f"{prefix}.shard_4.weight" in msg and str(path / "model.safetensors") in msg, msg
    # Renumbering shard 3 as 4 leaves a gap: the missing shard is the one named.
    tensors[f"{prefix}.shard_4.weight"] = tensors.pop(f"{prefix}.shard_3.weight")
    path = _write(tmp_path / "ckpt2", tensors, config)
    with pytest.raises(CheckpointError, match=rf"{prefix}\.shard_3\.weight"):
        _load(path)


# ---- (c) a reshaped tensor ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,shape", [
    ("model.layers.2.self_attn.k_proj.weight", (16, 64)),
    ("model.layers.0.mlp.experts.3.down_proj.weight", (16, 32)),
    ("model.layers.4.self_attn.indexer.index_qk_proj.weight", (32, 144)),
    ("model.layers.0.linear_attn.conv1d.weight", (64, 4)),
])
def test_reshaped_tensor_names_file_and_shapes(ref, tmp_path, name, shape):
    _, tensors, config = ref
    tensors = dict(tensors)
    old = list(tensors[name].shape)
    tensors[name] = tensors[name].reshape(shape).contiguous()
    path = _write(tmp_path / "ckpt", tensors, config)
    with pytest.raises(CheckpointError) as err:
        _load(path)
    msg = str(err.value)
    assert name in msg and str(path / "model.safetensors") in msg, msg
    assert str(list(shape)) in msg and str(old) in msg, msg


def test_reshaped_ple_shard_names_tensor_and_file(ref, tmp_path):
    _, tensors, config = ref
    tensors = dict(tensors)
    name = "model.layers.1.ple.ple_embedding.ngram_embedding.shard_1.weight"
    old = tensors[name]
    tensors[name] = old.reshape(old.shape[0] // 2, old.shape[1] * 2).contiguous()
    path = _write(tmp_path / "ckpt", tensors, config)
    with pytest.raises(CheckpointError) as err:
        _load(path)
    msg = str(err.value)
    assert name in msg and str(path / "model.safetensors") in msg, msg
    assert str([old.shape[0] // 2, old.shape[1] * 2]) in msg and str(list(old.shape)) in msg, msg


def test_replaced_ple_shards_are_not_served_from_a_stale_expansion(ref, tmp_path):
    _, tensors, config = ref
    path = _write(tmp_path / "ckpt", dict(tensors), config)
    _load(path)                                          # expands ple_table.layer{0,1}.bin beside the checkpoint
    tensors = dict(tensors)
    for k in range(4):                                   # a new checkpoint written over the old one, same shapes
        name = f"model.layers.1.ple.ple_embedding.ngram_embedding.shard_{k}.weight"
        tensors[name] = tensors[name] * -3.0
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    fresh = _write(tmp_path / "fresh", tensors, config)
    want = _logits(_load(fresh))
    assert (_logits(_load(path)) - want).abs().max().item() < 1e-6


def test_duplicate_tensor_does_not_hide_a_missing_expert(ref, tmp_path):
    _, tensors, config = ref
    a = dict(tensors)
    del a["model.layers.0.mlp.experts.3.up_proj.weight"]
    b = {"model.layers.0.mlp.experts.2.up_proj.weight": tensors["model.layers.0.mlp.experts.2.up_proj.weight"]}
    path = _write(tmp_path / "ckpt", a, config, name="model-a.safetensors")
    _write(path, b, config, name="model-b.safetensors")
    # A duplicate is itself an error (named, with both files); it can no longer mask the missing expert.
    with pytest.raises(CheckpointError, match=r"experts\.2\.up_proj\.weight' appears twice"):
        _load(path)
    b_path = path / "model-b.safetensors"
    b_path.unlink()
    with pytest.raises(CheckpointError, match=r"experts\.3\.up_proj"):
        _load(path)


# ---- (d) sharded checkpoints ----------------------------------------------------------------------------------------

def _shard(dst: Path, tensors: dict, config: dict, files: int = 2) -> dict:
    """Round-robin the tensors over `files` files (splitting experts and PLE shards between files) plus the index."""
    names = sorted(tensors)
    fname = [f"model-{i + 1:05d}-of-{files:05d}.safetensors" for i in range(files)]
    weight_map = {n: fname[i % files] for i, n in enumerate(names)}
    for f in fname:
        _write(dst, {n: tensors[n] for n in names if weight_map[n] == f}, config, name=f)
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": weight_map}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return index


def test_sharded_checkpoint_gives_the_single_file_logits(ref, tmp_path, ref_logits):
    _, tensors, config = ref
    dst = tmp_path / "sharded"
    _shard(dst, tensors, config)
    assert not (dst / "model.safetensors").exists()
    assert torch.equal(_logits(_load(dst)), ref_logits)
    # Pipeline slices of a sharded checkpoint too.
    a, b = _load(dst, start=0, end=3), _load(dst, start=3)
    engine = LocalEngine([a, b], block_size=8)
    engine.add(0)
    got = torch.cat([engine.step([(0, PROMPT)], all_logits=True), engine.step([(0, [3])])])
    assert (got - ref_logits).abs().max().item() < 1e-6


def test_sharded_index_listing_a_missing_file(ref, tmp_path):
    _, tensors, config = ref
    dst = tmp_path / "sharded"
    index = _shard(dst, tensors, config, files=3)
    (dst / "model-00003-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model-00003-of-00003\.safetensors"):
        _load(dst)
    # One entry pointing at a file that was never written, the rest complete.
    dst = tmp_path / "sharded2"
    index = _shard(dst, tensors, config)
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "model-00009-of-00009.safetensors"
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model-00009-of-00009\.safetensors"):
        _load(dst)


def test_sharded_checkpoint_missing_tensor_is_named(ref, tmp_path):
    _, tensors, config = ref
    dst = tmp_path / "sharded"
    index = _shard(dst, tensors, config)
    name = "model.layers.2.self_attn.v_proj.weight"
    f = dst / index["weight_map"][name]
    part = load_file(f)
    del part[name]
    save_file(part, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.self_attn\.v_proj\.weight"):
        _load(dst)


# ---- released-style layout: text_config nesting and the model.language_model. prefix ------------------------------

@pytest.mark.parametrize("inner_model_type", [True, False])
def test_nested_config_and_language_model_prefix_load(ref, tmp_path, ref_logits, caplog, inner_model_type):
    _, tensors, config = ref
    text = dict(config)
    text.pop("architectures", None)
    if not inner_model_type:
        text.pop("model_type")
    outer = {"architectures": ["Qwen4ExpForConditionalGeneration"], "model_type": "qwen4_exp",
             "text_config": text, "vision_config": {"depth": 2, "hidden_size": 16}, "image_token_id": 151655,
             "tie_word_embeddings": False}
    renamed = {("model.language_model." + n[len("model."):] if n.startswith("model.") else n): t
               for n, t in tensors.items()}
    renamed["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(48, 16)
    assert any(n.startswith("model.language_model.layers.") for n in renamed)
    path = _write(tmp_path / "released", renamed, outer)
    with caplog.at_level(logging.INFO):
        model = _load(path)
    assert torch.equal(_logits(model), ref_logits)
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "vision_config" in logged and "image_token_id" in logged


# ---- config errors --------------------------------------------------------------------------------------------------

def _edit(config: dict, **changes) -> dict:
    out = json.loads(json.dumps(config))
    for k, v in changes.items():
        if v is _DROP:
            out.pop(k)
        else:
            out[k] = v
    return out


_DROP = object()


@pytest.mark.parametrize("field,changes", [
    ("num_key_value_heads", {"num_key_value_heads": 3}),
    ("ple_layer_ids", {"ple_layer_ids": [1, 3]}),                # layer 3 (1-indexed) is indexed attention
    ("ple_layer_ids", {"ple_layer_ids": [6]}),                   # past the last layer
    ("indexer_budget", {"indexer_budget": _DROP}),
    ("indexer_head_dim", {"indexer_head_dim": _DROP}),
    ("indexer_budget", {"indexer_budget": 10}),                  # not a multiple of the compress ratio
    ("hidden_size", {"hidden_size": "32"}),
    ("num_hidden_layers", {"num_hidden_layers": "5"}),
    ("indexer_budget", {"indexer_budget": "8"}),
    ("num_experts", {"num_experts": 8.0}),
    ("norm_topk_prob", {"norm_topk_prob": "yes"}),
    ("model_type", {"model_type": "llama"}),
    ("layer_types", {"layer_types": ["linear_attention"] * 4}),
    ("num_experts_per_tok", {"num_experts_per_tok": 9}),
    ("output_gate_type", {"output_gate_type": "gelu"}),
    ("hidden_size", {"hidden_size": True}),
])
def test_inconsistent_config_names_the_field(ref, field, changes):
    _, _, config = ref
    with pytest.raises(ConfigError) as err:
        config_from_dict(_edit(config, **changes))
    assert repr(field) in str(err.value) or field in str(err.value), str(err.value)


def test_inconsistent_qwen3_next_config_names_the_field(reference_checkpoints):
    config = json.loads((reference_checkpoints["qwen3_next"][0] / "config.json").read_text())
    with pytest.raises(ConfigError, match="mlp_only_layers"):
        config_from_dict(_edit(config, mlp_only_layers=[4]))
    with pytest.raises(ConfigError, match="linear_num_key_heads"):
        config_from_dict(_edit(config, linear_num_key_heads=3))


def test_a_ratio_3_checkpoint_loads_and_a_block_size_it_cannot_use_is_named(ref):
    """QSA ratio 3 is valid in transformers: the config loads, the engine derives 48-token blocks, and a cache
    asked for 16-token blocks says which sizes would work."""
    from shared.kv_layout import KvLayoutError
    from stage_worker.model.cache import AttentionCache, CacheSpec

    _, _, config = ref
    cfg = config_from_dict(_edit(config, indexer_compress_ratio=3, indexer_budget=9))
    assert cfg.indexer_compress_ratio == 3
    with pytest.raises(KvLayoutError, match=r"block_size 16 must be a multiple of indexer_compress_ratio 3.*use 48"):
        AttentionCache(cfg, CacheSpec(num_blocks=2, block_size=16, num_slots=1))
    assert AttentionCache(cfg, CacheSpec(num_blocks=2, block_size=48, num_slots=1)).pooled_keys.shape[0] == 32


def test_unknown_keys_are_accepted_with_one_log_record(ref, caplog):
    _, _, config = ref
    raw = _edit(config, foo_training_knob=0.5, bar_schedule="cosine")
    with caplog.at_level(logging.INFO, logger="shared.model_config"):
        cfg = config_from_dict(raw)
    assert cfg == config_from_dict(config)
    naming = [r for r in caplog.records if "foo_training_knob" in r.getMessage()]
    assert len(naming) == 1 and "bar_schedule" in naming[0].getMessage()
    assert len(caplog.records) == 1


def test_flat_vision_config_is_logged(ref, caplog):
    _, _, config = ref
    raw = _edit(config, vision_config={"depth": 2}, foo_training_knob=1)
    with caplog.at_level(logging.INFO, logger="shared.model_config"):
        cfg = config_from_dict(raw)
    assert cfg == config_from_dict(config)                      # accepted either way
    assert len(caplog.records) == 1
    assert "vision_config" in caplog.records[0].getMessage()


@pytest.mark.parametrize("index,why", [("{not json", "is not a safetensors index"),
                                       ('{"metadata": {}}', "is not a safetensors index"),
                                       ('{"weight_map": [1, 2]}', "is not a safetensors index")])
def test_a_broken_index_is_named(ref, tmp_path, index, why):
    """A malformed model.safetensors.index.json is a CheckpointError naming the file (was a JSONDecodeError or a
    KeyError traceback from `moepipe serve`)."""
    path, tensors, config = ref
    d = _write(tmp_path / "ck", tensors, config)
    (d / "model.safetensors.index.json").write_text(index)
    with pytest.raises(CheckpointError, match=f"model.safetensors.index.json {why}"):
        _load(d)


@pytest.mark.parametrize("qc,field", [
    ("fp8", "quantization_config must be an object"),
    ({"quant_method": "fp8", "weight_block_size": [0, 128]}, "weight_block_size"),
    ({"quant_method": "compressed-tensors", "config_groups": [{"targets": ["Linear"]}]}, "config_groups must map"),
    ({"quant_method": "compressed-tensors",
      "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": "four", "type": "int"}}}},
     "config_groups.g.weights.num_bits"),
])
def test_malformed_quantization_metadata_is_named(ref, tmp_path, qc, field):
    """Quantization metadata of the wrong shape names the field (were AttributeError / ZeroDivisionError /
    int() tracebacks)."""
    from shared.quant_scheme import QuantSchemeError, parse

    with pytest.raises(QuantSchemeError, match=field):
        parse({"quantization_config": qc})
