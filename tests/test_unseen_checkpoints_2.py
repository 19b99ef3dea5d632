"""More checkpoints no test had seen (issue 13: any config transformers accepts must load and answer correctly).

Each case is a tiny random model built by transformers from a config that varies fields the other checkpoint tests
(test_any_checkpoint, test_unseen_checkpoints, test_checkpoint_variants_qa, test_parity) keep fixed, written by
`save_pretrained` (or a copy of it edited as real configs and files differ), loaded by moepipe and compared with
transformers at float32: prefill log-probabilities and greedy decode steps (`assert_matches`). Where transformers
runs a config moepipe cannot serve, the refusal must name the field and its value.

Qwen4-Exp cases use 8 QSA indexer heads: with 2, two blocks often both score exactly 0 (every head's ReLU is 0), and
then transformers' `torch.topk` and moepipe's documented lower-index rule may pick different blocks (docs/model.md,
section 5), which says nothing about the field under test.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest
import torch

from hf_oracle import _require_transformers, build_from_config, randomize_flat_weights
from test_checkpoint_variants_qa import edit_config, reread
from test_unseen_checkpoints import FULL, LIN, SMALL, assert_matches, qwen3_5_moe, qwen3_next, written

IDX = "indexed_attention"
QSA = dict(indexer_n_heads=8, indexer_kv_heads=1, indexer_head_dim=12, indexer_budget=8, indexer_compress_ratio=4)
PLE = dict(ple_layer_ids=[1, 2], ple_embed_dim=12, ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=37,
           make_ngram_vocab_size_divisible_by=8, split_ngram_parts=3)


def qwen4_exp(**kw):
    """Qwen4-Exp at test_unseen_checkpoints' SMALL sizes: 2 hyper-connection streams, QSA, PLE on layers 1-2."""
    from transformers import Qwen4ExpTextConfig

    return Qwen4ExpTextConfig(**{**SMALL, "num_hidden_layers": 3, "layer_types": [LIN, LIN, IDX], "hc_count": 2,
                                 "hc_lowrank": 4, "output_gate_type": "sigmoid", **QSA, **PLE, **kw})


MAKERS: dict[str, Callable] = {"qwen3_next": qwen3_next, "qwen3_5_moe": qwen3_5_moe, "qwen4_exp": qwen4_exp}
ALL = tuple(MAKERS)


def _for(family: str, kw: dict) -> dict:
    """A variant's fields for `family`: Qwen4-Exp spells attention layers indexed_attention and keeps PLE only on
    linear-attention layers (1-indexed ids)."""
    kw = dict(kw)
    if family == "qwen4_exp" and "layer_types" in kw:
        kw["layer_types"] = [IDX if t == FULL else t for t in kw["layer_types"]]
        kw["ple_layer_ids"] = [i + 1 for i, t in enumerate(kw["layer_types"]) if t == LIN][:2]
    return kw


def _rope(**kw) -> dict:
    return {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, **kw}


# (id, config fields, families, stage counts). None of these shapes is in another test file (those keep 2-3 K/V
# heads of 12-16, DeltaNet 2-3 key heads, conv kernel 4, 6-12 experts top-3, no biases, eps 1e-6, untied, ...).
VARIANTS: list[tuple[str, dict, tuple[str, ...], tuple[int, ...]]] = [
    ("head_dim_7", dict(head_dim=7), ALL, (1,)),                     # not hidden / heads, odd, 3 rotated -> 4
    ("one_kv_head", dict(num_key_value_heads=1), ALL, (1,)),         # MQA: all 6 query heads read one K/V head
    ("kv_heads_equal_heads", dict(num_key_value_heads=6), ("qwen3_next", "qwen4_exp"), (1,)),
    ("linear_1_key_5_value_heads", dict(linear_num_key_heads=1, linear_num_value_heads=5), ALL, (1,)),
    ("linear_heads_equal", dict(linear_num_key_heads=3, linear_num_value_heads=3), ALL, (1,)),
    ("linear_odd_head_dims", dict(linear_key_head_dim=5, linear_value_head_dim=7), ALL, (1,)),
    ("conv_kernel_1", dict(linear_conv_kernel_dim=1), ALL, (1,)),  # no conv state at all
    ("conv_kernel_2", dict(linear_conv_kernel_dim=2), ALL, (1,)),
    ("conv_kernel_5", dict(linear_conv_kernel_dim=5), ALL, (1,)),
    ("5_experts_top_1", dict(num_experts=5, num_experts_per_tok=1), ALL, (1,)),
    ("5_experts_top_5", dict(num_experts=5, num_experts_per_tok=5), ALL, (1,)),
    # top-1: Qwen4-Exp's MoE output is small beside its residual streams; at top-3 the weights' sum moved its
    # log-probabilities by less than the tolerance
    ("norm_topk_prob_false_top_1", dict(norm_topk_prob=False, num_experts_per_tok=1), ("qwen3_next", "qwen4_exp"),
     (1,)),
    ("attention_bias", dict(attention_bias=True), ALL, (1,)),
    ("rms_norm_eps_0.1", dict(rms_norm_eps=0.1), ALL, (1,)),
    ("tied_embeddings", dict(tie_word_embeddings=True), ALL, (1, 3)),
    ("vocab_137", dict(vocab_size=137), ALL, (1,)),
    ("positions_past_max_16", dict(max_position_embeddings=16), ALL, (1,)),    # 21 tokens: plain RoPE has no end
    ("all_attention", dict(layer_types=[FULL, FULL, FULL]), ALL, (1, 3)),
    ("all_linear", dict(layer_types=[LIN, LIN, LIN]), ALL, (1, 3)),
    ("attention_first", dict(layer_types=[FULL, LIN, LIN]), ALL, (1, 3)),
    ("one_layer", dict(num_hidden_layers=1, layer_types=[FULL]), ALL, (1,)),
    ("rope_whole_head_theta_500", dict(rope_parameters=_rope(rope_theta=500.0, partial_rotary_factor=1.0)), ALL,
     (1,)),
    ("rope_2_of_12_theta_1e6", dict(rope_parameters=_rope(rope_theta=1e6, partial_rotary_factor=0.2)), ALL, (1,)),
    # factor 0: transformers rotates nothing (no RoPE); moepipe refused it ('must be in (0, 1]')
    ("rope_factor_0", dict(rope_parameters=_rope(partial_rotary_factor=0.0)), ALL, (1,)),
    # Qwen3-Next's dense MLP layers mixed with MoE ones, by step and by list (step 5 > 3 layers: every layer dense)
    ("sparse_step_2", dict(decoder_sparse_step=2), ("qwen3_next",), (1, 3)),
    ("mlp_only_0_and_2", dict(mlp_only_layers=[0, 2]), ("qwen3_next",), (1,)),
    ("sparse_step_5", dict(decoder_sparse_step=5), ("qwen3_next",), (1,)),
    # Qwen4-Exp only: RoPE scalings with the QSA indexer (yarn was refused; see test_yarn_qsa_*), PLE and QSA shapes
    ("rope_linear", dict(rope_parameters=_rope(rope_type="linear", factor=3.0)), ("qwen4_exp",), (1,)),
    ("rope_dynamic", dict(rope_parameters=_rope(rope_type="dynamic", factor=2.0)), ("qwen4_exp",), (1,)),
    ("rope_llama3", dict(rope_parameters=_rope(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                               high_freq_factor=4.0, original_max_position_embeddings=8)),
     ("qwen4_exp",), (1,)),
    ("rope_yarn", dict(rope_parameters=_rope(rope_type="yarn", factor=4.0, original_max_position_embeddings=16)),
     ("qwen4_exp",), (1, 3)),
    ("rope_yarn_attention_factor_3", dict(rope_parameters=_rope(rope_type="yarn", factor=4.0, attention_factor=3.0,
                                                                original_max_position_embeddings=8),
                                          indexer_budget=4), ("qwen4_exp",), (1,)),
    ("rope_yarn_whole_head", dict(rope_parameters=_rope(rope_type="yarn", factor=32.0, partial_rotary_factor=1.0,
                                                        original_max_position_embeddings=8)), ("qwen4_exp",), (1,)),
    ("ple_conv_kernel_2", dict(ple_conv_kernel_size=2), ("qwen4_exp",), (1,)),
    ("ple_conv_kernel_5", dict(ple_conv_kernel_size=5), ("qwen4_exp",), (1,)),
    ("ple_bigrams", dict(ngram_size=2, heads_per_ngram=3), ("qwen4_exp",), (1,)),
    ("ple_4grams", dict(ngram_size=4, heads_per_ngram=2), ("qwen4_exp",), (1, 3)),
    ("ple_seed_7", dict(seed=7), ("qwen4_exp",), (1,)),
    ("ple_embed_dim_default", dict(ple_embed_dim=None, heads_per_ngram=3, split_ngram_parts=1), ("qwen4_exp",),
     (1,)),
    ("ple_vocab_divisible_by_1", dict(make_ngram_vocab_size_divisible_by=1), ("qwen4_exp",), (1,)),
    ("output_gate_silu", dict(output_gate_type="silu"), ("qwen4_exp",), (1,)),
    ("hc_3_streams_rank_1", dict(hc_count=3, hc_lowrank=1), ("qwen4_exp",), (1,)),
    ("qsa_ratio_1", dict(indexer_compress_ratio=1, indexer_budget=3), ("qwen4_exp",), (1,)),
    ("qsa_ratio_8", dict(indexer_compress_ratio=8, indexer_budget=8), ("qwen4_exp",), (1,)),
    ("qsa_5_heads_of_16", dict(indexer_head_dim=16, indexer_n_heads=5), ("qwen4_exp",), (1,)),
]
CASES = [pytest.param(f, kw, stages, id=f"{f}-{name}") for name, kw, fams, stages in VARIANTS for f in fams]


@pytest.mark.parametrize("family,kw,stages", CASES)
def test_config_variant_matches_transformers(family, kw, stages, tmp_path):
    model = written(MAKERS[family](**_for(family, kw)), tmp_path)
    assert_matches(model, tmp_path, stages=stages)


def test_dense_by_step_has_no_expert_tables(tmp_path):
    """decoder_sparse_step past the last layer: transformers builds dense MLPs everywhere though num_experts > 0."""
    from stage_worker.checkpoint.loader import LoadOptions, load_model

    model = written(qwen3_next(decoder_sparse_step=5), tmp_path)
    assert not any(hasattr(layer.mlp, "experts") for layer in model.model.layers)
    ours = load_model(tmp_path, LoadOptions(dtype=torch.float32))
    assert not any("experts" in name or "w13" in name for name, _ in ours.named_parameters())


# ---- checkpoint files and config.json as they come -----------------------------------------------------------------

def _save(family: str, path: Path, **save_kw):
    _require_transformers()
    model = build_from_config(MAKERS[family](), 0)
    model.save_pretrained(path, **save_kw)
    return model


def _rewrite(path: Path, edit: Callable[[dict], None]) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("family", ALL)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "mixed"])
def test_half_precision_files_read_at_float32(family, dtype, tmp_path):
    """Weights stored in bfloat16 / float16 (config dtype the same), or bfloat16 with A_log, dt_bias and the norms in
    float32 as some exporters keep them: moepipe loaded at float32 equals transformers reading the same files at
    float32."""
    model = build_from_config(MAKERS[family](), 0)
    half = "bfloat16" if dtype == "mixed" else dtype
    model.to(getattr(torch, half))
    model.config.dtype = half
    model.save_pretrained(tmp_path)
    if dtype == "mixed":
        def widen(t):
            for k in t:
                if k.endswith(("A_log", "dt_bias", "norm.weight", "layernorm.weight")):
                    t[k] = t[k].float()
        _rewrite(tmp_path, widen)
    ref = reread(tmp_path)          # bfloat16 / float16 values, then .float(): exact
    assert_matches(ref, tmp_path, stages=(1,))
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == half


@pytest.mark.parametrize("family", ALL)
def test_sharded_by_save_pretrained(family, tmp_path):
    """save_pretrained's own sharding (max_shard_size): many files and model.safetensors.index.json, experts and
    PLE shards of one layer in different files; whole and in three stages."""
    model = _save(family, tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(list(tmp_path.glob("*.safetensors"))) > 3
    assert_matches(model, tmp_path, stages=(1, 3))


@pytest.mark.parametrize("family", ALL)
def test_tensors_transformers_ignores(family, tmp_path):
    """mtp.* without any MTP key in config.json (Qwen3-Next's release has an MTP head its config does not
    declare), and a vision tower's model.visual.* beside a text-only config: transformers drops both."""
    _save(family, tmp_path)
    h = SMALL["hidden_size"]

    def add(t):
        t.update({"mtp.fc.weight": torch.randn(h, 2 * h), "mtp.norm.weight": torch.randn(h),
                  "mtp.pre_fc_norm_embedding.weight": torch.randn(h),
                  "mtp.layers.0.mlp.experts.0.gate_proj.weight": torch.randn(10, h),
                  "model.visual.blocks.0.attn.qkv.weight": torch.randn(48, 16),
                  "model.visual.patch_embed.proj.weight": torch.randn(16, 3, 2, 4, 4)})
    _rewrite(tmp_path, add)
    assert_matches(reread(tmp_path), tmp_path, stages=(1,))


@pytest.mark.parametrize("family", ALL)
@pytest.mark.parametrize("interval", [1, 2, None])
def test_layer_types_from_full_attention_interval(family, interval, tmp_path):
    """A config.json without layer_types (hand-written or older): both derive them from full_attention_interval
    (default 4); 1 makes every layer attention."""
    kw = {"layer_types": None, "num_hidden_layers": 4, "ple_layer_ids": [1]} if family == "qwen4_exp" else \
        {"layer_types": None, "num_hidden_layers": 4}
    if interval:
        kw["full_attention_interval"] = interval
    if family == "qwen4_exp" and interval == 1:
        kw["ple_layer_ids"] = []
    written(MAKERS[family](**kw), tmp_path)

    def drop(c):
        c.pop("layer_types")
        if interval:
            c["full_attention_interval"] = interval
    edit_config(tmp_path, drop)
    ref = reread(tmp_path)
    assert ref.config.layer_types[-1] != LIN and (interval != 1 or LIN not in ref.config.layer_types)
    assert_matches(ref, tmp_path, stages=(1,))


LEGACY = {
    "flat": dict(rope_theta=5e4, partial_rotary_factor=0.5),
    "flat_no_factor": dict(rope_theta=3e3, rope_scaling=None),
    "type_linear": dict(rope_theta=5e4, partial_rotary_factor=0.5, rope_scaling={"type": "linear", "factor": 2.0}),
    "type_yarn": dict(rope_theta=5e4, partial_rotary_factor=0.5,
                      rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
}


@pytest.mark.parametrize("family", ALL)
@pytest.mark.parametrize("legacy", list(LEGACY))
def test_transformers_4_rope_keys(family, legacy, tmp_path):
    """A config.json of transformers 4's shape: no rope_parameters, flat rope_theta / partial_rotary_factor, a
    rope_scaling spelled with `type` (or null). Without a flat factor the family's default applies (0.25, and the
    whole head for Qwen4-Exp)."""
    written(MAKERS[family](), tmp_path)
    edit_config(tmp_path, lambda c: (c.pop("rope_parameters"), c.update(LEGACY[legacy])))
    ref = reread(tmp_path)
    assert ref.config.rope_parameters["rope_theta"] == LEGACY[legacy]["rope_theta"]
    assert_matches(ref, tmp_path, stages=(1,))


def _qwen4_multimodal(path: Path, text_kw: dict | None = None, **top):
    """Qwen4-Exp's conditional-generation wrapper (text_config nested, model.language_model.*, a vision tower)."""
    from transformers import Qwen4ExpConfig, Qwen4ExpForConditionalGeneration

    _require_transformers()
    text = {**SMALL, "num_hidden_layers": 3, "layer_types": [LIN, LIN, IDX], "hc_count": 2, "hc_lowrank": 4,
            "output_gate_type": "sigmoid", **QSA, **PLE, **(text_kw or {})}
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=24, patch_size=4,
                  num_position_embeddings=16)
    torch.manual_seed(0)
    model = Qwen4ExpForConditionalGeneration._from_config(
        Qwen4ExpConfig(text_config=text, vision_config=vision, **top), attn_implementation="eager",
        experts_implementation="eager").float().eval()
    randomize_flat_weights(model)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("case", ["plain", "tied_top", "tied_text", "bfloat16_text"])
def test_qwen4_exp_multimodal_wrapper(case, tmp_path):
    """Qwen4ExpForConditionalGeneration's checkpoint (test_unseen_checkpoints has Qwen3.5-MoE's): the top level's
    tie_word_embeddings decides whether lm_head.weight is written; a text_config dtype is the checkpoint's."""
    from safetensors import safe_open

    text_kw = {"tie_word_embeddings": True} if case == "tied_text" else \
        {"dtype": "bfloat16"} if case == "bfloat16_text" else None
    model = _qwen4_multimodal(tmp_path, text_kw, **({"tie_word_embeddings": True} if case == "tied_top" else {}))
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert ("lm_head.weight" in names) == (case != "tied_top")
    assert any(n.startswith("model.visual.") for n in names)
    assert_matches(model, tmp_path, stages=(1, 3))


# ---- what moepipe refuses, and how --------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_zero_width_experts_are_refused_naming_the_field(family):
    """moe_intermediate_size 0 with experts: transformers computes zero-width experts (all output 0; its Qwen4-Exp
    config refuses it); moepipe's MoE kernels and expert tables do not, so the config is refused naming it."""
    from shared.model_config import ConfigError, config_from_dict

    _require_transformers()
    raw = MAKERS[family](moe_intermediate_size=0).to_dict()
    with pytest.raises(ConfigError, match=r"config field 'moe_intermediate_size': .* \(got 0\)"):
        config_from_dict(raw)


def test_pickled_weights_are_named_and_refused(tmp_path):
    """transformers still loads pytorch_model.bin; moepipe reads safetensors only, and said 'no *.safetensors
    files', as if the directory held no weights at all."""
    from safetensors.torch import load_file

    from shared.checkpoint_files import CheckpointError
    from stage_worker.checkpoint.loader import LoadOptions, load_model

    model = _save("qwen3_5_moe", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").unlink()
    torch.save(tensors, tmp_path / "pytorch_model.bin")
    assert torch.equal(reread(tmp_path).lm_head.weight, model.lm_head.weight)
    with pytest.raises(CheckpointError, match=r"PyTorch pickles \(pytorch_model\.bin\).*safetensors only"):
        load_model(tmp_path, LoadOptions(dtype=torch.float32))


# ---- YaRN with the QSA indexer -------------------------------------------------------------------------------------

def test_yarn_qsa_fused_decode_pools_keys_as_the_pytorch_path(monkeypatch):
    """YaRN with QSA was refused because the GPU kernel that pools the indexer's keys in decode rotates by inv_freq
    alone, without YaRN's cos/sin factor. It now takes the factor through the key norm's weight over the rotated
    features: one decode step that completes a compression block in every sequence, through the kernels (Triton's
    interpreter without a GPU), gives the PyTorch path's output and the same pooled keys for every complete block."""
    pytest.importorskip("triton")
    import dataclasses

    from stage_worker.model.attention import GatedAttention
    from stage_worker.model.batch import StepBatch
    from stage_worker.model.cache import AttentionCache, CacheSpec
    from stage_worker.model.rope import Rotary
    from test_kernel_attention_prep import _copy_of
    from test_kernel_decode_attention import DEVICE, paged_tables, tiny_config

    torch.manual_seed(3)
    cfg = dataclasses.replace(tiny_config(), rope_scaling={"rope_type": "yarn", "factor": 4.0, "attention_factor": 2.5,
                                                           "original_max_position_embeddings": 8})
    cfg.validate()
    assert cfg.rotary_dim < cfg.indexer_head_dim          # partial RoPE: the factor does not cancel in the scores
    rotary = Rotary(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, cfg.rope_dim)
    assert rotary.attention_scaling == 2.5
    attn = GatedAttention(cfg, True, rotary).eval().to(DEVICE)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    attn.prepare_kernels()
    bs, r, ctxs = 8, cfg.indexer_compress_ratio, [12, 24, 36]   # the decode token completes a block in each
    g = torch.Generator().manual_seed(5)
    num_blocks = sum(-(-c // bs) for c in ctxs) + 2
    tables = paged_tables(ctxs, bs, num_blocks, g)
    spec = CacheSpec(num_blocks=num_blocks, block_size=bs, num_slots=3, device=DEVICE)
    cache = AttentionCache(cfg, spec)
    with torch.no_grad():
        batch = StepBatch.build([(list(range(c - 1)), 0, i, tables[i]) for i, c in enumerate(ctxs)], bs,
                                device=DEVICE)
        x = torch.randn(batch.token_ids.shape[0], cfg.hidden_size, generator=g).to(DEVICE)
        attn(x, batch, cache, rotary.cos_sin(batch.positions, x.dtype))
        dec = StepBatch.build([([7], c - 1, i, tables[i]) for i, c in enumerate(ctxs)], bs, device=DEVICE)
        xd = torch.randn(3, cfg.hidden_size, generator=g).to(DEVICE)
        rope = rotary.cos_sin(dec.positions, x.dtype)
        twin = _copy_of(cache, cfg, spec)
        want = attn(xd, dec, cache, rope)                    # kernel flags off: the PyTorch path
        got = attn._decode_fused(xd, dec, twin, rope)
    rows = [(tables[i][t // bs] * bs + t % bs) // r for i, c in enumerate(ctxs) for t in range(0, c, r)]
    torch.testing.assert_close(twin.pooled_keys[rows], cache.pooled_keys[rows], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_yarn_qsa_served(tmp_path):
    """The refused class of checkpoint end to end: `moepipe serve` (one stage, the PLE service) on a Qwen4-Exp YaRN
    checkpoint with QSA gives transformers' logprobs for the echoed prompt and the greedy tokens."""
    from test_unseen_checkpoints import served_matches

    rope = _rope(rope_type="yarn", factor=4.0, attention_factor=1.7, original_max_position_embeddings=16)
    model = written(qwen4_exp(rope_parameters=rope, vocab_size=330, indexer_budget=4), tmp_path)
    served_matches(model, tmp_path, stages=1)
