"""Model configuration for the three supported families, read from a Hugging Face `config.json`.

One dataclass per family. Field names and defaults follow `transformers`' own config classes (`qwen4_exp`,
`qwen3_next`, `qwen3_5_moe`), because checkpoints are written by that code: a field we name differently is a field we
silently lose. Unknown keys (vision tower, training knobs) are ignored with one log line; known keys with inconsistent
values are rejected with a `ConfigError` naming the field.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

log = logging.getLogger(__name__)

LINEAR = "linear_attention"
FULL = "full_attention"
INDEXED = "indexed_attention"
# transformers' ACT2FN names without parameters of their own (prelu and xielu have weights no checkpoint carries for
# hidden_act): what `hidden_act` and Qwen4-Exp's `output_gate_type` may be; stage_worker/model/activations.py
ACTIVATIONS = frozenset({
    "silu", "swish", "gelu", "gelu_python", "gelu_10", "gelu_new", "gelu_accurate", "gelu_pytorch_tanh",
    "gelu_python_tanh", "gelu_fast", "quick_gelu", "laplace", "hardswish", "leaky_relu", "linear", "mish", "relu",
    "relu2", "relu6", "sigmoid", "sqrtsoftplus", "tanh"})


class ConfigError(ValueError):
    """A config.json value that moepipe cannot serve; the message names the field."""


# Keys that are present in real configs and carry nothing the inference path needs.
_IGNORED_KEYS = {
    "architectures", "model_type", "dtype", "torch_dtype", "transformers_version", "use_cache", "initializer_range",
    "output_router_logits", "router_aux_loss_coef", "attention_dropout", "number_of_conv_states", "_name_or_path",
    "full_attention_interval", "base_config_key", "rope_scaling", "rope_theta", "partial_rotary_factor",
    "mrope_section", "mrope_interleaved", "use_sliding_window", "sliding_window", "max_window_layers",
    "tie_word_embeddings", "id2label", "label2id", "return_dict", "output_hidden_states", "output_attentions",
    "is_encoder_decoder", "problem_type", "chunk_size_feed_forward", "pruned_heads", "tokenizer_class",
}


@dataclass
class HybridMoeConfig:
    """Fields shared by every family: Gated DeltaNet + gated full attention + sparse MoE with a shared expert."""

    family: ClassVar[str] = ""
    vocab_size: int = 248320
    hidden_size: int = 2048
    num_hidden_layers: int = 40
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 256
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    # RoPE scaling, from rope_parameters: {} for plain RoPE, else rope_type and its parameters (factor, ...)
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_experts: int = 512
    num_experts_per_tok: int = 10
    norm_topk_prob: bool = True
    layer_types: list[str] = field(default_factory=list)
    eos_token_id: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    mtp_num_hidden_layers: int = 0
    dtype: str = "bfloat16"

    # ---- derived -------------------------------------------------------------------------------------------------
    @property
    def rope_dim(self) -> int:
        """transformers' `dim`: int(head_dim * partial_rotary_factor), the exponent's divisor."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def rotary_dim(self) -> int:
        """Features rotated: rope_dim rounded up to even (an odd rope_dim still gives ceil(rope_dim / 2)
        frequencies, each rotating a pair)."""
        return self.rope_dim + self.rope_dim % 2

    @property
    def uses_hyper_connections(self) -> bool:
        return False

    @property
    def attention_layer_type(self) -> str:
        return FULL

    def is_attention(self, layer: int) -> bool:
        return self.layer_types[layer] != LINEAR

    def is_sparse_moe(self, layer: int) -> bool:
        return True

    @property
    def has_sparse_moe(self) -> bool:
        """Whether any layer routes to experts (a Qwen3-Next config with num_experts 0 is all dense MLPs)."""
        return any(self.is_sparse_moe(i) for i in range(self.num_hidden_layers))

    @property
    def primary_eos(self) -> int | None:
        return self.eos_token_id[0] if self.eos_token_id else None

    # ---- validation ----------------------------------------------------------------------------------------------
    def validate(self) -> None:
        def need(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise ConfigError(f"config field {name!r}: {why} (got {getattr(self, name, None)!r})")

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                     "linear_num_value_heads", "linear_conv_kernel_dim"):
            need(isinstance(getattr(self, name), int) and getattr(self, name) > 0, name, "must be a positive integer")
        if self.has_sparse_moe:
            for name in ("moe_intermediate_size", "num_experts"):
                need(getattr(self, name) > 0, name, "must be a positive integer")
            need(0 < self.num_experts_per_tok <= self.num_experts, "num_experts_per_tok",
                 "must be in [1, num_experts]")
        need(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
             "must divide num_attention_heads")
        need(self.linear_num_value_heads % self.linear_num_key_heads == 0, "linear_num_key_heads",
             "must divide linear_num_value_heads")
        need(self.shared_expert_intermediate_size >= 0, "shared_expert_intermediate_size", "must be >= 0")
        # 0 (or a factor with int(head_dim * factor) = 0) rotates nothing, as in transformers: no RoPE at all
        need(0.0 <= self.partial_rotary_factor <= 1.0, "partial_rotary_factor", "must be in [0, 1]")
        # only attention rotates: a model of linear-attention layers alone runs whatever the factor (transformers
        # builds and runs it; an odd head_dim at Qwen4-Exp's default 1.0 was refused)
        need(self.rotary_dim <= self.head_dim or all(t == LINEAR for t in self.layer_types),
             "partial_rotary_factor",
             f"head_dim * factor rounded up to even ({self.rotary_dim}) must fit head_dim={self.head_dim}")
        need(len(self.layer_types) == self.num_hidden_layers, "layer_types",
             f"must have num_hidden_layers={self.num_hidden_layers} entries")
        allowed = {LINEAR, self.attention_layer_type}
        bad = sorted(set(self.layer_types) - allowed)
        need(not bad, "layer_types", f"{self.family} supports only {sorted(allowed)}, not {bad}")
        # experts, MLPs and the DeltaNet short conv use it (stage_worker/model/activations.py computes each name)
        need(self.hidden_act in ACTIVATIONS, "hidden_act",
             f"must be one of transformers' parameter-free activations {sorted(ACTIVATIONS)}")
        need(self.mtp_num_hidden_layers >= 0, "mtp_num_hidden_layers", "must be >= 0")
        need(self.dtype in ("float32", "bfloat16", "float16"), "dtype", "must be float32, bfloat16 or float16")

    @property
    def longest_context(self) -> int:
        """The longest sequence this config serves as transformers computes it (vLLM's derived max_model_len):
        max_position_embeddings, times the factor for linear scaling, original_max_position_embeddings times the
        factor for YaRN (both are position-independent, so exact at any length). Not past max_position_embeddings
        for dynamic NTK: transformers rescales there by the sequence length, which moepipe does not compute."""
        kind = self.rope_scaling.get("rope_type")
        if kind == "linear":
            return int(self.max_position_embeddings * self.rope_scaling["factor"])
        if kind == "yarn":
            return max(self.max_position_embeddings,
                       int(self.rope_scaling["original_max_position_embeddings"] * self.rope_scaling["factor"]))
        return self.max_position_embeddings

    # ---- construction --------------------------------------------------------------------------------------------
    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def to_dict(self) -> dict[str, Any]:
        """The config.json text config that `transformers` reads back into the same model."""
        out = dataclasses.asdict(self)
        out["rope_parameters"] = {"rope_type": "default", **out.pop("rope_scaling"),
                                  "rope_theta": out.pop("rope_theta"),
                                  "partial_rotary_factor": out.pop("partial_rotary_factor")}
        out["eos_token_id"] = self.eos_token_id[0] if len(self.eos_token_id) == 1 else list(self.eos_token_id)
        out["model_type"] = MODEL_TYPES[self.family]
        out["architectures"] = [ARCHITECTURES[self.family]]
        if not self.mtp_num_hidden_layers:
            out.pop("mtp_num_hidden_layers")
        return out


@dataclass
class Qwen3NextConfig(HybridMoeConfig):
    """Qwen3-Next: plain residual, grouped qkvz/ba projections on disk, optional dense-MLP layers."""

    family: ClassVar[str] = "qwen3_next"
    vocab_size: int = 151936
    num_hidden_layers: int = 48
    intermediate_size: int = 5632
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    def is_sparse_moe(self, layer: int) -> bool:
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)

    def validate(self) -> None:
        # Before is_sparse_moe divides by it; as in transformers, only a layer it is asked about divides (num_experts
        # 0 and mlp_only_layers decide first).
        if self.decoder_sparse_step == 0 and self.num_experts > 0 and not set(range(self.num_hidden_layers)) <= set(
                self.mlp_only_layers):
            raise ConfigError("config field 'decoder_sparse_step': must not be 0 while a layer may be sparse (got 0)")
        super().validate()
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ConfigError(f"config field 'mlp_only_layers': layer indices out of range: {bad}")


@dataclass
class Qwen35MoeConfig(HybridMoeConfig):
    """Qwen3.5-MoE text model: plain residual, separate qkv/z/b/a projections."""

    family: ClassVar[str] = "qwen3_5_moe"
    num_experts: int = 256
    num_experts_per_tok: int = 8


@dataclass
class Qwen4ExpConfig(HybridMoeConfig):
    """Qwen4-Exp: hyper-connections, QSA indexed attention, the n-gram PLE branch."""

    family: ClassVar[str] = "qwen4_exp"
    # transformers' Qwen4-Exp config skips Qwen3.5's 0.25 default: without a factor in config.json RoPE spans
    # the whole head.
    partial_rotary_factor: float = 1.0
    hc_count: int = 4
    hc_lowrank: int = 320
    ple_layer_ids: list[int] = field(default_factory=list)
    ple_embed_dim: int | None = None
    ple_conv_kernel_size: int = 4
    ngram_size: int = 3
    heads_per_ngram: int = 8
    ngram_vocab_size_base: int = 20_000_000
    make_ngram_vocab_size_divisible_by: int = 128
    seed: int = 1234
    split_ngram_parts: int = 512
    indexer_n_heads: int | None = None
    indexer_kv_heads: int | None = None
    indexer_head_dim: int | None = None
    indexer_budget: int | None = None
    indexer_compress_ratio: int | None = None
    output_gate_type: str | None = None

    @property
    def uses_hyper_connections(self) -> bool:
        return True

    @property
    def attention_layer_type(self) -> str:
        return INDEXED

    @property
    def has_qsa(self) -> bool:
        return self.indexer_n_heads is not None

    @property
    def ple_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def ple_head_dim(self) -> int:
        return (self.ple_embed_dim or self.hidden_size) // self.ple_heads

    def ple_index(self, layer: int) -> int | None:
        """Position of 0-indexed `layer` in `ple_layer_ids` (which are 1-indexed), or None."""
        return self.ple_layer_ids.index(layer + 1) if layer + 1 in self.ple_layer_ids else None

    @property
    def gate_activation(self) -> str:
        return self.output_gate_type or self.hidden_act

    def validate(self) -> None:
        super().validate()

        def fail(name: str, why: str) -> None:
            raise ConfigError(f"config field {name!r}: {why} (got {getattr(self, name)!r})")

        if self.hc_count <= 1:
            fail("hc_count", "Qwen4-Exp needs more than one residual stream")
        if self.hc_lowrank <= 0:
            fail("hc_lowrank", "must be positive")
        if self.gate_activation not in ("sigmoid", "silu"):     # transformers' Qwen4-Exp config refuses others
            fail("output_gate_type", "must be sigmoid or silu")
        qsa = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")
        given = [n for n in qsa if getattr(self, n) is not None]
        if given:
            for n in qsa:
                if getattr(self, n) is None:
                    fail(n, f"QSA needs all of {list(qsa)} once any is set")
                if getattr(self, n) <= 0:
                    fail(n, "must be positive")
            if self.indexer_kv_heads != 1:
                fail("indexer_kv_heads", "Qwen4-Exp QSA has exactly one indexer key head")
            if self.indexer_budget % self.indexer_compress_ratio:
                fail("indexer_budget", "must be divisible by indexer_compress_ratio")
            if self.rotary_dim > self.indexer_head_dim:
                fail("indexer_head_dim", f"must hold the RoPE dimensions ({self.rotary_dim})")
        if self.ple_layer_ids:
            dim = self.ple_embed_dim
            if self.ple_heads <= 0 or dim is None or dim <= 0 or dim % self.ple_heads:
                fail("ple_embed_dim", f"must be a positive multiple of the {self.ple_heads} n-gram heads")
            bad = [i for i in self.ple_layer_ids if not 1 <= i <= self.num_hidden_layers]
            if bad:
                fail("ple_layer_ids", f"ids are 1-indexed layers in [1, {self.num_hidden_layers}]; bad: {bad}")
            bad = [i for i in self.ple_layer_ids if self.layer_types[i - 1] != LINEAR]
            if bad:
                fail("ple_layer_ids", f"PLE sits only on linear_attention layers; bad: {bad}")
            if not self.eos_token_id:
                fail("eos_token_id", "PLE needs an EOS id (its hash resets at EOS)")
            if self.split_ngram_parts <= 0:
                fail("split_ngram_parts", "must be positive")

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        if not self.has_qsa:
            for n in ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget",
                      "indexer_compress_ratio"):
                out.pop(n)
        return out


FAMILIES: dict[str, type[HybridMoeConfig]] = {
    "qwen4_exp": Qwen4ExpConfig, "qwen4_exp_text": Qwen4ExpConfig,
    "qwen3_next": Qwen3NextConfig,
    "qwen3_5_moe": Qwen35MoeConfig, "qwen3_5_moe_text": Qwen35MoeConfig,
}
MODEL_TYPES = {"qwen4_exp": "qwen4_exp_text", "qwen3_next": "qwen3_next", "qwen3_5_moe": "qwen3_5_moe_text"}
ARCHITECTURES = {"qwen4_exp": "Qwen4ExpForCausalLM", "qwen3_next": "Qwen3NextForCausalLM",
                 "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}


def _default_layer_types(cls: type[HybridMoeConfig], n: int, interval: int) -> list[str]:
    attn = INDEXED if cls is Qwen4ExpConfig else FULL
    return [LINEAR if (i + 1) % interval else attn for i in range(n)]


def config_from_dict(raw: dict[str, Any]) -> HybridMoeConfig:
    """Build the family's config from a parsed config.json (top level or its `text_config`)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"config.json: expected a JSON object, got {type(raw).__name__}")
    if "text_config" in raw and not isinstance(raw["text_config"], (dict, type(None))):
        raise ConfigError(f"config field 'text_config': expected an object, got {raw['text_config']!r}")
    outer_type = raw.get("model_type")
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    model_type = text.get("model_type") or outer_type
    if model_type not in FAMILIES:
        raise ConfigError(f"config field 'model_type': unsupported model type {model_type!r}; "
                          f"moepipe serves {sorted(set(MODEL_TYPES.values()) | set(MODEL_TYPES))}")
    cls = FAMILIES[model_type]
    names = cls.field_names()
    values: dict[str, Any] = {}
    unknown: list[str] = []
    for key, val in text.items():
        if key in names:
            values[key] = val
        elif key not in _IGNORED_KEYS and key not in ("rope_parameters", "text_config", "num_nextn_predict_layers"):
            unknown.append(key)
    if unknown:
        log.info("config.json: ignoring keys moepipe does not use: %s", ", ".join(sorted(unknown)))
    if text is not raw:
        ignored_outer = sorted(k for k in raw if k not in ("text_config", "model_type"))
        if ignored_outer:
            log.info("config.json: ignoring top-level keys outside text_config: %s", ", ".join(ignored_outer))

    # RoPE: transformers 5 nests it in rope_parameters; older configs keep rope_theta / partial_rotary_factor flat.
    # A non-empty legacy rope_scaling replaces rope_parameters whole, as transformers' convert_rope_params_to_dict
    # does (`rope_scaling or rope_parameters`): rope_theta and partial_rotary_factor then come from the flat keys or
    # the family's defaults. Qwen's model cards say to add rope_scaling for YaRN, also to configs saved by
    # transformers 5, which carry rope_parameters: reading rope_parameters first served plain RoPE there.
    rope_key = "rope_scaling" if text.get("rope_scaling") else "rope_parameters"
    rope = text.get(rope_key) or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"config field {rope_key!r}: expected an object, got {rope!r}")
    if rope_key == "rope_scaling" and text.get("rope_parameters"):
        log.warning("config.json: rope_scaling %s replaces rope_parameters %s (as transformers reads it): "
                    "rope_theta %s, partial_rotary_factor %s", rope, text["rope_parameters"],
                    rope.get("rope_theta", text.get("rope_theta", f"default {cls.rope_theta}")),
                    rope.get("partial_rotary_factor",
                             text.get("partial_rotary_factor", f"default {cls.partial_rotary_factor}")))
    rope = dict(rope)
    values["rope_scaling"] = _rope_scaling(rope, text, values.get("max_position_embeddings",
                                                                 cls.max_position_embeddings), rope_key)
    values["rope_theta"] = float(rope.get("rope_theta", text.get("rope_theta", cls.rope_theta)))
    values["partial_rotary_factor"] = float(rope.get("partial_rotary_factor",
                                                     text.get("partial_rotary_factor", cls.partial_rotary_factor)))
    if "num_nextn_predict_layers" in text and "mtp_num_hidden_layers" not in text:
        values["mtp_num_hidden_layers"] = text["num_nextn_predict_layers"]
    dtype = text.get("dtype") or text.get("torch_dtype") or raw.get("dtype") or raw.get("torch_dtype")
    if dtype:
        values["dtype"] = str(dtype)
    else:
        values.pop("dtype", None)
    if text is not raw and "tie_word_embeddings" in raw:
        # A multimodal wrapper (Qwen3_5MoeForConditionalGeneration) ties lm_head by its own flag, not its
        # text_config's: save_pretrained leaves lm_head.weight out exactly when the top level says true.
        values["tie_word_embeddings"] = raw["tie_word_embeddings"]
    if cls is Qwen35MoeConfig:
        # transformers' Qwen3.5-MoE router always renormalises its top-k weights; the key is not its config's.
        values.pop("norm_topk_prob", None)
    eos = values.get("eos_token_id", text.get("eos_token_id", raw.get("eos_token_id")))
    values["eos_token_id"] = [] if eos is None else ([eos] if isinstance(eos, int) else eos)
    n_layers = values.get("num_hidden_layers", cls.num_hidden_layers)
    if not values.get("layer_types"):
        interval = text.get("full_attention_interval", 4)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ConfigError(f"config field 'full_attention_interval': must be a positive integer (got {interval!r})")
        values["layer_types"] = _default_layer_types(cls, n_layers, interval)
    elif cls is Qwen4ExpConfig:
        # Released Qwen4-Exp configs call their indexed layers "full_attention".
        values["layer_types"] = [INDEXED if t == FULL else t for t in values["layer_types"]]
    if cls is Qwen4ExpConfig:
        values["ple_layer_ids"] = sorted(set(values.get("ple_layer_ids") or []))
        if values.get("ple_embed_dim") is None:
            values["ple_embed_dim"] = values.get("hidden_size", cls.hidden_size)
    if cls is Qwen3NextConfig:
        values["mlp_only_layers"] = list(values.get("mlp_only_layers") or [])
    try:
        cfg = cls(**values)
    except TypeError as exc:  # pragma: no cover - dataclass signature errors name the field themselves
        raise ConfigError(str(exc)) from exc
    _check_types(cfg)
    cfg.validate()
    return cfg


# RoPE types computed as transformers' ROPE_INIT_FUNCTIONS do (stage_worker/model/rope.py) -> required parameters.
# `dynamic` equals plain RoPE up to max_position_embeddings (transformers rescales only past it). longrope switches
# its frequencies by the longest sequence in a batch, which a server batching many sequences cannot reproduce.
_ROPE_SCALINGS = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                                      "original_max_position_embeddings"),
                  "yarn": ("factor", "original_max_position_embeddings"), "dynamic": ()}
_ROPE_KEYS = {"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor", "attention_factor",
              "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"}


def _rope_scaling(rope: dict[str, Any], text: dict[str, Any], max_positions: int,
                  key: str = "rope_parameters") -> dict[str, Any]:
    """The normalised scaling part of `rope_parameters` ({} for plain RoPE), as transformers' standardize_rope_params
    fills it in; an unsupported type or a missing parameter is a ConfigError naming it."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in ("default", "mrope"):
        return {}
    if kind not in _ROPE_SCALINGS:
        raise ConfigError(f"config field '{key}.rope_type': {kind!r} is not supported "
                          f"(moepipe computes default, mrope, {', '.join(sorted(_ROPE_SCALINGS))})")
    out = {"rope_type": kind, **{k: v for k, v in rope.items() if k in _ROPE_KEYS}}
    if kind in ("yarn", "llama3"):
        if "original_max_position_embeddings" in text:     # transformers gives the flat key priority (Phi3)
            out["original_max_position_embeddings"] = text["original_max_position_embeddings"]
        out.setdefault("original_max_position_embeddings", max_positions)
    if kind == "yarn" and out.get("factor") is None:
        out["factor"] = max_positions / out["original_max_position_embeddings"]
    for name in _ROPE_SCALINGS[kind]:
        val = out.get(name)
        if isinstance(val, bool) or not isinstance(val, (int, float)) or val <= 0:
            raise ConfigError(f"config field '{key}.{name}': rope_type {kind!r} needs a positive number "
                              f"(got {val!r})")
    return out


def _check_types(cfg: HybridMoeConfig) -> None:
    for f in dataclasses.fields(cfg):
        val = getattr(cfg, f.name)
        typ = f.type if isinstance(f.type, str) else str(f.type)
        if val is None:
            if "None" not in typ:
                raise ConfigError(f"config field {f.name!r}: must not be null")
            continue
        if typ.startswith("int") and (not isinstance(val, int) or isinstance(val, bool)):
            raise ConfigError(f"config field {f.name!r}: expected an integer, got {val!r}")
        if typ.startswith("float") and not isinstance(val, (int, float)):
            raise ConfigError(f"config field {f.name!r}: expected a number, got {val!r}")
        if typ.startswith("bool") and not isinstance(val, bool):
            raise ConfigError(f"config field {f.name!r}: expected true/false, got {val!r}")
        if typ.startswith("list") and not isinstance(val, list):
            raise ConfigError(f"config field {f.name!r}: expected a list, got {val!r}")
        if typ.startswith("list[int]") and any(isinstance(v, bool) or not isinstance(v, int) for v in val):
            raise ConfigError(f"config field {f.name!r}: expected a list of integers, got {val!r}")


def load_config(model_dir: str | Path) -> HybridMoeConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: no config.json in the model directory")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from exc
    return config_from_dict(raw)
