"""Tiny random checkpoints written by `transformers` itself: the oracle every parity test compares against."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

# The oracle runs on the CPU. Where flash-linear-attention is installed (GPU machines), transformers would route its
# Gated DeltaNet through fla's Triton kernels, which cannot take CPU tensors: hide fla from it.
sys.modules.setdefault("fla", None)

ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
COMMON = dict(vocab_size=320, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
              moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=8, num_experts_per_tok=3,
              rope_parameters=ROPE, eos_token_id=5, rms_norm_eps=1e-6)


def qwen4_exp_config():
    from transformers import Qwen4ExpTextConfig

    return Qwen4ExpTextConfig(
        **COMMON, num_hidden_layers=5,
        layer_types=["linear_attention", "linear_attention", "indexed_attention", "linear_attention",
                     "indexed_attention"],
        hc_count=4, hc_lowrank=8, ple_layer_ids=[1, 2], ple_embed_dim=16, ngram_size=3, heads_per_ngram=2,
        ngram_vocab_size_base=50, make_ngram_vocab_size_divisible_by=8, split_ngram_parts=4,
        indexer_n_heads=8, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4,
        output_gate_type="sigmoid")


def qwen3_next_config():
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(**COMMON, num_hidden_layers=4, intermediate_size=40, mlp_only_layers=[1],
                           layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])


def qwen3_5_moe_config():
    from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(**COMMON, num_hidden_layers=4,
                                layer_types=["linear_attention", "linear_attention", "linear_attention",
                                             "full_attention"])


FAMILIES = {"qwen4_exp": qwen4_exp_config, "qwen3_next": qwen3_next_config, "qwen3_5_moe": qwen3_5_moe_config}


def _require_transformers() -> None:
    """The oracle is transformers >= 5.24 (pyproject.toml): older ones (the H200's image has 5.17) refuse Qwen4-Exp's
    layer types, so a test that needs the oracle is skipped there rather than failed."""
    import pytest
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version("5.24"):
        pytest.skip(f"transformers {transformers.__version__} < 5.24: no reference implementation to compare with")


def build_reference(family: str, seed: int = 0):
    """A transformers model with every weight random (norms and PLE conv too, which init leaves at 0 or 1)."""
    _require_transformers()
    return build_from_config(FAMILIES[family](), seed)


def build_from_config(cfg, seed: int = 0):
    """`build_reference` for any transformers config (tests/test_any_checkpoint.py writes odd-dimension ones)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg._attn_implementation = "eager"
    # Eager experts: the default grouped GEMM needs 16-byte strides, which odd expert widths do not have.
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager",
                                             experts_implementation="eager").float().eval()
    return randomize_flat_weights(model)


def randomize_flat_weights(model):
    """Norms, biases and conv kernels, which init leaves at 0 or 1, get random values too."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 or "conv1d" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def save_reference(family: str, out: Path, seed: int = 0):
    model = build_reference(family, seed)
    model.save_pretrained(out)
    return model


def reference_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
