"""Cases tools/qa_checkpoint_fuzz.py found: random valid configs of the three families, written by transformers'
`save_pretrained`, that moepipe refused or computed differently. Each is compared with transformers in float32
(prefill log-probabilities and greedy decode, `assert_matches`), whole and split into stages."""

from __future__ import annotations

import pytest

from test_unseen_checkpoints import LIN, SMALL, assert_matches, written


def _all_linear(family: str, **kw):
    """Two linear-attention layers and no attention layer, attention heads of 3 features."""
    from transformers import Qwen4ExpTextConfig
    from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

    base = {**SMALL, "num_hidden_layers": 2, "layer_types": [LIN, LIN], "head_dim": 3, **kw}
    if family == "qwen4_exp":
        # no partial_rotary_factor: Qwen4-Exp's default 1.0 rotates all 3 features (4 rounded up to even)
        base["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
        return Qwen4ExpTextConfig(**base, hc_count=2, hc_lowrank=4, output_gate_type="sigmoid")
    return Qwen3_5MoeTextConfig(**base)


@pytest.mark.parametrize("family", ["qwen4_exp", "qwen3_5_moe"])
def test_rope_wider_than_head_without_attention_layers(family, tmp_path):
    """A model of linear-attention layers alone never rotates anything, so transformers builds and runs it whatever
    head_dim * partial_rotary_factor is. moepipe refused it ("config field 'partial_rotary_factor': head_dim * factor
    rounded up to even (4) must fit head_dim=3"); found by the fuzz at seed 2 (Qwen4-Exp, head_dim 3, its default
    factor 1.0, one linear layer). Attention layers still refuse it: transformers cannot run them either."""
    from shared.model_config import ConfigError, config_from_dict

    kw = {} if family == "qwen4_exp" else {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 1.0}}
    model = written(_all_linear(family, **kw), tmp_path)
    assert_matches(model, tmp_path, stages=(1, 2))
    raw = {**model.config.to_dict(), "layer_types": [LIN, "full_attention"]}
    with pytest.raises(ConfigError, match="config field 'partial_rotary_factor'"):
        config_from_dict(raw)
