"""Valid transformers checkpoints of shapes no preset has (issue 13's "any config transformers accepts"): each is
built by transformers, written by `save_pretrained`, loaded by moepipe whole and split into three stages, and must
give transformers' prefill log-probabilities (float32, 1e-4) and greedy tokens over a few decode steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hf_oracle import ROPE, _require_transformers, build_from_config, randomize_flat_weights, reference_logits
from shared.cluster_config import split_layers
from shared.model_config import load_config
from stage_worker.checkpoint.loader import LoadOptions, load_model
from stage_worker.local_engine import LocalEngine

LIN, FULL = "linear_attention", "full_attention"
SMALL = dict(vocab_size=150, hidden_size=24, num_attention_heads=6, num_key_value_heads=3, head_dim=12,
             linear_key_head_dim=8, linear_value_head_dim=6, linear_num_key_heads=3, linear_num_value_heads=6,
             moe_intermediate_size=10, shared_expert_intermediate_size=14, num_experts=6, num_experts_per_tok=3,
             rope_parameters=ROPE, eos_token_id=5, rms_norm_eps=1e-6, max_position_embeddings=256)
PROMPT = [40, 7, 100, 13, 5, 99, 101, 3, 17, 88, 61, 120, 45, 46, 47, 9, 2, 77]
NEW = 3
TOL = 1e-4


def qwen3_next(**kw):
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(**{**SMALL, "num_hidden_layers": 3, "intermediate_size": 20,
                              "layer_types": [LIN, FULL, LIN], **kw})


def qwen3_5_moe(**kw):
    from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(**{**SMALL, "num_hidden_layers": 3, "layer_types": [LIN, LIN, FULL], **kw})


def assert_matches(model, path: Path, stages=(1, 3), **opts) -> None:
    """moepipe's log-probabilities over the prompt and greedy continuation equal `model`'s, per stage count;
    `opts`: more LoadOptions (the loader's switches)."""
    ids = list(PROMPT)
    for _ in range(NEW):
        ids.append(int(reference_logits(model, ids)[-1].argmax()))
    want = torch.log_softmax(reference_logits(model, ids), -1)
    cfg = load_config(path)
    for n in stages:
        parts = [load_model(path, LoadOptions(start=s, end=e, dtype=torch.float32, **opts))
                 for s, e in split_layers(cfg.num_hidden_layers, n)]
        engine = LocalEngine(parts, max_seqs=1, max_tokens=64)
        engine.add(0)
        logits = engine.step([(0, PROMPT)], all_logits=True)
        got = [torch.log_softmax(logits, -1)]
        for tok in ids[len(PROMPT):-1]:
            logits = engine.step([(0, [tok])], all_logits=True)
            got.append(torch.log_softmax(logits, -1))
        got = torch.cat(got)
        assert got.shape == want[:-1].shape
        err = (got - want[:-1]).abs().max().item()
        assert err < TOL, f"{n} stage(s): max log-prob difference {err}"
        assert got[len(PROMPT) - 1:].argmax(-1).tolist() == ids[len(PROMPT):], f"{n} stage(s): greedy tokens differ"


def written(cfg, tmp_path: Path, seed: int = 0):
    _require_transformers()
    model = build_from_config(cfg, seed)
    model.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("make", [qwen3_next, qwen3_5_moe], ids=["qwen3_next", "qwen3_5_moe"])
def test_zero_width_shared_expert(make, tmp_path):
    """shared_expert_intermediate_size 0: transformers still writes a zero-width shared expert ([0, H] and [H, 0]
    weights) and its gate; the loader refused them as unexpected tensors."""
    model = written(make(shared_expert_intermediate_size=0), tmp_path)
    assert_matches(model, tmp_path)


def multimodal(text_kw: dict | None = None, **top):
    """A Qwen3.5-MoE release's shape: the conditional-generation wrapper (vision tower, `model.language_model.*`)."""
    from transformers.models.qwen3_5_moe import Qwen3_5MoeConfig

    text = {**SMALL, "num_hidden_layers": 3, "layer_types": [LIN, LIN, FULL], **(text_kw or {})}
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=24, patch_size=4,
                  num_position_embeddings=16)
    return Qwen3_5MoeConfig(text_config=text, vision_config=vision, **top)


def written_multimodal(cfg, tmp_path: Path):
    from transformers import Qwen3_5MoeForConditionalGeneration

    _require_transformers()
    torch.manual_seed(0)
    model = Qwen3_5MoeForConditionalGeneration._from_config(cfg, attn_implementation="eager",
                                                            experts_implementation="eager").float().eval()
    randomize_flat_weights(model)
    model.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("where", ["top", "text"])
def test_multimodal_wrapper_ties_by_its_top_level_flag(where, tmp_path):
    """The wrapper's own tie_word_embeddings decides: tied at the top level, save_pretrained writes no lm_head
    (moepipe said "missing lm_head.weight"); tied only in text_config, it writes one and does not tie (moepipe
    refused it as unexpected). The wrapper's top-level dtype is the checkpoint's when text_config has none."""
    cfg = multimodal(tie_word_embeddings=True) if where == "top" else multimodal({"tie_word_embeddings": True})
    model = written_multimodal(cfg, tmp_path)
    ours = load_config(tmp_path)
    assert ours.tie_word_embeddings == (where == "top")
    assert ours.dtype == "float32"
    assert_matches(model, tmp_path)


def test_qwen3_5_router_always_renormalises(tmp_path):
    """transformers' Qwen3.5-MoE router renormalises its top-k weights whatever `norm_topk_prob` says (the key is
    not its config's, yet a config.json may carry it); moepipe followed the key."""
    model = written(qwen3_5_moe(norm_topk_prob=False), tmp_path)
    assert_matches(model, tmp_path, stages=(1,))


def _rope(**kw) -> dict:
    return {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, **kw}


ROPES = {
    # head_dim 12 at transformers' default factor 0.25: 3 rotated features (odd), 2 frequencies over a width of 4
    "odd_rotary_dim": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "linear": dict(rope_parameters=_rope(rope_type="linear", factor=3.0)),
    "yarn": dict(rope_parameters=_rope(rope_type="yarn", factor=4.0, original_max_position_embeddings=16)),
    "yarn_from_max_positions": dict(rope_parameters=_rope(rope_type="yarn", factor=8.0, beta_fast=16, beta_slow=2,
                                                          truncate=False, mscale=1.0, mscale_all_dim=0.5)),
    "yarn_attention_factor": dict(rope_parameters=_rope(rope_type="yarn", factor=4.0, attention_factor=1.5,
                                                        original_max_position_embeddings=32)),
    "llama3": dict(rope_parameters=_rope(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                         original_max_position_embeddings=8)),
    "dynamic": dict(rope_parameters=_rope(rope_type="dynamic", factor=2.0)),
}


@pytest.mark.parametrize("rope", list(ROPES))
def test_rope_variants_transformers_computes(rope, tmp_path):
    """RoPE scalings transformers computes for these families (linear, yarn with its cos/sin factor, llama3; dynamic
    equals plain RoPE within max_position_embeddings) were refused as 'not supported yet'; an odd
    int(head_dim * factor) (head_dim 12 at the default 0.25) was refused as 'must be even'."""
    model = written(qwen3_next(**ROPES[rope]), tmp_path)
    assert_matches(model, tmp_path, stages=(3,))


def test_qwen3_5_yarn_with_mrope_sections(tmp_path):
    """Qwen3.5's interleaved multimodal RoPE with YaRN: for text it is YaRN on the plain positions."""
    rope = _rope(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, mrope_section=[1, 1, 1],
                 mrope_interleaved=True)
    model = written(qwen3_5_moe(rope_parameters=rope), tmp_path)
    assert_matches(model, tmp_path, stages=(1,))


def test_qwen3_5_five_heads_of_ten(tmp_path):
    """5 query and K/V heads of width 10 (not hidden / heads) at factor 0.5: int(10 * 0.5) = 5 rotated features,
    which transformers rotates as 3 pairs."""
    model = written(qwen3_5_moe(num_attention_heads=5, num_key_value_heads=5, head_dim=10), tmp_path)
    assert load_config(tmp_path).rotary_dim == 6
    assert_matches(model, tmp_path, stages=(1,))


@pytest.mark.parametrize("rope,field", [
    (_rope(rope_type="longrope", factor=4.0, short_factor=[1.0] * 3, long_factor=[2.0] * 3), "rope_type"),
    (_rope(rope_type="linear"), "factor"),
    (_rope(rope_type="llama3", factor=8.0, high_freq_factor=4.0), "low_freq_factor"),
])
def test_unsupported_rope_is_refused_naming_the_field(rope, field):
    from shared.model_config import ConfigError, config_from_dict

    raw = {"model_type": "qwen3_next", **SMALL, "num_hidden_layers": 3, "intermediate_size": 20,
           "layer_types": [LIN, FULL, LIN], "rope_parameters": rope}
    with pytest.raises(ConfigError, match=rf"rope_parameters\.{field}"):
        config_from_dict(raw)


@pytest.mark.parametrize("key,value,field", [
    ("text_config", "qwen3_next", "text_config"),             # was an AttributeError from the quantization reader
    ("rope_parameters", "default", "rope_parameters"),        # was "dictionary update sequence element #0 ..."
    ("eos_token_id", "5", "eos_token_id"),                    # was read as the list ['5']
    ("eos_token_id", [5, "6"], "eos_token_id"),
])
def test_malformed_config_values_name_the_field(key, value, field):
    from shared.model_config import ConfigError, config_from_dict

    raw = {"model_type": "qwen3_next", **SMALL, "num_hidden_layers": 3, "intermediate_size": 20,
           "layer_types": [LIN, FULL, LIN], key: value}
    with pytest.raises(ConfigError, match=rf"config field '{field}'"):
        config_from_dict(raw)


def test_zero_full_attention_interval_names_the_field():
    from shared.model_config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match="config field 'full_attention_interval'"):    # was ZeroDivisionError
        config_from_dict({"model_type": "qwen3_5_moe_text", **SMALL, "num_hidden_layers": 3,
                          "full_attention_interval": 0})


def test_unreadable_weight_file_is_a_checkpoint_error_naming_it(tmp_path):
    """A truncated or foreign file among the weights: a CheckpointError naming the file (was safetensors' bare
    'Error while deserializing header' with no file name)."""
    from shared.checkpoint_files import CheckpointError

    written(qwen3_5_moe(), tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors file"):
        load_model(tmp_path, LoadOptions(dtype=torch.float32))


def served_matches(model, path: Path, stages: int) -> None:
    """`moepipe serve --stages N` on `path` (a byte-level tokenizer added): the echoed prompt's and greedy tokens'
    logprobs equal transformers'."""
    from conftest import OpenAI, free_port
    from gateway.launcher import Cluster, ServeOptions
    from stage_worker.checkpoint.tokenizer_files import write_tokenizer_files

    write_tokenizer_files(path, vocab_size=model.config.vocab_size, model_max_length=256)
    ids = list(PROMPT)
    for _ in range(NEW):
        ids.append(int(reference_logits(model, ids)[-1].argmax()))
    lp = torch.log_softmax(reference_logits(model, ids), -1)
    want = [float(lp[i - 1, ids[i]]) for i in range(1, len(ids))]
    with Cluster(ServeOptions(model=path, stages=stages, port=free_port(), extra={"max_num_batched_tokens": 32})) as c:
        res = OpenAI(base_url=c.url + "/v1", api_key="x").completions.create(
            model="moepipe", prompt=PROMPT, max_tokens=NEW, temperature=0, echo=True, logprobs=1,
            extra_body={"ignore_eos": True})
    got = res.choices[0].logprobs.token_logprobs
    assert len(got) == len(ids) and got[0] is None
    assert max(abs(a - b) for a, b in zip(got[1:], want)) < TOL


def test_qwen3_next_without_experts_is_all_dense(tmp_path):
    """num_experts 0: transformers makes every layer a dense MLP (intermediate_size wide); moepipe refused the
    config ('num_experts must be a positive integer'). In-process at 1 and 3 stages, and served by 2."""
    model = written(qwen3_next(num_experts=0, vocab_size=330), tmp_path)
    assert not any(hasattr(layer.mlp, "experts") for layer in model.model.layers)
    cfg = load_config(tmp_path)
    assert not cfg.has_sparse_moe
    assert_matches(model, tmp_path)
    served_matches(model, tmp_path, stages=2)


def test_dense_qwen3_next_keys_transformers_never_reads():
    """With num_experts 0 transformers never asks decoder_sparse_step (0 does not divide) nor the expert sizes; with
    experts, a zero step or a zero expert count for a sparse layer is still refused naming the field."""
    from shared.model_config import ConfigError, config_from_dict

    raw = {"model_type": "qwen3_next", **SMALL, "num_hidden_layers": 3, "intermediate_size": 20,
           "layer_types": [LIN, FULL, LIN]}
    cfg = config_from_dict({**raw, "num_experts": 0, "decoder_sparse_step": 0, "moe_intermediate_size": 0,
                            "num_experts_per_tok": 0})
    assert [cfg.is_sparse_moe(i) for i in range(3)] == [False] * 3
    assert config_from_dict({**raw, "decoder_sparse_step": 0, "mlp_only_layers": [0, 1, 2]}).has_sparse_moe is False
    with pytest.raises(ConfigError, match="config field 'decoder_sparse_step'"):
        config_from_dict({**raw, "decoder_sparse_step": 0})
    with pytest.raises(ConfigError, match="config field 'num_experts_per_tok'"):
        config_from_dict({**raw, "num_experts_per_tok": 7})
    for family in ("qwen3_5_moe_text", "qwen4_exp_text"):     # no dense layers there: every layer routes
        with pytest.raises(ConfigError, match="config field 'num_experts': must be a positive integer"):
            config_from_dict({**raw, "model_type": family, "num_experts": 0})


def test_swish_is_silu(tmp_path):
    """hidden_act "swish" is transformers' ACT2FN alias of silu (experts, MLPs, the DeltaNet conv); moepipe refused
    it as 'only silu is supported'."""
    model = written(qwen3_next(hidden_act="swish", mlp_only_layers=[1]), tmp_path)
    assert_matches(model, tmp_path, stages=(1,))


def test_qwen4_exp_swish_hidden_act(tmp_path):
    """Qwen4-Exp with hidden_act "swish" and a sigmoid output gate matches transformers; with no output_gate_type
    the gate takes hidden_act, which transformers' Qwen4-Exp config refuses unless sigmoid or silu: so does moepipe,
    naming the field."""
    from transformers import Qwen4ExpTextConfig

    from shared.model_config import ConfigError, config_from_dict

    cfg = Qwen4ExpTextConfig(**{**SMALL, "num_hidden_layers": 3, "layer_types": [LIN, LIN, "indexed_attention"],
                                "hidden_act": "swish", "output_gate_type": "sigmoid", "hc_count": 2, "hc_lowrank": 4,
                                "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 12,
                                "indexer_budget": 8, "indexer_compress_ratio": 4})
    model = written(cfg, tmp_path)
    assert_matches(model, tmp_path, stages=(1,))
    raw = {"model_type": "qwen4_exp_text", **SMALL, "num_hidden_layers": 3, "layer_types": [LIN, LIN, FULL],
           "hidden_act": "swish"}
    with pytest.raises(ConfigError, match="config field 'output_gate_type'"):
        config_from_dict(raw)


def test_stage_worker_refusing_a_checkpoint_prints_one_line(tmp_path, monkeypatch, capsys):
    """A stage that cannot load the checkpoint (a CheckpointError or ConfigError naming the problem) prints that
    message as one line and exits 2; it printed a whole traceback (twice, with the chained safetensors error).
    Anything unexpected still raises, traceback and all."""
    from shared.cluster_config import ClusterConfig, StageSpec
    from stage_worker import main as worker

    written(qwen3_5_moe(), tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    capsys.readouterr()
    cluster = ClusterConfig(model=str(tmp_path), gateway_endpoint="ipc:///nonexistent",
                            stages=[StageSpec(0, 3, "ipc:///nonexistent-stage0", "cpu")])
    assert worker.serve(cluster, 0) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"stage_worker: stage0: {weights}: not a readable safetensors file "
                                        "(Error while deserializing header: invalid header length)"]
    config = tmp_path / "config.json"
    config.write_text(config.read_text().replace('"hidden_act": "silu"', '"hidden_act": "prelu"'))
    assert worker.serve(cluster, 0) == 2
    assert "config field 'hidden_act'" in capsys.readouterr().err

    def broken(*_):
        raise RuntimeError("not a refusal")

    config.write_text(config.read_text().replace('"hidden_act": "prelu"', '"hidden_act": "silu"'))
    monkeypatch.setattr(worker, "load_stage", broken)
    with pytest.raises(RuntimeError, match="not a refusal"):
        worker.serve(cluster, 0)


@pytest.mark.parametrize("eos", [[5, 7], 9])
def test_no_generation_config_stops_on_config_eos(eos, tmp_path):
    """A checkpoint without generation_config.json: transformers' generation stops on config.json's eos_token_id
    (GenerationConfig.from_model_config); moepipe stopped only on the tokenizer's eos_token."""
    from transformers import AutoConfig, GenerationConfig

    from shared.tokenizer import Tokenizer
    from stage_worker.checkpoint.tokenizer_files import write_tokenizer_files

    written(qwen3_next(vocab_size=330, eos_token_id=eos), tmp_path)
    (tmp_path / "generation_config.json").unlink(missing_ok=True)
    write_tokenizer_files(tmp_path, vocab_size=330, model_max_length=256)
    want = GenerationConfig.from_model_config(AutoConfig.from_pretrained(tmp_path)).eos_token_id
    tok = Tokenizer.from_dir(tmp_path)
    assert set([want] if isinstance(want, int) else want) < set(tok.eos_token_ids)
    assert tok.token_to_id("<|im_end|>") in tok.eos_token_ids


@pytest.mark.parametrize("extra", ["additional_special_tokens", "extra_special_tokens", "named"])
def test_tokens_only_tokenizer_config_declares(extra, tmp_path):
    """Tokens tokenizer_config.json declares but tokenizer.json lacks (added_tokens_decoder entries, a named special
    token, additional / extra special tokens): transformers adds them at the next free ids; moepipe encoded their
    text byte by byte."""
    import json

    from transformers import AutoTokenizer

    from shared.tokenizer import Tokenizer
    from stage_worker.checkpoint.tokenizer_files import write_tokenizer_files

    write_tokenizer_files(tmp_path, vocab_size=330, model_max_length=256)
    path = tmp_path / "tokenizer_config.json"
    config = json.loads(path.read_text())
    entry = dict(lstrip=False, normalized=False, rstrip=False, single_word=False)
    config["added_tokens_decoder"]["341"] = {**entry, "content": "<|plain|>", "special": False}
    config["added_tokens_decoder"]["340"] = {**entry, "content": "<|tool|>", "special": True}
    config["eos_token"] = "<|stop|>"
    listed = config.pop("additional_special_tokens") + ["<|extra|>"]
    config[extra if extra != "named" else "extra_special_tokens"] = (
        listed if extra != "named" else {"image_token": "<|extra|>"})
    path.write_text(json.dumps(config))
    hf, ours = AutoTokenizer.from_pretrained(tmp_path), Tokenizer.from_dir(tmp_path)
    text = "a<|tool|>b<|plain|>c<|stop|><|extra|><|im_end|>"
    assert ours.encode(text) == hf.encode(text, add_special_tokens=False)
    assert ours.vocab_size == len(hf) == 334
    ids = ours.encode(text)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert hf.eos_token_id in ours.eos_token_ids


@pytest.mark.parametrize("where", ["tokenizer_config", "additional_chat_templates"])
def test_named_chat_templates_pick_tool_use_for_tools(where, tmp_path):
    """Named chat templates (a list in tokenizer_config.json, or chat_template.jinja beside
    additional_chat_templates/*.jinja): transformers renders `tool_use` when tools are given, else `default`;
    moepipe always rendered `default` (and read no additional_chat_templates)."""
    import json

    from transformers import AutoTokenizer

    from shared.tokenizer import Tokenizer
    from stage_worker.checkpoint.tokenizer_files import write_tokenizer_files

    write_tokenizer_files(tmp_path, vocab_size=330, model_max_length=256)
    path = tmp_path / "tokenizer_config.json"
    config = json.loads(path.read_text())
    default = config.pop("chat_template")
    tool_use = "TOOLS {{ tools | length }}:{% for m in messages %}{{ m['content'] }}{% endfor %}"
    if where == "tokenizer_config":
        config["chat_template"] = [{"name": "default", "template": default}, {"name": "tool_use", "template": tool_use}]
    else:
        (tmp_path / "chat_template.jinja").write_text(default)
        (tmp_path / "additional_chat_templates").mkdir()
        (tmp_path / "additional_chat_templates" / "tool_use.jinja").write_text(tool_use)
    path.write_text(json.dumps(config))
    hf, ours = AutoTokenizer.from_pretrained(tmp_path), Tokenizer.from_dir(tmp_path)
    messages = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for kw in ({}, {"tools": tools}):
        want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
        assert ours.apply_chat_template(messages, add_generation_prompt=True, **kw) == want
    assert ours.apply_chat_template(messages, tools=tools) == "TOOLS 1:hi"


@pytest.mark.parametrize("act", ["gelu_pytorch_tanh", "relu2"])
def test_other_hidden_acts_match_transformers(act, tmp_path):
    """hidden_act is any of transformers' parameter-free activations (the MLPs, the experts, the DeltaNet short
    conv): moepipe refused everything but silu."""
    model = written(qwen3_next(hidden_act=act, mlp_only_layers=[1]), tmp_path)
    assert_matches(model, tmp_path, stages=(1, 3))


def test_several_mtp_layers_are_served_without_them(tmp_path):
    """mtp_num_hidden_layers 2: transformers builds the model and ignores mtp.*; serving never runs the MTP head,
    so moepipe serves it too (it refused any count but 0 or 1)."""
    model = written(qwen3_5_moe(mtp_num_hidden_layers=2), tmp_path)
    assert_matches(model, tmp_path, stages=(1,))
