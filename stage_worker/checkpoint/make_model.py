"""`moepipe make-model`: write a complete random-weight Qwen4-Exp checkpoint in `transformers`' on-disk layout.

Presets: `tiny` (every extension on, a few MB: the default preset and the tests' model), `small` (a mid-size model
for server benchmarks on a GPU), `full-shape` (the field reports' dimensions, 001 §1; config and tokenizer only, for
the `dummy` load format, since its weights would not fit this machine's disk), `qwen3-next-shape` (Qwen3-Next-80B-A3B's
config, config only too: the public relative's shape in the served benchmarks).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from shared.checkpoint_files import readable_as_umask_allows
from shared.model_config import Qwen4ExpConfig, config_from_dict
from shared.ngram_hash import NgramHashSpec
from shared.ple_table import shard_row_counts
from stage_worker.checkpoint.names import EXPERT, pieces_for
from stage_worker.checkpoint.random_init import random_param
from stage_worker.checkpoint.tokenizer_files import write_tokenizer_files
from stage_worker.model.meta_build import on_meta
from stage_worker.model.model import StageModel

log = logging.getLogger(__name__)

# In every weight file's safetensors metadata: `make-model --out` replaces a directory only if its weight files
# carry it (a `save_pretrained` folder holds the same file names, and rewriting it with random weights lost it)
WRITTEN_BY = {"written_by": "moepipe make-model"}
SHARD_BYTES = 2 << 30

PRESETS: dict[str, dict] = {
    "tiny": dict(
        vocab_size=2048, hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, partial_rotary_factor=0.25, max_position_embeddings=8192,
        layer_types=["linear_attention", "linear_attention", "indexed_attention"] * 2,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, shared_expert_intermediate_size=64,
        hc_count=4, hc_lowrank=16, ple_layer_ids=[2], ple_embed_dim=64, ngram_size=3, heads_per_ngram=4,
        ngram_vocab_size_base=3000, make_ngram_vocab_size_divisible_by=128, split_ngram_parts=4,
        indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=32, indexer_budget=64, indexer_compress_ratio=4,
        output_gate_type="sigmoid", mtp_num_hidden_layers=1, dtype="float32",
    ),
    "small": dict(
        vocab_size=32768, hidden_size=1024, num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=2,
        head_dim=128, partial_rotary_factor=0.25, max_position_embeddings=65536,
        layer_types=["linear_attention"] * 3 + ["indexed_attention"],
        linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
        num_experts=64, num_experts_per_tok=8, moe_intermediate_size=384, shared_expert_intermediate_size=384,
        hc_count=4, hc_lowrank=128, ple_layer_ids=[2], ple_embed_dim=1024, ngram_size=3, heads_per_ngram=8,
        ngram_vocab_size_base=200_000, make_ngram_vocab_size_divisible_by=128, split_ngram_parts=8,
        indexer_n_heads=8, indexer_kv_heads=1, indexer_head_dim=128, indexer_budget=512, indexer_compress_ratio=4,
        output_gate_type="sigmoid", mtp_num_hidden_layers=1, dtype="bfloat16",
    ),
    # 001 §1: 48 layers ([linear x3, full] x 12), hidden 2560, hc 4 / rank 320, 512 experts top-10, moe 640,
    # 24 heads / 2 KV heads of 256, QSA budget 2048 / ratio 4 / head dim 128, 3-gram x 8 heads PLE on layer 2,
    # 128 shards of [2,500,012, 160]. Not in the report, taken from the Qwen3.5 family: linear heads 16 K / 32 V of
    # 128, 32 indexer heads, partial RoPE 0.25.
    "full-shape": dict(
        vocab_size=248320, hidden_size=2560, num_hidden_layers=48, num_attention_heads=24, num_key_value_heads=2,
        head_dim=256, partial_rotary_factor=0.25, max_position_embeddings=262144,
        layer_types=["linear_attention"] * 3 + ["indexed_attention"],
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        num_experts=512, num_experts_per_tok=10, moe_intermediate_size=640, shared_expert_intermediate_size=640,
        hc_count=4, hc_lowrank=320, ple_layer_ids=[2], ple_embed_dim=2560, ngram_size=3, heads_per_ngram=8,
        ngram_vocab_size_base=20_000_000, make_ngram_vocab_size_divisible_by=128, split_ngram_parts=128,
        indexer_n_heads=32, indexer_kv_heads=1, indexer_head_dim=128, indexer_budget=2048, indexer_compress_ratio=4,
        output_gate_type="sigmoid", mtp_num_hidden_layers=1, dtype="bfloat16",
    ),
}
# The built-in demo model (issue 6, tools/train_demo.py): every extension on, 32 experts top-4, an MTP head, and
# small enough to keep in the repository (13.3 M parameters + a 1.2 M-row-element PLE table: 28.9 MB in bf16).
PRESETS["demo"] = dict(
    vocab_size=4096, hidden_size=192, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
    head_dim=48, partial_rotary_factor=0.25, max_position_embeddings=8192,
    layer_types=["linear_attention"] * 3 + ["indexed_attention"],
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=48, linear_value_head_dim=48,
    num_experts=32, num_experts_per_tok=4, moe_intermediate_size=48, shared_expert_intermediate_size=96,
    hc_count=4, hc_lowrank=24, ple_layer_ids=[2], ple_embed_dim=192, ngram_size=3, heads_per_ngram=4,
    ngram_vocab_size_base=6000, make_ngram_vocab_size_divisible_by=128, split_ngram_parts=4,
    indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=48, indexer_budget=128, indexer_compress_ratio=4,
    output_gate_type="sigmoid", mtp_num_hidden_layers=1, dtype="bfloat16",
)
GENERATION_DEFAULTS = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20}


QWEN3_NEXT_80B = dict(   # Qwen3-Next-80B-A3B's config.json (the `qwen3-next-shape` preset, config only)
    model_type="qwen3_next", vocab_size=151936, hidden_size=2048, num_hidden_layers=48, num_attention_heads=16,
    num_key_value_heads=2, head_dim=256, rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0,
                                                          "partial_rotary_factor": 0.25},
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
    intermediate_size=5120, decoder_sparse_step=1, max_position_embeddings=262144, eos_token_id=151645,
    dtype="bfloat16", full_attention_interval=4,
)


def preset_config(name: str, layers: int | None = None) -> dict:
    """A preset's config; `layers` keeps its first N decoder layers (a full-shape model cut to fit a machine: the
    two-GPU run serves a preset that needs both cards' memory)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    raw = dict(PRESETS[name])
    if layers is not None:
        if not 1 <= layers <= raw["num_hidden_layers"]:
            raise ValueError(f"--layers {layers}: the {name} preset has 1..{raw['num_hidden_layers']} layers")
        if any(i > layers for i in raw.get("ple_layer_ids", [])):
            raise ValueError(f"--layers {layers}: the PLE layer ids {raw['ple_layer_ids']} need more layers")
        raw["num_hidden_layers"] = layers
    n = raw["num_hidden_layers"]
    pattern = raw["layer_types"]
    raw["layer_types"] = [pattern[i % len(pattern)] for i in range(n)]
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 10_000_000.0,
                              "partial_rotary_factor": raw.pop("partial_rotary_factor")}
    raw["model_type"] = "qwen4_exp_text"
    return raw


def make_model(preset: str, out: Path, seed: int = 0, layers: int | None = None) -> Path:
    t0 = time.time()
    out = Path(out)
    if preset == "qwen3-next-shape":
        return _config_only_qwen3_next(out, layers)
    raw = preset_config(preset, layers)
    out.mkdir(parents=True, exist_ok=True)
    special = write_tokenizer_files(out, vocab_size=raw["vocab_size"], model_max_length=raw["max_position_embeddings"])
    raw.update(eos_token_id=special.im_end, pad_token_id=special.endoftext, bos_token_id=None)
    cfg = config_from_dict(raw)
    assert isinstance(cfg, Qwen4ExpConfig)
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    gen = {"eos_token_id": special.eos_ids, "pad_token_id": special.pad_id, "bos_token_id": None,
           **GENERATION_DEFAULTS}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    if preset != "full-shape":
        _write_weights(cfg, out, seed)
    log.info("wrote %s checkpoint to %s in %.1f s", preset, out, time.time() - t0)
    return out


def _config_only_qwen3_next(out: Path, layers: int | None) -> Path:
    """Qwen3-Next-80B-A3B's config (cut to `layers`) and a stand-in tokenizer: served with `--load-format dummy`,
    the public relative's shape beside the field reports' (no PLE, no hyper-connections)."""
    raw = dict(QWEN3_NEXT_80B)
    if layers is not None:
        if not 1 <= layers <= raw["num_hidden_layers"]:
            raise ValueError(f"--layers {layers}: the qwen3-next-shape preset has "
                             f"1..{raw['num_hidden_layers']} layers")
        raw["num_hidden_layers"] = layers
    out.mkdir(parents=True, exist_ok=True)
    special = write_tokenizer_files(out, vocab_size=raw["vocab_size"], model_max_length=raw["max_position_embeddings"])
    raw.update(eos_token_id=special.im_end, pad_token_id=special.endoftext, bos_token_id=None)
    cfg = config_from_dict(raw)
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    gen = {"eos_token_id": special.eos_ids, "pad_token_id": special.pad_id, "bos_token_id": None,
           **GENERATION_DEFAULTS}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out


def _planned_tensors(cfg: Qwen4ExpConfig) -> list[tuple[str, tuple[int, ...], torch.dtype, object]]:
    """(on-disk name, shape, dtype, producer) for every tensor, in a stable order."""
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg.dtype]
    with on_meta():
        model = StageModel(cfg, with_mtp=cfg.mtp_num_hidden_layers > 0)
    params = {n: tuple(p.shape) for n, p in model.named_parameters()}
    plan = []
    for name, pieces in pieces_for(cfg, params).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            continue                     # the fused alternative; we write per-expert tensors like transformers
        piece = next((p for p in pieces if not p.local.startswith("mtp.embed_tokens")), pieces[0])
        plan.append((name, piece.shape, dtype, (piece.local, params[piece.local], piece.index)))
    for layer_idx, layer in model.layers.items():
        if layer.ple is None:
            continue
        spec: NgramHashSpec = layer.ple.spec
        prefix = f"model.layers.{layer_idx}.ple.ple_embedding"
        for k, rows in enumerate(shard_row_counts(spec.padded_rows, cfg.split_ngram_parts)):
            plan.append((f"{prefix}.ngram_embedding.shard_{k}.weight", (rows, cfg.ple_head_dim), dtype, None))
        for buf, values in (("layer_multipliers", spec.multipliers), ("ngram_heads_vocab_sizes", spec.primes),
                            ("ngram_heads_offsets", spec.offsets)):
            plan.append((f"{prefix}.{buf}", (len(values),), torch.int64, torch.tensor(values, dtype=torch.int64)))
    return plan


def export_checkpoint(cfg: Qwen4ExpConfig, out: Path, state: dict[str, torch.Tensor],
                      ple_tables: dict[int, torch.Tensor], tokenizer_dir: Path) -> Path:
    """Write trained weights in the layout `make_model` writes (and transformers reads): `state` is a StageModel's
    state dict (MTP included), `ple_tables` the full PLE table [padded_rows, head_dim] per PLE layer index, the
    tokenizer files are copied from `tokenizer_dir`. Tensors are stored in the config's dtype."""
    import shutil

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(tokenizer_dir) / name).exists():
            shutil.copy(Path(tokenizer_dir) / name, out / name)
    (out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, list) else [cfg.eos_token_id]
    gen = {"eos_token_id": eos, "pad_token_id": cfg.pad_token_id, "bos_token_id": None, **GENERATION_DEFAULTS}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    state = {k: v.detach().cpu() for k, v in state.items()}
    _write_weights(cfg, out, 0, source=(state, {k: v.detach().cpu() for k, v in ple_tables.items()},
                                        cfg.split_ngram_parts))
    return out


def _write_weights(cfg: Qwen4ExpConfig, out: Path, seed: int, source=None) -> None:
    plan = _planned_tensors(cfg)
    files: list[list] = [[]]
    size = 0
    for item in plan:
        nbytes = item[2].itemsize * int(torch.tensor(item[1]).prod().item())
        if files[-1] and size + nbytes > SHARD_BYTES:
            files.append([])
            size = 0
        files[-1].append(item)
        size += nbytes
    names = ["model.safetensors"] if len(files) == 1 else \
        [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    weight_map = {}
    cache: dict[str, torch.Tensor] = {}
    for fname, items in zip(names, files):
        tensors = {}
        for name, shape, dtype, producer in items:
            tensors[name] = _produce(name, shape, dtype, producer, seed, cache) if source is None else \
                _from_source(name, shape, dtype, producer, source)
            weight_map[name] = fname
        save_file(tensors, str(out / fname), metadata={"format": "pt", **WRITTEN_BY})
        readable_as_umask_allows(out / fname)
        del tensors
    if len(files) > 1:
        total = sum(item[2].itemsize * int(torch.tensor(item[1]).prod().item()) for item in plan)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _from_source(name: str, shape: tuple, dtype: torch.dtype, producer, source) -> torch.Tensor:
    """A planned on-disk tensor taken from trained weights instead of generated."""
    state, ple_tables, parts = source
    if isinstance(producer, torch.Tensor):
        return producer
    if producer is None:                       # a PLE shard: its rows of that layer's table, in shard order
        layer = int(name.split(".")[2])
        k = int(name.rsplit("shard_", 1)[1].split(".")[0])
        counts = shard_row_counts(ple_tables[layer].shape[0], parts)
        start = sum(counts[:k])
        return ple_tables[layer][start:start + counts[k]].to(dtype).contiguous().clone()
    local, _, index = producer
    full = state[local]
    t = full[index] if index else full
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: trained tensor {local} has shape {tuple(t.shape)}, the layout wants {shape}")
    return t.to(dtype).contiguous().clone()


def _produce(name: str, shape: tuple, dtype: torch.dtype, producer, seed: int,
             cache: dict[str, torch.Tensor]) -> torch.Tensor:
    if isinstance(producer, torch.Tensor):
        return producer
    if producer is None:
        return random_param(name, shape, seed, dtype)
    local, local_shape, index = producer
    if EXPERT.match(local):
        # One fused expert tensor yields many on-disk tensors: generate it once, keep only the current one.
        if local not in cache:
            cache.clear()
            cache[local] = random_param(local, local_shape, seed, dtype)
        full = cache[local]
    else:
        full = random_param(local, local_shape, seed, dtype)
    return (full[index] if index else full).contiguous().clone()
